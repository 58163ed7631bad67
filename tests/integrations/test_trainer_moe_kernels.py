"""The three Trainer checks on transformers MoE models with their default experts kernel.

transformers 5 runs the experts of Mixtral, Qwen2-MoE and OLMoE through a kernel chosen by
``experts_implementation``; unset, it is ``grouped_mm`` on CPU too (``torch._grouped_mm``), which
takes no float64. ``audit_trainer``, ``ExactTrainer.verify_accumulation`` and ``verify_at_start``
build float64 copies of the model: they must run those copies' experts on the eager kernel (the
same function) and leave the user's float32, ``grouped_mm`` model exactly as it was.

Each model here is float32 and on the kernel a config that names none gets
(``get_correct_experts_implementation(None)``), asserted not eager: on the code before the switch
every check stopped with torch's "Expected mat_a to be Float32 ... got Double". Mixtral asks for
its balancing loss (``output_router_logits=True``, coef 0.05).

The independent figure: after ``verify_at_start`` the float32 model has taken one SGD step
(lr 1, no clipping); it must equal the full batch's update written by hand in float64 on an eager
copy (tests/helpers/moe.py). Tolerance 1e-5: float32 parameters and activations put ~1e-7
relative into the update (one ulp, 6e-8, per operation over a few hundred terms); a wrong
weighting or a missing balancing term is 1e-2 or more here (the plain-Trainer control).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import Trainer

from gradaccum.audit.measure import state_fingerprint
from gradaccum.integrations.transformers import ExactConfig, audit_trainer, exact_trainer
from tests.helpers import moe as h
from tests.integrations import common
from tests.integrations.test_transformers import K, M, training_args

COEF = 0.05
FAMILIES = ("mixtral", "qwen2_moe", "olmoe")
FLOAT32_BOUND = 1e-5


@pytest.fixture(scope="module", autouse=True)
def _deepspeed_imported(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Trainer's set-up imports DeepSpeed, which sets PYTORCH_NVML_BASED_CUDA_CHECK at import: once
    here, at the module's set-up, and taken out again at its end."""
    with pytest.MonkeyPatch.context() as env:
        env.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
        Trainer(model=torch.nn.Linear(2, 2), args=training_args(tmp_path_factory.mktemp("set-up")))
        yield


def default_kernel_moe(family: str) -> torch.nn.Module:
    """A tiny float32 MoE on the experts kernel transformers picks when the config names none."""
    model = h.tiny_moe(family, coef=COEF).to(torch.float32)
    model.set_experts_implementation(model.get_correct_experts_implementation(None))
    model.config.output_router_logits = family == "mixtral"
    return model


def _kernel(model: torch.nn.Module) -> Any:
    return model.config._experts_implementation


def _same(a: list[tuple[str, Any]], b: list[tuple[str, Any]]) -> bool:
    return [n for n, _ in a] == [n for n, _ in b] and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for (_, x), (_, y) in zip(a, b, strict=True)
    )


def _as_found(model: torch.nn.Module) -> tuple[Any, ...]:
    dtypes = {p.dtype for p in model.parameters()}
    return (_kernel(model), dtypes, model.training, model.config.output_router_logits)


@pytest.fixture(scope="module", params=FAMILIES)
def checked(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    family = request.param
    out = tmp_path_factory.mktemp(f"kernels-{family}")
    data = common.sequences(K * M)
    args = training_args(out, learning_rate=1.0)
    model = default_kernel_moe(family)
    found, before = _as_found(model), state_fingerprint(model)
    result: dict[str, Any] = {"family": family, "kernel": _kernel(model)}

    plain = Trainer(model=model, args=args, train_dataset=data, data_collator=common.collate)
    result["audit"] = audit_trainer(plain)
    exact = exact_trainer(Trainer)(model=model, args=args, train_dataset=data, data_collator=common.collate)
    result["verify"] = exact.verify_accumulation()
    result["untouched"] = _as_found(model) == found and _same(before, state_fingerprint(model))

    trained = default_kernel_moe(family)
    eager = copy.deepcopy(trained).to(torch.float64)
    eager.set_experts_implementation("eager")
    want = h.reference_update(
        eager, [e["input_ids"] for e in data], coef=COEF if family == "mixtral" else 0.0
    )
    start = [p.detach().to(torch.float64) for p in trained.parameters()]
    exact_trainer(Trainer)(
        model=trained,
        args=args,
        train_dataset=data,
        data_collator=common.collate,
        exact=ExactConfig(verify_at_start=True),
    ).train()
    update = [p.detach().to(torch.float64) - s for p, s in zip(trained.parameters(), start, strict=True)]
    result["start_error"] = h.rel_l2(update, want)
    result["trained_kernel"] = _kernel(trained)
    return result


def test_the_models_run_a_fused_default_kernel(checked: dict[str, Any]) -> None:
    assert checked["kernel"] not in (None, "eager")  # grouped_mm: the kernel that takes no float64


def test_audit_trainer_completes_with_finite_figures(checked: dict[str, Any]) -> None:
    report = checked["audit"]
    assert report.error is not None and math.isfinite(report.error), str(report)
    assert report.exact_error is not None and report.exact_error <= 1e-6  # float32 loss: 6e-8
    assert "eager kernel" in report.reference
    if checked["family"] == "mixtral":  # plain Trainer balances each micro-batch: named, measured
        assert report.error > 1e-2 and any("balancing loss" in c.sentence for c in report.causes)


def test_verify_accumulation_passes_on_its_float64_copies(checked: dict[str, Any]) -> None:
    report = checked["verify"]
    assert report.passed, report.summary()
    assert math.isfinite(report.grad_max_rel_err) and report.grad_max_rel_err <= 1e-10


def test_verify_at_start_trains_the_full_batch_update(checked: dict[str, Any]) -> None:
    assert checked["start_error"] <= FLOAT32_BOUND
    assert checked["trained_kernel"] == checked["kernel"]


def test_the_users_model_keeps_its_kernel_dtype_mode_parameters_and_grads(checked: dict[str, Any]) -> None:
    assert checked["untouched"]


def test_a_kernel_that_cannot_be_switched_is_refused_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import MixtralForCausalLM

    from gradaccum.errors import ConfigError

    def refuse(self: object, implementation: object) -> None:
        raise RuntimeError("locked at load time")

    model = default_kernel_moe("mixtral")
    monkeypatch.setattr(MixtralForCausalLM, "set_experts_implementation", refuse)
    data = common.sequences(K * M)
    args = training_args(tmp_path)
    plain = Trainer(model=model, args=args, train_dataset=data, data_collator=common.collate)
    with pytest.raises(
        ConfigError, match="experts_implementation 'grouped_mm'.*experts_implementation='eager'"
    ):
        audit_trainer(plain)
    exact = exact_trainer(Trainer)(model=model, args=args, train_dataset=data, data_collator=common.collate)
    with pytest.raises(ConfigError, match="verify_accumulation's float64 copies needs the experts"):
        exact.verify_accumulation()
    assert _kernel(model) == "grouped_mm"
