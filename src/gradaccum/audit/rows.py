"""The rows of ``gradaccum audit`` by name, and which of them a selection runs. Torch-free: the
names are listed in ``gradaccum audit --help``.

Every row has a short name; a group name stands for several rows (``deepspeed``: both DeepSpeed
rows, the slow ones: each starts a process with DeepSpeed's engine). :func:`select_rows` turns an
``only`` or a ``skip`` list of names into the rows to run, in the table's order, and refuses an
unknown name (naming it and the known ones) and the two lists together.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gradaccum.errors import ConfigError

__all__ = ["GROUPS", "ROWS", "Row", "known_names", "select_rows"]


@dataclass(frozen=True, slots=True)
class Row:
    """One row of the audit's table."""

    name: str
    """What ``--only``/``--skip`` call it."""
    recipe: str
    """The accumulation it runs, as the table prints it."""
    framework: str
    """The package that provides it (``torch`` for the hand-written loop)."""
    module: str
    """The import name whose presence decides whether it can run."""


ROWS: tuple[Row, ...] = (
    Row("hand-loop", "hand-written loop: (loss / k).backward()", "torch", "torch"),
    Row("accelerate", "Accelerator.accumulate()", "accelerate", "accelerate"),
    Row("lightning", "Trainer(accumulate_grad_batches=k)", "lightning", "lightning"),
    Row("deepspeed-engine", "engine.backward, gradient_accumulation_steps=k", "deepspeed", "deepspeed"),
    Row("deepspeed-gradaccum", "prepare_accumulator(engine).step", "deepspeed", "deepspeed"),
    Row(
        "transformers-trainer",
        "transformers Trainer(gradient_accumulation_steps=k)",
        "transformers",
        "transformers",
    ),
    Row("gradaccum", "Accumulator.step", "gradaccum", "gradaccum"),
)
"""Every row, in the table's order. ``transformers-trainer`` runs on ``hf:`` workloads only."""

GROUPS: dict[str, tuple[str, ...]] = {"deepspeed": ("deepspeed-engine", "deepspeed-gradaccum")}
"""Names that stand for several rows."""


def known_names() -> tuple[str, ...]:
    """Every name a selection may use: the rows', then the groups'."""
    return tuple(row.name for row in ROWS) + tuple(GROUPS)


def _expand(names: Sequence[str], flag: str) -> set[str]:
    """The row names ``names`` stand for; ``flag``: how the caller's setting is called, for the words."""
    known = known_names()
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ConfigError(
            f"{flag} {','.join(names)}: no audit row is called {', '.join(repr(n) for n in unknown)}; "
            f"the rows are {', '.join(known)}"
        )
    out: set[str] = set()
    for name in names:
        out.update(GROUPS.get(name, (name,)))
    return out


def select_rows(
    only: Sequence[str] | None = None,
    skip: Sequence[str] | None = None,
    *,
    settings: tuple[str, str] = ("only", "skip"),
) -> tuple[str, ...]:
    """The names of the rows to run, in the table's order: those in ``only`` (all when ``None``),
    less those in ``skip``. Giving both is refused (say the rows to run, or those to leave out), and
    so is a selection that leaves no row. ``settings``: what the caller calls the two, for the words."""
    only_word, skip_word = settings
    if only is not None and skip is not None:
        raise ConfigError(
            f"{only_word} {','.join(only)} and {skip_word} {','.join(skip)} were both given; give one of "
            f"them ({only_word} names the rows to run, {skip_word} the rows to leave out)"
        )
    chosen = {row.name for row in ROWS} if only is None else _expand(only, only_word)
    chosen -= _expand(skip or (), skip_word)
    if not chosen:
        raise ConfigError(
            f"{skip_word} {','.join(skip or ())} leaves no audit row to run; the rows are "
            f"{', '.join(row.name for row in ROWS)}"
        )
    return tuple(row.name for row in ROWS if row.name in chosen)
