"""Exactness of each integration beside the plain library, on the integration tests' own data.

Prints the relative L2 error of the update (|got - want| / |want - start|) against a full-batch
update computed on one process in float64, for: ExactTrainer and the plain Trainer (GPT-2, a
logits-only module, a model that takes loss kwargs but ignores them, a custom compute_loss over an
epoch with a short last window, and GPT-2 on two gloo processes), Lightning's window_step and
accumulate_grad_batches (short last window), and on two gloo processes Accelerate's prepared
objects under prepare_accumulator and its accumulate() (with the scheduler's last_epoch after 3
updates), and Fabric's (with gradient all-reduces per update). Reuses the builders and the spawned
rank functions of ``tests/integrations`` so the figures are those the tests assert on.

    .venv/bin/python benchmarks/integrations.py
"""

from __future__ import annotations

import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for tests/

import torch
from tests.helpers.launcher import run_ranks, values
from tests.integrations import common
from tests.integrations import test_accelerate as acc_tests
from tests.integrations import test_lightning as pl_tests
from tests.integrations import test_transformers as tf_tests
from transformers import Trainer

from gradaccum.integrations.transformers import ExactTrainer, exact_trainer


def row(name: str, exact: float, plain: float, note: str = "") -> None:
    print(f"{name:<44} exact {exact:9.2e}   plain {plain:9.2e}   {note}")


def trainer_rows(out: Path) -> None:
    k, m = tf_tests.K, tf_tests.M
    data = common.sequences(k * m)
    cases = [
        ("Trainer, GPT-2 (own loss, float32 inside)", common.gpt2, common.collate,
         common.causal_mean_loss, {}),
        ("Trainer, logits-only nn.Module", common.TinyLM, common.collate_aligned, common.aligned_mean_loss,
         {"compute_loss_func": tf_tests._mean_ce}),
        ("Trainer, loss kwargs taken but ignored", tf_tests.KwargsLM, common.collate_aligned,
         common.aligned_mean_loss, {}),
    ]  # fmt: skip
    for name, build, collate, mean_loss, plain_kw in cases:
        want = common.sgd_reference(build(), collate(data), mean_loss)
        start = common.params(build())
        errors = []
        for cls, kw in ((ExactTrainer, {}), (Trainer, plain_kw)):
            model = build()
            tf_tests.train(cls, model, data, out / name / cls.__name__, data_collator=collate, **kw)
            errors.append(common.update_error(common.params(model), want, start))
        row(name, *errors)
    # a custom compute_loss and sampler, an epoch of 5 micro-batches: windows of 4 and 1
    data = common.sequences(k * m + m)
    reference = common.TinyLM()
    start = common.params(reference)
    for window in (data[: k * m], data[k * m :]):
        want = common.sgd_reference(reference, common.collate_aligned(window), common.aligned_mean_loss)
        with torch.no_grad():
            for n, p in reference.named_parameters():
                p.copy_(want[n])
    errors = []
    for cls in (exact_trainer(tf_tests.SequentialTrainer), tf_tests.SequentialTrainer):
        model = common.TinyLM()
        args = tf_tests.training_args(out / cls.__name__, max_steps=-1, num_train_epochs=1)
        tf_tests.train(cls, model, data, out / cls.__name__, args=args, data_collator=common.collate_aligned)
        errors.append(common.update_error(common.params(model), want, start))
    row("Trainer, custom compute_loss, short last window", *errors)
    ranks = values(run_ranks(tf_tests._ddp_ranks, str(out / "ddp"), timeout_s=240))
    batch = common.collate(common.sequences(k * m * 2))
    want = common.sgd_reference(common.gpt2(), batch, common.causal_mean_loss)
    start = common.params(common.gpt2())
    for r in ranks:
        errs = (common.update_error(r["exact"], want, start), common.update_error(r["plain"], want, start))
        row("Trainer, GPT-2, 2-process DDP (a rank)", *errs, f"local tokens {r['local tokens']}")


def lightning_rows() -> None:
    want, start = pl_tests.reference([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]])
    exact, plain = pl_tests.ExactLM(pl_tests.EXAMPLES), pl_tests.PlainLM(pl_tests.EXAMPLES)
    pl_tests.fit(exact)
    pl_tests.fit(plain, accumulate_grad_batches=pl_tests.K)
    errors = [common.update_error(common.params(mod.net), want, start) for mod in (exact, plain)]
    row("Lightning Trainer, windows 4/4/2 examples", *errors, "plain: accumulate_grad_batches=2")


def two_process_rows() -> None:
    ranks = values(run_ranks(acc_tests._rank, world=acc_tests.WORLD, timeout_s=240))
    want, start = acc_tests.reference_updates()
    for r in ranks:
        errs = (common.update_error(r["exact"], want, start), common.update_error(r["control"], want, start))
        note = f"last_epoch {r['exact last_epoch']} vs {r['control last_epoch']}, all-reduces {r['reduces']}"
        row("Accelerate, 3 updates, 2 processes (a rank)", *errs, note)
    ranks = values(run_ranks(pl_tests._rank, world=2, timeout_s=240))
    want, start = pl_tests.fabric_reference()
    for r in ranks:
        error = common.update_error(r["fabric"], want, start)
        note = f"all-reduces per update {r['fabric reduces']}, local tokens {r['fabric tokens']}"
        print(f"{'Fabric, 2 updates, 2 processes (a rank)':<44} exact {error:9.2e}   {note}")
    for r in ranks:
        error = common.update_error(
            r["trainer"], *pl_tests.reference([list(range(8)), list(range(8, 16)), list(range(16, 20))])
        )
        print(f"{'Lightning Trainer, DDP, windows 8/8/4 (a rank)':<44} exact {error:9.2e}")


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    with tempfile.TemporaryDirectory() as tmp:
        trainer_rows(Path(tmp))
    lightning_rows()
    two_process_rows()
