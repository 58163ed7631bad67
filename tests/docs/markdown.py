"""Reading the committed Markdown pages as the site and a repository's web view both do: fenced
blocks, headings and their anchors, relative links."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

FENCE = re.compile(r"^(`{3,}|~{3,})[^\n]*\n.*?^\1[ \t]*$", re.S | re.M)
_HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)
_ANCHOR = re.compile(r"""<a\s+(?:id|name)=["']([^"']+)["']""")
LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def unfenced(text: str) -> str:
    """``text`` with every fenced block blanked (same length, so offsets and lines hold)."""
    return FENCE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)


def slug(heading: str) -> str:
    """The anchor Python-Markdown's ``toc`` gives a heading (MkDocs' default ``slugify``), with
    inline code marks and link targets dropped first."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(text: str) -> set[str]:
    """Every place a link can name on a page: its headings' anchors (a repeated one numbered as
    ``toc`` numbers it) and explicit ``<a id=...>`` tags."""
    prose = unfenced(text)
    found: set[str] = set(_ANCHOR.findall(prose))
    for match in _HEADING.finditer(prose):
        base = slug(match.group(2))
        name, n = base, 0
        while name in found:
            n += 1
            name = f"{base}_{n}"
        found.add(name)
    return found


def links(text: str) -> list[str]:
    """The targets of the Markdown links outside fenced blocks and inline code."""
    prose = re.sub(r"`[^`\n]*`", lambda m: " " * len(m.group(0)), unfenced(text))
    return LINK.findall(prose)


def committed_pages() -> list[Path]:
    """README.md and every Markdown page under docs/ that is not written by docs/generate.py."""
    generated = {DOCS / "quickstart.md", DOCS / "reference.md"}
    pages = [p for p in sorted(DOCS.rglob("*.md")) if p not in generated and "commands" not in p.parts]
    return [ROOT / "README.md", *pages]
