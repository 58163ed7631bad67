"""The training loop on one process: it learns, evaluation is side-effect free, skips are policed."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from gradaccum import AccumConfig, split
from gradaccum.errors import TooManySkipsError
from gradaccum.examples import build_tiny_gpt
from gradaccum.loss import valid_tokens
from gradaccum.train import EvalRecord, StepRecord, TrainEvent, evaluate, train
from gradaccum.train.data import train_seed
from gradaccum.train.schedule import ScheduleConfig
from tests.train.common import config, final_params, gpt, overflow_at


def test_training_lowers_the_loss_on_the_bundled_corpus(tmp_path: Path) -> None:
    events: list[TrainEvent] = []
    cfg = config(
        tmp_path, global_batch=32, micro_batch=8, steps=30, precision="float32", schedule=ScheduleConfig()
    )
    result = train(cfg, on_event=events.append)
    losses = [e.loss for e in events if isinstance(e, StepRecord) and e.loss is not None]
    assert len(losses) == 30 and result.progress.steps_applied == 30
    # the untrained model sits near ln(vocab) ~ 4.4 nats; measured: the first and last five
    # windows average 3.97 and 2.74 nats.
    # A margin of 0.8 nats between the first and last five windows' means is far above the
    # window-to-window noise (~0.1) yet would fail for a run that does not learn.
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.8, (first, last)
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    card = json.loads((tmp_path / "runcard.json").read_text())
    assert card["extra"]["schedule"]["clock"] == "steps"
    assert "does not advance the clock" in card["extra"]["schedule"]["skipped_updates"]


def test_bfloat16_autocast_trains(tmp_path: Path) -> None:
    cfg = config(tmp_path, steps=6, precision="bfloat16", schedule=ScheduleConfig(warmup=1))
    result = train(cfg)
    assert result.progress.steps_skipped == 0
    assert result.last_loss is not None and result.first_loss is not None
    assert math.isfinite(result.last_loss) and result.last_loss < result.first_loss


def test_evaluation_mid_window_leaves_accumulated_state_untouched() -> None:
    workload = gpt()
    model = build_tiny_gpt(0, dropout=0.1, dtype=torch.float64)
    model.train()
    first, _ = split(workload.make_batch(8, 3), micro_batch=4)
    workload.loss_fn(model, first).backward()  # half a window accumulated
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    rng = torch.get_rng_state()
    held_out = split(workload.make_batch(8, 4), micro_batch=4)

    loss, count = evaluate(model, held_out, workload.loss_fn, workload.count_fn, device=torch.device("cpu"))

    assert model.training, "evaluation must restore train mode"
    assert torch.equal(torch.get_rng_state(), rng), "evaluation must not consume the training RNG"
    for name, p in model.named_parameters():
        # bitwise: nothing may be added to .grad at all, so no rounding can excuse a difference
        assert torch.equal(p.grad, grads[name]), name
    want_count = sum(int(valid_tokens(mb["labels"], shift=False)) for mb in held_out)
    model.eval()
    with torch.no_grad():
        want = sum(float(workload.loss_fn(model, mb)) for mb in held_out) / want_count
    assert count == want_count
    assert loss == pytest.approx(want, rel=1e-12)  # float64, same terms summed in the same order


def test_evaluating_during_a_run_does_not_change_its_trajectory(tmp_path: Path) -> None:
    plain = train(config(tmp_path / "plain"))
    events: list[TrainEvent] = []
    evaluated = train(config(tmp_path / "eval", eval_every=2, eval_examples=12), on_event=events.append)
    assert [e.window for e in events if isinstance(e, EvalRecord)] == [2, 4, 6, 8]
    assert evaluated.eval_loss is not None
    want, got = final_params(plain), final_params(evaluated)
    for name in want:
        # identical operations in identical order on both runs: exact equality is the claim
        assert torch.equal(got[name], want[name]), name


def _window_tokens(global_batch: int, window: int) -> int:
    return int(valid_tokens(gpt().make_batch(global_batch, train_seed(0, window))["labels"], shift=False))


@pytest.mark.parametrize("clock", ["steps", "tokens"])
def test_fp16_overflow_is_skipped_counted_and_the_clock_follows_the_policy(
    tmp_path: Path, clock: str
) -> None:
    plan_accum = 4
    workload = overflow_at(gpt(), {2}, plan_accum)
    warmup = 3 if clock == "steps" else 3 * _window_tokens(16, 0)
    schedule = ScheduleConfig(clock=clock, warmup=warmup, kind="constant")  # type: ignore[arg-type]
    events: list[TrainEvent] = []
    cfg = config(tmp_path, steps=5, precision="float16", lr=1e-3, schedule=schedule)
    result = train(cfg, workload=workload, on_event=events.append)
    steps = [e for e in events if isinstance(e, StepRecord)]

    assert [s.applied for s in steps] == [True, True, False, True, True]
    assert "non-finite" in (steps[2].skip_reason or "")
    assert result.progress.steps_skipped == 1 and result.progress.steps_applied == 4
    # GradScaler("cpu") starts at 2**16 and backs off by 0.5 once for the one overflow
    assert [s.loss_scale for s in steps] == [65536.0, 65536.0, 32768.0, 32768.0, 32768.0]

    n = [_window_tokens(16, w) for w in range(5)]
    assert result.progress.tokens_seen == sum(n)
    assert result.progress.tokens_consumed == sum(n) - n[2], "a skipped window's tokens are not consumed"
    if clock == "steps":
        clock_after = [1, 2, 3, 3, 4]  # the skipped update does not advance the step clock
    else:
        consumed_before = [0, n[0], n[0] + n[1], n[0] + n[1], n[0] + n[1] + n[3]]
        clock_after = [consumed_before[w] + n[w] for w in range(5)]
    want = [1e-3 * min(1.0, c / warmup) for c in clock_after]
    assert [s.lr for s in steps] == pytest.approx(want, rel=1e-12)


def test_too_many_consecutive_skips_stop_the_run_with_a_clear_message(tmp_path: Path) -> None:
    workload = overflow_at(gpt(), {1, 2, 3, 4}, 4, factor=float("nan"))
    accum = AccumConfig(max_grad_norm=1.0, track_grad_norm=True, max_consecutive_skips=2)
    cfg = config(tmp_path, steps=6, precision="float32", accum=accum)
    with pytest.raises(
        TooManySkipsError, match=r"3 consecutive updates were skipped \(limit max_consecutive_skips=2\)"
    ):
        train(cfg, workload=workload)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["window"], r["applied"]) for r in records] == [(0, True), (1, False), (2, False)]
    assert (tmp_path / "loss.png").is_file()


def test_post_scaling_trains_the_same_run(tmp_path: Path) -> None:
    # float64, AdamW: the two modes agree to Adam's amplified roundoff (see
    # tests/equivalence/test_post_scaling.py, ADAM_TOL), through warmup, cosine and clipping
    runs = {}
    for scaling in ("pre", "post"):
        cfg = config(tmp_path / scaling, steps=4, accum=AccumConfig(max_grad_norm=1.0, scaling=scaling))
        result = train(cfg)
        assert result.progress.steps_applied == 4
        runs[scaling] = final_params(result)
    for name, value in runs["pre"].items():
        assert torch.allclose(runs["post"][name], value, rtol=1e-10, atol=1e-12), name
