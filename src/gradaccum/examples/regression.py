"""Linear regression whose gradient noise scale is known exactly: the check of ``noise_scale=True``.

A finite population of M examples, x ~ N(0, I_d) and y = x . w* + eps, and a linear model
f(x) = w . x + c with the summed loss 0.5 sum (f(x) - y)^2. At the model's current weights each
example's gradient is r [x, 1] with r = f(x) - y, so over the population

    G = mean_i g_i,    tr(Sigma) = mean_i |g_i - G|^2      (the population's own covariance)

are computed directly. Micro-batches drawn uniformly *with replacement* from the population are
exactly the independent draws the estimator assumes, so its expectations are these figures.
Each micro-batch row has an integer weight of 0 or 1 (``w``): the counted units are the rows of weight 1,
so micro-batches of equal size can hold unequal counts.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

if TYPE_CHECKING:
    from gradaccum.check.workload import Workload

__all__ = ["RegressionPopulation", "regression", "regression_count", "regression_loss"]


def regression_loss(model: nn.Module, micro_batch: dict[str, Any]) -> torch.Tensor:
    """0.5 sum_i w_i (f(x_i) - y_i)^2: summed over the counted rows."""
    residual = model(micro_batch["x"]).squeeze(-1) - micro_batch["y"]
    return 0.5 * (micro_batch["w"].to(residual.dtype) * residual.square()).sum()


def regression_count(micro_batch: dict[str, Any]) -> torch.Tensor:
    """The counted rows (weight 1) of a micro-batch, as a 0-dim tensor."""
    return micro_batch["w"].sum()


@dataclass(frozen=True, slots=True)
class RegressionPopulation:
    """The examples, their targets and the true weights; float64 throughout."""

    x: torch.Tensor
    """(M, d) inputs, standard normal."""
    y: torch.Tensor
    """(M,) targets x . w* + eps."""
    true_weight: torch.Tensor
    """(d,) the w* the targets were drawn with."""

    @classmethod
    def build(
        cls, examples: int = 1 << 14, features: int = 6, noise: float = 0.5, seed: int = 0
    ) -> RegressionPopulation:
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(examples, features, generator=gen, dtype=torch.float64)
        true_weight = torch.randn(features, generator=gen, dtype=torch.float64)
        y = x @ true_weight + noise * torch.randn(examples, generator=gen, dtype=torch.float64)
        return cls(x, y, true_weight)

    def model(self, *, fitted: bool = False) -> nn.Linear:
        """The linear model at zero weights (far from the optimum: |G|^2 large), or ``fitted`` at the
        population's least-squares solution, where G is 0 up to rounding and only noise is left."""
        features = self.x.shape[1]
        model = nn.Linear(features, 1, dtype=torch.float64)
        with torch.no_grad():
            model.weight.zero_()
            model.bias.zero_()
            if fitted:
                design = torch.cat([self.x, torch.ones_like(self.y)[:, None]], 1)
                solution = torch.linalg.lstsq(design, self.y[:, None]).solution.squeeze(1)
                model.weight.copy_(solution[:features][None, :])
                model.bias.copy_(solution[features:])
        return model

    def per_example_grads(self, model: nn.Module) -> torch.Tensor:
        """(M, d + 1): each example's gradient r [x, 1] at the model's current weights."""
        with torch.no_grad():
            residual = model(self.x).squeeze(-1) - self.y
        return torch.cat([residual[:, None] * self.x, residual[:, None]], 1)

    def truth(self, model: nn.Module) -> tuple[float, float]:
        """(tr(Sigma), |G|^2) over the population at the model's current weights."""
        grads = self.per_example_grads(model)
        mean = grads.mean(0)
        return float((grads - mean).square().sum(1).mean()), float(mean @ mean)

    def window(
        self, sizes: Sequence[int], generator: torch.Generator, *, masked: float = 0.0
    ) -> list[dict[str, torch.Tensor]]:
        """Micro-batches of ``sizes`` rows drawn with replacement; each row has weight 0 with
        probability ``masked``. ``i`` holds the rows' population indices (for a reference)."""
        out = []
        for size in sizes:
            rows = torch.randint(0, self.x.shape[0], (size,), generator=generator)
            weight = (torch.rand(size, generator=generator) >= masked).to(torch.int64)
            out.append({"x": self.x[rows], "y": self.y[rows], "w": weight, "i": rows})
        return out


@functools.cache
def _population() -> RegressionPopulation:
    return RegressionPopulation.build()


def _draw(n: int, seed: int) -> dict[str, torch.Tensor]:
    """``n`` rows of the default population drawn with replacement (the estimator's independent
    draws), all counted, deterministic in ``seed``."""
    population = _population()
    return population.window([n], torch.Generator().manual_seed(seed))[0]


def regression() -> Workload:
    """The regression as a workload (``--workload gradaccum.examples.regression:regression``): its
    noise scale at any weights is :meth:`RegressionPopulation.truth` of the default population, and
    its held-out loss can be computed exactly over the whole population. float64 throughout."""
    from gradaccum.check.workload import Workload

    return Workload(
        name="regression",
        build_model=lambda: _population().model(),
        make_batch=_draw,
        loss_fn=regression_loss,
        count_fn=regression_count,
        batch_size=8,
        micro_batch=2,
        unit="examples",
        description="linear regression on a finite population; its gradient noise scale is known exactly",
    )
