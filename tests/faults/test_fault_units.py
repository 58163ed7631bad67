"""The pieces of gradaccum.step.agreement and gradaccum.distributed.dist on one process: no ranks needed."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from gradaccum import Accumulator, GradAccumError, split
from gradaccum.distributed.dist import looks_like_comm_failure
from gradaccum.distributed.sync import needs_every_parameter
from gradaccum.errors import CollectiveError, RankFailedError, WindowOutOfMemoryError
from gradaccum.step.agreement import LocalFailure, raise_alone, unreached_parameters
from tests.faults.common import Trip, params, same
from tests.helpers import models

GLOO_LOST_PEER = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:32128"
)


def test_unreached_parameters_names_what_the_graph_does_not_touch() -> None:
    model = nn.ModuleDict({"a": nn.Linear(3, 2), "b": nn.Linear(3, 2)})
    x = torch.randn(4, 3)
    everything = list(model.parameters())
    assert unreached_parameters(model["a"](x).sum(), everything) == [2, 3]
    assert unreached_parameters((model["a"](x) + model["b"](x)).sum(), everything) == []
    assert unreached_parameters(torch.zeros(()), everything) == [0, 1, 2, 3]  # no graph at all


@pytest.mark.parametrize(
    ("error", "lost_peer"),
    [
        (RuntimeError(GLOO_LOST_PEER), True),
        (RuntimeError("[...gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 30000ms"), True),
        (torch.distributed.DistBackendError("NCCL communicator was aborted"), True),
        (RuntimeError("HTTP fetch failed: connection reset by peer"), False),  # the user's own
        (ValueError("gloo"), False),
        (KeyError("labels"), False),
    ],
)
def test_only_communication_errors_count_as_a_lost_peer(error: BaseException, lost_peer: bool) -> None:
    assert looks_like_comm_failure(error) is lost_peer


def test_a_failure_report_is_one_bounded_line() -> None:
    report = LocalFailure(RuntimeError("line one\nline two " + "x" * 1000), "forward", 3).report(1)
    assert "\n" not in report.message and len(report.message) == 400 and report.message.endswith("...")
    assert report.describe().startswith(
        "rank 1 failed in forward of micro-batch 3: RuntimeError: line one line"
    )
    assert LocalFailure(OSError("gone"), "reading the window", None).report(0).describe() == (
        "rank 0 failed in reading the window: OSError: gone"
    )


def test_window_oom_is_every_kind_of_error_a_caller_may_catch() -> None:
    error = WindowOutOfMemoryError("out of memory")
    for kind in (GradAccumError, RankFailedError, torch.OutOfMemoryError, torch.cuda.OutOfMemoryError):
        assert isinstance(error, kind)


def test_raise_alone_keeps_the_original_error_or_names_the_lost_peer() -> None:
    with pytest.raises(KeyError):
        raise_alone(LocalFailure(KeyError("labels"), "count_fn", 0), recoverable=True)
    with pytest.raises(WindowOutOfMemoryError, match="rank 0 failed in backward of micro-batch 2"):
        raise_alone(LocalFailure(torch.cuda.OutOfMemoryError("CUDA oom"), "backward", 2), recoverable=True)
    with pytest.raises(torch.OutOfMemoryError) as err:  # another rank waits: not retryable here
        raise_alone(LocalFailure(torch.cuda.OutOfMemoryError("CUDA oom"), "forward", 0), recoverable=False)
    assert not isinstance(err.value, WindowOutOfMemoryError)
    with pytest.raises(CollectiveError, match="Another rank stopped taking part"):
        raise_alone(LocalFailure(RuntimeError(GLOO_LOST_PEER), "forward", 1), recoverable=False)


def test_a_failure_mid_window_on_one_process_clears_the_partial_gradients() -> None:
    model = models.mlp()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = params(model)
    model[0].register_forward_hook(Trip(lambda: RuntimeError("boom"), {2}))
    with pytest.raises(RuntimeError, match="boom"):
        acc.step(split(models.mlp_batch(6), micro_batch=2), models.mlp_loss, models.count_rows)
    # micro-batch 0 had accumulated; a later optimizer.step() by the caller must not apply it
    assert all(p.grad is None for p in model.parameters())
    assert same(before, params(model)) and (acc.steps_applied, acc.steps_skipped) == (0, 0)


def test_oom_in_a_plain_step_is_a_window_oom_that_names_where() -> None:
    model = models.mlp()
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1))
    model[0].register_forward_hook(Trip(lambda: torch.cuda.OutOfMemoryError("CUDA out of memory"), {3}))
    with pytest.raises(WindowOutOfMemoryError, match="forward of micro-batch 2") as err:
        acc.step(split(models.mlp_batch(6), micro_batch=2), models.mlp_loss, models.count_rows)
    assert err.value.__cause__ is None and err.value.__suppress_context__  # no activations kept alive
    assert all(p.grad is None for p in model.parameters())


def test_only_ddp_without_unused_detection_needs_every_parameter() -> None:
    assert not needs_every_parameter(models.mlp())
