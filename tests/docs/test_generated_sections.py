"""The committed pages read whole as plain Markdown (a repository's web view shows them as they
are): no ``--8<--`` include markers, and every section docs/generate.py writes into a committed
page (a script shown whole, the module index) is what it writes from the tree now."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import yaml

from tests.docs.markdown import DOCS, ROOT, committed_pages

FIX = "run `python docs/generate.py --committed` and commit the pages it rewrites"


def _generate() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_generate_sections", DOCS / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_no_page_holds_an_include_marker() -> None:
    # a snippets include is a line of its own (inside a fence or not); a mention in running text is not
    include = re.compile(r"^\s*--8<--", re.M)
    marked = [
        p.relative_to(ROOT).as_posix() for p in committed_pages() if include.search(p.read_text("utf-8"))
    ]
    assert marked == [], "a web view shows these markers as text; use a generated section instead"
    extensions = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))["markdown_extensions"]
    assert not any(isinstance(e, dict) and "pymdownx.snippets" in e for e in extensions)
    assert "pymdownx.snippets" not in extensions


def test_the_pages_that_show_scripts_hold_them_whole() -> None:
    generate = _generate()
    shown = {
        page.relative_to(DOCS).as_posix(): generate.section_names(page.read_text(encoding="utf-8"))
        for page in generate.committed_pages()
    }
    assert shown["distributed.md"] == [
        "include examples/ddp_accumulate.py",
        "include examples/mesh_accumulate.py",
    ]
    assert shown["integrations.md"] == ["include examples/deepspeed_accumulate.py"]
    assert shown["rl.md"] == ["include examples/grpo_exact.py"]
    assert shown["design/modules.md"] == ["module index"]
    text = (DOCS / "rl.md").read_text(encoding="utf-8")
    assert (DOCS / "examples" / "grpo_exact.py").read_text(encoding="utf-8").rstrip() in text


def test_every_generated_section_is_up_to_date() -> None:
    generate = _generate()
    stale = [
        page.relative_to(DOCS).as_posix()
        for page in generate.committed_pages()
        if generate.fill_sections(page.read_text(encoding="utf-8")) != page.read_text(encoding="utf-8")
    ]
    assert stale == [], f"generated sections out of date in {stale}: {FIX}"


def test_a_stale_section_is_rewritten_and_an_unknown_one_refused(tmp_path: Path) -> None:
    generate = _generate()
    begin = (
        "<!-- BEGIN generated: {} (python docs/generate.py --committed writes it; tests/docs checks it) -->"
    )
    page = f"before\n\n{begin.format('include examples/ddp_accumulate.py')}\n\nold text\n\n"
    page += "<!-- END generated: include examples/ddp_accumulate.py -->\n\nafter\n"
    filled = generate.fill_sections(page)
    assert "old text" not in filled and filled.startswith("before\n") and filled.endswith("\nafter\n")
    assert '```python title="docs/examples/ddp_accumulate.py"\n"""Exact accumulation under DDP' in filled
    assert generate.fill_sections(filled) == filled
    unknown = f"{begin.format('weather')}\n\n<!-- END generated: weather -->\n"
    try:
        generate.fill_sections(unknown)
    except SystemExit as refused:
        assert "unknown generated section 'weather'" in str(refused)
    else:
        raise AssertionError("an unknown section was accepted")
