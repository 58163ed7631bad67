"""First contact with the Trainer checks and the audit: the calls and commands a new user makes.

1. A transformers MoE with its default experts kernel (``grouped_mm``, float32 parameters, Mixtral
   asking for its balancing loss) in a plain ``Trainer``: ``audit_trainer``, then
   ``exact_trainer(Trainer)``'s ``verify_accumulation`` and ``verify_at_start``. Each completes with
   finite figures (the float64 copies run the eager experts kernel) and says which window and which
   reference it measured; the model keeps its kernel.
2. ``gradaccum audit --help`` names the Trainer row and ``--only``/``--skip``.
3. ``gradaccum audit --workload hf:DIR --data FILE --skip deepspeed``: every output line before the
   table, then each row's first line, asserted; gradaccum's row names its independent reference and
   prints its real, nonzero error.

Tolerances: gradaccum's row is float64 rounding against a whole-window forward (<= 1e-10); the
Trainer row on a Llama is transformers' float32 causal-LM loss (one ulp, 6e-8 per token: <= 1e-6).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import Trainer

from gradaccum.cli.main import main
from gradaccum.integrations.transformers import ExactConfig, audit_trainer, exact_trainer
from tests.helpers import hf
from tests.helpers import moe as h
from tests.integrations import common
from tests.integrations.test_transformers import K, M, training_args

FIGURE = r"\d\.\d\de[-+]\d\d"


def _default_kernel_mixtral() -> torch.nn.Module:
    model = h.tiny_moe("mixtral", coef=0.05).to(torch.float32)
    model.set_experts_implementation(model.get_correct_experts_implementation(None))  # grouped_mm
    model.config.output_router_logits = True
    return model


@pytest.fixture(scope="module")
def moe_checks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The three checks, run once. Trainer's set-up imports DeepSpeed, which sets
    PYTORCH_NVML_BASED_CUDA_CHECK at import: here, at module set-up, and removed at its end."""
    tmp_path = tmp_path_factory.mktemp("journey-moe")
    with pytest.MonkeyPatch.context() as env:
        env.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
        data = common.sequences(K * M)
        model = _default_kernel_mixtral()
        kernel = model.config._experts_implementation
        args = training_args(tmp_path)
        trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=common.collate)
        lines = str(audit_trainer(trainer)).splitlines()
        exact = exact_trainer(Trainer)(
            model=model, args=args, train_dataset=data, data_collator=common.collate
        )
        summary = exact.verify_accumulation().summary()
        exact_trainer(Trainer)(
            model=model,
            args=args,
            train_dataset=data,
            data_collator=common.collate,
            exact=ExactConfig(verify_at_start=True),
        ).train()
        yield {"kernel": kernel, "lines": lines, "summary": summary, "model": model}


def test_the_three_trainer_checks_on_a_default_kernel_moe(moe_checks: dict[str, Any]) -> None:
    assert moe_checks["kernel"] == "grouped_mm"
    lines, summary, model = moe_checks["lines"], moe_checks["summary"], moe_checks["model"]
    assert re.fullmatch(
        rf"Trainer: update error {FIGURE} against the full batch \(token cross-entropy summed over the "
        rf"window's targets / N \+ 0\.05 x the balancing loss over the whole window\); gradaccum's exact "
        rf"path {FIGURE}",
        lines[0],
    ), lines[0]
    assert lines[1].startswith(
        "  window: the first window the trainer's own train dataloader draws (its sampler's order and "
        "its collator; verify_accumulation checks the training set's first 8 examples in dataset "
        "order, another window): 4 micro-batches, 8 examples, "
    )
    assert "target tokens (labels != -100 that a position predicts, after the causal shift)" in lines[1]
    assert lines[2].startswith(
        "  reference: the objective written out in float64 on a float64 deep copy of the model, "
        "dropout off, its experts on transformers' eager kernel instead of the model's 'grouped_mm'"
    )
    assert lines[3].startswith("  cause: the router balancing loss (router_aux_loss_coef 0.05)")
    assert re.fullmatch(rf"  left after those fixes: {FIGURE}", lines[-1])

    assert summary.startswith("PASS: gradient max rel err "), summary  # verify_accumulation
    # verify_at_start passed and trained; the model keeps its kernel and dtype
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert model.config._experts_implementation == "grouped_mm"
    assert next(model.parameters()).dtype == torch.float32


def test_audit_help_names_the_trainer_row_and_the_row_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["audit", "--help"])
    assert exit_.value.code == 0
    text = " ".join(re.sub(r"-\s+", "-", capsys.readouterr().out).split())  # argparse wraps at hyphens
    assert "--only ROW[,ROW]" in text and "--skip ROW[,ROW]" in text
    assert "the transformers Trainer(gradient_accumulation_steps=k) (hf: workloads)" in text
    assert (
        "Rows: hand-loop, accelerate, lightning, deepspeed-engine, deepspeed-gradaccum, "
        "transformers-trainer, gradaccum (deepspeed: deepspeed-engine and deepspeed-gradaccum)"
    ) in text


def test_audit_of_an_hf_folder_without_the_deepspeed_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = hf.make_model_folder(tmp_path / "llama", weights=False)
    data = hf.write_txt(tmp_path / "data.txt", hf.texts())
    out = tmp_path / "out"
    argv = [
        "audit",
        "--workload",
        f"hf:{folder}",
        "--data",
        str(data),
        "--skip",
        "deepspeed",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    head = [
        r"audit hf:llama: llama from .* token normalization",
        r"hand-written loop: \(loss / k\)\.backward\(\) \(torch\) on 4 micro-batches \.\.\.",
        rf"  update error {FIGURE}",
        r"Accelerator\.accumulate\(\) \(accelerate\) on 4 micro-batches \.\.\.",
        rf"  update error {FIGURE}",
        r"Trainer\(accumulate_grad_batches=k\) \(lightning\) on 4 micro-batches \.\.\.",
        rf"  update error {FIGURE}",
        r"transformers Trainer\(gradient_accumulation_steps=k\) \(transformers\) on 4 micro-batches \.\.\.",
        rf"  update error {FIGURE}",
        r"Accumulator\.step \(gradaccum\) on 4 micro-batches \.\.\.",
        rf"  update error {FIGURE}",
        r"  objective: loss_fn summed over every counted token of the window / N \(N = \d+\), float64",
        r"  window: 4 micro-batches of 2, 8 examples, \d+ tokens \(what count_fn counts, the units the "
        r"loss sums over; per micro-batch \[[\d, ]+\]\)",
        r"  model: a float64 deep copy of the model, train mode kept, every dropout probability set to 0",
        r"  reference: the whole window in one forward and one backward on another float64 copy "
        r"\(loss_fn over all its examples / N, as verify computes it\), independent of every row's "
        r"micro-batch loop",
        r"  rows not run \(--skip deepspeed\): deepspeed-engine, deepspeed-gradaccum",
    ]
    for pattern, line in zip(head, lines, strict=False):
        assert re.fullmatch(pattern, line), (pattern, line)
    table = lines[len(head) :]
    assert table[0].split()[:3] == ["row", "┃", "recipe"]
    firsts = {line.split()[0]: line for line in table[2:] if line.strip() and not line.startswith(" " * 4)}
    assert list(firsts)[:5] == ["hand-loop", "accelerate", "lightning", "transformers-trainer", "gradaccum"]
    assert "deepspeed-engine" not in firsts and table[-1].startswith("written: ")
    trainer_error = float(re.findall(FIGURE, firsts["transformers-trainer"])[0])
    assert 0 < trainer_error <= 1e-6
    gradaccum_error = float(re.findall(FIGURE, firsts["gradaccum"])[0])
    assert 0 < gradaccum_error <= 1e-10  # its real rounding, not a bitwise 0.00e+00
    cause = " ".join(" ".join(line.split("│")[-1].split()) for line in table if "│" in line)
    assert "against the whole window's single forward and backward" in cause
