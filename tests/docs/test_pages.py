"""The site covers what there is: a page per command, a section per error, resolvable API entries,
and the distributed example runs under torchrun. (``make docs`` builds it with warnings as errors;
``.ci/run`` runs that after the tests.)"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import yaml

import gradaccum
import gradaccum.errors
from gradaccum.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _generate() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_generate", DOCS / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def _subcommands() -> set[str]:
    actions = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    assert len(actions) == 1
    return set(actions[0].choices)


def _nav_pages() -> set[str]:
    def walk(node: object) -> list[str]:
        if isinstance(node, str):
            return [node]
        if isinstance(node, dict):
            return [page for value in node.values() for page in walk(value)]
        if isinstance(node, list):
            return [page for item in node for page in walk(item)]
        return []

    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    return set(walk(config["nav"]))


def test_every_command_gradaccum_lists_has_a_generated_page_in_the_navigation() -> None:
    commands = _subcommands()
    assert commands >= {"plan", "verify", "scan", "bench", "accept", "train"}
    assert set(_generate().PAGES) == commands
    assert {f"commands/{c}.md" for c in commands} <= _nav_pages()


def test_every_page_in_the_navigation_is_written_or_generated() -> None:
    generated = {"quickstart.md", "reference.md"} | {f"commands/{c}.md" for c in _subcommands()}
    for page in _nav_pages() - generated:
        assert (DOCS / page).is_file(), f"mkdocs.yml lists {page}, which does not exist"


def test_every_error_class_has_a_cause_and_fix_on_the_troubleshooting_page() -> None:
    text = (DOCS / "troubleshooting.md").read_text(encoding="utf-8")
    headings = set(re.findall(r"^### (\w+)$", text, re.M))
    classes = {
        name
        for name in gradaccum.errors.__all__
        if issubclass(getattr(gradaccum.errors, name), (gradaccum.errors.GradAccumError, Warning))
    }
    assert len(classes) >= 25
    assert "`gradaccum.GradAccumError`" in text  # the base class: the page's opening paragraph
    assert classes - headings == {"GradAccumError"}, "errors without a troubleshooting section"
    assert headings - classes == set(), "sections for classes that do not exist"


def test_every_reference_entry_resolves_to_what_gradaccum_exports() -> None:
    page = _generate().reference()
    entries = re.findall(r"^::: ([\w.]+)$", page, re.M)
    assert {e.rsplit(".", 1)[1] for e in entries} == set(gradaccum._EXPORTS)
    for entry in entries:
        module, name = entry.rsplit(".", 1)
        assert getattr(importlib.import_module(module), name) is getattr(gradaccum, name)


def test_a_command_page_shows_the_commands_real_output(tmp_path: Path) -> None:
    generate = _generate()
    page = generate.command_page("plan", generate.PAGES["plan"], fast=True, scratch=tmp_path)
    assert page.startswith("# gradaccum plan\n")
    assert "usage: gradaccum plan" in page
    assert "global batch" in page.lower()
    assert page.count("Exit code 0.") == len(generate.PAGES["plan"])
    _says_activate_before_the_first_command(page, "the generated plan page")


# `make run` installs into .venv/, which is not on the shell's path: a page says so before the first
# command a reader would type (a fenced line starting with gradaccum, torchrun or python; in the
# README and on the home page also a command in running text)
ACTIVATE = "source .venv/bin/activate"
_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)
_TYPED = re.compile(r"^(?:\$ )?(?:time )?(?:gradaccum|torchrun|python)\s+-{0,2}[\w./-]+(?:\s|$)")
_INLINE = re.compile(r"`(?:time )?(?:gradaccum|torchrun) [a-z-]+[^`]*`")


def _first_command(text: str, *, inline: bool) -> int | None:
    """Where the first command a reader types starts (an offset into ``text``), or None."""
    found = [
        fence.start()
        for fence in _FENCE.finditer(text)
        if fence.group(1) not in ("python", "pycon")
        and any(_TYPED.match(line.strip()) for line in fence.group(2).splitlines())
    ][:1]
    if inline:  # in running text: outside the fences (blanked with spaces, so offsets hold)
        prose = _FENCE.sub(lambda m: " " * len(m.group(0)), text)
        found += [m.start() for m in _INLINE.finditer(prose)][:1]
    return min(found, default=None)


def _says_activate_before_the_first_command(text: str, name: str, *, inline: bool = False) -> None:
    first = _first_command(text, inline=inline)
    if first is not None:
        said = text.find(ACTIVATE)
        shown = text[first : first + 80]
        assert 0 <= said < first, f"{name} shows a command before saying `{ACTIVATE}`: {shown!r}"


def test_the_readme_and_every_page_say_to_activate_the_environment_before_a_command() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert _first_command(readme, inline=True) is not None
    _says_activate_before_the_first_command(readme, "README.md", inline=True)
    home = (DOCS / "index.md").read_text(encoding="utf-8")
    assert ACTIVATE in home
    _says_activate_before_the_first_command(home, "index.md", inline=True)
    pages = [p for p in DOCS.glob("*.md") if _first_command(p.read_text(encoding="utf-8"), inline=False)]
    assert {p.name for p in pages} >= {"distributed.md", "tradeoffs.md", "rl.md"}
    for page in pages:
        _says_activate_before_the_first_command(page.read_text(encoding="utf-8"), page.name)
    accept = "# gradaccum accept\n\n## The main job\n\n```bash\ngradaccum accept --no-progress\n```\n"
    _says_activate_before_the_first_command(_generate().quickstart(accept), "the generated quickstart")


# torch 2.13's gloo threads can outlive the process group; one still releasing a collective while
# Python finalizes aborts the finished process (docs/design/distributed-and-mesh.md, "A clean exit
# under torchrun"). The examples end without finalization (exit_process), so it should not happen;
# if it does, it is accepted only with this signature on every failed rank, after the result was
# printed and checked: the run did its work, and only its exit was torch's.
TEARDOWN_ABORT = "terminate called without an active exception"
_EXITCODES = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)", re.M)


def _aborted_in_teardown(proc: subprocess.CompletedProcess[str]) -> bool:
    """torchrun failed only because ranks died of the known SIGABRT at exit: every exit code its
    failure summary lists is -6, and gloo's abort message is on stderr."""
    codes = _EXITCODES.findall(proc.stderr)
    return (
        proc.returncode != 0
        and bool(codes)
        and all(code == "-6" for code in codes)
        and "Signal 6 (SIGABRT)" in proc.stderr
        and TEARDOWN_ABORT in proc.stderr
    )


def _checked_run(proc: subprocess.CompletedProcess[str]) -> str:
    """The example's output, once its printed difference from the full batch is float64
    summation-order rounding (<= 1e-12) and the run exited 0 or only by the known teardown abort."""
    match = re.search(r"largest relative difference from the full batch: (\S+)", proc.stdout)
    assert match is not None, proc.stdout + proc.stderr
    assert float(match.group(1)) <= 1e-12, proc.stdout  # float64, summation order only
    assert "differs from the full batch" not in proc.stderr, proc.stderr
    assert proc.returncode == 0 or _aborted_in_teardown(proc), proc.stdout + proc.stderr
    return proc.stdout


def _run_example(name: str, processes: int, timeout_s: int) -> str:
    """Run docs/examples/NAME under torchrun as the page says and check what it prints
    (:func:`_checked_run`). Returns its output."""
    page = (DOCS / "distributed.md").read_text(encoding="utf-8")
    assert f"BEGIN generated: include examples/{name} " in page
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    proc = subprocess.run(
        [*launch, str(processes), str(DOCS / "examples" / name)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    return _checked_run(proc)


_RESULT = (
    "2 ranks: 55 tokens here, 107 in the window\nlargest relative difference from the full batch: 1.2e-16\n"
)
_ABORT_SUMMARY = (
    "terminate called without an active exception\n"
    "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
    "Root Cause (first observed failure):\n[0]:\n  rank      : 1 (local_rank: 1)\n"
    "  exitcode  : -6 (pid: 4242)\n  traceback : Signal 6 (SIGABRT) received by PID 4242\n"
)


def _torchrun(stdout: str, stderr: str, code: int) -> subprocess.CompletedProcess[str]:
    return subprocess.CompletedProcess(["torchrun"], code, stdout, stderr)


def test_an_example_run_is_accepted_only_clean_or_aborted_in_teardown_after_its_checked_result() -> None:
    assert _checked_run(_torchrun(_RESULT, "", 0)) == _RESULT
    assert _checked_run(_torchrun(_RESULT, _ABORT_SUMMARY, 1)) == _RESULT  # torch's abort, after the work
    refused = [
        _torchrun("", _ABORT_SUMMARY, 1),  # aborted before the result was printed
        _torchrun(_RESULT.replace("1.2e-16", "3.0e-05"), "", 0),  # printed, but not exact
        _torchrun(_RESULT, _ABORT_SUMMARY.replace("terminate called without an active exception\n", ""), 1),
        _torchrun(_RESULT, _ABORT_SUMMARY.replace("exitcode  : -6", "exitcode  : 1"), 1),  # a rank failed
        _torchrun(_RESULT, _ABORT_SUMMARY + "[1]:\n  exitcode  : 1 (pid: 4243)\n", 1),  # and another did
        _torchrun(_RESULT, "rank 1: the accumulated update differs from the full batch by 3.0e-05\n", 1),
    ]
    for proc in refused:
        with pytest.raises(AssertionError):
            _checked_run(proc)


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_the_distributed_pages_example_runs_exactly_under_torchrun() -> None:
    _run_example("ddp_accumulate.py", processes=2, timeout_s=150)


def test_every_bundled_workload_is_on_the_workloads_page() -> None:
    import gradaccum.examples

    text = (DOCS / "workloads.md").read_text(encoding="utf-8")
    functions = [getattr(gradaccum.examples, name) for name in gradaccum.examples.__all__]
    bundled = [f.__name__ for f in functions if inspect.signature(f).return_annotation == "Workload"]
    assert set(bundled) == {"tiny_gpt", "bn_cnn", "contrastive"}
    for name in bundled:
        assert f"gradaccum.examples:{name}" in text


def test_links_in_the_repository_lead_to_a_file_or_say_the_page_is_generated() -> None:
    generated = {"quickstart.md", "reference.md"} | {f"commands/{c}.md" for c in _subcommands()}
    docs = DOCS.resolve()
    for page in [*DOCS.glob("*.md"), ROOT / "README.md"]:
        if page.parent == DOCS and page.name in generated:
            continue
        text = page.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)#:]+\.md)(?:#[^)]*)?\)", text):
            path = (page.parent / target).resolve()
            name = path.relative_to(docs).as_posix() if path.is_relative_to(docs) else None
            if name in generated:
                assert "generate" in text, f"{page.name} links to the generated {target} without saying so"
            else:
                assert path.is_file(), f"{page.name} links to {target}, which does not exist"


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_the_mesh_example_runs_exactly_on_four_processes() -> None:
    assert "mesh dp_shard=2 x tp=2: " in _run_example("mesh_accumulate.py", processes=4, timeout_s=280)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_grpo_example_trains_with_trl_and_verifies_exactly() -> None:
    pytest.importorskip("trl")
    assert "BEGIN generated: include examples/grpo_exact.py " in (DOCS / "rl.md").read_text(encoding="utf-8")
    proc = subprocess.run(
        [sys.executable, str(DOCS / "examples" / "grpo_exact.py")],
        capture_output=True,
        text=True,
        timeout=220,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "aggregation: token-mean, updates: 2" in proc.stdout, proc.stdout
    # the report prints in a few lines (its __str__), not as the dataclass's screenful
    match = re.search(r"^  PASS: gradient max rel err (\S+) ", proc.stdout, re.M)
    assert match is not None, proc.stdout
    assert float(match.group(1)) <= 1e-12  # float64, summation order only
    assert "ParamRow" not in proc.stdout and len(proc.stdout.splitlines()) <= 6
