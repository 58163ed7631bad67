"""``prepare_accumulator`` on what ``accelerator.prepare`` returns, two gloo processes, uneven tokens.

One spawn runs everything a rank does: three exact updates through the prepared model, optimizer,
scheduler and dataloader; then, as the control, Accelerate's documented ``accumulate()`` loop on the
same data under ``gradaccum.guard``. The reference is computed here on one process: three SGD
updates, each on the mean token loss of the 16 examples both ranks held in that window, at the
learning rate the schedule gives that update (0.1 x 0.5^u). The exact loss is summed cross-entropy
in float64, so the updates match to rounding (~1e-16; asserted below 1e-12); the control is off by
more than 1e-2 (a mean of means, and a schedule that runs twice as fast).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import gradaccum
from gradaccum.errors import ConfigError
from tests.helpers.launcher import run_ranks, values
from tests.integrations import common

K, M, UPDATES, WORLD = 4, 2, 3, 2
EXAMPLES = K * M * WORLD * UPDATES


def _decay(update: int) -> float:
    return 0.5**update


def loss_fn(model: torch.nn.Module, mb: dict[str, Any]) -> torch.Tensor:
    logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits
    return gradaccum.summed_cross_entropy(logits, mb["labels"], shift=True)


count_fn = gradaccum.count_tokens("labels", shift=True)


def _prepared(accelerator: Any) -> tuple[Any, ...]:
    model = common.gpt2()
    optimizer = torch.optim.SGD(model.parameters(), lr=common.LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _decay)
    loader = torch.utils.data.DataLoader(common.sequences(EXAMPLES), batch_size=M, collate_fn=common.collate)
    return accelerator.prepare(model, optimizer, scheduler, loader)


def _rank(rank: int, world: int) -> dict[str, Any]:
    from accelerate import Accelerator

    from gradaccum.distributed.comm import count_allreduces
    from gradaccum.integrations.accelerate import prepare_accumulator

    common.distributed_env(rank, world)
    accelerator = Accelerator(cpu=True)
    model, optimizer, scheduler, loader = _prepared(accelerator)
    acc = prepare_accumulator(accelerator, model, optimizer, scheduler)
    reduces = count_allreduces(model)
    out: dict[str, Any] = {"type": accelerator.distributed_type.value, "kind": acc.kind, "tokens": []}
    for window in gradaccum.windows(loader, accum_steps=K):
        before = reduces.calls
        result = acc.step(window, loss_fn, count_fn)
        out["tokens"].append(result.local_count)
        out.setdefault("reduces", []).append(reduces.calls - before)
    out["exact"] = common.params(accelerator.unwrap_model(model))
    out["exact last_epoch"] = scheduler.scheduler.last_epoch
    out["updates"] = acc.steps_applied

    # the control: Accelerate's accumulate() as its documentation shows, watched by the guard
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=K)
    model, optimizer, scheduler, loader = _prepared(accelerator)
    try:
        prepare_accumulator(accelerator, model, optimizer)
    except ConfigError as exc:
        out["refusal"] = str(exc)
    with gradaccum.guard(model, optimizer, accum_steps=K, scheduler=scheduler, mode="warn") as g:
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
    out["control"] = common.params(accelerator.unwrap_model(model))
    out["control last_epoch"] = scheduler.scheduler.last_epoch
    out["guard"] = sorted({f.code for f in g.findings})
    out["guard files"] = sorted({f.filename.rsplit("/", 1)[-1] for f in g.findings})
    out["guard windows"] = g.windows
    out["guard synced"] = g.synced_backward_passes
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return values(run_ranks(_rank, world=WORLD, timeout_s=240))


def reference_updates() -> tuple[common.Params, common.Params]:
    """The parameters after the three full-batch updates, and before them."""
    data = common.sequences(EXAMPLES)
    model = common.gpt2()
    start = common.params(model)
    per_update = K * M * WORLD
    for u in range(UPDATES):
        batch = common.collate(data[u * per_update : (u + 1) * per_update])
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model, batch) / count_fn(batch)
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= common.LR * _decay(u) * p.grad
    return common.params(model), start


@pytest.fixture(scope="module")
def reference() -> tuple[common.Params, common.Params]:
    return reference_updates()


pytestmark = pytest.mark.distributed


def test_prepared_objects_give_the_full_batch_updates(ranks: list[dict[str, Any]], reference: Any) -> None:
    want, start = reference
    assert [r["type"] for r in ranks] == ["MULTI_CPU"] * WORLD and ranks[0]["kind"] == "ddp"
    tokens = [r["tokens"] for r in ranks]
    assert all(a != b for a, b in zip(*tokens, strict=True))  # uneven token counts in every window
    for r in ranks:
        assert common.update_error(r["exact"], want, start) < 1e-12


def test_the_scheduler_steps_once_per_update_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    assert [(r["updates"], r["exact last_epoch"]) for r in ranks] == [(UPDATES, UPDATES)] * WORLD
    # Accelerate's AcceleratedScheduler steps the scheduler once per process (Accelerate #2926)
    assert [r["control last_epoch"] for r in ranks] == [UPDATES * WORLD] * WORLD


def test_one_gradient_all_reduce_per_update(ranks: list[dict[str, Any]]) -> None:
    assert [r["reduces"] for r in ranks] == [[1] * UPDATES] * WORLD  # the tiny GPT-2 fits one bucket


def test_accelerates_accumulate_differs_and_the_guard_names_why(
    ranks: list[dict[str, Any]], reference: Any
) -> None:
    want, start = reference
    for r in ranks:
        assert common.update_error(r["control"], want, start) > 1e-2
        assert r["guard"] == ["mean-of-means", "scheduler-mid-window"]
        assert r["guard files"] == ["test_accelerate.py"]  # the user's line, not Accelerate's
        assert r["guard windows"] == UPDATES and r["guard synced"] == UPDATES  # no_sync seen through


def test_accelerate_accumulation_steps_are_refused(ranks: list[dict[str, Any]]) -> None:
    assert "gradient_accumulation_steps=4" in ranks[0]["refusal"]


def _bf16(rank: int, world: int) -> dict[str, Any]:
    from accelerate import Accelerator

    from gradaccum.integrations.accelerate import prepare_accumulator

    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    model = common.gpt2().float()  # autocast lowers float32 (never float64) inputs
    optimizer = torch.optim.SGD(model.parameters(), lr=common.LR)
    loader = torch.utils.data.DataLoader(common.sequences(K * M), batch_size=M, collate_fn=common.collate)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    seen: list[torch.dtype] = []
    head = accelerator.unwrap_model(model).lm_head
    head.register_forward_hook(lambda module, args, output: seen.append(output.dtype))
    acc = prepare_accumulator(accelerator, model, optimizer)
    result = acc.step(list(loader), loss_fn, count_fn)
    return {
        "dtypes": sorted({str(d) for d in seen}),
        "applied": result.applied,
        "params": common.params(model),
    }


def test_accelerates_mixed_precision_stays_in_the_forward() -> None:
    # bfloat16 keeps 8 significant bits (one ulp is 3.9e-3 relative); the update of a one-layer
    # GPT-2 through bf16 matmuls stays within a few ulps of the float32 one (measured 3.4e-3),
    # while a loss weighted by a wrong factor (k = 4) would move it by 3
    (out,) = values(run_ranks(_bf16, world=1, timeout_s=120))
    assert out["dtypes"] == ["torch.bfloat16"] and out["applied"]
    model = common.gpt2().float()
    start = common.params(model)
    batch = common.collate(common.sequences(K * M))
    want = common.sgd_reference(model, batch, common.causal_mean_loss)
    assert common.update_error(out["params"], want, start) < 3e-2


def test_an_accelerated_scheduler_given_to_the_accumulator_is_refused_naming_prepare_accumulator() -> None:
    from accelerate.scheduler import AcceleratedScheduler

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    plain = torch.optim.lr_scheduler.LambdaLR(optimizer, _decay)
    wrapped = AcceleratedScheduler(plain, optimizer, step_with_optimizer=True, split_batches=False)
    with pytest.raises(ConfigError, match="prepare_accumulator") as refused:
        gradaccum.Accumulator(model, optimizer, scheduler=wrapped)
    assert "AcceleratedScheduler (wrapping LambdaLR)" in str(refused.value)
    assert "scheduler=scheduler.scheduler" in str(refused.value)
    assert gradaccum.Accumulator(model, optimizer, scheduler=plain).scheduler is plain
