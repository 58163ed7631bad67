"""What breaks equivalence: a static scan of a model and the planned accumulation.

An accumulated update equals the full-batch update when the loss is a sum of independent
per-example terms and nothing in the forward depends on which examples run together. The scan
looks for the layers that break that by type and by attribute names:

- BatchNorm (any flavour, SyncBatchNorm included) normalizing with batch statistics: each
  micro-batch is normalized with its own statistics, and running estimates update k times per
  optimizer step, so the effective momentum per step is ``1 - (1 - m)^k``. The fix names
  ``batchnorm_stats="window"`` for the running estimates (once per step, from the pooled moments of
  what each BatchNorm saw over the window);
  the normalization inside each forward stays per micro-batch.
- InstanceNorm with running statistics: gradients are exact (statistics are per example), but the
  running estimates still update k times per step.
- Random layers (dropout of every kind, MultiheadAttention's attention dropout, float attributes
  named like a drop probability that modules read in training mode, such as ``attention_dropout``
  or a drop-path rate, RReLU, fractional max pooling): masks depend on execution shape. The same
  list (:func:`random_sources`) is what ``verify`` switches off.
- Mixture-of-experts routers, recognised by an auxiliary-loss attribute (``aux_loss``, ``l_aux``,
  ``load_balancing_loss``, ...; see ``AUX_LOSS_NAMES``) or by a class name containing
  router/moe/gate/expert together with an expert count (``num_experts``, ``n_experts``,
  ``num_local_experts``, ``n_routed_experts``): balancing statistics are per forward. When the
  model computes no balancing loss (``output_router_logits=False`` in its config, as transformers'
  Mixtral has by default, or a coefficient of 0) and sets no expert capacity, each token is routed
  on its own and the update is exact: the finding is then a note, not an error.
- Hazards the workload declares (``Workload.declared_hazards``), e.g. ``in-batch-negatives``.
- Inside a compiled region (a compiled model or block, a compiled loss): a division by a Python
  number computed from the batch, which torch.compile bakes into the graph
  (:mod:`gradaccum.hazards.compiled`).

It cannot see couplings written inside ``forward`` or the loss (functional ``batch_norm``, a loss over
the whole batch), so every scan ends with a note that ``verify`` is the empirical check.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch.nn as nn

from gradaccum.errors import PlanError
from gradaccum.hazards.compiled import compiled_findings
from gradaccum.hazards.finding import Finding, Severity
from gradaccum.hazards.precision import precision_findings
from gradaccum.values import require_int

__all__ = [
    "AUX_LOSS_NAMES",
    "EXPERT_COUNT_NAMES",
    "KNOWN_HAZARDS",
    "Finding",
    "RandomSource",
    "Severity",
    "effective_momentum",
    "matched_momentum",
    "random_sources",
    "scan",
]

_RANK: dict[str, int] = {"error": 0, "warning": 1, "info": 2}

# isinstance only: these base classes cover every flavour (Sync, Lazy, 1d/2d/3d) and user subclasses
_BATCH_NORM = nn.modules.batchnorm._BatchNorm
_INSTANCE_NORM = nn.modules.instancenorm._InstanceNorm
_DROPOUT = nn.modules.dropout._DropoutNd

AUX_LOSS_NAMES = (
    "aux_loss",
    "l_aux",
    "load_balancing_loss",
    "balance_loss",
    "lb_loss",
    "router_aux_loss",
    "router_z_loss",
    "router_aux_loss_coef",
)
"""Attributes whose presence marks a module as a router with batch-level balancing statistics."""
EXPERT_COUNT_NAMES = ("num_experts", "n_experts", "num_local_experts", "n_routed_experts")
"""Expert-count attributes; they mark a router when the class name says router/moe/gate/expert."""
_ROUTER_NAME_PARTS = ("router", "moe", "gate", "gating", "expert")


def effective_momentum(momentum: float, accum_steps: int) -> float:
    """Momentum per optimizer step of a running estimate updated ``accum_steps`` times per step.

    Each update keeps ``1 - m`` of the old estimate, so k updates keep ``(1 - m)^k``.
    """
    return 1.0 - (1.0 - momentum) ** accum_steps


def matched_momentum(momentum: float, accum_steps: int) -> float:
    """The per-forward momentum that gives ``momentum`` per optimizer step over ``accum_steps``."""
    return 1.0 - (1.0 - momentum) ** (1.0 / accum_steps)


def _has_any(module: nn.Module, names: Iterable[str]) -> str | None:
    """The first of ``names`` that ``module`` has (attribute, parameter, buffer or submodule)."""
    return next((name for name in names if hasattr(module, name)), None)


@dataclass(frozen=True, slots=True)
class RandomSource:
    """One place a model draws random numbers in training mode, and how verify switches it off."""

    path: str
    """The module's path in the model (``h.0.attn.attn_dropout``)."""
    kind: str
    """Its class name."""
    attribute: str | None
    """The probability attribute the check sets to 0 (``p``, ``dropout``, ``attention_dropout``,
    ...), ``training`` for a layer that is random only in training mode (RReLU), ``None`` for one
    that cannot be switched off (fractional max pooling)."""
    value: float | None = None
    """The attribute's value (the drop probability)."""

    @property
    def switchable(self) -> bool:
        return self.attribute is not None

    def describe(self) -> str:
        """``h.0.attn.attn_dropout.p=0.1``, ``act (RReLU, training off)`` or, for fractional pooling,
        ``pool (FractionalMaxPool2d, cannot be switched off)``."""
        where = self.path or "(the model)"
        if self.attribute is None:
            return f"{where} ({self.kind}, cannot be switched off)"
        if self.attribute == "training":
            return f"{where} ({self.kind}, training off)"
        return f"{where}.{self.attribute}={self.value:g}"


def _drop_attributes(module: nn.Module) -> Iterator[tuple[str, float]]:
    """Float attributes of ``module`` named like a drop probability and in (0, 1]: what modules read
    in training mode instead of calling a Dropout layer (``self.attention_dropout`` handed to
    scaled_dot_product_attention, a drop-path rate)."""
    for name, value in vars(module).items():
        if "drop" in name.lower() and isinstance(value, float) and 0.0 < value <= 1.0:
            yield name, value


def random_sources(model: nn.Module) -> list[RandomSource]:
    """Every recognised source of random numbers of ``model`` as it is now (its training flags).

    Dropout layers of every kind with ``p > 0`` (their ``p``, which some attention modules read
    directly: GPT-2's ``self.attn_dropout.p if self.training``), MultiheadAttention's ``dropout``,
    float attributes named like a drop probability (``attention_dropout``, ``drop_prob``), RReLU,
    and fractional max pooling (random in eval mode too, and not switchable). The scan reports these,
    and ``verify`` switches exactly these off: the two always agree.
    """
    sources: list[RandomSource] = []
    for path, module in model.named_modules():
        kind = type(module).__name__
        if isinstance(module, (nn.FractionalMaxPool2d, nn.FractionalMaxPool3d)):
            sources.append(RandomSource(path=path, kind=kind, attribute=None))
            continue
        if not module.training:
            continue
        if isinstance(module, _DROPOUT):
            if module.p > 0:
                sources.append(RandomSource(path=path, kind=kind, attribute="p", value=float(module.p)))
            continue
        if isinstance(module, nn.MultiheadAttention) and module.dropout > 0:
            sources.append(
                RandomSource(path=path, kind=kind, attribute="dropout", value=float(module.dropout))
            )
            continue
        if isinstance(module, nn.RReLU):
            sources.append(RandomSource(path=path, kind=kind, attribute="training"))
            continue
        for name, value in _drop_attributes(module):
            sources.append(RandomSource(path=path, kind=kind, attribute=name, value=value))
    return sources


def _batch_shape(accum_steps: int, micro_batch: int | None) -> tuple[str, str]:
    if micro_batch is None:
        return f"1/{accum_steps} of the step's examples", "all of them"
    return f"{micro_batch} examples", f"{micro_batch * accum_steps}"


_WINDOW_STATS = (
    " For its running statistics, Accumulator(..., batchnorm_stats='window') updates them once per "
    "optimizer step from the pooled moments of what each BatchNorm saw over the window's "
    "micro-batches (and data-parallel ranks); it does not change the normalization "
    "inside each forward, which still uses the micro-batch's statistics, so the gradients stay "
    "those of micro-batches"
)
"""What ``batchnorm_stats="window"`` fixes (the running estimates) and what it does not."""


def _running_stats(module: nn.Module, k: int, figures: dict[str, float]) -> tuple[str, str]:
    """The explanation and fix of running estimates updated k times per optimizer step."""
    momentum = getattr(module, "momentum", None)
    if momentum is None:
        return (
            f"Its running estimates are a cumulative average (momentum=None): every forward weighs "
            f"equally, so k does not reweight them, but num_batches_tracked counts micro-batches "
            f"({k} per optimizer step), not steps, and each estimate comes from one micro-batch.",
            "",
        )
    eff, matched = effective_momentum(momentum, k), matched_momentum(momentum, k)
    figures.update(momentum=momentum, effective_momentum=eff, matched_momentum=matched)
    return (
        f"Its running estimates update on every forward, {k} times per optimizer step: the effective "
        f"momentum per step is 1 - (1 - {momentum:g})^{k} = {eff:.4f} instead of {momentum:g}.",
        f"set momentum={matched:.4f} per forward to keep {momentum:g} per optimizer step "
        f"(1 - (1 - {momentum:g})^(1/{k}))",
    )


def _norm_finding(path: str, module: nn.Module, k: int, micro_batch: int | None) -> Finding | None:
    kind = type(module).__name__
    figures: dict[str, float] = {"accum_steps": float(k)}
    tracks = bool(getattr(module, "track_running_stats", False))
    if isinstance(module, _INSTANCE_NORM):
        # per-example statistics: gradients are exact, only the running estimates see k
        if not (tracks and module.training):
            return None
        text, fix = _running_stats(module, k, figures)
        return Finding(
            code="running-stats",
            severity="warning",
            path=path,
            kind=kind,
            summary="updates its running estimates once per micro-batch",
            explanation="It normalizes each example on its own, so gradients are exact. " + text,
            fix=(fix or "nothing to change for the gradients")
            + "; evaluation uses these estimates, so compare eval metrics, not only losses.",
            figures=figures,
        )
    uses_batch_stats = module.training or not tracks
    if not uses_batch_stats:
        return Finding(
            code="note",
            severity="info",
            path=path,
            kind=kind,
            summary="is in eval mode and normalizes with its running estimates",
            explanation="It couples no examples now; in training mode it would normalize each "
            "micro-batch with that micro-batch's own statistics.",
            fix="None while it stays in eval mode.",
            figures=figures,
        )
    each, whole = _batch_shape(k, micro_batch)
    if micro_batch is not None:
        figures.update(micro_batch=float(micro_batch), global_batch=float(micro_batch * k))
    explanation = (
        f"In training mode it normalizes with the mean and variance of the examples in the same "
        f"forward: {each} per forward instead of {whole}, so each example's output and gradient "
        f"depend on which micro-batch it lands in, and no loss scaling repairs that."
    )
    fix_momentum = ""
    if tracks and module.training:
        text, fix_momentum = _running_stats(module, k, figures)
        explanation += " " + text
    pooled = (
        "SyncBatchNorm already pools statistics across GPUs, but not across micro-batches in time"
        if isinstance(module, nn.SyncBatchNorm)
        else "SyncBatchNorm pools statistics across GPUs (not across micro-batches in time)"
    )
    return Finding(
        code="batch-norm",
        severity="error",
        path=path,
        kind=kind,
        summary="normalizes each micro-batch separately",
        explanation=explanation,
        fix=(
            "accept it (micro-batches of 16+ examples usually normalize well, but the update is no "
            f"longer the full-batch one); {pooled}; or use GroupNorm/LayerNorm, which normalize each "
            "example on its own and are exact under accumulation."
            + (_WINDOW_STATS + (f"; without it, {fix_momentum}." if fix_momentum else ".") if tracks else "")
        ),
        figures=figures,
    )


def _random_finding(sources: list[RandomSource]) -> Finding:
    first = sources[0]
    if first.switchable:
        # the attributes, not the module's path: modules of one kind share one finding with their places
        switched = ", ".join(
            dict.fromkeys(
                "training off" if s.attribute == "training" else f"{s.attribute} -> 0" for s in sources
            )
        )
        how = f"verify switches it off for its diagnostic ({switched}, restored afterwards). "
    else:
        how = "It cannot be switched off (it draws in eval mode too); verify reports it as randomness. "
    return Finding(
        code="random-layer",
        severity="warning",
        path=first.path,
        kind=first.kind,
        summary="draws random numbers in its forward",
        explanation=(
            "Its masks come from the global generator in execution order: splitting the batch changes "
            "how many numbers each forward draws and in which order, so the two partitionings see "
            "different masks even with the same seed. The objective matches in expectation, not update "
            "for update."
        ),
        fix=how + "To compare trajectories, derive each example's mask from a generator seeded by the "
        "example's index, or accept the difference and compare several seeds.",
        figures={"drop_probability": first.value} if first.value is not None else {},
    )


_CAPACITY_NAMES = ("capacity_factor", "expert_capacity", "eval_capacity_factor")
"""Attributes that set how many tokens an expert takes per forward (tokens beyond it are dropped)."""


def _aux_loss_off(module: nn.Module, root: nn.Module) -> str | None:
    """Why the model computes no balancing loss, in words; ``None`` when it does or cannot be told."""
    for owner in (module, root):
        config = getattr(owner, "config", None)
        if getattr(config, "output_router_logits", None) is False:
            return "its config has output_router_logits=False, so the forward computes no balancing loss"
        coef = getattr(owner, "router_aux_loss_coef", getattr(config, "router_aux_loss_coef", None))
        if isinstance(coef, (int, float)) and not isinstance(coef, bool) and coef == 0:
            return "its balancing-loss coefficient (router_aux_loss_coef) is 0"
    return None


def _has_capacity(module: nn.Module, root: nn.Module) -> bool:
    config = getattr(root, "config", None)
    owners = [*module.modules(), config]
    return any(getattr(o, name, None) not in (None, 0, False) for o in owners for name in _CAPACITY_NAMES)


_LOAD_BALANCE = (
    "gradaccum.Accumulator(model, optimizer, balance=gradaccum.moe.LoadBalance.from_model(model)) "
    "computes the balancing loss once per optimizer step from the window's routing statistics "
    "(tokens per expert, routed rows, summed router probabilities), with loss_fn returning the "
    "cross-entropy only (exact_trainer(Trainer) does it for a transformers model by itself). "
    "LoadBalance modes: 'exact' (default) counts the window in a no-grad routing pass first, the "
    "full batch's objective at up to two forwards per micro-batch; 'lagged' uses the previous "
    "window's counts at one forward; 'micro-batch' is the per-forward term, for comparison"
)
"""The moe-router finding's fix: what makes the balancing loss the batch's, and what the modes do."""


def _router_finding(path: str, module: nn.Module, k: int, root: nn.Module) -> Finding:
    figures: dict[str, float] = {"accum_steps": float(k)}
    count_name = _has_any(module, EXPERT_COUNT_NAMES)
    experts = getattr(module, count_name, None) if count_name else None
    if isinstance(experts, int):
        figures["num_experts"] = float(experts)
    off = _aux_loss_off(module, root)
    severity: Severity
    if off is not None and not _has_capacity(module, root):
        severity, summary = "info", "routes each token on its own: its balancing loss is off"
        explanation = (
            f"A mixture-of-experts router, but {off} and no expert capacity is set: each token's "
            "experts depend on that token alone, so nothing couples the examples of a micro-batch "
            f"and the update over {k} micro-batches is exact (verify measures it). Turning the "
            "balancing loss on (output_router_logits=True) makes it a per-forward batch statistic."
        )
        fix = f"None needed while the balancing loss is off. With it on: {_LOAD_BALANCE}."
    else:
        severity, summary = "error", "routes tokens with load-balancing statistics computed per forward"
        explanation = (
            "A balancing loss multiplies each expert's fraction of tokens by its mean router "
            f"probability, both averaged over one forward: over {k} micro-batches the sum of products "
            "of micro-batch means is not the product of the batch means, and expert capacity (where "
            "tokens are dropped) is computed per forward too."
        )
        fix = (
            f"balance over the window: {_LOAD_BALANCE}; or accept the difference and let verify "
            "measure it (it reports how far lagged and micro-batch balancing are from exact)."
        )
    return Finding(
        code="moe-router",
        severity=severity,
        path=path,
        kind=type(module).__name__,
        summary=summary,
        explanation=explanation,
        fix=fix,
        figures=figures,
    )


@dataclass(frozen=True, slots=True)
class _Hazard:
    summary: str
    sized: str
    """The explanation with ``{b}`` (micro-batch), ``{neg}``/``{all_neg}`` (negatives) and ``{all}``."""
    unsized: str
    """The explanation when the micro-batch size is unknown or uneven (``{k}`` micro-batches)."""
    fix: str


KNOWN_HAZARDS: dict[str, _Hazard] = {
    "in-batch-negatives": _Hazard(
        "uses in-batch negatives: each example is contrasted only with the examples of its own forward",
        "Split into micro-batches of {b}, each example meets {neg} instead of {all_neg} negatives: the "
        "objective itself changes, not just how it is evaluated, so no loss scaling repairs it.",
        "Split into {k} micro-batches, each example meets only the negatives of its own micro-batch "
        "instead of every other example of the step: the objective itself changes, so no loss scaling "
        "repairs it.",
        "step with gradaccum.CachedAccumulator(model, optimizer).step(window, encode_fn, loss_fn), which "
        "makes the loss exact with a gradient cache (Gao et al. 2021: encode the whole window without a "
        "graph, compute the loss over every representation of the step, then backpropagate its "
        "gradients micro-batch by micro-batch), and check it with `gradaccum verify --cached` (the "
        "workload's extras encode_fn and rep_loss_fn); or accept fewer negatives as a different objective.",
    ),
    "batch-statistics": _Hazard(
        "uses statistics over the whole batch (a batch mean, centering or variance term)",
        "Computed per micro-batch, those statistics come from {b} examples instead of the {all} of the "
        "step, so the objective changes.",
        "Computed per micro-batch, those statistics come from 1/{k} of the step's examples, so the "
        "objective changes.",
        "compute the statistics over the window first (a forward pass without a graph, or running "
        "sums), then backpropagate per micro-batch against them; or accept the difference.",
    ),
    "moe-load-balancing": _Hazard(
        "adds a mixture-of-experts load-balancing loss computed per forward",
        "Balancing statistics over micro-batches of {b} examples are not those over the {all} of the step.",
        "Balancing statistics over 1/{k} of the step's examples are not those over the whole step.",
        "balance over the window with gradaccum.moe.LoadBalance (Accumulator(..., balance=...)): the "
        "balancing loss computed once per step from the window's routing statistics.",
    ),
}
"""Hazards a workload may declare for its loss (``Workload.declared_hazards``), by name."""


def _declared_finding(hazard: str, k: int, micro_batch: int | None) -> Finding:
    known = KNOWN_HAZARDS.get(hazard)
    figures: dict[str, float] = {"accum_steps": float(k)}
    if known is None:
        return Finding(
            code="declared-hazard",
            severity="error",
            path="",
            kind="workload",
            summary=f"declares the hazard {hazard!r}",
            explanation="The workload says its objective couples examples in this way; the scan has no "
            f"rule for it (known: {', '.join(sorted(KNOWN_HAZARDS))}).",
            fix="verify measures whether it matters; see the workload's documentation for its remedy.",
            figures=figures,
        )
    if micro_batch is None:
        explanation = known.unsized.format(k=k)
    else:
        total = micro_batch * k
        figures.update(micro_batch=float(micro_batch), global_batch=float(total))
        explanation = known.sized.format(b=micro_batch, neg=micro_batch - 1, all_neg=total - 1, all=total)
    return Finding(
        code="declared-hazard",
        severity="error",
        path="",
        kind="loss",
        summary=known.summary,
        explanation=explanation,
        fix=known.fix,
        figures=figures,
    )


def _closing_note() -> Finding:
    return Finding(
        code="verify",
        severity="info",
        path="",
        kind="scan",
        summary="recognises layers by type and attribute names only",
        explanation=(
            "Couplings written inside forward or the loss (functional batch_norm, a loss over the "
            "whole batch, state cached between calls) are invisible to it. `gradaccum verify` is the "
            "empirical check: it compares the accumulated update with the full-batch update on your "
            "model and loss."
        ),
        fix="run `gradaccum verify --workload MODULE:FUNCTION` (or call gradaccum.verify(...)) on the model.",
    )


def scan(
    model: nn.Module,
    accum_steps: int = 4,
    *,
    micro_batch: int | None = None,
    declared_hazards: Iterable[str] = (),
    loss_fn: Callable[..., Any] | None = None,
) -> list[Finding]:
    """Static findings for ``model`` accumulated over ``accum_steps`` micro-batches per step.

    ``micro_batch`` (examples per forward), when given, puts sizes into the explanations;
    ``declared_hazards`` are couplings the workload declares for its loss; ``loss_fn``, when given,
    is read too where it is compiled (:mod:`gradaccum.hazards.compiled`, as are the model's
    compiled modules). Findings come errors first, then warnings, then notes; the last one always
    says that ``verify`` is the empirical check.
    """
    require_int("accum_steps", accum_steps)
    require_int("micro_batch", micro_batch, none_ok=True)
    if not isinstance(model, nn.Module):
        raise PlanError(f"scan needs a torch.nn.Module, got {type(model).__name__}")
    k = accum_steps
    findings: list[Finding] = []
    if k == 1:
        findings.append(
            Finding(
                code="note",
                severity="info",
                path="",
                kind="plan",
                summary="has one micro-batch per optimizer step (accum_steps=1)",
                explanation="Nothing is split, so no layer sees a different batch than without accumulation.",
                fix="None needed.",
                figures={"accum_steps": 1.0},
            )
        )
    else:
        random: dict[str, list[RandomSource]] = {}
        for source in random_sources(model):
            random.setdefault(source.path, []).append(source)
        routers: list[str] = []
        for path, module in model.named_modules():
            if isinstance(module, (_BATCH_NORM, _INSTANCE_NORM)):
                norm = _norm_finding(path, module, k, micro_batch)
                if norm is not None:
                    findings.append(norm)
            elif path in random:
                findings.append(_random_finding(random[path]))
            elif _is_router(module) and not any(r == "" or path.startswith(r + ".") for r in routers):
                # the gate inside a recognised MoE block is the same finding
                routers.append(path)
                findings.append(_router_finding(path, module, k, model))
        findings.extend(_declared_finding(h, k, micro_batch) for h in dict.fromkeys(declared_hazards))
        findings.extend(precision_findings(model, k))
    findings.extend(compiled_findings(model, loss_fn))
    findings.sort(key=lambda f: _RANK[f.severity])  # stable: model order within a severity
    findings.append(_closing_note())
    return findings


def _is_router(module: nn.Module) -> bool:
    if _has_any(module, AUX_LOSS_NAMES):
        return True
    name = type(module).__name__.lower()
    return (
        any(part in name for part in _ROUTER_NAME_PARTS) and _has_any(module, EXPERT_COUNT_NAMES) is not None
    )
