"""Two real gloo processes: DDP and FSDP2 training equal one process on the same global batch.

All scenarios run in one two-process launch (module fixture) to pay the start-up once.

Tolerances (float64). The two-process runs sum each window's gradient in a different order (per
rank, then across ranks) than one process does, which moves float64 gradients by ~1e-16 relative.
Losses and evaluation losses agree to 1e-12. Parameters after six AdamW steps agree to 1e-14 on
every tensor but the attention's key bias, measured at 5e-13: its gradient is exactly zero in exact
arithmetic (softmax is invariant to a shift of a whole row of scores), so in floating point it is
pure rounding noise of ~1e-17 whose value depends on summation order, and Adam divides it by
sqrt(v) + eps (eps = 1e-8) into updates of ~lr * 1e-9 that differ between the runs. Parameters
are therefore compared at 1e-11 relative, which still fails any real accumulation error (a wrong
denominator is off by percents). Within one launch, ranks and resumed runs repeat identical
operations, so those comparisons are exact.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from gradaccum.cli.main import main
from gradaccum.train import EvalRecord, StepRecord, TrainControl, TrainEvent, train
from gradaccum.train.schedule import ScheduleConfig
from tests.helpers.launcher import run_ranks, values
from tests.helpers.reference import max_rel_err
from tests.train.common import config, final_params, gpt, on_loss_call, one_thread, overflow_at

pytestmark = pytest.mark.distributed

STEPS = 6
REL = 1e-12  # losses
REL_PARAMS = 1e-11  # parameters after AdamW steps (module docstring)


def _scenarios(rank: int, world: int, tmp: str) -> dict[str, Any]:
    root = Path(tmp)
    out: dict[str, Any] = {}

    # DDP: global batch 16 = micro-batch 4 x dp 2 x accum 2, evaluated every 3 windows
    events: list[TrainEvent] = []
    ddp = train(
        config(root / "ddp", dp=2, steps=STEPS, eval_every=3, eval_examples=10), on_event=events.append
    )
    out["ddp_checkpoint"] = str(ddp.checkpoints[-1])
    out["ddp_eval"] = [e.eval_loss for e in events if isinstance(e, EvalRecord)]

    # DDP interrupted: only rank 1 gets the stop request, mid-window 2; both must stop together
    control = TrainControl()
    workload = on_loss_call(gpt(), 2 * 2 + 1, control.request_stop) if rank == 1 else gpt()
    stopped = train(config(root / "ddp_resume", dp=2, steps=STEPS), workload=workload, control=control)
    out["stopped"] = (stopped.stopped, stopped.progress.windows)
    resumed = train(config(root / "ddp_resume", dp=2, steps=STEPS, resume=root / "ddp_resume"))
    out["resumed_checkpoint"] = str(resumed.checkpoints[-1])

    # FSDP2: the same run sharded; checkpoint after 3 windows, then resume from it elsewhere
    events = []
    fsdp = train(
        config(
            root / "fsdp", dp=2, steps=STEPS, fsdp=True, checkpoint_every=3, eval_every=3, eval_examples=10
        ),
        on_event=events.append,
    )
    out["fsdp_checkpoint"] = str(fsdp.checkpoints[-1])
    out["fsdp_eval"] = [e.eval_loss for e in events if isinstance(e, EvalRecord)]
    middle = root / "fsdp" / "checkpoints" / "step-00000003"
    again = train(config(root / "fsdp_again", dp=2, steps=STEPS, fsdp=True, resume=middle))
    out["fsdp_again_checkpoint"] = str(again.checkpoints[-1])

    # float16 + GradScaler("cpu"): an overflow on rank 1 only, in window 2
    events = []
    fp16_cfg = config(
        root / "fp16",
        dp=2,
        steps=4,
        precision="float16",
        lr=1e-3,
        schedule=ScheduleConfig(kind="constant", warmup=3),
    )
    fp16_workload = overflow_at(gpt(), {2}, accum_steps=2) if rank == 1 else gpt()
    fp16 = train(fp16_cfg, workload=fp16_workload, on_event=events.append)
    out["fp16"] = [(s.applied, s.loss_scale, s.lr, s.step) for s in events if isinstance(s, StepRecord)]
    out["fp16_progress"] = fp16.progress

    # the batch-size schedule under DDP: every rank makes the same decisions (issue 26)
    from gradaccum.examples.regression import regression
    from gradaccum.step.config import AccumConfig
    from gradaccum.train.batch_schedule import BatchChange, CriticalBatchConfig

    events = []
    grown = train(
        config(
            root / "batch",
            dp=2,
            micro_batch=4,
            global_batch=8,
            steps=40,
            optimizer="sgd",
            lr=0.02,
            schedule=ScheduleConfig(kind="constant", warmup=0),
            accum=AccumConfig(noise_scale=True, track_grad_norm=True),
            batch_schedule=CriticalBatchConfig(max_global_batch=64, min_updates=10),
            workload="gradaccum.examples.regression:regression",
            checkpoint_every=None,
            checkpoint_minutes=None,
        ),
        workload=regression(),
        on_event=events.append,
    )
    out["batch_changes"] = [e for e in events if isinstance(e, BatchChange)]
    out["batch_sizes"] = [(s.global_batch, s.window_tokens) for s in events if isinstance(s, StepRecord)]
    out["batch_checkpoint"] = str(grown.checkpoints[-1])

    # the command line under an existing process group (as torchrun would give)
    argv = ["train", "--steps", "3", "--global-batch", "16", "--micro-batch", "4", "--precision", "float64"]
    out["cli"] = main([*argv, "--run-dir", str(root / "cli")])
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("ranks")
    return root, values(run_ranks(_scenarios, str(root), timeout_s=200))


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, torch.Tensor], list[float | None]]:
    events: list[TrainEvent] = []
    with one_thread():  # as the spawned ranks run
        result = train(
            config(tmp_path_factory.mktemp("single"), steps=STEPS, eval_every=3, eval_examples=10),
            on_event=events.append,
        )
    return final_params(result), [e.eval_loss for e in events if isinstance(e, EvalRecord)]


def _params(path: str) -> dict[str, torch.Tensor]:
    return torch.load(Path(path) / "state.pt", map_location="cpu", weights_only=True)["model"]


def _equals_single_process(ranks: Any, single: Any, layout: str) -> dict[str, torch.Tensor]:
    """The ``layout`` run's final parameters, checked against one process's after the same steps, and
    its evaluation: one all-reduced figure, identical on every rank."""
    _, (r0, r1) = ranks
    want, want_eval = single
    got = _params(r0[f"{layout}_checkpoint"])
    err = max_rel_err(got, want)
    assert err < REL_PARAMS, f"{layout} vs one process after {STEPS} steps: max relative error {err:.2e}"
    assert r0[f"{layout}_eval"] == r1[f"{layout}_eval"]
    assert r0[f"{layout}_eval"] == pytest.approx(want_eval, rel=REL)
    return got


def test_ddp_training_equals_single_process_on_the_same_global_batch(ranks: Any, single: Any) -> None:
    _equals_single_process(ranks, single, "ddp")


def test_ddp_stop_on_one_rank_mid_window_stops_all_and_resumes_exactly(ranks: Any) -> None:
    _, (r0, r1) = ranks
    assert r0["stopped"] == r1["stopped"] == ("stop requested", 3)
    want, got = _params(r0["ddp_checkpoint"]), _params(r0["resumed_checkpoint"])
    for name in want:
        assert torch.equal(got[name], want[name]), name  # same operations, same order: exact


def test_fsdp2_training_equals_single_process_and_resumes_exactly(ranks: Any, single: Any) -> None:
    got = _equals_single_process(ranks, single, "fsdp")
    _, (r0, _) = ranks
    again = _params(r0["fsdp_again_checkpoint"])
    for name in got:
        assert torch.equal(again[name], got[name]), name


def test_fp16_overflow_on_one_rank_is_skipped_on_every_rank(ranks: Any) -> None:
    _, (r0, r1) = ranks
    assert r0["fp16"] == r1["fp16"], "ranks must agree on skip, scale, lr and step"
    applied = [a for a, *_ in r0["fp16"]]
    scales = [s for _, s, *_ in r0["fp16"]]
    lrs = [lr for _, _, lr, _ in r0["fp16"]]
    assert applied == [True, True, False, True]
    assert scales == [65536.0, 65536.0, 32768.0, 32768.0]  # backed off once, on both ranks
    # steps clock, constant schedule with warmup 3: the skipped update does not advance the clock
    assert lrs == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3, 1e-3], rel=REL)
    assert r0["fp16_progress"].steps_skipped == r1["fp16_progress"].steps_skipped == 1


def test_every_rank_makes_the_same_batch_decisions(ranks: Any) -> None:
    _, (r0, r1) = ranks
    assert r0["batch_changes"], "the schedule never grew the batch under DDP"
    assert r0["batch_changes"] == r1["batch_changes"] and r0["batch_sizes"] == r1["batch_sizes"]
    assert all(c.global_batch % 8 == 0 for c in r0["batch_changes"])  # micro-batch 4 x dp 2
    assert all(size == rows for size, rows in r0["batch_sizes"])  # each window held the decided batch


def test_cli_trains_under_an_existing_process_group(ranks: Any) -> None:
    root, (r0, r1) = ranks
    assert r0["cli"] == r1["cli"] == 0

    card = json.loads((root / "cli" / "runcard.json").read_text())
    assert (card["micro_batch"], card["dp"], card["accum_steps"], card["precision"]) == (4, 2, 2, "float64")
    assert sorted(p.name for p in (root / "cli" / "checkpoints" / "step-00000003").iterdir()) == [
        "manifest.json",
        "rng-rank00000.pt",
        "rng-rank00001.pt",
        "state.pt",
    ]
