"""The documentation's examples run: every ```python and ```pycon block of every page, in order, in
one namespace per page. A ```python block must run; a ```pycon block is a doctest (what it prints
must match what the page shows). Snippets that are not meant to run are fenced as ```text."""

from __future__ import annotations

import doctest
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
BLOCK = re.compile(r"^```(pycon|python)\n(.*?)^```", re.S | re.M)
PAGES = sorted(p for p in DOCS.glob("*.md") if BLOCK.search(p.read_text(encoding="utf-8")))


def test_the_pages_with_examples_are_found() -> None:
    assert {p.name for p in PAGES} >= {"concepts.md", "workloads.md", "packing.md"}


# third-party noise on the integrations page (as in tests/integrations/test_lightning.py): Lightning
# 2.6 on torch 2.13 builds a deprecated pytree LeafSpec, and warns that a tiny loader has few workers
@pytest.mark.filterwarnings(r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated:FutureWarning")
@pytest.mark.filterwarnings("ignore::lightning.fabric.utilities.warnings.PossibleUserWarning")
@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_example_on_the_page_runs_and_prints_what_it_shows(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    namespace: dict[str, object] = {"__name__": f"docs_{page.stem}"}
    attempted = 0
    for kind, block in BLOCK.findall(text):
        if kind == "python":
            exec(compile(block, f"{page.name} (python block)", "exec"), namespace)
            attempted += 1
            continue
        test = doctest.DocTestParser().get_doctest(block, namespace, page.name, str(page), 0)
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
        report: list[str] = []
        runner.run(test, out=report.append, clear_globs=False)
        failed, tried = runner.summarize(verbose=False)
        assert failed == 0, "".join(report)
        namespace.update(test.globs)  # a DocTest runs on a copy: carry its names to the next block
        attempted += tried
    assert attempted > 0
