"""Entry point: parse arguments, dispatch to a subcommand, map errors to exit codes.

Exit codes: 0 success, 1 a check that ran and failed (e.g. verify found a mismatch) or a run that
failed on its own (another rank failed, a collective timed out, too many skipped updates), 2 bad input
(unknown workload, impossible plan, malformed run card). Each ``cmd_*.py`` module in this package
defines ``register(subparsers)``, which adds its parser and sets ``run(args) -> int`` as the default
``func``; new subcommands need no change here.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence

from gradaccum import __version__
from gradaccum.cli.common import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_INTERRUPTED
from gradaccum.errors import CollectiveError, GradAccumError, RankFailedError, TooManySkipsError

__all__ = ["build_parser", "main"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return EXIT_BAD_INPUT
    try:
        return int(args.func(args))
    except (RankFailedError, CollectiveError, TooManySkipsError) as exc:
        # the input was fine; the run itself failed (another rank, the network, the loss diverged)
        print(f"gradaccum {args.command}: failed: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except GradAccumError as exc:
        print(f"gradaccum {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print(f"gradaccum {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
