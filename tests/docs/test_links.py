"""Every relative link of README.md and the committed docs pages leads somewhere: a file in the
checkout (or a page ``make docs`` generates) and, where it names one, an anchor on that page."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.docs.markdown import DOCS, ROOT, anchors, committed_pages, links, slug

GENERATED = {"quickstart.md", "reference.md"}
"""Pages docs/generate.py writes (and the command pages under docs/commands/)."""

PAGES = committed_pages()


def _generated(path: Path) -> bool:
    if not path.is_relative_to(DOCS):
        return False
    name = path.relative_to(DOCS).as_posix()
    return name in GENERATED or name.startswith("commands/")


def _broken(page: Path) -> list[str]:
    text = page.read_text(encoding="utf-8")
    broken = []
    for target in links(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):
            continue  # a web address or mailto:
        path, _, fragment = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if _generated(resolved):
            continue  # exists after `make docs`; tests/docs/test_pages.py checks the page says so
        if not resolved.exists():
            broken.append(f"{target} (no such file)")
        elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved.read_text("utf-8")):
            broken.append(f"{target} (no heading or anchor #{fragment} there)")
    return broken


def test_the_pages_are_found() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in PAGES}
    assert {"README.md", "docs/start.md", "docs/overview.md", "docs/design/modules.md"} <= names
    assert "docs/quickstart.md" not in names


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_every_relative_link_resolves_to_a_file_and_its_anchor(page: Path) -> None:
    assert _broken(page) == []


def test_a_broken_file_or_anchor_is_found(tmp_path: Path) -> None:
    (tmp_path / "there.md").write_text("# A page\n\n## Its `first` section: here\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](there.md#its-first-section-here) [gone](missing.md) [bad](there.md#nowhere)\n"
        "`[not a link](missing.md)`\n\n```text\n[fenced](missing.md)\n```\n",
        encoding="utf-8",
    )
    assert _broken(page) == [
        "missing.md (no such file)",
        "there.md#nowhere (no heading or anchor #nowhere there)",
    ]


def test_anchors_follow_the_sites_slugs() -> None:
    assert slug("Every framework's recipe on your model: `gradaccum audit`") == (
        "every-frameworks-recipe-on-your-model-gradaccum-audit"
    )
    assert slug("Meshes: FSDP2 x tensor x context x pipeline parallel") == (
        "meshes-fsdp2-x-tensor-x-context-x-pipeline-parallel"
    )
    assert anchors('# A\n\n## B\n\n## B\n\n<a id="verify"></a>\n```\n# not a heading\n```\n') == {
        "a",
        "b",
        "b_1",
        "verify",
    }
