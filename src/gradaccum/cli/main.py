"""Entry point: parse arguments, dispatch to a subcommand, map errors to exit codes.

Exit codes (:mod:`gradaccum.cli.exitcodes`): 0 success, 1 a check that ran and failed (e.g. verify
found a mismatch) or a run that failed on its own (another rank failed, a collective timed out, too
many skipped updates, out of memory, a full disk), 2 bad input (unknown workload, impossible plan,
malformed run card), 130 interrupted (SIGINT), 143 stopped by SIGTERM. Each ``cmd_*.py`` module in
this package defines ``register(subparsers)``, which adds its parser and sets ``run(args) -> int``
as the default ``func``; new subcommands need no change here.

This module imports only the standard library at import time: an interrupt while torch and the
commands load (the first seconds of every command) ends in one line and exit 130, not a traceback.
Every option's help shows its default; a help text that does not say it gets ``(default X)``.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import os
import pkgutil
import signal
import sys
import threading
from collections.abc import Sequence
from types import FrameType
from typing import Any

from gradaccum import __version__
from gradaccum.cli.exitcodes import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_TERMINATED,
)

__all__ = ["Terminated", "build_parser", "entry", "main"]


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C so that the same clean-up runs; the command exits 143."""


class _DefaultsFormatter(argparse.HelpFormatter):
    """Appends ``(default X)`` to an option's help unless the help already names its default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or not action.option_strings
            or action.nargs == 0
            or default is None
            or default is argparse.SUPPRESS
        ):
            return text
        return f"{text} (default {str(default).replace('%', '%%')})"


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _DefaultsFormatter)
        # a prefix of a flag is refused, never read as the flag (--max-token is not --max-tokens)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        from gradaccum.cli.once import say_once

        # every rank parses the same command line: under torchrun one message is enough
        say_once(f"{self.format_usage().rstrip()}\n{self.prog}: error: {message}", alike=True)
        raise SystemExit(EXIT_BAD_INPUT)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="gradaccum", description="Exact, verified and measured gradient accumulation.")
    parser.add_argument("--version", action="version", version=f"gradaccum {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    from gradaccum import cli

    for info in sorted(pkgutil.iter_modules(cli.__path__), key=lambda m: m.name):
        if info.name.startswith("cmd_"):
            importlib.import_module(f"gradaccum.cli.{info.name}").register(subparsers)
    return parser


def _refuse_unknown(parser: argparse.ArgumentParser, args: argparse.Namespace, unknown: list[str]) -> None:
    """Exit 2 on arguments no parser took, in the subcommand's own usage, naming the flags that a
    mistyped or shortened one may have meant (flags are never abbreviated)."""
    command = getattr(args, "command", None)
    owner = parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            owner = action.choices[command]
    flags = [flag for action in owner._actions for flag in action.option_strings if flag.startswith("--")]
    hints = []
    for word in unknown:
        name = word.partition("=")[0]
        if not name.startswith("--"):
            continue
        near = [f for f in flags if f.startswith(name)] or difflib.get_close_matches(name, flags, n=2)
        if near:
            hints.append(f"{name}: did you mean {' or '.join(near)}?")
    hint = f" (flags are not abbreviated; {'; '.join(hints)})" if hints else ""
    owner.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")


def _command(argv: Sequence[str]) -> str:
    """The subcommand's name, for messages printed before (or without) parsing."""
    return next((a for a in argv if not a.startswith("-")), "")


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise Terminated()


def _exit_while_loading(argv: Sequence[str]) -> Any:
    """A handler for the first seconds, while torch and the commands import: print one line and
    exit at once. Nothing has been written yet, and raising instead would be unsafe here: a
    ``KeyboardInterrupt`` inside an import that a library guards with a broad ``except`` (torch
    importing numpy does) is swallowed, and the command would go on with a half-imported library."""
    prog = " ".join(p for p in ("gradaccum", _command(argv)) if p)

    def handler(signum: int, frame: FrameType | None) -> None:
        name = "SIGTERM" if signum == signal.SIGTERM else "SIGINT"
        with contextlib.suppress(OSError):
            os.write(2, f"{prog}: interrupted ({name}) while starting; nothing was done\n".encode())
        os._exit(EXIT_TERMINATED if signum == signal.SIGTERM else EXIT_INTERRUPTED)

    return handler


def entry() -> None:
    """The ``gradaccum`` command and ``python -m gradaccum``: :func:`main`, then the exit. A process
    torchrun launched held a process group, so it ends without interpreter finalization (see
    :mod:`gradaccum.distributed.process_exit`: otherwise a finished run can abort on its way out)."""
    code = main()
    from gradaccum.distributed.process_exit import exit_process

    exit_process(code, held_process_group="RANK" in os.environ and "WORLD_SIZE" in os.environ)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # while the commands load, a signal exits at once (see _exit_while_loading); then SIGINT raises
    # KeyboardInterrupt and SIGTERM Terminated, for every command (train installs its own handlers)
    previous: dict[int, Any] = {}
    main_thread = threading.current_thread() is threading.main_thread()
    if main_thread:
        loading = _exit_while_loading(argv)
        previous = {sig: signal.signal(sig, loading) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        parser = build_parser()
        args, unknown = parser.parse_known_args(argv)
        if unknown:
            _refuse_unknown(parser, args, unknown)
        if main_thread:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, _on_sigterm)
        return _main(parser, args, argv)
    except KeyboardInterrupt as exc:
        name = "SIGTERM" if isinstance(exc, Terminated) else "SIGINT"
        prog = " ".join(p for p in ("gradaccum", _command(argv)) if p)
        print(f"{prog}: interrupted ({name}); stopped", file=sys.stderr)
        return EXIT_TERMINATED if isinstance(exc, Terminated) else EXIT_INTERRUPTED
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _main(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str]) -> int:
    if getattr(args, "func", None) is None:
        parser.print_help()
        return EXIT_BAD_INPUT
    args.argv = argv  # the command line as typed, for the resume command a stopped run prints
    try:
        return int(args.func(args))
    except Exception as exc:
        return _report(args, exc)


def _report(args: argparse.Namespace, exc: Exception) -> int:
    """Print one message for a command that raised, and choose its exit code (or re-raise a bug)."""
    from gradaccum.cli.once import say_once
    from gradaccum.errors import (
        CheckpointWriteError,
        CollectiveError,
        GradAccumError,
        RankFailedError,
        TooManySkipsError,
    )

    prog = f"gradaccum {args.command}"

    def say(text: str) -> None:  # once per torchrun job where every rank says the same
        say_once(text, alike=_alike_on_every_rank(exc))

    oom = _out_of_memory(exc)
    if oom is not None:
        say(f"{prog}: failed: {_oom_message(args, oom)}")
        return EXIT_FAILED
    if isinstance(exc, (RankFailedError, CollectiveError, TooManySkipsError, CheckpointWriteError)):
        # the input was fine; the run itself failed (another rank, the network, the loss, the disk)
        say(f"{prog}: failed: {exc}")
        return EXIT_FAILED
    if isinstance(exc, GradAccumError):
        say(f"{prog}: error: {exc}")
        return EXIT_BAD_INPUT
    if isinstance(exc, OSError):  # a disk that filled up, a folder that vanished
        where = f" ({exc.filename})" if exc.filename else ""
        say(f"{prog}: failed: {exc.strerror or exc}{where}")
        return EXIT_FAILED
    raise exc


def _alike_on_every_rank(exc: Exception) -> bool:
    """Whether every rank is expected to raise this error with the same message: bad input is
    refused on every rank alike, and a failure the ranks agreed on names the failing rank in every
    rank's message. Not so for a collective that failed (which rank stopped is seen differently), or
    an error of this process alone (its disk, its memory, a bug)."""
    from gradaccum.errors import CollectiveError, GradAccumError

    return isinstance(exc, GradAccumError) and not isinstance(exc, (CollectiveError, OSError))


# -- out of memory -------------------------------------------------------------------------------

_OOM_TEXTS = ("out of memory", "can't allocate memory", "cannot allocate memory")

# the flags that set how much each forward holds, per command, and what to change
_SIZE_FLAGS = {
    "train": "a smaller --micro-batch (the global batch stays: more accumulation steps)",
    "verify": "a smaller --micro-batch or --sizes",
    "accept": "a baseline and candidate with a smaller MICRO (--baseline/--candidate MICROxACCUM)",
    "bench": "a smaller --global-batch, or --configs with smaller micro-batches",
    "scan": "a smaller model in the workload",
}
_SHOWN = (
    "workload",
    "runcard",
    "baseline",
    "candidate",
    "configs",
    "global_batch",
    "micro_batch",
    "sizes",
    "accum_steps",
    "precision",
    "dtype",
    "device",
    "fsdp",
)


def _out_of_memory(exc: BaseException) -> BaseException | None:
    """The out-of-memory error behind ``exc`` (CUDA's, a host allocation, or one a workload error
    wraps), or None."""
    torch = sys.modules.get("torch")
    kinds: tuple[type[BaseException], ...] = (MemoryError,)
    if torch is not None:
        kinds += (torch.OutOfMemoryError,)
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, kinds):
            return current
        if isinstance(current, RuntimeError) and any(t in str(current).lower() for t in _OOM_TEXTS):
            return current
        current = current.__cause__ or current.__context__
    return None


def _oom_message(args: argparse.Namespace, oom: BaseException) -> str:
    shown = []
    for name in _SHOWN:
        value = getattr(args, name, None)
        if value is None or value is False:
            continue
        flag = f"--{name.replace('_', '-')}"
        if isinstance(value, list):
            value = ",".join(map(str, value))
        shown.append(flag if value is True else f"{flag} {value}")
    first = (str(oom).strip().splitlines() or [type(oom).__name__])[0]
    first = first if len(first) <= 300 else first[:297] + "..."
    config = ", ".join(shown) if shown else "the defaults"
    resolved = getattr(args, "configuration", None)  # what a command resolved the flags into
    if resolved:
        config = f"{config} ({resolved})"
    return (
        f"out of memory ({first}) with {config}. Try {_SIZE_FLAGS.get(args.command, 'a smaller batch')}, "
        "activation checkpointing in the workload's model (torch.utils.checkpoint), or a lower "
        "precision (bfloat16)."
    )
