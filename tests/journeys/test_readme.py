"""The README as a new user meets it: a front page (at most 200 lines) whose set-up commands come
first, that leads to the audit, and whose example runs as written and prints what it shows."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs.markdown import ROOT, unfenced

README = ROOT / "README.md"


def _text() -> str:
    return README.read_text(encoding="utf-8")


def _example() -> tuple[str, str]:
    """The README's one Python example and the output it shows after it."""
    text = _text()
    (code,) = re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)
    after = text.split(code, 1)[1]
    shown = re.search(r"^```text\n(.*?)^```", after, re.S | re.M)
    assert shown is not None, "the README shows what its example prints"
    return code, shown.group(1)


def test_the_readme_is_a_front_page_of_at_most_200_lines() -> None:
    assert len(_text().splitlines()) <= 200


def test_the_two_set_up_commands_come_within_the_first_60_lines() -> None:
    first = _text().splitlines()[:60]
    assert any(re.match(r"make run\s", line) for line in first), "`make run` in the first 60 lines"
    assert any(re.match(r"make test\s", line) for line in first), "`make test` in the first 60 lines"
    assert "source .venv/bin/activate" in "\n".join(first)


def test_it_names_the_audit_and_shows_its_command() -> None:
    text = _text()
    assert re.search(r"^## .*audit", text, re.M | re.I), "a section on the audit"
    assert re.search(r"^gradaccum audit --workload ", text, re.M), "the audit's command, in a fence"
    assert "`gradaccum audit`" in unfenced(text)
    assert "(docs/audit.md)" in text


def test_every_command_is_in_its_table() -> None:
    from gradaccum.cli.main import build_parser

    (sub,) = [a for a in build_parser()._actions if hasattr(a, "choices") and isinstance(a.choices, dict)]
    rows = re.findall(r"^\| `gradaccum (\w+)", _text(), re.M)
    assert sorted(rows) == sorted(sub.choices)


def test_its_snippets_pass_shift_explicitly() -> None:
    code, _ = _example()
    calls = re.findall(r"(count_tokens|summed_cross_entropy)\((.*?)\)\s*(?:#|$)", code, re.M)
    assert sorted(name for name, _ in calls) == ["count_tokens", "summed_cross_entropy"]
    for name, arguments in calls:
        assert "shift=True" in arguments, f"{name}({arguments}): a causal LM's labels shift by one"


@pytest.mark.timeout(120)
def test_the_example_runs_as_written_and_prints_what_the_readme_shows(tmp_path: Path) -> None:
    code, shown = _example()
    script = tmp_path / "example.py"
    script.write_text(code, encoding="utf-8")
    path = os.pathsep.join([str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
        env={**os.environ, "PYTHONPATH": path},  # this checkout's gradaccum, as a pasted file sees it
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == shown
    assert done.stderr == ""
