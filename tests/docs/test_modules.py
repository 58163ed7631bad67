"""The design record's module map cannot go stale: docs/design/modules.md names every folder and
top-level module of src/gradaccum with a one-line job, nothing that is not there, and every path
of its repository table exists. (Its module index is generated: test_generated_sections.py.)"""

from __future__ import annotations

import re
from pathlib import Path

from tests.docs.markdown import DOCS, ROOT

PACKAGE = ROOT / "src" / "gradaccum"
PAGE = DOCS / "design" / "modules.md"


def _table(heading: str) -> dict[str, str]:
    """The ``| `path` | job |`` rows of the table under ``heading``."""
    text = PAGE.read_text(encoding="utf-8")
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return dict(re.findall(r"^\| `([^`]+)` \| (.*?) \|$", section, re.M))


def _tree() -> set[str]:
    folders = {
        p.relative_to(PACKAGE).as_posix() + "/"
        for p in PACKAGE.rglob("*")
        if p.is_dir() and p.name != "__pycache__" and "__pycache__" not in p.parts
    }
    return folders | {p.name for p in PACKAGE.glob("*.py")}


def test_every_folder_and_top_level_module_is_listed_with_its_job() -> None:
    listed = _table("Packages and top-level modules")
    tree = _tree()
    assert {"audit/", "moe/", "tokens/", "step/", "bench/mesh/", "errors.py"} <= tree
    assert sorted(tree - set(listed)) == [], "add a row with its job to docs/design/modules.md"
    assert sorted(set(listed) - tree) == [], "docs/design/modules.md lists what src/gradaccum does not hold"
    for path, job in listed.items():
        assert len(job.split()) >= 3 and len(job) <= 200, f"{path}: a one-line job, please: {job!r}"


def test_every_path_of_the_repository_table_exists() -> None:
    listed = _table("The repository")
    assert {"src/gradaccum/", "tests/", "benchmarks/", "docs/", "docs/design/"} <= set(listed)
    for path in listed:
        assert (ROOT / path).exists(), f"docs/design/modules.md lists {path}, which does not exist"


def test_the_page_is_in_the_navigation_and_the_index_lists_every_module() -> None:
    assert "design/modules.md" in (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    text = PAGE.read_text(encoding="utf-8")
    for module in PACKAGE.rglob("*.py"):
        if "__pycache__" in module.parts:
            continue
        folder = module.parent.relative_to(PACKAGE).as_posix()
        heading = "### `src/gradaccum/`" if folder == "." else f"### `{folder}/`"
        section = text.split(f"\n{heading}\n", 1)[1].split("\n### ", 1)[0]
        assert f"| `{module.name}` |" in section, f"{module} is missing from the module index"


def test_every_benchmark_script_is_on_the_benchmarks_page() -> None:
    text = (DOCS / "benchmarks.md").read_text(encoding="utf-8")
    missing = [
        p.name for p in sorted((ROOT / "benchmarks").glob("*.py")) if f"`benchmarks/{p.name}`" not in text
    ]
    assert missing == [], f"docs/benchmarks.md does not say what these do: {missing}"


def test_a_missing_row_is_found(tmp_path: Path) -> None:
    listed = _table("Packages and top-level modules")
    del listed["moe/"]
    assert sorted(_tree() - set(listed)) == ["moe/"]
