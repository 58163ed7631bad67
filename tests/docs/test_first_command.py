"""The README's first command and the pages it sends a reader to.

``make run`` is a newcomer's first command: any verdict accept reaches (ADOPT, KEEP BASELINE,
INCONCLUSIVE) is a finished run and exits 0, saying which verdict and what ``gradaccum accept``
itself returns to scripts; only a run that reached none fails. Run against the Makefile's own
``run`` recipe, with a stand-in ``gradaccum`` that exits as accept would (the real one takes
minutes and installs a virtual environment). And every relative link of README.md and
docs/index.md leads to a file in the git checkout, without ``make docs``.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def _make_run(tmp_path: Path, accept_exit: int) -> subprocess.CompletedProcess[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "gradaccum"
    fake.write_text(f"#!/bin/sh\necho 'accept: verdict as printed'\nexit {accept_exit}\n")
    fake.chmod(0o755)
    stamp = tmp_path / "installed"
    stamp.touch()  # newer than pyproject.toml: the recipe does not install
    return subprocess.run(
        ["make", "-s", "-C", str(ROOT), "run", f"BIN={bin_dir}", f"STAMP={stamp}"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@needs_make
@pytest.mark.parametrize(("accept_exit", "says"), [(0, "ADOPT or KEEP BASELINE"), (3, "INCONCLUSIVE")])
def test_make_run_exits_0_on_any_verdict_and_says_which(tmp_path: Path, accept_exit: int, says: str) -> None:
    done = _make_run(tmp_path, accept_exit)
    assert done.returncode == 0, done.stderr
    last = done.stdout.strip().splitlines()[-1]
    assert says in last
    assert f"gradaccum accept itself exit{'ed' if accept_exit == 0 else 's'} {accept_exit}" in last


@needs_make
@pytest.mark.parametrize("accept_exit", [1, 2])
def test_make_run_fails_when_accept_reached_no_verdict(tmp_path: Path, accept_exit: int) -> None:
    done = _make_run(tmp_path, accept_exit)
    assert done.returncode != 0
    assert f"could not reach a verdict (exit {accept_exit}" in done.stderr


def _tracked() -> set[str]:
    out = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files"], capture_output=True, text=True, check=False, timeout=60
    )
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    return set(out.stdout.splitlines())


_LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", ["README.md", "docs/index.md"])
def test_every_relative_link_resolves_to_a_file_in_the_checkout(page: str) -> None:
    tracked = _tracked()
    text = (ROOT / page).read_text(encoding="utf-8")
    base = (ROOT / page).parent
    missing = []
    for target in _LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a web address, or a place on the same page
        path = (base / target.split("#", 1)[0]).resolve().relative_to(ROOT).as_posix()
        if path not in tracked:
            missing.append(target)
    assert not missing, f"{page} links to pages not in the checkout: {missing}"
