"""Reinforcement-learning and preference objectives whose update is exact under accumulation.

:class:`PolicyLoss` (PPO/GRPO clipped surrogate, optional KL, four aggregations) and
:class:`PreferenceLoss` (DPO, IPO) each give ``loss_fn``/``count_fn`` for ``Accumulator.step``;
:func:`rollout_updates` splits a generation batch over several updates, normalized per update or
by the whole generation batch. TRL's trainers: :mod:`gradaccum.integrations.trl`. The names are
imported on first use, like ``gradaccum``'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gradaccum.lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "PolicyLoss": "gradaccum.rl.policy",
    "PreferenceLoss": "gradaccum.rl.preference",
    "RolloutUpdate": "gradaccum.rl.rollout",
    "rollout_updates": "gradaccum.rl.rollout",
    "AGGREGATIONS": "gradaccum.rl.aggregation",
    "Aggregation": "gradaccum.rl.aggregation",
    "EMPTY_ROWS": "gradaccum.rl.aggregation",
    "EmptyRows": "gradaccum.rl.aggregation",
    "PREFERENCE_OBJECTIVES": "gradaccum.rl.preference",
    "ROLLOUT_NORMALIZATIONS": "gradaccum.rl.rollout",
}

__all__ = [
    "AGGREGATIONS",
    "EMPTY_ROWS",
    "PREFERENCE_OBJECTIVES",
    "ROLLOUT_NORMALIZATIONS",
    "Aggregation",
    "EmptyRows",
    "PolicyLoss",
    "PreferenceLoss",
    "RolloutUpdate",
    "rollout_updates",
]

if TYPE_CHECKING:
    from gradaccum.rl.aggregation import AGGREGATIONS, EMPTY_ROWS, Aggregation, EmptyRows
    from gradaccum.rl.policy import PolicyLoss
    from gradaccum.rl.preference import PREFERENCE_OBJECTIVES, PreferenceLoss
    from gradaccum.rl.rollout import ROLLOUT_NORMALIZATIONS, RolloutUpdate, rollout_updates


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals(), __all__)
