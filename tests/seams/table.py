"""The seams table: every pair of the step's features, and every feature against the inputs users
pass, with the outcome each cell must have. A pure function of names (no torch): the tests run the
``exact`` cells, assert the ``refused`` ones raise the named error at construction, and check that
docs/design/seams.md prints this table.

Outcomes: ``exact`` (the update equals an independent float64 objective, relL2 <= 1e-10, and the
state is bitwise where a run is compared with a run), ``refused`` (the named error class, naming the
setting, at construction), ``n/a`` (the pair cannot be formed; the reason says why), and ``open``
(a pair the table lists but does not run yet; none is left, and docs/design/seams.md would name one).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FEATURES", "INPUTS", "Cell", "cells", "counts", "render"]

MOE = ("moe-exact", "moe-lagged", "moe-micro-batch")
FEATURES = (
    *MOE,
    "batchnorm-window",
    "accum_dtype",
    "token-budget",
    "post-scaling",
    "gradient-cache",
    "compile",
    "ddp",
    "external-step",
)
INPUTS = (
    "dict",
    "BatchEncoding",
    "tuple",
    "dataclass",
    "loss_fn-submodules",
    "loss_fn-compiled",
    "skipped-window",
    "short-window",
    "resume",
)
RUN = ("moe-exact", "moe-lagged", "moe-micro-batch", "batchnorm-window", "accum_dtype", "token-budget",
       "post-scaling", "gradient-cache")  # fmt: skip
"""The features the single-process harness (tests/seams/scenario.py) composes."""
HARNESSED = (*RUN, "ddp", "compile", "external-step")
"""With the two-process launch (test_ddp_cells.py), the compiled model (test_compile_cells.py) and
DeepSpeed's engine (test_deepspeed_cells.py)."""
EXTERNAL = {
    "accum_dtype": ("refused", "ConfigError: accum_dtype (ZeRO stages 2-3; exact at stages 0-1)"),
    "post-scaling": ("refused", "ConfigError: scaling"),
    "ddp": ("refused", "ConfigError: DistributedDataParallel (inside the engine)"),
    "loss_fn-submodules": (
        "refused",
        "ConfigError: loss_fn (ZeRO stage 3, at the step: it never called the engine; exact at stages 0-2)",
    ),
}
"""The external step's cells that are not exact (test_deepspeed_cells.py runs ZeRO stages 0-3)."""


@dataclass(frozen=True, slots=True)
class Cell:
    row: str
    col: str
    outcome: str
    """``exact``, ``refused``, ``n/a`` or ``open``."""
    note: str = ""
    """refused: ``ErrorClass: setting``; n/a and open: why."""


def _pair(a: str, b: str) -> tuple[str, str]:
    if a in MOE and b in MOE:
        return "n/a", "one LoadBalance has one mode"
    pair = {a, b}
    if pair & set(MOE) and "post-scaling" in pair:
        return "refused", "ConfigError: scaling"
    if pair & set(MOE) and "gradient-cache" in pair:
        return "refused", "ConfigError: balance"
    if pair == {"batchnorm-window", "gradient-cache"}:
        return "refused", "CacheError: batchnorm_stats"
    if pair == {"post-scaling", "gradient-cache"}:
        return "refused", "CacheError: scaling"
    if pair == {"token-budget", "gradient-cache"}:
        return "n/a", "a cached objective concatenates representations; trimmed widths differ"
    if "external-step" in pair and pair & {*MOE, "gradient-cache"}:
        return "n/a", "prepare_accumulator takes no balance= and is not CachedAccumulator"
    if "external-step" in pair:
        return EXTERNAL.get(a if b == "external-step" else b, ("exact", ""))
    if "ddp" in pair and "external-step" not in pair:
        return "exact", ""
    if "compile" in pair and not pair & {"ddp", "external-step"}:
        return "exact", ""
    return "exact", ""


def _input(feature: str, given: str) -> tuple[str, str]:
    if feature == "ddp" and given == "loss_fn-submodules":
        # refused at the step (loss_fn arrives there): tests/distributed/test_ddp_forward.py
        return "refused", "ConfigError: loss_fn (at the step: it never called the DDP model)"
    if given == "loss_fn-compiled" and feature != "external-step":
        return "exact", ""
    if feature == "external-step":
        return EXTERNAL.get(given, ("exact", ""))
    if feature in ("ddp", "compile") and given != "loss_fn-compiled":
        return "exact", ""
    if feature == "token-budget" and given == "tuple":
        return "refused", "PlanError: batch (split_by_tokens reads a named attention_mask)"
    if feature == "gradient-cache" and given == "loss_fn-submodules":
        return "n/a", "CachedAccumulator's encode_fn is the user's function: it may call anything"
    return "exact", ""


def cells() -> list[Cell]:
    """Features x features (each unordered pair once, a feature alone on the diagonal), then
    features x inputs."""
    out = []
    for i, a in enumerate(FEATURES):
        for b in FEATURES[i:]:
            outcome, note = ("exact", "") if a == b and a in HARNESSED else _pair(a, b) if a != b else (
                "open", "needs the compiled / two-process / DeepSpeed harness")  # fmt: skip
            out.append(Cell(a, b, outcome, note))
    for a in FEATURES:
        for b in INPUTS:
            out.append(Cell(a, b, *_input(a, b)))
    return out


def counts(table: list[Cell]) -> dict[str, int]:
    return {k: sum(c.outcome == k for c in table) for k in ("exact", "refused", "n/a", "open")}


def render(table: list[Cell]) -> str:
    """The markdown docs/design/seams.md holds between its markers."""
    lines = ["| feature | with | outcome | note |", "|---|---|---|---|"]
    lines += [f"| {c.row} | {c.col} | {c.outcome} | {c.note} |" for c in table]
    n = counts(table)
    lines.append("")
    lines.append(
        f"{len(table)} cells: {n['exact']} exact, {n['refused']} refused, {n['n/a']} not applicable, "
        f"{n['open']} open."
    )
    return "\n".join(lines)
