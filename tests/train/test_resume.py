"""Checkpoints at optimizer boundaries: resume equals uninterrupted, requests are deferred, never lost.

Exactness: every comparison here is between float64 CPU runs in one process with one intra-op
thread, which execute the same operations on the same values in the same order; a checkpoint stores
tensors bit for bit. So resumed and uninterrupted parameters are compared with exact equality: any
difference would be a resume bug (a replayed or skipped micro-batch, a lost optimizer moment, a
reset counter), not rounding.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gradaccum.train import (
    CheckpointError,
    CheckpointRecord,
    TrainControl,
    TrainError,
    TrainEvent,
    latest_checkpoint,
    read_metrics,
    train,
)
from tests.train.common import config, final_params, gpt, on_loss_call, one_thread

ACCUM = 4  # config(): global batch 16 = micro-batch 4 x dp 1 x accum 4


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    with one_thread():  # as the tests it is compared with run
        return final_params(train(config(tmp_path_factory.mktemp("reference"))))


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), f"{name} differs after resume"


def test_stop_requested_mid_window_checkpoints_at_the_boundary_and_resumes_exactly(
    tmp_path: Path, uninterrupted: dict[str, torch.Tensor]
) -> None:
    control = TrainControl()
    # the request arrives during micro-batch 2 of window 3 (as a SIGTERM would)
    workload = on_loss_call(gpt(), 3 * ACCUM + 2, control.request_stop)
    stopped = train(config(tmp_path), workload=workload, control=control)

    assert stopped.stopped == "stop requested"
    assert stopped.progress.windows == 4, "window 3 must finish before the run stops"
    state = torch.load(stopped.checkpoints[-1] / "state.pt", weights_only=True)
    assert stopped.checkpoints[-1].name == "step-00000004"
    assert state["data_position"] == {"window": 4, "micro_batch": 0}

    resumed = train(config(tmp_path, resume=tmp_path), workload=gpt())
    assert resumed.resumed_from == stopped.checkpoints[-1]
    assert resumed.progress.windows == 8 and resumed.progress.steps_applied == 8
    _assert_same(final_params(resumed), uninterrupted)
    steps = [r["window"] for r in read_metrics(tmp_path / "metrics.jsonl") if r["kind"] == "step"]
    assert steps == list(range(8)), "each window trained and recorded exactly once"


def test_crash_mid_window_resumes_from_the_last_boundary_exactly(
    tmp_path: Path, uninterrupted: dict[str, torch.Tensor]
) -> None:
    def crash() -> None:
        raise RuntimeError("simulated crash")

    # checkpoints after windows 3 and 6; the crash hits micro-batch 1 of window 4
    workload = on_loss_call(gpt(), 4 * ACCUM + 1, crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(config(tmp_path, checkpoint_every=3), workload=workload)
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-00000003"
    assert not list((tmp_path / "checkpoints").glob(".tmp-*")), "no half-written checkpoint is left"

    events: list[TrainEvent] = []
    resumed = train(
        config(tmp_path, checkpoint_every=3, resume=tmp_path), workload=gpt(), on_event=events.append
    )
    # the partial window 4 never reached the parameters; the resumed run starts at window 3's end
    first_step = next(e for e in events if hasattr(e, "window") and not isinstance(e, CheckpointRecord))
    assert first_step.window == 3
    _assert_same(final_params(resumed), uninterrupted)
    steps = [r["window"] for r in read_metrics(tmp_path / "metrics.jsonl") if r["kind"] == "step"]
    assert steps == list(range(8))


def test_checkpoint_request_mid_window_is_deferred_to_the_boundary_not_dropped(
    tmp_path: Path, uninterrupted: dict[str, torch.Tensor]
) -> None:
    control = TrainControl()
    workload = on_loss_call(gpt(), 2 * ACCUM + 1, control.request_checkpoint)
    events: list[TrainEvent] = []
    result = train(
        config(tmp_path, keep_checkpoints=5), workload=workload, control=control, on_event=events.append
    )
    saved = [(e.window, e.reason) for e in events if isinstance(e, CheckpointRecord)]
    assert saved == [(3, "requested"), (8, "final")]
    assert result.stopped == "completed"
    _assert_same(final_params(result), uninterrupted)  # checkpointing does not perturb the run
    # and the requested checkpoint resumes to the same end
    resumed = train(config(tmp_path / "again", resume=tmp_path / "checkpoints" / "step-00000003"))
    _assert_same(final_params(resumed), uninterrupted)


def test_resume_refuses_what_changes_the_trajectory_by_name(tmp_path: Path) -> None:
    train(config(tmp_path, steps=2))
    with pytest.raises(CheckpointError) as info:
        train(config(tmp_path, global_batch=8, resume=tmp_path))
    message = str(info.value)
    assert "with global batch 16 (global_batch = micro_batch 4 x dp 1 x accum_steps 4 = 16)" in message
    assert "this run has global batch 8 (global_batch = micro_batch 4 x dp 1 x accum_steps 2 = 8)" in message
    assert "Resume with --global-batch 16 (any --micro-batch, --max-tokens or number of processes)" in message
    with pytest.raises(CheckpointError, match="uses float32; resume with --precision float64"):
        train(config(tmp_path, precision="float32", resume=tmp_path))
    with pytest.raises(CheckpointError, match="with seed 0, this run has seed 5: .* Resume with --seed 0"):
        train(config(tmp_path, seed=5, resume=tmp_path))
    with pytest.raises(CheckpointError, match="Resume with --workload gradaccum.examples:tiny_gpt"):
        train(config(tmp_path, workload="gradaccum.examples.regression:regression", resume=tmp_path))


def test_resume_on_another_micro_batch_ends_where_the_uninterrupted_run_does(
    tmp_path: Path, uninterrupted: dict[str, torch.Tensor]
) -> None:
    control = TrainControl()
    with one_thread():
        train(
            config(tmp_path),
            workload=on_loss_call(gpt(), 3 * ACCUM + 2, control.request_stop),
            control=control,
        )
        # micro-batch 8 x accum 2 where the checkpoint had 4 x 4: the same global batch of 16
        resumed = train(config(tmp_path, micro_batch=8, resume=tmp_path))
    got = final_params(resumed)
    # another cut of each window only reorders float64 sums (~1e-16 relative per gradient); four
    # AdamW steps carry that to ~1e-13 at most (the module's runs: measured 1e-14), far below 1e-10
    assert max((got[k] - uninterrupted[k]).abs().max().item() for k in got) <= 1e-10
    card = json.loads((tmp_path / "runcard.json").read_text())["extra"]["train"]
    (resume,) = card["resumes"]
    assert (resume["window"], resume["rows"]) == (4, 64)
    assert resume["written_on"]["micro_batch"] == 4 and resume["written_on"]["accum_steps"] == 4
    assert (
        resume["resumed_on"]
        == card["layout"]
        == {
            "world": 1,
            "micro_batch": 8,
            "accum_steps": 2,
            "max_tokens": None,
            "fsdp": False,
        }
    )


def test_old_checkpoints_are_pruned_and_latest_points_at_a_complete_one(tmp_path: Path) -> None:
    result = train(config(tmp_path, steps=5, checkpoint_every=1, keep_checkpoints=2))
    folders = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.is_dir())
    assert folders == ["step-00000004", "step-00000005"]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-00000005"
    assert sorted(p.name for p in result.checkpoints[-1].iterdir()) == [
        "manifest.json",
        "rng-rank00000.pt",
        "state.pt",
    ]
    state = torch.load(result.checkpoints[-1] / "state.pt", weights_only=True)
    assert state["progress"]["windows"] == 5 and state["plan"] == {
        "micro_batch": 4,
        "accum_steps": 4,
        "dp": 1,
    }
    assert state["meta"]["schedule"]["clock"] == "steps"
    assert json.loads((tmp_path / "runcard.json").read_text())["accum_steps"] == 4


def test_missing_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        train(config(tmp_path, resume=tmp_path / "nowhere"))


def test_a_fresh_run_refuses_a_folder_with_checkpoints_and_latest_survives_a_bad_pointer(
    tmp_path: Path,
) -> None:
    train(config(tmp_path, steps=3, checkpoint_every=1, keep_checkpoints=3))
    holds = r"already holds another run \(runcard.json, metrics.jsonl, checkpoints/\)"
    with pytest.raises(TrainError, match=holds):
        train(config(tmp_path, steps=3))
    # a crash between swapping a folder and re-pointing: the newest complete checkpoint is used
    (tmp_path / "checkpoints" / "latest").write_text("step-00000099\n")
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step-00000003"
