"""What an accumulator leaves on the user's model, and for how long; ``close()`` and ``with``.

An accumulator reaches into the model: ``grad_dtype`` and the wide sums of ``accum_dtype``
(:mod:`gradaccum.step.accum_dtype`), the noise meter's parameter hooks (:mod:`gradaccum.step.noise`),
BatchNorm's forward pre-hooks (:mod:`gradaccum.step.batchnorm`), DDP's communication hook. Each
is one of the engine's window parts, which it opens with a window's accumulation and ends with the
window (the update, a skip, a failure: ``zero_grad``, which every skipped or abandoned window
passes). The parts' lifetimes:

- ``accum_dtype`` and the noise meter touch the model only while a window is open: nothing of
  theirs is on it between windows, so an accumulator dropped without ``close()`` leaves nothing
  behind (tensor hooks and ``grad_dtype`` are read by autograd's eager engine, so registering
  them per window costs torch.compile nothing);
- BatchNorm's hooks live from construction to ``close()`` and hold their part weakly: a compiled
  model traced while no hook was there never calls one registered later (torch.compile skips the
  guards on module hooks), so per-window hooks would silently miss the window's rows; outside a
  window they return at once, and when the accumulator is dropped they remove themselves;
- DDP's communication hook cannot be unregistered: it holds the accumulator weakly and is DDP's
  plain average outside an open window.

``close()`` (also the end of a ``with`` block) ends a window left open by an exit the step did not
see (a ``KeyboardInterrupt``): its ``.grad`` kept in the parameters' dtype, BatchNorm's buffers as
they were at its start; removes every hook, gives every ``grad_dtype`` back, and refuses any later
step. It is idempotent.
"""

from __future__ import annotations

from gradaccum.errors import WindowError

__all__ = ["closed_error"]


def closed_error(owner: str) -> WindowError:
    """The error of a step on a closed accumulator."""
    return WindowError(
        f"this {owner} was closed (close(), or the end of its with-block): its hooks are removed and "
        "the model is as it was before it. Build a new one to step again, and call close() only "
        "when done stepping."
    )
