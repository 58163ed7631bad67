"""The communication and gradient memory of each sync policy, written down from the mesh's sizes.

Let k be the micro-batches per update, U the FSDP2 units that own parameters, G the bytes of the
gradients one rank computes per micro-batch for them (after tensor parallelism, before FSDP2
shards them), s = ``dp_shard`` and r = ``dp_replicate``. FSDP2 reduces one unit's gradients in one
reduce-scatter over ``dp_shard`` (payload G_unit) and, under HSDP, one all-reduce of the resulting
shard over ``dp_replicate`` (payload G_unit / s). Per optimizer update:

============== ============================ ================================ ==================
policy         reduce-scatter, dp_shard     all-reduce, dp_replicate         gradients held
============== ============================ ================================ ==================
defer          U calls, G bytes             U calls, G / s bytes             G (unsharded)
defer_replicate k U calls, k G bytes        U calls, G / s bytes             G / s (shards)
every          k U calls, k G bytes         k U calls, k G / s bytes         G / s (shards)
============== ============================ ================================ ==================

(no reduce-scatter when s = 1, no all-reduce when r = 1), plus the step's own two small
all-reduces over every rank (the counts, the end of the window), whose few hundred bytes are
measured, not modelled. "Gradients held" is what a rank holds between micro-batches: ``defer``
keeps the unsharded gradients until the last backward; the others keep the reduce-scattered
shards (``defer_replicate`` before, ``every`` after the all-reduce). The bytes assume FSDP2 needs
no padding (dim 0 of every parameter divisible by s); padding adds at most s - 1 rows per
parameter to what is measured. Parameter all-gathers do not depend on the policy and are measured
only.
"""

from __future__ import annotations

from dataclasses import dataclass

from gradaccum.fielddocs import document_fields

__all__ = ["POLICIES", "STEP_ALL_REDUCES", "PolicyBench", "Traffic", "held_model", "policy_model"]

POLICIES = ("defer", "defer_replicate", "every")
"""The HSDP sync policies, in the order they trade communication for memory."""
STEP_ALL_REDUCES = 2
"""The step's own all-reduces over every rank per update: the counts, the end of the window."""


@document_fields
@dataclass(frozen=True, kw_only=True, slots=True)
class Traffic:
    """One collective over one mesh dimension, per optimizer update, on one rank."""

    collective: str
    """``reduce_scatter``, ``all_reduce`` or ``all_gather``."""
    dimension: str
    """The mesh dimension its group spans (``world``: every rank; ``other``: no single dimension)."""
    calls: int
    """Calls per update."""
    bytes: int | None
    """Payload per update on this rank (reduce-scatter: input; all-gather: output; all-reduce: the
    tensor); ``None`` where the model leaves it to the measurement."""


def policy_model(
    policy: str,
    *,
    accum_steps: int,
    grad_bytes: int,
    units: int,
    shard: int,
    replicate: int,
    shard_dim: str = "dp_shard",
    replicate_dim: str = "dp_replicate",
) -> tuple[Traffic, ...]:
    """The gradient reductions and the step's own all-reduces of ``policy`` (see the module doc)."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    k = accum_steps
    scatters = 1 if policy == "defer" else k
    reduces = k if policy == "every" else 1
    # (ranks in the group, collective, dimension, calls per FSDP2 unit, bytes per update)
    reductions = (
        (shard, "reduce_scatter", shard_dim, scatters, scatters * grad_bytes),
        (replicate, "all_reduce", replicate_dim, reduces, reduces * grad_bytes // shard),
    )
    out = [
        Traffic(collective=collective, dimension=dim, calls=calls * units, bytes=size)
        for ranks, collective, dim, calls, size in reductions
        if ranks > 1
    ]
    out.append(Traffic(collective="all_reduce", dimension="world", calls=STEP_ALL_REDUCES, bytes=None))
    return tuple(out)


def held_model(policy: str, *, grad_bytes: int, shard: int) -> int:
    """Gradient bytes a rank holds between micro-batches under ``policy``."""
    return grad_bytes if policy == "defer" else grad_bytes // shard


@document_fields
@dataclass(frozen=True, kw_only=True, slots=True)
class PolicyBench:
    """One sync policy: measured and modelled communication per update, gradient memory held."""

    policy: str
    """``defer``, ``defer_replicate`` or ``every``."""
    measured: tuple[Traffic, ...]
    """Every collective counted in one update, by mesh dimension."""
    modelled: tuple[Traffic, ...]
    """The gradient reductions and the step's all-reduces the model predicts (``bytes`` None:
    not modelled)."""
    grad_bytes_held: int
    """Measured: bytes of the gradient tensors alive after the (k-1)-th backward, the largest over
    ranks (``.grad`` plus FSDP2's unsharded and partially reduced gradients)."""
    grad_bytes_held_model: int
    """The model's figure for the same."""

    @property
    def comm_bytes(self) -> int:
        """Every measured byte per update (all-gathers included: the same under every policy)."""
        return sum(t.bytes or 0 for t in self.measured)

    @property
    def comm_calls(self) -> int:
        return sum(t.calls for t in self.measured)

    def disagreements(self) -> list[str]:
        """Where the measurement differs from the model (empty when they agree)."""
        got = {(t.collective, t.dimension): t for t in self.measured}
        out = []
        for want in self.modelled:
            have = got.get((want.collective, want.dimension))
            calls = have.calls if have else 0
            nbytes = have.bytes if have else 0
            if calls != want.calls or (want.bytes is not None and nbytes != want.bytes):
                out.append(
                    f"{want.collective} over {want.dimension}: measured {calls} calls, {nbytes} B; "
                    f"modelled {want.calls} calls, {want.bytes} B"
                )
        modelled = {(t.collective, t.dimension) for t in self.modelled}
        for t in self.measured:
            if t.collective != "all_gather" and (t.collective, t.dimension) not in modelled:
                out.append(f"{t.collective} over {t.dimension}: {t.calls} calls measured, none modelled")
        if self.grad_bytes_held != self.grad_bytes_held_model:
            out.append(
                f"gradients held: measured {self.grad_bytes_held} B, modelled {self.grad_bytes_held_model} B"
            )
        return out
