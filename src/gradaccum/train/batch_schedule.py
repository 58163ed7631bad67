"""A global batch that grows with the measured critical batch: ``train --batch-schedule critical``.

McCandlish et al. (2018, arXiv 1812.06162) model the cost of reaching a loss with batch B as
S = S_min (1 + B_noise / B) updates and E = E_min (1 + B / B_noise) examples: below B_noise a larger
batch cuts the updates almost in proportion at little cost in data, above it more data per update
buys little. B_noise grows as training proceeds (Zhang et al. 2024, arXiv 2410.21676; Merrill et al.
2025, arXiv 2505.23971 measure a critical batch near 0 at initialization that rises and plateaus),
so a fixed batch is either too large early (wasted data) or too small late (wasted updates). Merrill
et al.'s batch-size warmup (start small, grow as the critical batch grows) reached slightly better
loss than OLMo 1B's fixed batch in 43 % fewer updates.

The rule, applied after every window once ``min_updates`` applied updates have passed since the
start or the last change:

    B_recent = sum_w tr(Sigma)_w / sum_w |G|^2_w     over the last min_updates measured windows
    target   = fraction x (B_recent - se) / (units per example)
    grow     when global_batch < target, to the smallest multiple of micro_batch x dp that reaches
             the target, capped at growth x global_batch and at max_global_batch

(se: the standard error of the ratio B_recent, by the delta method from the windows' spread).
The micro-batch stays fixed and ``accum_steps`` rises, so memory does not change; each update is
still normalized by its own window's count (the step's W / N), so it is exact whatever the
window's length.

B_recent combines the accumulator's own per-window estimates (``noise_scale=True``:
``NoiseScale.window_trace_cov`` and ``window_grad_sq``, each unbiased) as B_simple does, a ratio
of sums, but over the last ``min_updates`` windows only. The accumulator's B_simple averages ~100
windows (beta 0.99): while |G|^2 falls fast early in a run it remembers the large early gradients
and lags the current critical batch by tens of windows (on the regression example it read 18 at
update 90 where the last 10 windows' figures gave ~800). Both figures are per unit, so windows at
different batch sizes combine.

The batch never shrinks: the critical batch grows over a run, and shrinking on a noisy estimate
would make the schedule chatter. So a decision taken on an estimate that noise pushed up stays,
and repeated decisions on a constant B_noise would ratchet the batch up to the largest of their
estimates; aiming at the one-standard-error lower bound approaches B_noise from below (regression
example with the weights held still, 16 runs: settled batch / B_noise 1.28-1.85 aiming at B_recent
itself, 1.11-1.61 at the bound, where 1.11 is the rounding up to whole micro-batches).

The learning rate when the batch grows from B_0 to B is multiplied by (B / B_0)^p:

* ``sqrt`` (p = 1/2, the default): keeps Adam's noise temperature lr / sqrt(B). This is the
  square-root rule for adaptive optimizers (Malladi et al. 2022, arXiv 2205.10287), and Seesaw's
  equivalence (Meterez et al. 2025, arXiv 2510.14717: doubling the batch at lr / sqrt 2 matches
  halving the learning rate, for normalized SGD as a proxy of Adam). With it a batch change neither
  anneals nor heats the run; it only cuts the updates. ``train``'s default optimizer is AdamW.
* ``linear`` (p = 1): keeps SGD's lr / B (Goyal et al. 2017; Seesaw's SGD case).
* ``keep`` (p = 0): each change acts as a learning-rate decay (Smith et al. 2018, "Don't decay the
  learning rate, increase the batch size").

Every decision is a pure function of the schedule's state (:meth:`CriticalBatchSchedule.state_dict`,
the recent windows' figures included) and of the figures every rank reads alike (the all-reduced
noise estimate, the window's global count), so a resumed run makes the same decisions, and so does
every rank of a data-parallel run.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

from gradaccum.errors import PlanError
from gradaccum.fielddocs import document_fields
from gradaccum.plan import BatchPlan
from gradaccum.values import require_int

if TYPE_CHECKING:
    from gradaccum.step.noise import NoiseScale

__all__ = [
    "DEFAULT_GROWTH",
    "DEFAULT_LR_RULE",
    "DEFAULT_MIN_UPDATES",
    "LR_RULES",
    "BatchChange",
    "CriticalBatchConfig",
    "CriticalBatchSchedule",
    "LrRule",
]

LrRule = Literal["keep", "sqrt", "linear"]
LR_RULES: tuple[LrRule, ...] = ("keep", "sqrt", "linear")
_POWER = {"keep": 0.0, "sqrt": 0.5, "linear": 1.0}
DEFAULT_LR_RULE: LrRule = "sqrt"
"""Adam's square-root rule (see the module docstring): ``train`` defaults to AdamW."""
DEFAULT_GROWTH = 2.0
"""At most a doubling per change: Merrill et al.'s warmup and Seesaw both double."""
DEFAULT_MIN_UPDATES = 20
"""Updates between changes: the estimate's moving average (~100 windows) must first see the new
batch, and a decision on fewer than ~20 windows rests on an estimate with a ~20 % spread."""


def _flag(field: str) -> str:
    return {
        "max_global_batch": "--max-global-batch",
        "growth": "--batch-growth",
        "min_updates": "--batch-min-updates",
        "lr_rule": "--batch-lr-rule",
        "fraction": "--batch-fraction",
    }[field]


@document_fields
@dataclass(frozen=True, kw_only=True, slots=True)
class CriticalBatchConfig:
    """How the global batch follows the measured noise scale (``train --batch-schedule critical``)."""

    max_global_batch: int
    """The largest global batch, in examples over all ranks: a multiple of micro_batch x dp, at
    least the starting global batch."""
    growth: float = DEFAULT_GROWTH
    """The largest factor one change may multiply the global batch by (> 1); a change always adds at
    least one micro-batch per rank, so a small factor on a short window may be exceeded."""
    min_updates: int = DEFAULT_MIN_UPDATES
    """Applied updates before the first change and between two changes."""
    lr_rule: LrRule = DEFAULT_LR_RULE
    """How the learning rate follows the batch: ``keep``, ``sqrt`` (x sqrt(B / B_0)) or ``linear``
    (x B / B_0), on top of the learning-rate schedule."""
    fraction: float = 1.0
    """The global batch aimed at, as a fraction of B_simple (1: McCandlish et al.'s balance, ~2x the
    fewest updates and ~2x the fewest examples; below 1 spends fewer examples and more updates)."""

    def __post_init__(self) -> None:
        require_int(f"max_global_batch ({_flag('max_global_batch')})", self.max_global_batch, error=PlanError)
        require_int(f"min_updates ({_flag('min_updates')})", self.min_updates, error=PlanError)
        for name in ("growth", "fraction"):
            value = getattr(self, name)
            bad = isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            low = 1.0 if name == "growth" else 0.0
            if bad or not value > low:
                raise PlanError(f"{name} ({_flag(name)}) must be a number above {low:g}, got {value!r}")
        if self.lr_rule not in LR_RULES:
            raise PlanError(
                f"lr_rule ({_flag('lr_rule')}) must be one of {', '.join(LR_RULES)}, got {self.lr_rule!r}"
            )

    def check(self, plan: BatchPlan) -> None:
        """Refuse bounds that contradict ``plan`` (the starting plan), naming the flag and the fix."""
        per_pass = plan.micro_batch * plan.dp
        if plan.accum_steps * plan.dp < 2:
            raise PlanError(
                f"--batch-schedule critical measures the noise scale from the micro-batches of a window, "
                f"and {plan.equation()} has one: start with at least two (accum_steps x dp >= 2, e.g. "
                f"--global-batch {2 * per_pass})"
            )
        if self.max_global_batch < plan.global_batch:
            raise PlanError(
                f"max_global_batch ({_flag('max_global_batch')}) {self.max_global_batch} is below the "
                f"starting global batch {plan.global_batch} ({plan.equation()}): the schedule only grows "
                f"the batch; give a maximum of at least {plan.global_batch}"
            )
        if self.max_global_batch % per_pass:
            below = self.max_global_batch // per_pass * per_pass
            raise PlanError(
                f"max_global_batch ({_flag('max_global_batch')}) {self.max_global_batch} is not a multiple "
                f"of micro_batch x dp = {per_pass} (the batch grows by whole micro-batches); use {below} or "
                f"{below + per_pass}"
            )
        if self.max_global_batch == plan.global_batch:
            raise PlanError(
                f"max_global_batch ({_flag('max_global_batch')}) {self.max_global_batch} equals the "
                f"starting global batch: the schedule could never change it; raise the maximum or train "
                "without --batch-schedule"
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchChange:
    """One decision: from the next window on, the global batch is ``global_batch``."""

    window: int
    """Windows done when it was decided: the first window at the new batch has this index."""
    step: int
    """Applied updates when it was decided."""
    from_global_batch: int
    """The global batch until now (examples, all ranks)."""
    global_batch: int
    """The global batch from the next window on."""
    accum_steps: int
    """The accumulation steps that make it (micro-batch and dp fixed)."""
    b_simple: float
    """B_recent, the noise scale over the last ``min_updates`` windows, in the workload's units."""
    target: float
    """The global batch aimed at, in examples: fraction x (B_recent - its standard error) over the
    units per example (the batch grows to the smallest whole number of micro-batches reaching it)."""
    lr_scale: float
    """The learning-rate multiplier from the next window on (relative to the starting batch)."""
    kind: str = "batch"


class CriticalBatchSchedule:
    """The batch-size schedule's state: the current ``accum_steps`` and the decisions so far."""

    def __init__(self, config: CriticalBatchConfig, plan: BatchPlan) -> None:
        config.check(plan)
        self.config = config
        self.base = plan
        self.accum_steps = plan.accum_steps
        self.last_change_step = 0
        self.changes: list[BatchChange] = []
        self._recent: list[list[float]] = []  # [tr(Sigma)_w, |G|^2_w] of the last min_updates windows
        self._seen = 0

    @property
    def plan(self) -> BatchPlan:
        """The plan of the next window."""
        return BatchPlan(micro_batch=self.base.micro_batch, accum_steps=self.accum_steps, dp=self.base.dp)

    @property
    def lr_scale(self) -> float:
        """(B / B_0)^p for the configured rule: what the learning rate is multiplied by."""
        ratio = self.accum_steps / self.base.accum_steps
        return float(ratio ** _POWER[self.config.lr_rule])

    def decide(
        self, *, step: int, window: int, noise: NoiseScale, units_per_example: float
    ) -> BatchChange | None:
        """After a window: grow the batch if the rule says so (see the module docstring).

        ``step``: applied updates so far; ``window``: windows done; ``noise``: the accumulator's
        estimate; ``units_per_example``: the last window's count over its examples (B_simple is in
        the units ``count_fn`` counts, the batch in examples).
        """
        if noise.samples > self._seen and noise.window_trace_cov is not None:
            # a newly measured window (a skipped one adds nothing): its own unbiased figures
            self._seen = noise.samples
            self._recent = [*self._recent, [noise.window_trace_cov, noise.window_grad_sq or 0.0]]
            self._recent = self._recent[-self.config.min_updates :]
        if step - self.last_change_step < self.config.min_updates or len(self._recent) < 2:
            return None
        trace, grad_sq = math.fsum(t for t, _ in self._recent), math.fsum(g for _, g in self._recent)
        if not (units_per_example > 0 and grad_sq > 0 and trace > 0):
            return None  # the noise still hides the gradient: no figure to act on
        recent = trace / grad_sq
        n = len(self._recent)
        # the ratio estimator's standard error (delta method): residuals T_w - R Q_w over mean Q
        spread = math.fsum((t - recent * g) ** 2 for t, g in self._recent) / (n * (n - 1))
        se = math.sqrt(spread) / (grad_sq / n)
        per_pass = self.base.micro_batch * self.base.dp
        target = self.config.fraction * (recent - se) / units_per_example
        current = self.accum_steps
        if current * per_pass >= target:
            return None
        need = math.ceil(target / per_pass)
        capped = max(current + 1, math.floor(current * self.config.growth))
        new = min(need, capped, self.config.max_global_batch // per_pass)
        if new <= current:
            return None
        before = self.plan.global_batch
        self.accum_steps, self.last_change_step = new, step
        change = BatchChange(
            window=window,
            step=step,
            from_global_batch=before,
            global_batch=self.plan.global_batch,
            accum_steps=new,
            b_simple=recent,
            target=target,
            lr_scale=self.lr_scale,
        )
        self.changes.append(change)
        return change

    def to_dict(self) -> dict[str, Any]:
        """The settings, the rule and the changes so far, as the run card records them."""
        return {
            **self.config.to_dict(),
            "start_global_batch": self.base.global_batch,
            "rule": "after a window, once min_updates updates passed since the last change: grow the "
            "global batch (accum_steps, micro-batch fixed) toward fraction x (B_recent - its standard "
            "error), B_recent = tr(Sigma) over |G|^2 summed over the last min_updates measured windows; "
            "at most growth x per change, up to max_global_batch; never shrink; lr x (B / B_0)^p for "
            "the lr_rule (keep 0, sqrt 1/2, linear 1)",
            "changes": [asdict(c) for c in self.changes],
        }

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to make the same decisions (plain JSON values)."""
        return {
            "config": self.config.to_dict(),
            "base": {
                "micro_batch": self.base.micro_batch,
                "accum_steps": self.base.accum_steps,
                "dp": self.base.dp,
            },
            "accum_steps": self.accum_steps,
            "last_change_step": self.last_change_step,
            "recent": [list(pair) for pair in self._recent],
            "seen": self._seen,
            "changes": [asdict(c) for c in self.changes],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`; refuses a state written with other settings or plan."""
        keys = {"config", "base", "accum_steps", "last_change_step", "recent", "seen", "changes"}
        if not isinstance(state, dict) or set(state) != keys:
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise PlanError(f"a batch-schedule state holds exactly {sorted(keys)}, got {got}")
        if state["config"] != self.config.to_dict():
            saved = ", ".join(f"{k} {v}" for k, v in state["config"].items())
            raise PlanError(
                f"the checkpoint's batch schedule was {saved}; this run asks for "
                f"{', '.join(f'{k} {v}' for k, v in self.config.to_dict().items())}. Resume with the "
                "checkpoint's --max-global-batch, --batch-growth, --batch-min-updates, --batch-lr-rule "
                "and --batch-fraction, or start a new run"
            )
        base = self.state_dict()["base"]
        if state["base"] != base:
            raise PlanError(
                f"the checkpoint's batch schedule started from {state['base']}, this run from {base}"
            )
        accum = require_int("batch-schedule accum_steps", state["accum_steps"], error=PlanError)
        limit = self.config.max_global_batch // (self.base.micro_batch * self.base.dp)
        if not self.base.accum_steps <= accum <= limit:
            raise PlanError(
                f"batch-schedule accum_steps {accum} is outside [{self.base.accum_steps}, {limit}]: "
                "not a state this schedule can reach"
            )
        last = require_int(
            "batch-schedule last_change_step", state["last_change_step"], low=0, error=PlanError
        )
        recent = state["recent"]
        pairs = isinstance(recent, list) and len(recent) <= self.config.min_updates
        if not pairs or not all(
            isinstance(p, list) and len(p) == 2 and all(isinstance(v, float) and math.isfinite(v) for v in p)
            for p in recent
        ):
            raise PlanError(
                f"batch-schedule recent windows must be at most {self.config.min_updates} pairs of finite "
                f"floats, got {recent!r}"
            )
        seen = require_int("batch-schedule seen", state["seen"], low=0, error=PlanError)
        changes = [BatchChange(**c) for c in state["changes"]]
        self.accum_steps, self.last_change_step, self.changes = accum, last, changes
        self._recent, self._seen = [list(p) for p in recent], seen
