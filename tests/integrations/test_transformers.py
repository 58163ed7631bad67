"""``ExactTrainer`` and ``exact_trainer`` against a full-batch update computed here, with the plain
``transformers.Trainer`` on the same data as the control; ``verify_accumulation``; DDP on two ranks.

Tolerances. A float64 model whose loss is computed in float64 (token cross-entropy from the logits:
the plain module, the custom ``compute_loss``) matches the full batch to rounding: ~1e-16 relative;
asserted below 1e-12. GPT-2's own loss (``ForCausalLMLoss``) calls ``logits.float()``, so its
per-token loss and the gradient it sends back into the float64 model are float32: a logit that
rounds to a different float32 in the micro-batch forward than in the full-batch forward moves that
token's gradient by one float32 ulp (6e-8 relative); asserted below 1e-6 (measured 3.8e-8, and
4.5e-8 on two processes). The logged loss is accumulated by
Trainer in a float32 tensor: 1e-6 relative. The controls are off by 8/53 = 0.15 (GPT-2: one count
too many per row) and by more than 1e-2 (means of means).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers import Trainer, TrainingArguments

from gradaccum import EquivalenceError
from gradaccum.errors import ConfigError
from gradaccum.integrations.transformers import ExactConfig, ExactTrainer, exact_trainer
from tests.helpers.launcher import run_ranks, values
from tests.integrations import common

K, M = 4, 2  # gradient_accumulation_steps, per_device_train_batch_size


def training_args(out: Path, **overrides: Any) -> TrainingArguments:
    settings: dict[str, Any] = {
        "output_dir": str(out),
        "report_to": [],
        "use_cpu": True,
        "per_device_train_batch_size": M,
        "gradient_accumulation_steps": K,
        "max_steps": 1,
        "learning_rate": common.LR,
        "optim": "sgd",
        "lr_scheduler_type": "constant",
        "max_grad_norm": 0.0,
        "weight_decay": 0.0,
        "save_strategy": "no",
        "logging_steps": 1,
        "disable_tqdm": True,
        "seed": 0,
    }
    settings.update(overrides)
    return TrainingArguments(**settings)


def train(cls: type[Trainer], model: torch.nn.Module, data: list[Any], out: Path, **kw: Any) -> Trainer:
    collator = kw.pop("data_collator", common.collate)
    args = kw.pop("args", None) or training_args(out)
    trainer = cls(model=model, args=args, train_dataset=data, data_collator=collator, **kw)
    trainer.train()
    return trainer


def logged(trainer: Trainer, key: str) -> list[float]:
    return [
        entry[key] for entry in trainer.state.log_history if key in entry and "train_runtime" not in entry
    ]


@pytest.fixture(scope="module")
def gpt2_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("gpt2")
    data = common.sequences(K * M)
    batch = common.collate(data)
    reference = common.gpt2()
    want = common.sgd_reference(reference, batch, common.causal_mean_loss)
    with torch.no_grad():
        full_loss = float(common.causal_mean_loss(reference(**batch).logits, batch["labels"]))
    grad_norm = float(torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in reference.parameters()])))
    start = common.params(common.gpt2())
    runs: dict[str, Any] = {"want": want, "start": start, "loss": full_loss, "grad_norm": grad_norm}
    for name, cls in (("plain", Trainer), ("exact", ExactTrainer)):
        model = common.gpt2()
        trainer = train(cls, model, data, out / name)
        runs[name] = (common.params(model), trainer)
    return runs


def test_gpt2_exact_trainer_equals_the_full_batch_update(gpt2_runs: dict[str, Any]) -> None:
    got, trainer = gpt2_runs["exact"]
    assert trainer.label_shift and trainer.loss_form == "sum"
    assert common.update_error(got, gpt2_runs["want"], gpt2_runs["start"]) < 1e-6


def test_plain_trainer_on_gpt2_counts_one_label_too_many_per_row(gpt2_runs: dict[str, Any]) -> None:
    got, _ = gpt2_runs["plain"]
    lengths = common.LENGTHS[: K * M]
    rows, tokens = len(lengths), sum(lengths)  # Trainer divides by 53 labels; 45 are predicted
    err = common.update_error(got, gpt2_runs["want"], gpt2_runs["start"])
    assert err == pytest.approx(rows / tokens, rel=1e-6)


def test_exact_trainer_logs_the_global_mean_loss_and_the_pre_clip_norm(gpt2_runs: dict[str, Any]) -> None:
    _, trainer = gpt2_runs["exact"]
    assert logged(trainer, "loss") == [pytest.approx(gpt2_runs["loss"], rel=1e-6)]
    assert logged(trainer, "grad_norm") == [pytest.approx(gpt2_runs["grad_norm"], rel=1e-6)]
    _, plain = gpt2_runs["plain"]
    assert abs(logged(plain, "loss")[0] / gpt2_runs["loss"] - 1) > 1e-2


def _mean_ce(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
    """A compute_loss_func as often written: the micro-batch's token mean, num_items_in_batch ignored."""
    return common.aligned_mean_loss(outputs, labels)


def test_plain_module_returning_logits(tmp_path: Path) -> None:
    data = common.sequences(K * M)
    batch = common.collate_aligned(data)
    want = common.sgd_reference(common.TinyLM(), batch, common.aligned_mean_loss)
    start = common.params(common.TinyLM())
    exact_model = common.TinyLM()
    trainer = train(ExactTrainer, exact_model, data, tmp_path / "exact", data_collator=common.collate_aligned)
    assert not trainer.label_shift and trainer.loss_form == "sum"
    assert common.update_error(common.params(exact_model), want, start) < 1e-12
    # the control: Trainer needs a loss for a logits-only model; a per-micro-batch mean is the usual one
    plain_model = common.TinyLM()
    train(
        Trainer,
        plain_model,
        data,
        tmp_path / "plain",
        data_collator=common.collate_aligned,
        compute_loss_func=_mean_ce,
    )
    assert common.update_error(common.params(plain_model), want, start) > 1e-2


class KwargsLM(common.TinyLM):
    """Takes ``**kwargs`` (so Trainer passes num_items_in_batch) but returns its own per-batch token
    mean, ignoring it: the models transformers #37766 leaves inexact."""

    def forward(  # type: ignore[override]
        self, input_ids: torch.Tensor, attention_mask: Any = None, labels: Any = None, **kwargs: Any
    ) -> dict[str, torch.Tensor]:
        logits = super().forward(input_ids)
        if labels is None:
            return {"logits": logits}
        return {"loss": common.aligned_mean_loss(logits, labels), "logits": logits}


def test_a_model_that_takes_loss_kwargs_but_ignores_them(tmp_path: Path) -> None:
    data = common.sequences(K * M)
    want = common.sgd_reference(KwargsLM(), common.collate_aligned(data), common.aligned_mean_loss)
    start = common.params(KwargsLM())
    exact_model = KwargsLM()
    trainer = train(ExactTrainer, exact_model, data, tmp_path / "exact", data_collator=common.collate_aligned)
    assert trainer.model_accepts_loss_kwargs and trainer.loss_form == "mean"
    assert common.update_error(common.params(exact_model), want, start) < 1e-12
    plain_model = KwargsLM()
    train(Trainer, plain_model, data, tmp_path / "plain", data_collator=common.collate_aligned)
    assert common.update_error(common.params(plain_model), want, start) > 1e-2


class SequentialTrainer(Trainer):
    """A user's Trainer: its own sampler (examples in order) and its own compute_loss, a token mean
    that ignores num_items_in_batch (transformers #44342)."""

    def _get_train_sampler(self, train_dataset: Any = None) -> torch.utils.data.Sampler[int]:
        return torch.utils.data.SequentialSampler(train_dataset or self.train_dataset)

    def compute_loss(
        self, model: Any, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        labels = inputs.pop("labels")
        logits = model(**inputs)
        loss = common.aligned_mean_loss(logits, labels)
        return (loss, logits) if return_outputs else loss


def test_custom_compute_loss_and_sampler_over_an_epoch_with_a_short_last_window(tmp_path: Path) -> None:
    data = common.sequences(K * M + M)  # 5 micro-batches: windows of 4 and 1
    reference = common.TinyLM()
    start = common.params(reference)
    for window in (data[: K * M], data[K * M :]):  # two updates, in the sampler's order
        want = common.sgd_reference(reference, common.collate_aligned(window), common.aligned_mean_loss)
        with torch.no_grad():
            for name, p in reference.named_parameters():
                p.copy_(want[name])
    args = training_args(tmp_path, max_steps=-1, num_train_epochs=1)
    exact_cls = exact_trainer(SequentialTrainer)
    assert exact_cls.__mro__[1:3] == (ExactTrainer, SequentialTrainer)
    model = common.TinyLM()
    trainer = train(
        exact_cls, model, data, tmp_path / "exact", args=args, data_collator=common.collate_aligned
    )
    assert isinstance(
        trainer.get_train_dataloader().base_dataloader.sampler, torch.utils.data.SequentialSampler
    )
    assert trainer.loss_form == "mean" and trainer.state.global_step == 2
    assert common.update_error(common.params(model), want, start) < 1e-12
    plain = common.TinyLM()
    train(SequentialTrainer, plain, data, tmp_path / "plain", args=args, data_collator=common.collate_aligned)
    assert common.update_error(common.params(plain), want, start) > 1e-2


class PaddedMeanTrainer(ExactTrainer):
    """Deliberately wrong: averages the summed token loss over every label position, padding included."""

    def compute_loss(
        self, model: Any, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        labels = inputs.pop("labels")
        logits = model(**inputs).logits
        summed = F.cross_entropy(
            logits[:, :-1].reshape(-1, common.VOCAB), labels[:, 1:].reshape(-1), reduction="sum"
        )
        return summed / labels.numel()


def _gpt2_trainer(cls: Any, model: torch.nn.Module, tmp_path: Path, exact: ExactConfig | None = None) -> Any:
    """``cls`` on K x M of the tests' sequences, collated as GPT-2 takes them."""
    extra = {} if exact is None else {"exact": exact}
    return cls(
        model=model,
        args=training_args(tmp_path),
        train_dataset=common.sequences(K * M),
        data_collator=common.collate,
        **extra,
    )


def test_verify_accumulation_passes_on_the_exact_trainer(tmp_path: Path) -> None:
    model = common.gpt2(dropout=0.1)  # dropout on: the check switches it off in its own copies
    before = common.params(model)
    report = _gpt2_trainer(ExactTrainer, model, tmp_path).verify_accumulation()
    assert report.passed, report.likely_causes
    assert report.sizes == (M,) * K and report.grad_max_rel_err < 1e-10
    assert report.candidate == "ExactTrainer.training_step"
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())  # the model is untouched


def test_verify_accumulation_names_a_wrong_compute_loss(tmp_path: Path) -> None:
    report = _gpt2_trainer(PaddedMeanTrainer, common.gpt2(), tmp_path).verify_accumulation()
    assert not report.passed and report.grad_max_rel_err > 1e-3
    first = report.likely_causes[0]
    assert "PaddedMeanTrainer.compute_loss ignores num_items_in_batch" in first
    assert "not over those units" in first


def test_verify_at_start_stops_training_before_the_first_update(tmp_path: Path) -> None:
    model = common.gpt2()
    before = common.params(model)
    trainer = _gpt2_trainer(PaddedMeanTrainer, model, tmp_path, exact=ExactConfig(verify_at_start=True))
    with pytest.raises(EquivalenceError, match="before training.*ignores num_items_in_batch"):
        trainer.train()
    assert trainer.state.global_step == 0
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


def test_settings_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="label_shift"):
        ExactConfig(label_shift="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="Trainer subclass"):
        exact_trainer(int)  # type: ignore[arg-type]
    assert exact_trainer(Trainer) is not Trainer and exact_trainer(ExactTrainer) is ExactTrainer
    trainer = ExactTrainer(
        model=common.TinyLM(), args=training_args(tmp_path), train_dataset=common.sequences(2)
    )
    with pytest.raises(ConfigError, match="window's divisor"):
        trainer.training_step(trainer.model, common.collate(common.sequences(2)), None)
    with pytest.raises(ConfigError, match=r"loss_from_logits=True\) and a compute_loss_func"):
        ExactTrainer(
            model=common.TinyLM(),
            args=training_args(tmp_path),
            compute_loss_func=_mean_ce,
            exact=ExactConfig(loss_from_logits=True),
        )
    with pytest.raises(ConfigError, match="exact must be a gradaccum ExactConfig, got dict"):
        ExactTrainer(model=common.TinyLM(), args=training_args(tmp_path), exact={"label_shift": True})  # type: ignore[arg-type]


# -- two processes ------------------------------------------------------------------------------


def _ddp_ranks(rank: int, world: int, out: str) -> dict[str, Any]:
    common.distributed_env(rank, world)
    data = common.sequences(K * M * world)
    result: dict[str, Any] = {}
    for name, cls in (("plain", Trainer), ("exact", ExactTrainer)):
        model = common.gpt2()
        trainer = train(cls, model, data, Path(out) / f"{name}-{rank}")
        result[name] = common.params(model)
        result[name + " loss"] = logged(trainer, "loss")
        result[name + " world"] = trainer.args.world_size
    loader = trainer.get_train_dataloader()
    result["local tokens"] = sum(int((b["labels"][:, 1:] != -100).sum()) for b in loader)
    return result


@pytest.mark.distributed
def test_two_process_ddp_with_uneven_tokens(tmp_path: Path) -> None:
    ranks = values(run_ranks(_ddp_ranks, str(tmp_path), timeout_s=180))
    data = common.sequences(K * M * 2)
    batch = common.collate(data)
    reference = common.gpt2()
    want = common.sgd_reference(reference, batch, common.causal_mean_loss)
    with torch.no_grad():
        full_loss = float(common.causal_mean_loss(reference(**batch).logits, batch["labels"]))
    start = common.params(common.gpt2())
    assert [r["exact world"] for r in ranks] == [2, 2]
    tokens = [r["local tokens"] for r in ranks]
    assert tokens[0] != tokens[1] and sum(tokens) == sum(n - 1 for n in common.LENGTHS)
    for r in ranks:
        assert common.update_error(r["exact"], want, start) < 1e-6
        assert r["exact loss"] == [pytest.approx(full_loss, rel=1e-6)]
        assert common.update_error(r["plain"], want, start) > 1e-2
    assert math.isclose(ranks[0]["exact loss"][0], ranks[1]["exact loss"][0], rel_tol=0, abs_tol=0)
