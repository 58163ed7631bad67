"""``prepare_accumulator`` on DeepSpeed engines, ZeRO stages 0-3, two gloo processes, uneven tokens.

One spawn of two ranks runs everything (DeepSpeed's first engine JIT-builds a small communication
op once per process; further engines are built in seconds). For each stage a rank builds one
float32 engine (SGD lr 0.1, ``gradient_accumulation_steps=4``, no clipping, a constant LR
schedule) from the same GPT-2 weights and steps three windows through it:

A. 4 micro-batches of 2 sequences of uneven lengths per rank (16 sequences in all);
B. 3 micro-batches per rank on the engine configured for 4 (12 sequences);
C. a window whose loss is NaN on rank 1 only: skipped on both ranks.

The reference is one float64 process from the same float32-rounded weights: SGD on the token-mean
loss of all of A's sequences in one batch, then of all of B's. Tolerance 2e-5 on the update's
relative L2 error |got - want| / |want - start|: the engines hold their parameters in float32, and
storing a parameter near 1 (the layer norms) after an update of ~1e-2 rounds it by up to 6e-8, a
few 1e-6 of the update (3.1e-6 measured at every stage); the float32 sums of ~90 tokens' gradients
add less. 2e-5 leaves a margin of six, and is four orders below DeepSpeed's own division (0.29 on
these windows, measured here on a stage-0 engine as the control).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import gradaccum
from tests.helpers.launcher import run_ranks, values
from tests.helpers.torch_extensions import kept_extensions
from tests.integrations import common

STAGES = (0, 1, 2, 3)
WORLD, M, K, SHORT = 2, 2, 4, 3
TOLERANCE = 2e-5

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs gradaccum[deepspeed]"),
]


@pytest.fixture(scope="module", autouse=True)
def _extensions_kept() -> Iterator[None]:
    # every rank these tests spawn, and the example's torchrun, inherit it
    yield from kept_extensions()


def loss_fn(model: Any, mb: dict[str, Any]) -> torch.Tensor:
    logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits
    return gradaccum.summed_cross_entropy(logits, mb["labels"], shift=True)


count_fn = gradaccum.count_tokens("labels", shift=True)


def _data() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A's 16 and B's 12 examples (both ranks'), in rank order."""
    examples = common.sequences(WORLD * M * (K + SHORT))
    return examples[: WORLD * M * K], examples[WORLD * M * K :]


def _window(examples: list[dict[str, Any]], rank: int, k: int) -> list[dict[str, torch.Tensor]]:
    mine = examples[rank * M * k : (rank + 1) * M * k]
    return [common.collate(mine[i * M : (i + 1) * M]) for i in range(k)]


def _engine(stage: int, model: torch.nn.Module) -> Any:
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": M,
        "gradient_accumulation_steps": K,
        "gradient_clipping": 0.0,  # DeepSpeed 0.19.8 clips at 1.0 by default
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    optimizer = torch.optim.SGD(model.parameters(), lr=common.LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)
    return engine


def _full_params(engine: Any) -> dict[str, torch.Tensor]:
    """Every parameter in full on this rank (ZeRO-3 gathers its partitions for the read)."""
    import deepspeed

    named = list(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in named]):
        return {n: p.detach().to(torch.float64).clone() for n, p in named}


def _poisoned(rank: int) -> Any:
    def loss(model: Any, mb: dict[str, Any]) -> torch.Tensor:
        value = loss_fn(model, mb)
        return value * float("nan") if rank == 1 else value

    return loss


def _stage(rank: int, stage: int) -> dict[str, Any]:
    from gradaccum.errors import ConfigError, LossError, WindowError
    from gradaccum.integrations.deepspeed import prepare_accumulator

    a, b = _data()
    engine = _engine(stage, common.gpt2().float())
    out: dict[str, Any] = {"stage": engine.zero_optimization_stage()}
    try:
        prepare_accumulator(engine, config=gradaccum.AccumConfig(max_grad_norm=1.0))
    except ConfigError as exc:
        out["clip refusal"] = str(exc)
    acc = prepare_accumulator(engine)
    steps = [int(engine.global_steps)]
    results = []
    for examples, k, fn in ((a, K, loss_fn), (b, SHORT, loss_fn), (a, K, _poisoned(rank))):
        results.append(acc.step(_window(examples, rank, k), fn, count_fn))
        steps.append(int(engine.global_steps))
        out[f"params {len(results)}"] = _full_params(engine)
    try:  # rank 0 holds 2 micro-batches, rank 1 one: refused on both before any forward
        acc.step(_window(a, rank, 2 - rank), loss_fn, count_fn)
    except WindowError as exc:
        out["uneven refusal"] = str(exc)
    out["after refusal"] = int(engine.global_steps)
    try:  # a mean passed as a sum: refused on both ranks before the first backward, nothing stepped
        prepare_accumulator(engine).step(
            _window(a, rank, K), lambda m, mb: loss_fn(m, mb) / count_fn(mb), count_fn
        )
    except LossError as exc:
        out["mean refusal"] = str(exc)
    out["after mean refusal"] = int(engine.global_steps)
    out["results"] = [(r.applied, r.micro_batches, r.global_count, r.local_count) for r in results]
    out["global_steps"] = steps
    out["skipped_steps"] = int(engine.skipped_steps)
    out["scheduler"] = int(engine.lr_scheduler.last_epoch)
    return out


def _deepspeeds_own(rank: int) -> dict[str, torch.Tensor]:
    """DeepSpeed's documented loop on window A: engine.backward of each micro-batch's mean loss
    (divided by gradient_accumulation_steps inside), engine.step() after each."""
    engine = _engine(0, common.gpt2().float())
    for mb in _window(_data()[0], rank, K):
        loss = loss_fn(engine, mb) / count_fn(mb)
        engine.backward(loss)
        engine.step()
    return _full_params(engine)


def _rank(rank: int, world: int) -> dict[str, Any]:
    os.environ["DS_ACCELERATOR"] = "cpu"  # this spawned process only
    common.distributed_env(rank, world)
    return {"stages": [_stage(rank, stage) for stage in STAGES], "control": _deepspeeds_own(rank)}


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return values(run_ranks(_rank, world=WORLD, timeout_s=300, pg_timeout_s=120))


def reference_states() -> list[dict[str, torch.Tensor]]:
    """The float64 parameters at the start, after A's full batch, after B's full batch."""
    model = common.gpt2().float().double()  # the engines' float32 start, exactly
    states = [common.params(model)]
    for examples in _data():
        batch = common.collate(examples)
        model.zero_grad(set_to_none=True)
        (loss_fn(model, batch) / count_fn(batch)).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= common.LR * p.grad
        states.append(common.params(model))
    return states


@pytest.fixture(scope="module")
def reference() -> list[dict[str, torch.Tensor]]:
    return reference_states()


def _errors(ranks: list[dict[str, Any]], reference: list[Any], window: int) -> list[list[float]]:
    start, want = reference[window - 1], reference[window]
    return [[common.update_error(s[f"params {window}"], want, start) for s in r["stages"]] for r in ranks]


def test_every_zero_stage_gives_the_full_batch_update(ranks: list[dict[str, Any]], reference: Any) -> None:
    assert [s["stage"] for s in ranks[0]["stages"]] == list(STAGES)
    tokens = {r["stages"][0]["results"][0][3] for r in ranks}
    assert len(tokens) == WORLD  # the ranks hold different numbers of tokens
    errors = _errors(ranks, reference, 1)
    assert max(max(e) for e in errors) < TOLERANCE, errors


def test_deepspeeds_own_division_is_far_off(ranks: list[dict[str, Any]], reference: Any) -> None:
    error = common.update_error(ranks[0]["control"], reference[1], reference[0])
    assert error > 0.1, error  # 0.29 measured: a mean of per-micro-batch means


def test_the_ranks_hold_identical_parameters(ranks: list[dict[str, Any]]) -> None:
    for window in (1, 2, 3):
        for mine, theirs in zip(ranks[0]["stages"], ranks[1]["stages"], strict=True):
            for name, value in mine[f"params {window}"].items():
                assert torch.equal(value, theirs[f"params {window}"][name]), (mine["stage"], window, name)


def test_one_optimizer_step_and_one_scheduler_step_per_applied_window(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        for s in r["stages"]:
            assert s["global_steps"][:3] == [0, 1, 2], s["stage"]
            assert s["scheduler"] == 2, s["stage"]  # the skipped window C did not move it


def test_a_window_of_three_on_an_engine_for_four_is_exact(
    ranks: list[dict[str, Any]], reference: Any
) -> None:
    assert all(s["results"][1][:2] == (True, SHORT) for r in ranks for s in r["stages"])
    errors = _errors(ranks, reference, 2)
    assert max(max(e) for e in errors) < TOLERANCE, errors


def test_a_non_finite_window_on_one_rank_is_skipped_on_both(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        for s in r["stages"]:
            assert s["results"][2][0] is False, s["stage"]
            for name, value in s["params 3"].items():
                assert torch.equal(value, s["params 2"][name]), (s["stage"], name)
    # stages 1-3: ZeRO's own step found the global norm non-finite and discarded its partitions
    assert [s["skipped_steps"] for s in ranks[0]["stages"]] == [0, 1, 1, 1]


def test_windows_of_unequal_lengths_are_refused_on_both_ranks(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        for s in r["stages"]:
            assert "different numbers of micro-batches" in s["uneven refusal"], s["stage"]
            assert s["after refusal"] == s["global_steps"][-1]  # nothing stepped


def test_a_mean_reduced_loss_is_refused_on_both_ranks(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        for s in r["stages"]:
            assert s["mean refusal"].startswith("loss_fn returned a mean-reduced loss for micro-batch 0"), s[
                "stage"
            ]
            assert "a sum divided by" in s["mean refusal"] and "loss_reduction='mean'" in s["mean refusal"]
            assert s["after mean refusal"] == s["global_steps"][-1]  # nothing stepped


def test_gradaccum_clipping_is_refused_naming_deepspeeds(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        for s in r["stages"]:
            assert "gradient_clipping" in s["clip refusal"]


# -- the Hugging Face Trainer with a DeepSpeed config ---------------------------------------------


def _trainer_rank(rank: int, world: int, out: str) -> dict[str, Any]:
    import deepspeed
    from accelerate.state import AcceleratorState
    from transformers import Trainer

    from gradaccum.errors import ConfigError
    from gradaccum.integrations.transformers import ExactTrainer
    from tests.integrations.test_transformers import training_args

    os.environ["DS_ACCELERATOR"] = "cpu"  # this spawned process only
    common.distributed_env(rank, world)
    data = common.sequences(WORLD * M * K)
    result: dict[str, Any] = {}
    for name, cls, stage in (
        ("exact 2", ExactTrainer, 2),
        ("exact 3", ExactTrainer, 3),
        ("plain 2", Trainer, 2),
    ):
        config = {
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto",
            "zero_optimization": {"stage": stage},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9,
        }
        # max_grad_norm far above the norm: DeepSpeed computes and logs it, and never clips
        args = training_args(f"{out}/{name}-{rank}", deepspeed=config, max_grad_norm=1e9)
        if stage == 2 and cls is ExactTrainer:
            zero = training_args(
                f"{out}/zero-{rank}", deepspeed={**config, "zero_optimization": {"stage": 0}}
            )
            try:
                ExactTrainer(model=common.gpt2().float(), args=zero, train_dataset=data)
            except ConfigError as exc:
                result["stage 0 refusal"] = str(exc)
            AcceleratorState._reset_state()  # one DeepSpeed plugin per Accelerator state; a test's reset
        trainer = cls(
            model=common.gpt2().float(), args=args, train_dataset=data, data_collator=common.collate
        )
        trainer.train()
        named = list(trainer.model_wrapped.module.named_parameters())
        with deepspeed.zero.GatheredParameters([p for _, p in named]):
            result[name] = {n: p.detach().to(torch.float64).clone() for n, p in named}
        result[name + " log"] = trainer.state.log_history[0]
        result[name + " steps"] = trainer.model_wrapped.global_steps
        AcceleratorState._reset_state()
    return result


@pytest.fixture(scope="module")
def trainer_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = str(tmp_path_factory.mktemp("deepspeed-trainer"))
    return values(run_ranks(_trainer_rank, out, world=WORLD, timeout_s=300, pg_timeout_s=120))


def test_exact_trainer_under_deepspeed_gives_the_full_batch_update_loss_and_grad_norm(
    trainer_ranks: list[dict[str, Any]],
) -> None:
    model = common.gpt2().float().double()
    start = common.params(model)
    batch = common.collate(common.sequences(WORLD * M * K))
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model, batch) / count_fn(batch)
    loss.backward()
    loss = loss.detach()
    norm = float(torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for p in model.parameters()])))
    with torch.no_grad():
        want = {n: p - common.LR * p.grad for n, p in model.named_parameters()}
    for r in trainer_ranks:
        for name in ("exact 2", "exact 3"):
            assert common.update_error(r[name], want, start) < TOLERANCE, name
            # float32 forward and float32 norm of the partitioned gradient: 1e-6 relative
            assert r[name + " log"]["loss"] == pytest.approx(float(loss), rel=1e-6)
            assert r[name + " log"]["grad_norm"] == pytest.approx(norm, rel=1e-6)
            assert r[name + " steps"] == 1
        # the plain Trainer on the same engine: one label too many per row, a different grad norm
        assert common.update_error(r["plain 2"], want, start) > 1e-2
        assert abs(r["plain 2 log"]["grad_norm"] - norm) > 1e-2 * norm


def test_exact_trainer_refuses_deepspeed_stage_0(trainer_ranks: list[dict[str, Any]]) -> None:
    for r in trainer_ranks:
        assert "ZeRO stage 0" in r["stage 0 refusal"] and "prepare_accumulator" in r["stage 0 refusal"]


# -- the documentation's example ----------------------------------------------------------------


@pytest.mark.timeout(180)
def test_the_documented_example_runs_exactly_under_torchrun() -> None:
    """docs/examples/deepspeed_accumulate.py at ZeRO stage 3, as docs/integrations.md runs it."""
    root = Path(__file__).resolve().parents[2]
    script = root / "docs" / "examples" / "deepspeed_accumulate.py"
    assert (
        "BEGIN generated: include examples/deepspeed_accumulate.py "
        in (root / "docs" / "integrations.md").read_text()
    )
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}  # the child's environment only
    proc = subprocess.run(
        [*launch, str(script), "3"], capture_output=True, text=True, timeout=150, check=False, env=env
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    match = re.search(r"optimizer steps: 1; update's relative error from the full batch: (\S+)", proc.stdout)
    assert match is not None, proc.stdout
    assert float(match.group(1)) < TOLERANCE
