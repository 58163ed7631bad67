"""gradaccum.guard on one process: each rule fires on a seeded broken loop, at the line that did it,
and stays silent on correct loops; the guard leaves no trace and never changes the numbers.

The loop below is correct (exact token mean: summed loss / N of the window; zero_grad, clip, step and
schedule once per window); ``bug`` switches on one misuse, on a line tagged ``# BUG:<name>`` that the
tests look up, so findings are checked against the very line that misbehaved.
"""

from __future__ import annotations

import copy
import io
import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from gradaccum.hazards.sanitizer import GUARD_RULES, Guard, GuardError, GuardSetupError, GuardWarning, guard
from gradaccum.step.accumulator import Accumulator

K = 4
Batch = list[tuple[torch.Tensor, torch.Tensor]]


def _line(tag: str) -> int:
    for number, text in enumerate(Path(__file__).read_text().splitlines(), start=1):
        if text.rstrip().endswith(f"# BUG:{tag}"):
            return number
    raise LookupError(tag)


def _model(dtype: torch.dtype = torch.float64) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


def _data(n: int, *, uneven: bool = True, dtype: torch.dtype = torch.float64) -> Batch:
    """Micro-batches of 3 examples; ``uneven``: 3, 2, 1, 3, 2, ... valid labels (the rest -100)."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for j in range(n):
        x = torch.randn(3, 4, generator=gen, dtype=dtype)
        y = torch.randint(0, 3, (3,), generator=gen)
        if uneven:
            y[: j % 3] = -100
        out.append((x, y))
    return out


def _valid(y: torch.Tensor) -> int:
    return int((y != -100).sum())


def _train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    data: Batch,
    k: int = K,
    *,
    bug: str = "",
    sched: Any = None,
    scaler: Any = None,
    clip: bool = True,
    g: Guard | None = None,
) -> None:
    for start in range(0, len(data), k):
        window = data[start : start + k]
        if g is not None and start + k >= len(data):
            g.final_window()
        n = sum(_valid(y) for _, y in window)
        opt.zero_grad()
        for j, (x, y) in enumerate(window):
            if bug == "zero_grad" and j:
                opt.zero_grad()  # BUG:zero_grad
            if bug == "mean":
                loss = F.cross_entropy(model(x), y) / k
            elif bug == "own-count":
                loss = F.cross_entropy(model(x), y, reduction="sum") / (y != -100).sum() / k
            elif bug == "weighted-mean":  # correct: each mean weighted by its share of the window
                loss = F.cross_entropy(model(x), y) * (_valid(y) / n)
            else:
                loss = F.cross_entropy(model(x), y, reduction="sum") / n
            if scaler is None:
                loss.backward()  # BUG:backward
            else:
                scaler.scale(loss).backward()
            if bug == "step":
                opt.step()  # BUG:step
            if bug == "clip":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # BUG:clip
            if bug == "scheduler":
                sched.step()  # BUG:scheduler
            if bug == "unscale":
                scaler.unscale_(opt)  # BUG:unscale
            if bug == "update":
                scaler.update()  # BUG:update
        if scaler is not None and bug != "clip-scaled":
            scaler.unscale_(opt)
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # BUG:clip-scaled
        if scaler is not None:
            scaler.step(opt)  # BUG:scaler-step
            scaler.update()
        else:
            opt.step()  # BUG:window-step
        if sched is not None:
            sched.step()


def _setup(dtype: torch.dtype = torch.float64) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    model = _model(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)


def _findings(data: Batch, k: int = K, guard_k: int = K, **kw: Any) -> list[tuple[str, int]]:
    """Run the loop under a warn-mode guard; (code, line) of every finding, checked against warnings."""
    model, opt, sched = _setup()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with guard(model, opt, guard_k, scheduler=sched, mode="warn") as g:
            _train(model, opt, data, k, sched=sched, **kw)
    found = [(f.code, f.lineno) for f in g.findings]
    # (torch's own warnings, e.g. a scheduler stepped before the optimizer, are not the guard's)
    warned = [(w.filename, w.lineno) for w in caught if w.category is GuardWarning]
    # a line that repeats its mistake at every micro-batch warns once per window
    once = dict.fromkeys((f.code, f.lineno, f.window) for f in g.findings)
    assert warned == [(__file__, line) for _, line, _ in once]
    assert all(f.filename == __file__ for f in g.findings)
    return found


# -- each rule fires, at the line that did it ------------------------------------------------------


@pytest.mark.parametrize(
    ("bug", "code", "tag", "per_window"),
    [
        ("zero_grad", "zero-grad-mid-window", "zero_grad", K - 1),
        ("step", "step-mid-window", "step", K),  # every micro-batch step sees one backward
        ("clip", "clip-mid-window", "clip", K - 1),
        ("scheduler", "scheduler-mid-window", "scheduler", K),  # K-1 mid-window, then a second step
        ("mean", "mean-of-means", "backward", 1),
        ("own-count", "mean-of-means", "backward", 1),
    ],
)
def test_rule_fires_at_the_misuse_line_in_warn_mode(bug: str, code: str, tag: str, per_window: int) -> None:
    found = _findings(_data(2 * K), bug=bug)
    # micro-batch steps leave the window's own step with zero backward passes: one more per window
    extra = [("step-mid-window", _line("window-step"))] * 2 if bug == "step" else []
    assert sorted(found) == sorted([(code, _line(tag))] * per_window * 2 + extra)


def test_warn_mode_warns_once_per_window_for_a_mistake_repeated_at_every_micro_batch() -> None:
    model, opt, sched = _setup()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with guard(model, opt, K, scheduler=sched, mode="warn") as g:
            _train(model, opt, _data(2 * K), sched=sched, bug="zero_grad")
    warned = [w for w in caught if w.category is GuardWarning]
    assert len(g.findings) == 2 * (K - 1), "every occurrence is still recorded"
    assert [w.lineno for w in warned] == [_line("zero_grad")] * 2, "one warning per window, not K - 1"


def test_raise_mode_raises_before_the_misuse_runs() -> None:
    model, opt, sched = _setup()
    with pytest.raises(GuardError) as info, guard(model, opt, K, scheduler=sched):
        _train(model, opt, _data(2 * K), bug="zero_grad")
    finding = info.value.finding
    assert (finding.code, finding.filename, finding.lineno, finding.window) == (
        "zero-grad-mid-window",
        __file__,
        _line("zero_grad"),
        0,
    )
    assert "after 1 of accum_steps=4 backward passes" in str(info.value)
    assert f"{__file__}:{_line('zero_grad')}" in str(info.value)
    # the erasing zero_grad did not run: the first micro-batch's gradient is still there
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_mean_of_means_names_the_counts_and_weights() -> None:
    model, opt, _ = _setup()
    with pytest.raises(GuardError) as info, guard(model, opt, K):
        _train(model, opt, _data(K), bug="mean")
    assert info.value.finding.code == "mean-of-means"
    # counts 3, 2, 1, 3 (uneven labels); each mean divided by 4 gives a unit 1/12 .. 1/4
    assert "means over [3, 2, 1, 3] units" in info.value.finding.message
    assert "[0.08333, 0.125, 0.25, 0.08333]" in info.value.finding.message


def test_window_overrun_when_the_loop_accumulates_more_than_declared() -> None:
    assert _findings(_data(2 * 2 * K), k=2 * K, guard_k=K) == [("window-overrun", _line("window-step"))] * 2


def test_undeclared_short_final_window_is_a_step_mid_window() -> None:
    found = _findings(_data(2 * K + 2), clip=False)
    assert found == [("step-mid-window", _line("window-step"))]


def test_short_final_window_divided_by_planned_k() -> None:
    # equal counts: mean / k is exact on full windows; the short window (2 of 4) is halved
    model, opt, _ = _setup()
    with pytest.raises(GuardError) as info, guard(model, opt, K, micro_batches_per_epoch=2 * K + 2):
        _train(model, opt, _data(2 * K + 2, uneven=False), bug="mean")
    finding = info.value.finding
    assert (finding.code, finding.lineno, finding.window) == ("short-window-scale", _line("backward"), 2)
    assert "its gradient is 2/4 of the window's mean" in finding.message


@pytest.mark.parametrize(
    ("bug", "code", "tag"),
    [
        ("unscale", "unscale-mid-window", "unscale"),
        ("update", "scaler-update-mid-window", "update"),
        ("clip-scaled", "clip-before-unscale", "clip-scaled"),
    ],
)
def test_grad_scaler_rules(bug: str, code: str, tag: str) -> None:
    model, opt, _ = _setup(torch.float32)
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(GuardError) as info, guard(model, opt, K, scaler=scaler):
        _train(model, opt, _data(2 * K, dtype=torch.float32), bug=bug, scaler=scaler)
    assert (info.value.finding.code, info.value.finding.lineno) == (code, _line(tag))


# -- silence on correct loops ----------------------------------------------------------------


@pytest.mark.parametrize("bug", ["", "weighted-mean"])
def test_correct_loops_are_silent(bug: str) -> None:
    model, opt, sched = _setup()
    with guard(model, opt, K, scheduler=sched) as g:
        _train(model, opt, _data(3 * K), bug=bug, sched=sched)
    assert g.findings == []
    assert (g.windows, g.backward_passes, g.synced_backward_passes) == (3, 3 * K, 0)


def test_mean_over_k_is_exact_with_equal_counts_and_silent() -> None:
    model, opt, sched = _setup()
    with guard(model, opt, K, scheduler=sched) as g:
        _train(model, opt, _data(2 * K, uneven=False), bug="mean", sched=sched)
    assert g.findings == []


def test_correct_grad_scaler_loop_is_silent() -> None:
    model, opt, sched = _setup(torch.float32)
    scaler = torch.amp.GradScaler("cpu")
    with guard(model, opt, K, scheduler=sched, scaler=scaler) as g:
        _train(model, opt, _data(2 * K, dtype=torch.float32), sched=sched, scaler=scaler)
        _train(model, opt, _data(K, dtype=torch.float32), sched=sched, scaler=scaler, clip=False)
    assert g.findings == [] and g.windows == 3


def test_declared_short_windows_are_silent() -> None:
    data = _data(2 * K + 2)
    model, opt, sched = _setup()
    with guard(model, opt, K, scheduler=sched, micro_batches_per_epoch=len(data)) as g:
        for _epoch in range(2):  # the loop is unchanged: the guard knows where each pass ends
            _train(model, opt, data, bug="weighted-mean", sched=sched)
    assert g.findings == [] and g.windows == 6
    with guard(model, opt, K, scheduler=sched) as g:
        _train(model, opt, data, sched=sched, g=g)  # marks its last window with g.final_window()
    assert g.findings == [] and g.windows == 3


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_the_library_step_is_silent_under_the_guard(reduction: str) -> None:
    model, opt, sched = _setup()
    acc = Accumulator(model, opt, sched, max_grad_norm=1.0, loss_reduction=reduction)  # type: ignore[arg-type]
    data = _data(2 * K)

    def loss_fn(m: nn.Module, mb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(m(mb[0]), mb[1], reduction=reduction)

    with guard(model, opt, K, scheduler=sched) as g:
        for start in range(0, len(data), K):
            acc.step(data[start : start + K], loss_fn, lambda mb: (mb[1] != -100).sum())
    assert g.findings == [] and g.windows == 2


def test_ignore_inspect_loss_and_foreign_clipping() -> None:
    model, opt, sched = _setup()
    other = _model()
    with guard(model, opt, K, scheduler=sched, ignore={"zero-grad-mid-window"}) as g:
        _train(model, opt, _data(K), bug="zero_grad", sched=sched)
        other(torch.randn(2, 4, dtype=torch.float64)).sum().backward()
        torch.nn.utils.clip_grad_norm_(other.parameters(), 1.0)  # another model: not this window's
    assert g.findings == []
    with guard(model, opt, K, scheduler=sched, inspect_loss=False) as g:
        _train(model, opt, _data(K), bug="mean", sched=sched)
    assert g.findings == []


@pytest.mark.cuda
def test_rules_on_cuda_where_hooks_run_on_engine_threads() -> None:
    # On CUDA the autograd engine calls the parameter hooks on its own threads, whose stacks hold no
    # user frame: findings must still name the user's line (taken when backward was called).
    model = _model(torch.float32).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [(x.cuda(), y.cuda()) for x, y in _data(2 * K, dtype=torch.float32)]
    with pytest.raises(GuardError) as info, guard(model, opt, K):
        _train(model, opt, data, bug="mean")
    assert (info.value.finding.code, info.value.finding.lineno) == ("mean-of-means", _line("backward"))
    scaler = torch.amp.GradScaler("cuda")
    with guard(model, opt, K, scaler=scaler) as g:
        _train(model, opt, data, scaler=scaler)
    assert g.findings == [] and g.windows == 2


# -- no trace, no numerical change ---------------------------------------------------------


def test_everything_is_restored_even_after_an_exception() -> None:
    model, opt, sched = _setup()
    scaler = torch.amp.GradScaler("cpu", enabled=False)

    def own(set_to_none: bool = True) -> None:  # a user's own zero_grad, set before the guard
        pass

    opt.zero_grad = own  # type: ignore[method-assign]
    utils, clip_mod = torch.nn.utils, torch.nn.utils.clip_grad

    def patched() -> tuple[Any, ...]:
        """What the guard patches while it is open: the hooks and the objects' attributes."""
        return (
            torch.autograd.backward,
            utils.clip_grad_norm_,
            utils.clip_grad_value_,
            utils.clip_grads_with_norm_,
            clip_mod.clip_grad_norm_,
            dict(vars(model)),
            dict(vars(sched)),
            dict(vars(scaler)),
        )

    before = patched()
    with pytest.raises(RuntimeError, match="boom"), guard(model, opt, K, scheduler=sched, scaler=scaler):
        raise RuntimeError("boom")
    after = patched()
    assert all(a is b or a == b for a, b in zip(after, before, strict=True))
    assert vars(opt)["zero_grad"] is own
    # hooks are gone too: a broken loop after exit reaches no guard
    del opt.zero_grad
    _train(model, opt, _data(K), bug="step")


def test_models_copy_and_pickle_inside_the_guard() -> None:
    model, opt, sched = _setup()
    with guard(model, opt, K, scheduler=sched, mode="warn") as g:
        _train(model, opt, _data(K), sched=sched)
        snapshot = copy.deepcopy(model)  # e.g. an EMA or best-model copy
        buffer = io.BytesIO()
        torch.save(model, buffer)  # a whole-module checkpoint
        # the copy's zero_grad clears the copy, not the guarded model, and is not the guard's business
        model(torch.randn(2, 4, dtype=torch.float64)).sum().backward()
        snapshot.zero_grad()
        assert all(p.grad is not None for p in model.parameters())
        assert all(p.grad is None for p in snapshot.parameters())
        with pytest.warns(GuardWarning, match="zero-grad-mid-window"):
            opt.zero_grad()  # the guarded model's own zero_grad mid-window is still seen
    assert [f.code for f in g.findings] == ["zero-grad-mid-window"]
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert "zero_grad" not in vars(loaded) or vars(loaded)["zero_grad"].__self__ is loaded
    error = pickle.loads(pickle.dumps(GuardError(g.findings[0])))
    assert error.finding == g.findings[0]


def test_guard_does_not_change_the_numbers() -> None:
    # Identical operations in identical order on both runs (the guard adds no arithmetic), so the
    # results must be bitwise equal; any difference would mean the guard touched the computation.
    results = []
    for guarded in (False, True):
        model, opt, sched = _setup()
        if guarded:
            with guard(model, opt, K, scheduler=sched):
                _train(model, opt, _data(2 * K), sched=sched)
        else:
            _train(model, opt, _data(2 * K), sched=sched)
        results.append([p.detach().clone() for p in model.parameters()] + [torch.tensor(sched.get_last_lr())])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def test_bad_settings_name_the_setting() -> None:
    model, opt, _ = _setup()
    with pytest.raises(GuardSetupError, match="accum_steps must be a positive integer, got 0"):
        guard(model, opt, 0)
    with pytest.raises(GuardSetupError, match="micro_batches_per_epoch must be a positive integer, got 0"):
        guard(model, opt, K, micro_batches_per_epoch=0)
    with pytest.raises(GuardSetupError, match="mode must be 'raise' or 'warn', got 'loud'"):
        guard(model, opt, K, mode="loud")  # type: ignore[arg-type]
    with pytest.raises(GuardSetupError, match="unknown rules \\['no-such-rule'\\]"):
        guard(model, opt, K, ignore={"no-such-rule"})
    with pytest.raises(GuardSetupError, match="scheduler must have methods"):
        guard(model, opt, K, scheduler=object())
    g = guard(model, opt, K)
    with g, pytest.raises(GuardSetupError, match="already active"), g:
        pass
    assert set(GUARD_RULES) >= {"mean-of-means", "no-sync-backward-only", "sync-per-micro-batch"}
