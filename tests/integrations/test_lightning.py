"""Lightning: ``window_step`` in the Trainer over an epoch whose last window is short (one process
and two), and ``Accumulator`` on what ``fabric.setup`` returns (two gloo processes).

References are computed here on one process: one SGD step per window on the mean token loss of the
examples every rank held in it. Every loss is summed cross-entropy in float64, so the exact runs
match to rounding (~1e-16; asserted below 1e-12). The controls (Lightning's
``accumulate_grad_batches``, a Fabric loop without ``no_backward_sync``) are off by more than 1e-2 or
are named by the guard.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch

import gradaccum
from gradaccum.integrations.lightning import window_step
from tests.helpers.launcher import run_ranks, values
from tests.integrations import common

pytestmark = [
    # Lightning 2.6 on torch 2.13 builds a deprecated pytree LeafSpec for every dataloader
    pytest.mark.filterwarnings(r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated:FutureWarning"),
    # "does not have many workers" and similar advice about these deliberately tiny loaders
    pytest.mark.filterwarnings("ignore::lightning.fabric.utilities.warnings.PossibleUserWarning"),
]

M, K = 2, 2  # micro-batch, micro-batches per window
EXAMPLES = 10  # windows of 4, 4 and 2 examples: the last one is short
count_fn = gradaccum.count_tokens("labels", shift=False)


def loss_fn(module: Any, mb: dict[str, Any]) -> torch.Tensor:
    return gradaccum.summed_cross_entropy(module.net(mb["input_ids"]), mb["labels"], shift=False)


class ExactLM(pl.LightningModule):
    """The documented pattern: manual optimization, one DataLoader batch = one window."""

    def __init__(self, examples: int, shard: tuple[int, int] = (0, 1)) -> None:
        super().__init__()
        self.net = common.TinyLM()
        self.automatic_optimization = False
        self.examples = examples
        self.shard = shard  # (rank, world): examples rank, rank + world, ...
        self.results: list[gradaccum.StepResult] = []

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self.results.append(window_step(self, gradaccum.split(batch, micro_batch=M), loss_fn, count_fn))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=common.LR)

    def train_dataloader(self) -> Any:
        rank, world = self.shard
        data = common.sequences(self.examples)[rank::world]
        return torch.utils.data.DataLoader(data, batch_size=M * K, collate_fn=common.collate_aligned)


class FaultyLM(ExactLM):
    """Window ``FAULTY`` goes wrong on rank 1 only: a NaN loss, or a finite loss with a NaN gradient."""

    def __init__(self, examples: int, shard: tuple[int, int], fault: str) -> None:
        super().__init__(examples, shard)
        self.fault = fault

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        faulty = batch_idx == FAULTY and self.shard[0] == 1
        handle = None
        if faulty and self.fault == "gradient":
            # the hook runs before DDP's reducer, so the NaN reaches both ranks' averaged gradient
            handle = self.net.mix.weight.register_hook(lambda grad: grad * float("nan"))

        def faulty_loss(module: Any, mb: dict[str, Any]) -> torch.Tensor:
            loss = loss_fn(module, mb)
            return loss * float("nan") if faulty and self.fault == "loss" else loss

        try:
            micro_batches = gradaccum.split(batch, micro_batch=M)
            self.results.append(window_step(self, micro_batches, faulty_loss, count_fn))
        finally:
            if handle is not None:
                handle.remove()


FAULTY = 1
"""The window (DataLoader batch index) that FaultyLM spoils on rank 1."""


class PlainLM(ExactLM):
    """The control: automatic optimization with accumulate_grad_batches=K over micro-batches."""

    def __init__(self, examples: int) -> None:
        super().__init__(examples)
        self.automatic_optimization = True

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        return loss_fn(self, batch) / count_fn(batch)

    def train_dataloader(self) -> Any:
        data = common.sequences(self.examples)
        return torch.utils.data.DataLoader(data, batch_size=M, collate_fn=common.collate_aligned)


def fit(module: pl.LightningModule, **trainer_args: Any) -> pl.Trainer:
    settings: dict[str, Any] = {
        "max_epochs": 1,
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    settings.update(trainer_args)
    trainer = pl.Trainer(**settings)
    trainer.fit(module)
    return trainer


def reference(windows: list[list[int]]) -> tuple[common.Params, common.Params]:
    """One SGD step per window (example indices), on the window's token-mean loss."""
    data = common.sequences(max(i for w in windows for i in w) + 1)
    model = common.TinyLM()
    start = common.params(model)
    for window in windows:
        batch = common.collate_aligned([data[i] for i in window])
        want = common.sgd_reference(model, batch, common.aligned_mean_loss)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(want[name])
    return common.params(model), start


def test_trainer_epoch_with_a_short_last_window() -> None:
    want, start = reference([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]])
    module = ExactLM(EXAMPLES)
    trainer = fit(module)
    assert [(r.micro_batches, r.applied) for r in module.results] == [(2, True), (2, True), (1, True)]
    assert trainer.global_step == 3
    assert common.update_error(common.params(module.net), want, start) < 1e-12
    control = PlainLM(EXAMPLES)
    fit(control, accumulate_grad_batches=K)
    assert common.update_error(common.params(control.net), want, start) > 1e-2


def test_window_step_refuses_automatic_optimization() -> None:
    module = ExactLM(4)
    module.automatic_optimization = True  # forgotten: Lightning would step a second time
    with pytest.raises(gradaccum.ConfigError, match="automatic_optimization = False"):
        fit(module)


# -- two processes: the Trainer under DDP, and Fabric ----------------------------------------------

BOUNDS, SIZES = [0, 5, 8], {0: [2, 2, 1], 1: [2, 1]}  # Fabric: uneven examples and micro-batch counts


def _fabric_window(rank: int) -> list[dict[str, torch.Tensor]]:
    batch = common.collate_aligned(common.sequences(BOUNDS[-1]))
    mine = {k: v[BOUNDS[rank] : BOUNDS[rank + 1]] for k, v in batch.items()}
    return gradaccum.split(mine, sizes=SIZES[rank])


def _fabric_loss(model: Any, mb: dict[str, Any]) -> torch.Tensor:
    return gradaccum.summed_cross_entropy(model(mb["input_ids"]), mb["labels"], shift=False)


def _rank(rank: int, world: int) -> dict[str, Any]:
    import lightning as L

    from gradaccum.distributed.comm import count_allreduces
    from gradaccum.distributed.sync import sync_module

    common.distributed_env(rank, world)
    out: dict[str, Any] = {}
    # the Lightning Trainer under DDP: 20 examples, windows of 8, 8 and 4 (4, 4, 2 per rank); each
    # rank's loader holds its own shard, so the reference knows which examples met in a window
    module = ExactLM(2 * EXAMPLES, shard=(rank, world))
    fit(module, devices=world, strategy="ddp", use_distributed_sampler=False)
    out["trainer"] = common.params(module.net)
    out["trainer windows"] = [(r.micro_batches, r.local_count, r.global_count) for r in module.results]
    for fault in ("loss", "gradient"):
        faulty = FaultyLM(2 * EXAMPLES, shard=(rank, world), fault=fault)
        fit(faulty, devices=world, strategy="ddp", use_distributed_sampler=False)
        out[f"{fault} fault"] = common.params(faulty.net)
        out[f"{fault} fault windows"] = [(r.applied, r.skip_reason or "") for r in faulty.results]

    # "32-true" leaves the float64 module and its outputs alone ("64-true" casts outputs back to the
    # default float32 after the forward, which would put float32 logits into the loss)
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy="ddp", precision="32-true")
    fabric.launch()  # the processes exist already: this only sets Fabric up in each
    net = common.TinyLM()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=common.LR))
    acc = gradaccum.Accumulator(model, optimizer)
    ddp = sync_module(model)
    reduces = count_allreduces(ddp)
    window = _fabric_window(rank)
    out["fabric kind"], out["fabric inner"] = acc.kind, type(ddp).__name__
    out["fabric reduces"] = []
    for _ in range(2):
        before = reduces.calls
        result = acc.step(window, _fabric_loss, count_fn)
        out["fabric reduces"].append(reduces.calls - before)
    out["fabric"] = common.params(model.module)
    out["fabric tokens"] = result.local_count

    # the guard around hand-written Fabric loops, with no_backward_sync and without (two
    # micro-batches on each rank: synchronizing every backward needs equal counts)
    pair = window[:2]
    for deferred in (True, False):
        with gradaccum.guard(model, optimizer, accum_steps=2, mode="warn", inspect_loss=False) as g:
            optimizer.zero_grad()
            for i, mb in enumerate(pair):
                with fabric.no_backward_sync(model, enabled=deferred and i == 0):
                    fabric.backward(_fabric_loss(model, mb) / 100)
            optimizer.step()
        out[f"guard deferred={deferred}"] = (sorted({f.code for f in g.findings}), g.synced_backward_passes)
        out[f"guard files {deferred}"] = sorted({f.filename.rsplit("/", 1)[-1] for f in g.findings})
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return values(run_ranks(_rank, world=2, timeout_s=240))


@pytest.mark.distributed
def test_trainer_under_ddp_with_a_short_last_window(ranks: list[dict[str, Any]]) -> None:
    want, start = reference([list(range(8)), list(range(8, 16)), list(range(16, 20))])
    windows = [r["trainer windows"] for r in ranks]
    assert [[k for k, _, _ in w] for w in windows] == [[2, 2, 1]] * 2
    assert windows[0][0][1] != windows[1][0][1] and windows[0][0][2] == windows[1][0][2]
    for r in ranks:
        assert common.update_error(r["trainer"], want, start) < 1e-12


@pytest.mark.distributed
@pytest.mark.parametrize("fault", ["loss", "gradient"])
def test_trainer_skips_a_window_on_both_ranks_when_one_ranks_loss_or_gradient_is_not_finite(
    ranks: list[dict[str, Any]], fault: str
) -> None:
    # window 1 is skipped on both ranks (gradients cleared, no step): the update is windows 0 and 2
    want, start = reference([list(range(8)), list(range(16, 20))])
    for r in ranks:
        applied = [a for a, _ in r[f"{fault} fault windows"]]
        assert applied == [True, False, True]
        assert "non-finite" in r[f"{fault} fault windows"][FAULTY][1]
        assert all(torch.isfinite(p).all() for p in r[f"{fault} fault"].values())
        assert common.update_error(r[f"{fault} fault"], want, start) < 1e-12


def fabric_reference() -> tuple[common.Params, common.Params]:
    """Two full-batch SGD steps on the 8 examples both ranks held, and the start."""
    return reference([list(range(BOUNDS[-1]))] * 2)


@pytest.mark.distributed
def test_fabric_setup_objects_give_the_full_batch_update(ranks: list[dict[str, Any]]) -> None:
    want, start = fabric_reference()
    assert ranks[0]["fabric tokens"] != ranks[1]["fabric tokens"]
    for r in ranks:
        assert (r["fabric kind"], r["fabric inner"]) == ("ddp", "DistributedDataParallel")
        assert common.update_error(r["fabric"], want, start) < 1e-12
        assert r["fabric reduces"] == [1, 1]  # one gradient all-reduce per update (one bucket)


@pytest.mark.distributed
def test_the_guard_counts_syncs_through_fabrics_wrapper(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["guard deferred=True"] == ([], 1)
        assert r["guard deferred=False"] == (["sync-per-micro-batch"], 2)
        assert r["guard files False"] == ["test_lightning.py"]  # the user's line, not Fabric's
