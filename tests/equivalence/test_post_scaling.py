"""Post-scaling (``AccumConfig(scaling="post")``) on one process: the same update as pre-scaling,
a window streamed from a generator consumed once, in order, and no host read in the step with a
fused optimizer.

Tolerance: 1e-12 relative in float64, as in test_exact_step.py. Post-scaling changes the order of
one multiplication (c, a power of two, is exact; W/(N c) is one more rounding per gradient element,
1.1e-16 relative), so the two modes differ by a few units of roundoff; any weighting error (a wrong
N, the constant left in) is off by percents.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from gradaccum import AccumConfig, Accumulator, CachedAccumulator, ConfigError, StepResult, WindowError, split
from gradaccum.distributed.comm import count_sync_points
from gradaccum.errors import CacheError, CountError
from gradaccum.step.stream import DeviceStepResult, host_post_constant, post_constant
from tests.helpers import models
from tests.helpers.reference import full_batch_grads, grads_of, max_rel_err, params_of

REL_TOL = 1e-12
# Adam divides each gradient element by its own running RMS, so an element's relative rounding (large
# for elements near zero) becomes an absolute error of up to ~1e-16 * lr per step in the parameter:
# after a few steps the parameters of the two modes agree to ~1e-12 relative, not to the gradient's
# 1e-15. 1e-10 keeps a 100x margin; a weighting error moves Adam's first step by percents.
ADAM_TOL = 1e-10


def _pair(
    sizes: list[int], *, seed: int = 3, opt: Any = None, **settings: Any
) -> tuple[torch.nn.Module, torch.nn.Module, Accumulator, Accumulator]:
    factory = opt or (lambda p: torch.optim.SGD(p, lr=0.1))
    pre, post = models.gpt(), models.gpt()
    a = Accumulator(pre, factory(pre.parameters()), **settings)
    b = Accumulator(post, factory(post.parameters()), scaling="post", **settings)
    return pre, post, a, b


def _counters(state: dict[str, Any]) -> dict[str, Any]:
    """The three counters of a state_dict (post-scaling adds its basis of c as "post")."""
    return {key: state[key] for key in ("steps_applied", "steps_skipped", "consecutive_skips")}


def _lazy(batch: Any, sizes: list[int], seen: list[int] | None = None) -> Iterator[Any]:
    """A generator that builds each micro-batch when asked, recording the order it was asked in."""
    start = 0
    for i, size in enumerate(sizes):
        if seen is not None:
            seen.append(i)
        yield {key: value[start : start + size].clone() for key, value in batch.items()}
        start += size


@pytest.mark.parametrize("sizes", [[2, 2, 2, 2], [1, 3, 4], [8], [3, 1, 1, 3]])
def test_post_matches_pre_and_the_full_batch_in_float64(sizes: list[int]) -> None:
    batch = models.gpt_batch(8, seed=3)
    want = full_batch_grads(models.gpt(), batch, models.gpt_loss, models.tokens)
    pre, post, a, b = _pair(sizes, opt=lambda p: torch.optim.SGD(p, lr=0.0))
    ra = a.step(split(batch, sizes=sizes), models.gpt_loss, models.tokens)
    rb = b.step(_lazy(batch, sizes), models.gpt_loss, models.tokens)
    assert max_rel_err(grads_of(post), want) < REL_TOL
    assert max_rel_err(grads_of(post), grads_of(pre)) < REL_TOL
    assert rb.loss == pytest.approx(ra.loss, rel=REL_TOL)
    assert (rb.global_count, rb.local_count, rb.micro_batches) == (
        ra.global_count,
        ra.local_count,
        len(sizes),
    )


@pytest.mark.parametrize("fused", [False, True])
def test_updates_match_over_several_windows_with_adamw_and_clipping(fused: bool) -> None:
    def factory(p: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, fused=fused)

    pre, post, a, b = _pair([], opt=factory, max_grad_norm=0.5, track_grad_norm=True)
    for seed in range(3):
        batch = models.gpt_batch(6, seed=seed)
        ra = a.step(split(batch, sizes=[2, 1, 3]), models.gpt_loss, models.tokens)
        rb = b.step(_lazy(batch, [2, 1, 3]), models.gpt_loss, models.tokens)
        assert rb.applied and rb.step == ra.step == seed + 1
        assert rb.grad_norm == pytest.approx(ra.grad_norm, rel=REL_TOL)
        assert isinstance(rb, DeviceStepResult) is fused  # the decision stayed on the device
    assert max_rel_err(params_of(post), params_of(pre)) < ADAM_TOL
    assert (
        _counters(b.state_dict())
        == a.state_dict()
        == {"steps_applied": 3, "steps_skipped": 0, "consecutive_skips": 0}
    )


@pytest.mark.parametrize("fused", [False, True])
def test_the_noise_scale_is_the_same_figure_in_both_modes(fused: bool) -> None:
    """The hooks see c s_j under post-scaling and W/N s_j under pre; one rescale by (W/(N c))^2
    makes P the same figure. 1e-9: the estimate cancels in A - b and K b - A (a few dozen
    roundings of 1e-16 amplified by < 10x here, as in test_noise_scale.py); a missing rescale is
    off by (N c)^2, a factor of 4 or more."""

    def factory(p: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(p, lr=1e-2, fused=fused)

    pre, post, a, b = _pair([], opt=factory, noise_scale=True)
    for seed, sizes in enumerate([[2, 1, 3], [1, 1, 4], [3, 3]]):
        batch = models.gpt_batch(6, seed=seed)
        ra = a.step(split(batch, sizes=sizes), models.gpt_loss, models.tokens)
        rb = b.step(_lazy(batch, sizes), models.gpt_loss, models.tokens)
        assert ra.applied and rb.applied and not isinstance(rb, DeviceStepResult)  # read with the verdict
        na, nb = a.noise_scale, b.noise_scale
        assert nb.samples == na.samples == seed + 1
        for name in ("trace_cov", "grad_sq", "window_trace_cov", "window_grad_sq"):
            assert getattr(nb, name) == pytest.approx(getattr(na, name), rel=1e-9), name
    assert max_rel_err(params_of(post), params_of(pre)) < ADAM_TOL


def test_a_generator_is_consumed_once_in_order_one_ahead_and_none_when_declared() -> None:
    batch = models.gpt_batch(8, seed=4)
    _, _, _, b = _pair([])
    seen: list[int] = []
    forwards: list[int] = []

    def loss_fn(model: torch.nn.Module, mb: Any) -> torch.Tensor:
        forwards.append(len(seen))  # how many micro-batches had been pulled when this one ran
        return models.gpt_loss(model, mb)

    b.step(_lazy(batch, [2, 2, 2, 2], seen), loss_fn, models.tokens)
    assert seen == [0, 1, 2, 3]
    assert forwards == [2, 3, 4, 4]  # the running one and the one after it, never more
    # declared: exactly `length` micro-batches, none read ahead, the rest left in the iterator
    forwards.clear()
    seen.clear()
    stream = _lazy(batch, [2, 2, 2, 2], seen)
    b.step(stream, loss_fn, models.tokens, length=2)
    assert forwards == [1, 2] and seen == [0, 1]
    assert next(stream)["input_ids"].shape[0] == 2 and seen == [0, 1, 2]


def test_a_list_steps_on_as_many_micro_batches_as_declared_with_mixed_counts() -> None:
    # a list is walked in place when its length is the declared one, pulled like an iterator when
    # a shorter length is declared; ints and tensors may mix in one window's counts
    batch = models.gpt_batch(8, seed=6)
    pre, post, a, b = _pair([])
    calls: list[int] = []

    def mixed(mb: Any) -> int | torch.Tensor:  # a tensor, an int, a tensor, ...
        calls.append(1)
        return models.tokens(mb) if len(calls) % 2 else int(models.tokens(mb))

    b.step(split(batch, sizes=[2, 2, 2, 2]), models.gpt_loss, mixed, length=3)
    assert len(calls) == 3
    a.step(split(batch, sizes=[2, 2, 2, 2])[:3], models.gpt_loss, models.tokens)
    assert max_rel_err(params_of(post), params_of(pre)) < REL_TOL
    result = b.step(split(batch, sizes=[2, 2, 2, 2]), models.gpt_loss, mixed)
    a.step(split(batch, sizes=[2, 2, 2, 2]), models.gpt_loss, models.tokens)
    assert result.micro_batches == 4
    assert max_rel_err(params_of(post), params_of(pre)) < REL_TOL


def test_a_generator_that_raises_mid_window_leaves_the_gradients_cleared() -> None:
    batch = models.gpt_batch(8, seed=4)
    _, post, _, b = _pair([])
    before = params_of(post)

    def broken() -> Iterator[Any]:
        yield from _lazy(batch, [2, 2])
        raise OSError("shard 7 is unreadable")

    with pytest.raises(OSError, match="shard 7"):
        b.step(broken(), models.gpt_loss, models.tokens)
    assert all(p.grad is None for p in post.parameters())
    assert max_rel_err(params_of(post), before) == 0
    # the next window steps normally
    assert b.step(_lazy(batch, [4, 4]), models.gpt_loss, models.tokens).applied


def test_post_refusals_name_the_setting() -> None:
    batch = models.gpt_batch(4, seed=1)
    _, _, a, b = _pair([])
    with pytest.raises(WindowError, match="the window is empty"):
        b.step(iter([]), models.gpt_loss, models.tokens)
    with pytest.raises(WindowError, match="declared to hold 3 micro-batches but ended after 2"):
        b.step(_lazy(batch, [2, 2]), models.gpt_loss, models.tokens, length=3)
    with pytest.raises(ConfigError, match="length=2 declares a streamed window's size"):
        a.step(split(batch, micro_batch=2), models.gpt_loss, models.tokens, length=2)
    model = models.gpt()
    with pytest.raises(CacheError, match="scaling='post' is not supported by CachedAccumulator"):
        CachedAccumulator(
            model, torch.optim.SGD(model.parameters(), lr=0.1), config=AccumConfig(scaling="post")
        )


def test_the_constant_is_a_power_of_two_near_one_over_the_expected_count() -> None:
    cpu = torch.device("cpu")
    assert post_constant(100, 4, cpu).item() == 2.0**-9  # 400 units: 2**-round(8.64)
    assert post_constant(torch.tensor(100), None, cpu).item() == 2.0**-7
    assert post_constant(0, None, cpu).item() == 1.0  # an all-padding first micro-batch
    # the previous window's N (the same on every rank) wins; distributed without one: 1
    last = torch.tensor(3000.0, dtype=torch.float64)
    assert post_constant(100, 4, cpu, expected=last, distributed=True).item() == 2.0**-12
    assert post_constant(100, 4, cpu, distributed=True).item() == 1.0


def test_the_host_constant_is_the_device_constant() -> None:
    cpu = torch.device("cpu")
    for units in [0, 1, 2, 3, 5, 95, 181, 362, 400, 1448, 3000, 10**6 + 7]:
        device = post_constant(torch.tensor(units), None, cpu).item()
        assert host_post_constant(units) == device == post_constant(units, None, cpu).item()


def test_int_counts_take_the_host_path_and_land_on_the_same_bits_as_tensor_counts() -> None:
    # one process, int counts: c, W/(N c) and the next window's N' are Python floats, not device
    # tensors; the float64 operations are the same, so the update is the same to the last bit,
    # over windows whose c comes from the previous window's N
    batches = [models.gpt_batch(6, seed=s) for s in (4, 5, 6)]
    host_model, device_model = models.gpt(), models.gpt()
    host = Accumulator(host_model, torch.optim.SGD(host_model.parameters(), lr=0.1), scaling="post")
    device = Accumulator(device_model, torch.optim.SGD(device_model.parameters(), lr=0.1), scaling="post")
    for sizes, batch in zip([[2, 2, 2], [1, 5], [3, 3]], batches, strict=True):
        rh = host.step(_lazy(batch, sizes), models.gpt_loss, lambda mb: int(models.tokens(mb)))
        rd = device.step(_lazy(batch, sizes), models.gpt_loss, models.tokens)
        assert isinstance(host._engine._basis.expected, float)  # the host path was taken
        assert rh.loss == rd.loss and rh.global_count == rd.global_count
    got, want = params_of(host_model), params_of(device_model)
    assert all(torch.equal(got[name], want[name]) for name in want)


def test_the_next_constant_comes_from_the_host_read_of_the_last_count() -> None:
    # tensor counts: the verdict's one read brings N to the host, so the next window's c (and its
    # part of W/(N c)) costs no device op; with the decision on the device N stays there
    batches = [models.gpt_batch(6, seed=s) for s in (4, 5, 6)]
    model = models.gpt()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), scaling="post")
    for sizes, batch in zip([[2, 2, 2], [1, 5], [3, 3]], batches, strict=True):
        result = acc.step(_lazy(batch, sizes), models.gpt_loss, models.tokens)
        assert acc._engine._basis.expected == float(result.global_count)
    fused_model = models.gpt()
    fused = Accumulator(
        fused_model, torch.optim.SGD(fused_model.parameters(), lr=0.1, fused=True), scaling="post"
    )
    fused.step(_lazy(batches[0], [2, 2, 2]), models.gpt_loss, models.tokens)
    assert isinstance(fused._engine._basis.expected, torch.Tensor)


def test_a_fused_optimizer_step_reads_nothing_on_the_host_and_still_skips_nonfinite() -> None:
    batch = models.gpt_batch(6, seed=2)
    pre, post, a, b = _pair([], opt=lambda p: torch.optim.Adam(p, lr=1e-2, fused=True))
    b.step(_lazy(batch, [2, 2, 2]), models.gpt_loss, models.tokens)  # warm-up (optimizer state)
    a.step(split(batch, sizes=[2, 2, 2]), models.gpt_loss, models.tokens)
    with count_sync_points() as points:
        result = b.step(_lazy(batch, [2, 2, 2]), models.gpt_loss, models.tokens)
    assert (points.host_reads, points.collectives) == (0, 0), points.by_name
    a.step(split(batch, sizes=[2, 2, 2]), models.gpt_loss, models.tokens)
    assert result.applied and result.step == 2  # read now, after the count
    before = params_of(post)

    def poisoned(model: torch.nn.Module, mb: Any) -> torch.Tensor:
        return models.gpt_loss(model, mb) * float("inf")

    with count_sync_points() as points:
        skipped = b.step(_lazy(batch, [2, 2, 2]), poisoned, models.tokens)
    assert points.host_reads == 0
    assert not skipped.applied and "non-finite" in (skipped.skip_reason or "")
    assert max_rel_err(params_of(post), before) == 0  # Adam's step count was not advanced either
    assert _counters(b.state_dict()) == {"steps_applied": 2, "steps_skipped": 1, "consecutive_skips": 1}
    # after the skip, both modes still agree update for update
    a_after = a.step(split(batch, sizes=[3, 3]), models.gpt_loss, models.tokens)
    b_after = b.step(_lazy(batch, [3, 3]), models.gpt_loss, models.tokens)
    assert b_after.step == 3 and a_after.step == 3
    assert max_rel_err(params_of(post), params_of(pre)) < ADAM_TOL
    assert b.steps_applied == 3 and b.consecutive_skips == 0


def test_the_counters_decided_on_the_device_count_runs_of_skips() -> None:
    batch = models.gpt_batch(4, seed=1)
    _, _, _, b = _pair([], opt=lambda p: torch.optim.SGD(p, lr=0.1, fused=True))

    def poisoned(model: torch.nn.Module, mb: Any) -> torch.Tensor:
        return models.gpt_loss(model, mb) * float("nan")

    states, steps = [], []
    for loss_fn in (models.gpt_loss, poisoned, poisoned, models.gpt_loss, poisoned):
        steps.append(b.step(_lazy(batch, [2, 2]), loss_fn, models.tokens))
        if len(steps) in (3, 5):
            states.append(_counters(b.state_dict()))  # settles the counters: one read
    assert [r.applied for r in steps] == [True, False, False, True, False]
    assert [r.step for r in steps] == [1, 1, 1, 2, 2]  # read late: each result kept its own figures
    assert states == [
        {"steps_applied": 1, "steps_skipped": 2, "consecutive_skips": 2},
        {"steps_applied": 2, "steps_skipped": 3, "consecutive_skips": 1},
    ]


def test_a_zero_count_window_is_skipped_on_the_device() -> None:
    batch = models.gpt_batch(4, seed=1)
    _, post, _, b = _pair([], opt=lambda p: torch.optim.SGD(p, lr=0.1, fused=True))
    before = params_of(post)
    result = b.step(_lazy(batch, [2, 2]), models.gpt_loss, lambda mb: torch.tensor(0) * models.tokens(mb))
    assert not result.applied and result.loss is None and result.global_count == 0
    assert "zero valid units" in (result.skip_reason or "")
    assert max_rel_err(params_of(post), before) == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_grad_scaler_skips_the_same_windows_in_both_modes(dtype: torch.dtype) -> None:
    # float32 parameters, forward in low precision under CPU autocast: the GradScaler's own domain
    def loss_fn(model: torch.nn.Module, mb: Any) -> torch.Tensor:
        with torch.autocast("cpu", dtype=dtype):
            out = models.mlp_loss(model, mb)
        return out.float() * mb["boost"]

    skipped: dict[str, list[bool]] = {}
    updates: dict[str, dict[str, torch.Tensor]] = {}
    for scaling in ("pre", "post"):
        model = models.mlp(dtype=torch.float32)
        start = params_of(model)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=1e-3), scaler=scaler, scaling=scaling)
        flags = []
        for window in range(5):
            batch = models.mlp_batch(8, seed=window, dtype=torch.float32)
            # window 2 overflows: one micro-batch's loss is beyond float32 once scaled
            boost = 1e36 if window == 2 else 1.0
            micro = [dict(mb, boost=torch.tensor(boost)) for mb in split(batch, sizes=[3, 3, 2])]
            flags.append(
                acc.step(iter(micro) if scaling == "post" else micro, loss_fn, models.count_rows).skipped
            )
        skipped[scaling] = flags
        updates[scaling] = {name: value - start[name] for name, value in params_of(model).items()}
        assert scaler.get_scale() == 2.0**9  # backed off once, on the same window
    assert skipped["pre"] == skipped["post"] == [False, False, True, False, False]
    # The backward runs in bf16/fp16 (unit roundoff 3.9e-3 / 4.9e-4) and the two modes hand it
    # different scales (W/N against a power of two), so the summed updates differ by a few units of
    # that roundoff, not of float64's: 3e-2 (bf16), 4e-3 (fp16) relative to the update itself.
    tol = 3e-2 if dtype == torch.bfloat16 else 4e-3
    assert max_rel_err(updates["post"], updates["pre"]) < tol


def test_post_results_copy_like_plain_ones() -> None:
    batch = models.gpt_batch(4, seed=1)
    _, _, a, b = _pair([], opt=lambda p: torch.optim.SGD(p, lr=0.1, fused=True))
    ra = a.step(split(batch, micro_batch=2), models.gpt_loss, models.tokens)
    rb = b.step(_lazy(batch, [2, 2]), models.gpt_loss, models.tokens)
    assert copy.copy(rb) == rb.resolved() and repr(rb).startswith("DeviceStepResult(")
    assert type(copy.deepcopy(rb)) is StepResult
    assert rb.loss == pytest.approx(ra.loss, rel=REL_TOL) and rb.step == ra.step == 1


@pytest.mark.parametrize(("length", "most"), [(None, 2), (16, 1)])
def test_a_streamed_window_holds_at_most_the_running_micro_batch_and_the_next(
    length: int | None, most: int
) -> None:
    alive, peak = [0], [0]

    def lazy() -> Iterator[Any]:
        for j in range(16):
            mb = models.mlp_batch(2, seed=j)
            alive[0] += 1
            peak[0] = max(peak[0], alive[0])
            weakref.finalize(mb["x"], lambda: alive.__setitem__(0, alive[0] - 1))
            yield mb

    model = models.mlp()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), scaling="post")
    acc.step(lazy(), models.mlp_loss, models.count_rows, length=length)
    assert peak[0] == most  # k = 16 micro-batches, never more than these alive at once


@pytest.mark.cuda
def test_a_post_window_with_a_fused_optimizer_never_synchronizes_on_cuda() -> None:
    from gradaccum.batch import to_device

    batch = to_device(models.gpt_batch(6, seed=2), "cuda")
    micro = split(batch, sizes=[2, 2, 2])  # on the device before the step: no copy inside it
    pre, post = models.gpt().cuda(), models.gpt().cuda()
    a = Accumulator(pre, torch.optim.Adam(pre.parameters(), lr=1e-2, fused=True))
    b = Accumulator(post, torch.optim.Adam(post.parameters(), lr=1e-2, fused=True), scaling="post")
    for _ in range(2):  # the first builds the optimizer state
        a.step(micro, models.gpt_loss, models.tokens)
        torch.cuda.set_sync_debug_mode("error")  # any host read or synchronizing copy raises
        try:
            result = b.step(iter(micro), models.gpt_loss, models.tokens)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert result.applied and result.step == 2
    assert max_rel_err(params_of(post), params_of(pre)) < ADAM_TOL


def test_a_negative_tensor_count_is_refused_where_the_device_is_read() -> None:
    batch = models.gpt_batch(4, seed=1)

    def negative(mb: Any) -> torch.Tensor:
        return -models.tokens(mb)

    _, post, _, b = _pair([], opt=lambda p: torch.optim.Adam(p, lr=0.1, fused=True))
    before = params_of(post)
    result = b.step(_lazy(batch, [2, 2]), models.gpt_loss, negative)  # decided on the device: skipped
    with pytest.raises(CountError, match="negative count"):
        _ = result.applied
    assert max_rel_err(params_of(post), before) == 0
    _, _, _, plain = _pair([])  # a plain optimizer reads the verdict in the step, and raises there
    with pytest.raises(CountError, match="negative count"):
        plain.step(_lazy(batch, [2, 2]), models.gpt_loss, negative)
