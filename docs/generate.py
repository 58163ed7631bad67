"""Generate the documentation's pages that show real output: one page per command, the quickstart
and the API reference. ``make docs`` runs this, then ``mkdocs build --strict``; nothing these pages
show is pasted: every line of output and every plot comes from running the command now, on the
bundled defaults, in a scratch folder.

It also fills the generated sections of committed pages, between ``<!-- BEGIN generated: NAME ...
-->`` and ``<!-- END generated: NAME -->``: ``include examples/FILE.py`` (the script, so that the
page reads whole as plain Markdown too) and ``module index`` (every module of ``src/gradaccum``
with the first sentence of its docstring). ``tests/docs/test_generated_sections.py`` fails when one
differs from what this writes.

    .venv/bin/python docs/generate.py [--fast]
    .venv/bin/python docs/generate.py --committed   # only the committed pages' sections: seconds

``--fast`` shortens the measuring commands (fewer steps and runs); the figures then say so.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path

DOCS = Path(__file__).resolve().parent
COMMANDS = DOCS / "commands"
IMAGES = COMMANDS / "img"
PACKAGE = DOCS.parent / "src" / "gradaccum"


@dataclass(frozen=True)
class Example:
    """One run shown on a command's page: why, the arguments, and the files whose plots to show."""

    title: str
    args: tuple[str, ...]
    fast_args: tuple[str, ...] = ()
    plots: tuple[str, ...] = ()
    """PNG files of the run folder to show (the newest runs/<command>-* folder)."""
    note: str = ""


# Every subcommand `gradaccum --help` lists, and what its page runs. tests/docs/test_pages.py checks
# that this covers every subcommand.
PAGES: dict[str, list[Example]] = {
    "plan": [
        Example("The seeds' worked example (no arguments)", ()),
        Example(
            "Your own plans against a baseline",
            ("base=8x8x4", "half-micro=4x8x8", "fewer-updates=4x8x1", "--seq-len", "2048"),
        ),
    ],
    "verify": [
        Example("The bundled tiny GPT: exact", ()),
        Example(
            "A BatchNorm CNN: not exact, and why",
            ("--workload", "gradaccum.examples:bn_cnn", "--trace-steps", "0"),
            note="Exit code 1: the check ran and failed; the likely causes name the layers.",
        ),
        Example(
            "In-batch negatives through the gradient cache",
            ("--workload", "gradaccum.examples:contrastive", "--cached"),
        ),
    ],
    "audit": [
        Example(
            "The installed frameworks' recipes on the bundled tiny GPT",
            ("--workload", "gradaccum.examples:tiny_gpt", "--out", "runs/audit"),
        ),
    ],
    "scan": [
        Example("A BatchNorm CNN", ("--workload", "gradaccum.examples:bn_cnn")),
        Example("The bundled tiny GPT", ()),
    ],
    "bench": [
        Example(
            "Every factorization of a global batch of 8",
            ("--global-batch", "8", "--memory-budget", "1MiB", "--no-progress"),
            fast_args=("--runs", "1", "--steps", "3", "--warmup", "1"),
            plots=("throughput.png", "memory.png"),
        ),
    ],
    "accept": [
        Example(
            "The main job, on the bundled default (`make run`)",
            ("--no-progress",),
            fast_args=("--steps", "20", "--block-updates", "5", "--trace-steps", "2"),
            plots=("throughput.png", "memory.png"),
        ),
    ],
    "train": [
        Example(
            "A short run of the bundled tiny GPT",
            ("--steps", "40", "--run-dir", "runs/train-docs"),
            fast_args=(),
            plots=("loss.png",),
        ),
    ],
}


def _run(args: list[str], cwd: Path) -> tuple[int, str]:
    env = {**os.environ, "COLUMNS": "160", "NO_COLOR": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "gradaccum", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    return proc.returncode, (proc.stdout + proc.stderr).rstrip()


VENV_NOTE = (
    "The commands run in the virtual environment `make run` creates: `source .venv/bin/activate` "
    "first (or prefix them with `.venv/bin/`)."
)
"""Said on every generated page before its first command: after `make run` a bare `gradaccum` is
not on the shell's path."""


def _fence(text: str) -> str:
    return f"```text\n{text}\n```"


def _newest_folder(cwd: Path, command: str) -> Path | None:
    runs = cwd / "runs"
    if not runs.is_dir():
        return None
    folders = sorted(
        (p for p in runs.iterdir() if p.is_dir() and p.name.startswith(command)), key=os.path.getmtime
    )
    return folders[-1] if folders else None


def command_page(command: str, examples: list[Example], *, fast: bool, scratch: Path) -> str:
    code, help_text = _run([command, "--help"], scratch)
    if code != 0:
        raise SystemExit(f"gradaccum {command} --help exited {code}:\n{help_text}")
    lines = [f"# gradaccum {command}", "", VENV_NOTE, "", _fence(help_text), ""]
    for n, example in enumerate(examples):
        args = [command, *example.args, *(example.fast_args if fast else ())]
        code, output = _run(args, scratch)
        shown = " ".join(["gradaccum", *args])
        lines += [f"## {example.title}", "", f"```bash\n{shown}\n```", "", _fence(output), ""]
        lines.append(f"Exit code {code}." + (f" {example.note}" if example.note else ""))
        lines.append("")
        folder = _newest_folder(scratch, command) if example.plots else None
        for plot in example.plots:
            if folder is None or not (folder / plot).is_file():
                raise SystemExit(f"gradaccum {command}: expected {plot} in its run folder, found none")
            target = f"{command}-{n}-{plot}"
            shutil.copyfile(folder / plot, IMAGES / target)
            lines += [f"![{plot}](img/{target})", ""]
    if fast:
        lines.append(
            "!!! note\n    Generated with `docs/generate.py --fast`: fewer steps and runs than defaults.\n"
        )
    return "\n".join(lines)


def quickstart(accept_page: str) -> str:
    return (
        textwrap.dedent(
            """\
        # Quickstart

        Two commands do all the set-up on a fresh machine (Python 3.10+, a C compiler not needed):

        ```bash
        make run    # creates .venv, installs gradaccum, runs `gradaccum accept` on the bundled default
        make test   # creates .venv if needed, runs ruff, mypy and the whole test suite (what CI runs)
        ```

        `make run` verifies that accumulating the bundled tiny GPT's batch as 4 micro-batches of 8
        (the baseline) and as 8 micro-batches of 4 (the candidate) gives the full-batch update, measures
        both side by side, and decides whether the candidate is worth adopting. What it printed when
        these pages were generated (`gradaccum accept` is what `make run` runs; to run it yourself,
        `source .venv/bin/activate` first, or prefix it with `.venv/bin/`):

        """
        )
        # the accept page's plots live beside it, in commands/img/
        + accept_page.split("## ", 1)[1].split("\n", 1)[1].replace("](img/", "](commands/img/")
    )


def reference() -> str:
    sys.path.insert(0, str(DOCS.parent / "src"))
    import gradaccum

    exports = gradaccum._EXPORTS
    lines = [
        "# API reference",
        "",
        "Everything `gradaccum` exports, from the docstrings. Each name lives in its feature's module;",
        "`import gradaccum` imports none of them until first use.",
        "",
    ]
    groups: dict[str, list[str]] = {}
    for name, module in exports.items():
        groups.setdefault(module.split(".")[1] if module.count(".") else module, []).append(name)
    for group, names in groups.items():
        lines += [f"## {group}", ""]
        for name in names:
            lines += [f"::: {exports[name]}.{name}", ""]
    return "\n".join(lines)


# -- generated sections of committed pages ----------------------------------------------------------

_SECTION = re.compile(
    r"^(<!-- BEGIN generated: (?P<name>[^(]+?) \(python docs/generate.py --committed writes it; "
    r"tests/docs checks it\) -->\n)(?P<body>.*?)^(<!-- END generated: (?P=name) -->)$",
    re.S | re.M,
)


def _first_sentence(docstring: str) -> str:
    """The first sentence of a docstring's first paragraph, its reST roles as Markdown code."""
    paragraph = " ".join(docstring.strip().split("\n\n")[0].split())
    match = re.match(r"(.+?[.!?])(?:\s|$)", paragraph)
    text = match.group(1) if match else paragraph
    text = re.sub(r":\w+:`~?(?:[\w.]+\.)?([^`]+)`", r"`\1`", text)  # :class:`~a.b.C` -> `C`
    return text.replace("``", "`").replace("|", "\\|")


def module_index() -> str:
    """Every module of ``src/gradaccum``, grouped by folder, with its docstring's first sentence."""
    groups: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        relative = path.relative_to(PACKAGE)
        folder = relative.parent.as_posix()
        docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        summary = _first_sentence(docstring) if docstring else "(no docstring)"
        groups.setdefault(folder, []).append(f"| `{relative.name}` | {summary} |")
    lines: list[str] = []
    for folder, rows in groups.items():
        title = "`src/gradaccum/`" if folder == "." else f"`{folder}/`"
        lines += [f"### {title}", "", "| module | what it does |", "|---|---|", *rows, ""]
    return "\n".join(lines).rstrip()


def include(name: str) -> str:
    """A script of ``docs/`` shown whole on a page, as a fenced block titled with its path."""
    path = DOCS / name
    if not path.is_file():
        raise SystemExit(f"docs: a page includes {name}, which is not in docs/")
    text = path.read_text(encoding="utf-8").rstrip("\n")
    return f'```python title="docs/{name}"\n{text}\n```'


def generated_section(name: str) -> str:
    """What the section called ``name`` holds: ``module index`` or ``include PATH``."""
    if name == "module index":
        return module_index()
    if name.startswith("include "):
        return include(name.removeprefix("include "))
    raise SystemExit(f"docs: unknown generated section {name!r}")


def fill_sections(text: str) -> str:
    """``text`` with every generated section rewritten from the tree."""

    def fill(match: re.Match[str]) -> str:
        body = generated_section(match.group("name"))
        return f"{match.group(1)}\n{body}\n\n{match.group(4)}"

    return _SECTION.sub(fill, text)


def section_names(text: str) -> list[str]:
    return [m.group("name") for m in _SECTION.finditer(text)]


def committed_pages() -> list[Path]:
    """The committed pages that hold a generated section."""
    pages = sorted(p for p in DOCS.rglob("*.md") if COMMANDS not in p.parents)
    return [p for p in pages if section_names(p.read_text(encoding="utf-8"))]


def fill_committed_pages() -> list[Path]:
    """Rewrite every committed page's generated sections; returns the pages that changed."""
    changed = []
    for page in committed_pages():
        text = page.read_text(encoding="utf-8")
        filled = fill_sections(text)
        if filled != text:
            page.write_text(filled, encoding="utf-8")
            changed.append(page)
    return changed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", action="store_true", help="shorter measuring runs")
    parser.add_argument(
        "--committed", action="store_true", help="only rewrite the committed pages' generated sections"
    )
    args = parser.parse_args()
    for page in fill_committed_pages():
        print(f"docs: rewrote the generated sections of {page.relative_to(DOCS)}", flush=True)
    if args.committed:
        return
    shutil.rmtree(COMMANDS, ignore_errors=True)
    IMAGES.mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="gradaccum-docs-") as tmp:
        scratch = Path(tmp)
        pages = {}
        for command, examples in PAGES.items():
            print(f"docs: gradaccum {command}", flush=True)
            pages[command] = command_page(command, examples, fast=args.fast, scratch=scratch)
            (COMMANDS / f"{command}.md").write_text(pages[command] + "\n", encoding="utf-8")
    (DOCS / "quickstart.md").write_text(quickstart(pages["accept"]), encoding="utf-8")
    (DOCS / "reference.md").write_text(reference() + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
