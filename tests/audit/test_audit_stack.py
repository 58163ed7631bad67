"""``gradaccum audit`` and ``audit_stack`` on the bundled tiny GPT (uneven token counts per
micro-batch), against an independent float64 computation written here.

The independent figures: the full batch's gradient is the summed token cross-entropy over the
window divided once by N; the hand loop's and Accelerate's documented recipes both accumulate
``mean_j / k`` (Accelerate divides the loss by ``gradient_accumulation_steps``), so their update
error is relL2(sum_j grad(mean_j) / k, full batch), computed here with ``F.cross_entropy`` directly.
The same arithmetic in float64, a different order of a few additions: the figures agree to ~1e-15
relative, bound 1e-9. gradaccum's Accumulator divides each summed loss by the same N: its error is
float64 rounding, bound 1e-10 (the gradients' terms are O(1), 16 digits).

DeepSpeed's rows run in float32 (its engine reduces no float64 gradient): the float32 weights and
sums put ~1e-7 of the update into its gradient (1.2e-7 measured for prepare_accumulator). Its own
row is compared with the mean of means within 1e-5 absolute, and prepare_accumulator's error is
bounded by 1e-5: each a margin of ~80 over the rounding, and four orders below the 0.25 the
weighting costs.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from gradaccum.audit.measure import state_fingerprint
from gradaccum.audit.recipes import audit_stack
from gradaccum.batch import cast, split
from gradaccum.cli.main import main
from gradaccum.examples import build_tiny_gpt, tiny_gpt
from tests.helpers.torch_extensions import kept_extensions

MICRO = 2
DEEPSPEED_LOOP = "engine.backward, gradient_accumulation_steps=k"
DEEPSPEED_EXACT = "prepare_accumulator(engine).step"
FLOAT32_BOUND = 1e-5


@pytest.fixture(scope="module", autouse=True)
def _extensions_kept() -> Iterator[None]:
    yield from kept_extensions()  # DeepSpeed's child process builds or loads its op there


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]


def _independent() -> dict[str, float]:
    """The mean-of-means error, on a fresh float64 model without dropout."""
    model = build_tiny_gpt(0, dtype=torch.float64)
    micro = split(cast(tiny_gpt().batch(0), torch.float64), MICRO)

    def summed(mb: dict[str, Any]) -> tuple[torch.Tensor, int]:
        logits = model(mb["input_ids"])
        labels = mb["labels"]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum")
        return loss, int(labels.ne(-100).sum())

    n = sum(summed(mb)[1] for mb in micro)
    model.zero_grad()
    for mb in micro:
        loss, _ = summed(mb)
        (loss / n).backward()
    full = _grads(model)
    model.zero_grad()
    for mb in micro:
        loss, count = summed(mb)
        (loss / count / len(micro)).backward()
    mean = _grads(model)
    num = sum(float((a - b).pow(2).sum()) for a, b in zip(mean, full, strict=True))
    den = sum(float(b.pow(2).sum()) for b in full)
    return {"mean_of_means": (num / den) ** 0.5}


@pytest.fixture(scope="module")
def independent() -> dict[str, float]:
    return _independent()


def test_command_prints_every_recipe_and_writes_json_and_markdown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], independent: dict[str, float]
) -> None:
    code = main(["audit", "--workload", "gradaccum.examples:tiny_gpt", "--out", str(tmp_path / "a")])
    out, _ = capsys.readouterr()
    assert code == 0
    for name in ("hand-written loop", "Accelerator.accumulate()", "Trainer(accumulate_grad_batches=k)"):
        assert name in out
    assert "Accumulator.step" in out and DEEPSPEED_LOOP in out and DEEPSPEED_EXACT in out
    assert "update error" in out  # the progress line of each recipe
    data = json.loads((tmp_path / "a" / "audit.json").read_text())
    rows = {row["recipe"]: row for row in data["rows"]}
    assert rows["Accumulator.step"]["error"] <= 1e-10
    want = independent["mean_of_means"]
    assert want > 0.1  # uneven counts: the mean of means is far off here, not a vacuous comparison
    for name in ("hand-written loop: (loss / k).backward()", "Accelerator.accumulate()"):
        assert rows[name]["status"] == "measured"
        assert abs(rows[name]["error"] - want) <= 1e-9 * want, (name, rows[name]["error"], want)
        assert "weighs micro-batch tokens unequally" in rows[name]["cause"]
    # Lightning divides the mean by accumulate_grad_batches: the same weighting
    assert abs(rows["Trainer(accumulate_grad_batches=k)"]["error"] - want) <= 1e-9 * want
    if importlib.util.find_spec("deepspeed") is not None:  # engine.backward divides by k likewise
        assert rows[DEEPSPEED_LOOP]["status"] == "measured", rows[DEEPSPEED_LOOP]["cause"]
        assert abs(rows[DEEPSPEED_LOOP]["error"] - want) <= FLOAT32_BOUND, rows[DEEPSPEED_LOOP]["error"]
        assert "weighs micro-batch tokens unequally" in rows[DEEPSPEED_LOOP]["cause"]
        assert 0 < rows[DEEPSPEED_EXACT]["error"] <= FLOAT32_BOUND  # float32, and exact
        assert "float32 rounding" in rows[DEEPSPEED_EXACT]["cause"]
    markdown = (tmp_path / "a" / "audit.md").read_text()
    assert "| Accelerator.accumulate() | accelerate" in markdown
    assert f"{rows['Accumulator.step']['error']:.2e}" in markdown


def test_model_random_state_and_dropout_left_as_found(independent: dict[str, float]) -> None:
    model = build_tiny_gpt(0, dropout=0.1)  # float32, in train mode, with dropout: audited without it
    before = state_fingerprint(model)
    rng = torch.get_rng_state()
    result = audit_stack(
        model, tiny_gpt().batch(0), tiny_gpt().loss_fn, tiny_gpt().count_fn, micro_batch=MICRO
    )
    after = state_fingerprint(model)
    assert [n for n, _ in before] == [n for n, _ in after]
    assert all(
        (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
        for (_, a), (_, b) in zip(before, after, strict=True)
    )
    assert model.training and next(p.dtype for p in model.parameters()) == torch.float32
    assert all(m.p == 0.1 for m in model.modules() if isinstance(m, torch.nn.Dropout))
    assert torch.equal(torch.get_rng_state(), rng)
    # DeepSpeed ran in a child process: no process group, no LOCAL_RANK left here
    assert not torch.distributed.is_initialized() and "LOCAL_RANK" not in os.environ
    rows = {row.recipe: row for row in result.rows}
    # with dropout on, the figures would not match the dropout-free independent ones
    want = independent["mean_of_means"]
    assert abs(rows["Accelerator.accumulate()"].error - want) <= 1e-9 * want
    assert rows["Accumulator.step"].error <= 1e-10


def test_frameworks_not_installed_are_listed_as_such(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from gradaccum.audit import recipes

    real = importlib.util.find_spec
    missing = {"accelerate", "lightning", "pytorch_lightning", "deepspeed"}
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in missing else real(name, *a)
    )
    workload = tiny_gpt()
    result = recipes.audit_stack(
        build_tiny_gpt(0), workload.batch(0), workload.loss_fn, workload.count_fn, micro_batch=MICRO
    )
    rows = {row.framework: row for row in result.rows}
    for framework in ("accelerate", "lightning", "deepspeed"):
        assert rows[framework].status == "not installed" and rows[framework].error is None
        assert "not installed" in rows[framework].cause
    assert rows["gradaccum"].status == "measured" and rows["gradaccum"].error is not None
    assert rows["gradaccum"].error <= 1e-10


def test_a_micro_batch_that_does_not_divide_the_batch_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["audit", "--micro-batch", "3", "--out", str(tmp_path / "a")])
    out, err = capsys.readouterr()
    assert code == 2
    assert "--micro-batch 3 does not divide the batch of 8" in out + err
    assert not (tmp_path / "a").exists()


def test_deepspeed_rows_say_why_when_the_window_cannot_reach_their_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where CUDA is initialized the DeepSpeed rows run in a spawned process, which the model and
    functions must pickle to reach: a closure cannot, and both rows say so instead of failing."""
    from gradaccum.audit import deepspeed

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    workload = tiny_gpt()
    micro = split(cast(workload.batch(0), torch.float64), MICRO)
    got = deepspeed.deepspeed_gradients(
        build_tiny_gpt(0, dtype=torch.float64),
        micro,
        lambda m, mb: workload.loss_fn(m, mb),
        workload.count_fn,
    )
    assert set(got) == {"loop", "exact"}
    for why in got.values():
        assert isinstance(why, deepspeed.NotRun) and "must pickle" in str(why)


def test_an_accelerator_already_in_the_process_neither_skews_the_row_nor_loses_its_state(
    independent: dict[str, float],
) -> None:
    """Accelerate's state is process-wide: an Accelerator built earlier (here with k = 3 and
    sync_each_batch) must not change how the audit's Accelerator accumulates, and keeps its own."""
    from accelerate import Accelerator
    from accelerate.state import GradientState
    from accelerate.utils import GradientAccumulationPlugin

    plugin = GradientAccumulationPlugin(num_steps=3, sync_each_batch=True)
    Accelerator(cpu=True, gradient_accumulation_plugin=plugin)
    try:
        workload = tiny_gpt()
        result = audit_stack(
            build_tiny_gpt(0), workload.batch(0), workload.loss_fn, workload.count_fn, micro_batch=MICRO
        )
        rows = {row.recipe: row for row in result.rows}
        want = independent["mean_of_means"]
        assert abs(rows["Accelerator.accumulate()"].error - want) <= 1e-9 * want
        state = GradientState()
        assert state.num_steps == 3 and state.plugin_kwargs.get("sync_each_batch") is True
    finally:
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(True)
        GradientState._reset_state()
