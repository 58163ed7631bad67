"""Checking the plain values a user passes: one place, one wording.

Every setting that must be a whole number goes through :func:`require_int`, which refuses ``bool``
(``True`` is an ``int`` in Python) and says what arrived, every setting that names one of a few
choices through :func:`require_choice`, and every settings object through :func:`settings_or_default`,
so that messages read the same wherever the value came from; the caller names the error class of
its feature.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TypeVar, overload

from gradaccum.errors import ConfigError, GradAccumError, PlanError

__all__ = ["is_int", "require_choice", "require_int", "settings_or_default"]

T = TypeVar("T")


def is_int(value: object) -> bool:
    """A true integer: ``int`` but not ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


@overload
def require_int(
    name: str, value: object, *, low: int = 1, error: type[GradAccumError] = PlanError
) -> int: ...
@overload
def require_int(
    name: str, value: object, *, low: int = 1, error: type[GradAccumError] = PlanError, none_ok: bool
) -> int | None: ...
def require_int(
    name: str, value: object, *, low: int = 1, error: type[GradAccumError] = PlanError, none_ok: bool = False
) -> int | None:
    """``value`` if it is an integer ``>= low`` (or ``None`` with ``none_ok``); else ``error``.

    >>> require_int("micro_batch", "2")
    Traceback (most recent call last):
    gradaccum.errors.PlanError: micro_batch must be a positive integer, got '2' (str)
    """
    if value is None and none_ok:
        return None
    if is_int(value) and value >= low:  # type: ignore[operator]
        return value  # type: ignore[return-value]
    kind = {1: "a positive integer", 0: "a non-negative integer"}.get(low, f"an integer >= {low}")
    got = f"{value!r}" if is_int(value) else f"{value!r} ({type(value).__name__})"
    raise error(f"{name} must be {kind}{' or None' if none_ok else ''}, got {got}")


def require_choice(
    name: str, value: object, choices: Collection[str], *, error: type[GradAccumError] = ConfigError
) -> None:
    """Refuse ``value`` with ``error`` unless it is one of ``choices``.

    >>> require_choice("PolicyLoss empty_rows", "some", ("excluded", "counted"))
    Traceback (most recent call last):
    gradaccum.errors.ConfigError: PolicyLoss empty_rows must be one of ['excluded', 'counted'], got 'some'
    """
    if value not in choices:
        raise error(f"{name} must be one of {list(choices)}, got {value!r}")


def settings_or_default(name: str, value: object, cls: type[T]) -> T:
    """``value`` if it is a ``cls``, the default ``cls()`` if it is ``None``; else a ConfigError that
    names what arrived (a dict or the wrong settings class passed by mistake)."""
    if value is None:
        return cls()
    if not isinstance(value, cls):
        raise ConfigError(f"{name} must be a gradaccum {cls.__name__}, got {type(value).__name__}")
    return value
