"""``TrainSpec`` (what ``gradaccum train`` is asked for) and ``resolve_spec`` (the run it resolves to).

Every flag of ``train`` is a field of TrainSpec and back, so that adding a flag stays a two-place
change; the defaults the spec resolves to are TrainConfig's own; the spec refuses bad values itself.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from gradaccum.cli.cmd_train import spec_from_args
from gradaccum.cli.main import build_parser
from gradaccum.errors import PlanError, TrainError
from gradaccum.plan import BatchPlan
from gradaccum.train.config import TrainConfig
from gradaccum.train.resolve import resolve_spec
from gradaccum.train.spec import CARD_FIELDS, TrainSpec

# the train flags that are the launch's, not the request's: where to run and what data an hf:
# workload reads (folded into --workload before the spec is built)
LAUNCH_FLAGS = {"device", "threads", "run_dir", "resume", "data", "text_field", "seq_len", "pack"}
LAUNCH_FLAGS |= {"normalization", "func", "help"}


def _train_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices["train"]


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["train", *argv])


def test_every_spec_field_is_a_train_flag_and_every_flag_a_field_or_the_launchs() -> None:
    dests = {a.dest: a for a in _train_parser()._actions}
    fields = {f.name for f in dataclasses.fields(TrainSpec)}
    assert fields - set(dests) == set(), "TrainSpec fields without a flag"
    assert set(dests) - fields - LAUNCH_FLAGS == set(), "train flags that reach no TrainSpec field"
    # a flag left out is None (the field's default applies), a switch is False
    for name in fields:
        default = dests[name].default
        assert default is None or default is False or default == getattr(TrainSpec(), name), name


def test_no_flags_resolve_to_train_configs_own_defaults(tmp_path: Path) -> None:
    spec = spec_from_args(_args())
    assert spec == TrainSpec()
    resolved = resolve_spec(spec, world=1, device="cpu", run_dir=tmp_path, resume=None)
    plan = BatchPlan.solve(global_batch=32, micro_batch=8, dp=1)
    assert resolved.config == TrainConfig(plan=plan, run_dir=tmp_path, steps=200, device="cpu")
    assert resolved.notes == ()


def test_flags_reach_the_config(tmp_path: Path) -> None:
    args = _args(
        *("--global-batch", "16", "--micro-batch", "4", "--precision", "bfloat16", "--seed", "3"),
        *("--tokens", "500", "--optimizer", "sgd", "--lr", "0.5", "--weight-decay", "0.1"),
        *("--max-grad-norm", "0", "--max-consecutive-skips", "2", "--schedule", "constant"),
        *("--schedule-clock", "tokens", "--warmup", "7", "--checkpoint-every", "0"),
        *("--checkpoint-minutes", "0", "--keep-checkpoints", "5", "--eval-every", "4"),
        *("--eval-examples", "8", "--noise-scale"),
    )
    config = resolve_spec(spec_from_args(args), world=2, device="cpu", run_dir=tmp_path, resume=None).config
    assert (config.plan.micro_batch, config.plan.accum_steps, config.plan.dp) == (4, 2, 2)
    assert (config.precision, config.seed, config.optimizer, config.lr) == ("bfloat16", 3, "sgd", 0.5)
    assert (config.steps, config.tokens, config.weight_decay) == (None, 500, 0.1)
    # 0 turns clipping and each checkpoint trigger off
    assert config.accum.max_grad_norm is None and config.accum.max_consecutive_skips == 2
    assert config.accum.noise_scale and config.accum.track_grad_norm
    assert (config.checkpoint_every, config.checkpoint_minutes, config.keep_checkpoints) == (None, None, 5)
    assert (config.eval_every, config.eval_examples) == (4, 8)
    assert (config.schedule.kind, config.schedule.clock, config.schedule.warmup) == ("constant", "tokens", 7)


def test_the_spec_refuses_bad_values_naming_them() -> None:
    with pytest.raises(PlanError, match=r"--warmup 9 is longer than --horizon 4 \(steps\)"):
        TrainSpec(warmup=9, horizon=4)
    TrainSpec(warmup=9, horizon=4, schedule="constant")  # a constant schedule has no horizon to pass
    with pytest.raises(TrainError, match="global_batch must be a positive integer or None, got 0"):
        TrainSpec(global_batch=0)
    with pytest.raises(TrainError, match="precision must be one of float64, float32, bfloat16, float16"):
        TrainSpec(precision="fp8")  # type: ignore[arg-type]
    with pytest.raises(TrainError, match="lr must be a number > 0, got 0"):
        TrainSpec(lr=0)
    with pytest.raises(TrainError, match="min_lr_ratio must be a fraction from 0 to 1"):
        TrainSpec(min_lr_ratio=1.5)
    with pytest.raises(TrainError, match="checkpoint_every must be a non-negative integer, got True"):
        TrainSpec(checkpoint_every=True)


def test_given_names_the_run_card_fields_set() -> None:
    assert TrainSpec().given() == ()
    assert TrainSpec(seed=0, lr=0.1, eval_every=3).given() == ("seed", "lr")
    assert set(CARD_FIELDS) <= {f.name for f in dataclasses.fields(TrainSpec)}


def test_the_lazy_train_package_exports_its_names_not_its_modules() -> None:
    """gradaccum.train imports its names on first use (the parser reads TrainSpec without torch);
    a submodule named like an export would shadow it once imported, so none may be."""
    import pkgutil

    import gradaccum.train
    import gradaccum.train.loop

    modules = {m.name for m in pkgutil.iter_modules(gradaccum.train.__path__)}
    assert modules & set(gradaccum.train.__all__) == set()
    for name in gradaccum.train.__all__:
        value = getattr(gradaccum.train, name)
        assert not isinstance(value, type(gradaccum.train)), name
    assert gradaccum.train.evaluate.__module__ == "gradaccum.train.evaluation"
