"""``accum_dtype`` under real DDP and FSDP2 (gloo, two processes).

DDP: the issue's bf16 GPT-2 and 128 sequences, 64 per rank in k = 32 micro-batches, against the
one-process k = 1 error (the bound 1.15x is argued in tests/unit/test_accum_dtype.py; the float32
all-reduce of two ranks' sums adds one more float32 rounding, ~6e-8). The ranks must hold the same
gradient bit for bit, and the synchronizing all-reduce must carry float32: 4 bytes per parameter.
FSDP2: refused without ``reduce_dtype``, naming it; with ``reduce_dtype=float32`` FSDP2 accumulates
the unsharded gradient in float32 itself.
"""

from __future__ import annotations

import copy
import gc
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from gradaccum import Accumulator, split
from gradaccum.batch import cast
from gradaccum.check.accumulation import GradientProbe, accumulation_errors
from gradaccum.errors import ConfigError
from tests.helpers import models
from tests.helpers.ddp import rank_slice
from tests.helpers.launcher import run_ranks, values
from tests.helpers.precision import SEQUENCES, gpt2, gpt2_count, gpt2_loss, padded_sequences

pytestmark = pytest.mark.distributed

BOUND = 1.15
PER_RANK_K = 32


def _ddp_gradients(rank: int, world: int) -> dict[str | None, dict[str, Any]]:
    return {accum_dtype: _ddp_gradient(rank, world, accum_dtype) for accum_dtype in (None, "float32")}


def _ddp_gradient(rank: int, world: int, accum_dtype: str | None) -> dict[str, Any]:
    low = gpt2().to(torch.bfloat16)
    ddp = DDP(low)
    probe = GradientProbe(ddp.parameters())
    acc = Accumulator(ddp, probe, accum_dtype=accum_dtype)
    half = SEQUENCES // world
    mine = rank_slice(padded_sequences(), [0, half, SEQUENCES], rank)
    acc.step(split(cast(mine, torch.bfloat16), half // PER_RANK_K), gpt2_loss, gpt2_count)
    wide = acc._engine.update.wide  # the hook's byte count: what the synchronizing all-reduce carried
    return {
        "grad": torch.cat([g.reshape(-1) for g in probe.seen]),
        "reduced_bytes": None if wide is None else wide.reduced_bytes,
        "parameters": sum(p.numel() for p in low.parameters()),
    }


def _reference() -> tuple[torch.Tensor, float]:
    """The float64 full-batch gradient on the bf16 weights, and the one-process k = 1 error."""
    low = gpt2().to(torch.bfloat16)
    wide = copy.deepcopy(low).to(torch.float64)
    batch = padded_sequences()
    (gpt2_loss(wide, batch) / gpt2_count(batch)).backward()
    reference = torch.cat([p.grad.reshape(-1) for p in wide.parameters()])
    (k1,) = accumulation_errors(gpt2(), batch, gpt2_loss, gpt2_count, accum_steps=[1], accum_dtypes=[None])
    return reference, k1.rel_l2


@pytest.fixture(scope="module")
def reference() -> tuple[torch.Tensor, float]:
    return _reference()


@pytest.fixture(scope="module")
def ddp_runs() -> list[dict[str | None, dict[str, Any]]]:
    return values(run_ranks(_ddp_gradients, timeout_s=240))


def _rel(grad: torch.Tensor, reference: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(grad - reference) / torch.linalg.vector_norm(reference))


def test_ddp_accumulates_and_reduces_the_float32_sum(
    reference: tuple[torch.Tensor, float], ddp_runs: list[dict[str | None, dict[str, Any]]]
) -> None:
    full, k1 = reference
    ranks = [run["float32"] for run in ddp_runs]
    assert torch.equal(ranks[0]["grad"], ranks[1]["grad"])  # the ranks step on the same gradient
    assert _rel(ranks[0]["grad"], full) <= BOUND * k1
    # one window, one synchronizing backward: every parameter all-reduced once, in float32
    assert ranks[0]["reduced_bytes"] == 4 * ranks[0]["parameters"]


def test_ddp_bf16_grad_accumulation_is_worse(
    reference: tuple[torch.Tensor, float], ddp_runs: list[dict[str | None, dict[str, Any]]]
) -> None:
    # the control: the same run with bf16 .grad exceeds the bound (the issue measured 1.49x)
    full, k1 = reference
    ranks = [run[None] for run in ddp_runs]
    assert torch.equal(ranks[0]["grad"], ranks[1]["grad"])
    assert _rel(ranks[0]["grad"], full) > BOUND * k1


def _fsdp2(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    out: dict[str, Any] = {}
    model = fully_shard(models.mlp(dtype=torch.bfloat16))
    try:
        Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), accum_dtype="float32")
    except ConfigError as exc:
        out["refusal"] = str(exc)
    policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    model = fully_shard(models.mlp(dtype=torch.bfloat16), mp_policy=policy)
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0), accum_dtype="float32")
    batch = rank_slice(models.mlp_batch(16), [0, 8, 16], rank)
    result = acc.step(split(cast(batch, torch.bfloat16), 2), models.mlp_loss, models.count_rows)
    out["applied"] = result.applied
    return out


def test_fsdp2_needs_reduce_dtype_and_ddp_refuses_a_second_hook_and_post_scaling_matches(
    wrapped: list[dict[str, Any]],
) -> None:
    for rank in wrapped:
        assert "reduce_dtype" in rank["refusal"] and "accum_dtype='float32'" in rank["refusal"]
        assert rank["applied"]
        assert "communication hook" in rank["hook refusal"] and "accum_dtype" in rank["hook refusal"]
        # float32 parameters summed in float64 under DDP: pre- and post-scaling differ by the float32
        # rounding of W/N in pre's loss scale and float32 backprops of scaled losses (~1e-7 relative);
        # after the one rounding to float32 they agree to a few float32 ulps
        for pre, post in zip(rank["pre"], rank["post"], strict=True):
            assert torch.allclose(pre, post, rtol=1e-5, atol=1e-7)
    assert all(torch.equal(a, b) for a, b in zip(wrapped[0]["post"], wrapped[1]["post"], strict=True))


def _ddp_hook_and_post(rank: int, world: int) -> dict[str, Any]:
    from gradaccum.distributed.comm import count_allreduces

    out: dict[str, Any] = _fsdp2(rank, world)
    hooked = DDP(models.mlp(dtype=torch.bfloat16))
    count_allreduces(hooked)  # a hook of the model's own
    try:
        Accumulator(hooked, torch.optim.SGD(hooked.parameters(), lr=0.1), accum_dtype="float32")
    except ConfigError as exc:
        out["hook refusal"] = str(exc)
    batch = rank_slice(models.mlp_batch(16, dtype=torch.float32), [0, 6, 16], rank)  # uneven counts
    for scaling in ("pre", "post"):
        ddp = DDP(models.mlp(dtype=torch.float32))
        probe = GradientProbe(ddp.parameters())
        acc = Accumulator(ddp, probe, accum_dtype="float64", scaling=scaling)
        acc.step(split(batch, 2), models.mlp_loss, models.count_rows)
        out[scaling] = probe.seen
    return out


@pytest.fixture(scope="module")
def wrapped() -> list[dict[str, Any]]:
    return values(run_ranks(_ddp_hook_and_post, timeout_s=120))


def _lifetime(rank: int, world: int) -> dict[str, Any]:
    """Two windows in a with-block, the user's own DDP backward after it, then accumulators that
    take DDP's communication hook over from a closed and from a dropped one."""
    low = models.mlp(dtype=torch.bfloat16)
    ddp = DDP(low)
    batch = cast(rank_slice(models.mlp_batch(32), [0, 16, 32], rank), torch.bfloat16)
    window = split(batch, 8)
    dtypes: set[torch.dtype] = set()

    def observer(event: str, index: int) -> None:
        if event == "micro_end":
            dtypes.update(p.grad.dtype for p in low.parameters() if p.grad is not None)

    out: dict[str, Any] = {}
    probe = GradientProbe(ddp.parameters())
    with Accumulator(ddp, probe, accum_dtype="float32", observer=observer) as acc:
        acc.step(window, models.mlp_loss, models.count_rows)
        first = probe.seen
        dtypes.clear()
        acc.step(window, models.mlp_loss, models.count_rows)
        out["second window dtypes"] = set(dtypes)
        out["second window equal"] = all(torch.equal(a, b) for a, b in zip(probe.seen, first, strict=True))
    out["hooks"] = [m for m in (ddp, low) if m._forward_pre_hooks]
    out["grad_dtype"] = {p.grad_dtype for p in low.parameters()}
    ddp.zero_grad(set_to_none=True)
    models.mlp_loss(ddp, batch).backward()  # the user's own: DDP's average of bf16 gradients
    out["plain"] = [p.grad.clone() for p in low.parameters()]
    local = copy.deepcopy(low)
    local.zero_grad(set_to_none=True)
    models.mlp_loss(local, batch).backward()
    out["local"] = [p.grad.clone() for p in local.parameters()]
    later = []
    for _ in range(2):  # after the closed one, then after a dropped one
        seen = GradientProbe(ddp.parameters())
        taker = Accumulator(ddp, seen, accum_dtype="float32")
        taker.step(window, models.mlp_loss, models.count_rows)
        later.append(all(torch.equal(a, b) for a, b in zip(seen.seen, first, strict=True)))
        del taker
        gc.collect()
    out["later equal"] = later
    busy = Accumulator(ddp, GradientProbe(ddp.parameters()), accum_dtype="float32")
    try:
        Accumulator(ddp, GradientProbe(ddp.parameters()), accum_dtype="float32")
    except ConfigError as exc:
        out["busy refusal"] = str(exc)
    busy.close()
    return out


def test_ddp_windows_stay_wide_and_the_model_is_left_as_found() -> None:
    ranks = values(run_ranks(_lifetime, timeout_s=120))
    for rank in ranks:
        assert rank["second window dtypes"] == {torch.float32}
        assert rank["second window equal"]  # the same weights and window: the first's float32 sum
        assert rank["hooks"] == [] and rank["grad_dtype"] == {torch.bfloat16}
        assert {g.dtype for g in rank["plain"]} == {torch.bfloat16}
        assert rank["later equal"] == [True, True]  # the hook taken over, reducing wide again
        assert "close() that accumulator" in rank["busy refusal"]
    # closed: the hook is DDP's average, g0 / 2 + g1 / 2 in bf16 (halving is exact; the one
    # addition rounds once, rel 2**-8, as torch's bf16 addition of the same two values does)
    for plain0, plain1, g0, g1 in zip(
        ranks[0]["plain"], ranks[1]["plain"], ranks[0]["local"], ranks[1]["local"], strict=True
    ):
        assert torch.equal(plain0, plain1)
        torch.testing.assert_close(plain0, g0 / 2 + g1 / 2, rtol=2**-8, atol=0)
