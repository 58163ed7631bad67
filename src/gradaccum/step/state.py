"""What an accumulator's ``state_dict`` holds, and the check a loaded one must pass.

A resumed run must take the same updates as an uninterrupted one, bit for bit. Besides the three
counters, any part of the step that carries something from one window to the next (the noise
scale's moving averages, post-scaling's basis for its constant c, a lagged load balance's counts)
saves it under its own name. Each such part is a :class:`StatePart` that the engine registers;
the names are fixed here, so that a checkpoint with a name no version writes is refused, and one
written with a part this accumulator does not use is accepted and ignored (none of them changes an
update made without it).
"""

from __future__ import annotations

from typing import Any, Protocol

from gradaccum.errors import ConfigError
from gradaccum.values import require_int

__all__ = ["COUNTER_KEYS", "PART_KEYS", "StatePart", "check_state"]

COUNTER_KEYS = ("steps_applied", "steps_skipped", "consecutive_skips")
PART_KEYS = ("noise", "post", "balance", "batchnorm")
"""Every optional entry a version of the step writes: the noise scale, post-scaling's c basis, a
load balance's carried counts, BatchNorm's window moments."""


class StatePart(Protocol):
    """Something a window carries to the next one, saved with the counters."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


def check_state(state: Any) -> None:
    """Refuse missing, unknown or impossible entries before anything is restored."""
    got = set(state) if isinstance(state, dict) else None
    if got is None or not set(COUNTER_KEYS) <= got <= {*COUNTER_KEYS, *PART_KEYS}:
        shown = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ConfigError(
            f"an accumulator state_dict holds exactly {list(COUNTER_KEYS)}, and optionally "
            f"{list(PART_KEYS)} for the features that carry state across windows, got {shown}"
        )
    for key in COUNTER_KEYS:
        require_int(f"accumulator state {key}", state[key], low=0, error=ConfigError)
    if state["consecutive_skips"] > state["steps_skipped"]:
        raise ConfigError(
            f"accumulator state has consecutive_skips={state['consecutive_skips']} > "
            f"steps_skipped={state['steps_skipped']}: not a state a run can reach"
        )
