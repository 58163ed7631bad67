"""The run card: the record that lets a verified configuration be reproduced on another allocation.

``accept`` writes one for the configuration it verified; ``train --runcard`` replays it. The JSON
holds derived figures (global batch, tokens per step) beside the plan that implies them, so that a
card edited by hand into an inconsistent state is refused on reading rather than trusted.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gradaccum.atomic import atomic_write_text
from gradaccum.errors import ConfigError, GradAccumError, RunCardError
from gradaccum.plan import BatchPlan
from gradaccum.precision import PRECISIONS
from gradaccum.step.config import AccumConfig
from gradaccum.values import require_int

__all__ = [
    "FORMAT_VERSION",
    "RunCard",
    "environment",
    "read_runcard",
    "write_runcard",
]

FORMAT_VERSION = 1
OPTIMIZERS = ("workload", "adamw", "sgd")
_STORED_DTYPES = ("float64", "float32", "bfloat16", "float16")


@dataclass(frozen=True, kw_only=True)
class RunCard:
    """A verified (or trained) accumulation configuration and the environment it ran in."""

    workload: str
    """The ``MODULE:FUNCTION`` that builds the workload."""
    plan: BatchPlan
    """Micro-batch, accumulation steps and data-parallel degree."""
    accum: AccumConfig = field(default_factory=AccumConfig)
    """The Accumulator settings (clipping, loss reduction, sync deferral, skip policy)."""
    precision: str = "float32"
    """Production precision: one of ``PRECISIONS`` (``float16`` implies a GradScaler)."""
    optimizer: str = "workload"
    """What built the optimizer: ``workload`` (the workload's own ``optimizer_factory``, what
    ``accept`` measures with), or ``adamw``/``sgd`` at ``lr`` and ``weight_decay``."""
    lr: float | None = None
    """Peak learning rate for ``adamw``/``sgd`` (``None`` with ``workload``)."""
    weight_decay: float | None = None
    """Weight decay for ``adamw``/``sgd`` (``None`` with ``workload``)."""
    denominator: str = "tokens"
    """What the loss is normalized by: the workload's counted unit ("tokens", "examples")."""
    tokens_per_step: int | None = None
    """Valid units per optimizer step, as counted on the verification data (None if unknown)."""
    seed: int = 0
    """Seed of the model initialization and data draws."""
    versions: dict[str, str] = field(default_factory=dict)
    """gradaccum, torch and Python versions."""
    device: str = "cpu"
    """Device description (CPU model or GPU name)."""
    git_commit: str | None = None
    """Commit of the working directory's repository, when there is one."""
    verdict: str | None = None
    """``ADOPT`` / ``KEEP BASELINE`` for cards written by ``accept``."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form details of the writer (schedule clock, trace window, ...); JSON values only."""
    max_tokens: int | None = None
    """Micro-batches by a token budget (:func:`gradaccum.split_by_tokens`): at most this many tokens
    each, the plan holding the global batch as rows per rank; ``None`` (and cards that predate it):
    the plan's fixed micro-batches."""
    balance_cost: dict[str, Any] | None = None
    """With ``max_tokens``: the ranks were balanced by compute cost,
    ``{"model": "transformer", "d_model": D, "layers": N}`` (:func:`gradaccum.tokens.transformer_cost`);
    ``train --runcard`` balances so again. ``None`` (and cards that predate it): by valid tokens."""
    compile: bool = False
    """The model ran compiled (``torch.compile``, in place, before DDP): ``train --runcard``
    compiles too. Cards written before issue 23 have no such field and read as eager."""
    balance: dict[str, Any] | None = None
    """A routing (mixture-of-experts) model's load balance as it ran: ``{"mode": "exact" | "lagged" |
    "micro-batch" | "off", "coef": the balancing term's coefficient}``; ``train --runcard`` runs the
    same mode. ``None``: a dense model, or a card written before the field (the model's own choice)."""
    param_dtype: str | None = None
    """The dtype the parameters were stored and trained in (``train --param-dtype``; the largest share
    of a mixed model), apart from the compute ``precision``: ``train --runcard`` stores them so.
    ``None``: a card of ``accept`` (float32 parameters, float64 under precision float64) or one written
    before the field (float32 for an ``hf:`` folder)."""

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise RunCardError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.optimizer not in OPTIMIZERS:
            raise RunCardError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if not isinstance(self.compile, bool):
            raise RunCardError(f"run card 'compile' must be true or false, got {self.compile!r}")
        if self.balance is not None:
            _check_balance(self.balance)
        if self.param_dtype is not None and self.param_dtype not in _STORED_DTYPES:
            raise RunCardError(
                f"run card 'param_dtype' must be null or one of {', '.join(_STORED_DTYPES)}, got "
                f"{self.param_dtype!r} (edited by hand?)"
            )
        if self.balance_cost is not None:
            _check_balance_cost(self.balance_cost, self.max_tokens)
        for name in ("lr", "weight_decay"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise RunCardError(f"run card '{name}' must be a number or null, got {value!r}")

    @property
    def global_batch(self) -> int:
        return self.plan.global_batch

    def label(self) -> str:
        """The configuration's name: the plan's (``4x8``), or a token budget's (``tokens<=256``)."""
        return self.plan.label() if self.max_tokens is None else f"tokens<={self.max_tokens}"

    def equation(self) -> str:
        """The batch equation; with a token budget, the window in rows and the budget of each
        micro-batch (the number of micro-batches follows the lengths)."""
        if self.max_tokens is None:
            return self.plan.equation()
        return (
            f"global_batch = {self.plan.global_batch} rows over dp {self.plan.dp}, micro-batches of at "
            f"most max_tokens {self.max_tokens} tokens"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "workload": self.workload,
            # a token budget cuts the window by lengths: no fixed micro-batch or count to record
            "micro_batch": self.plan.micro_batch if self.max_tokens is None else None,
            "accum_steps": self.plan.accum_steps if self.max_tokens is None else None,
            "dp": self.plan.dp,
            "global_batch": self.plan.global_batch,
            "accum": self.accum.to_dict(),
            "precision": self.precision,
            "optimizer": self.optimizer,
            "lr": self.lr,
            "weight_decay": self.weight_decay,
            "denominator": self.denominator,
            "tokens_per_step": self.tokens_per_step,
            "seed": self.seed,
            "versions": dict(self.versions),
            "device": self.device,
            "git_commit": self.git_commit,
            "verdict": self.verdict,
            "extra": dict(self.extra),
            "compile": self.compile,
            "max_tokens": self.max_tokens,
            "balance_cost": None if self.balance_cost is None else dict(self.balance_cost),
            "balance": None if self.balance is None else dict(self.balance),
            "param_dtype": self.param_dtype,
        }

    @classmethod
    def from_dict(cls, data: Any) -> RunCard:
        """Rebuild a card, refusing missing fields, wrong types and inconsistent derived figures."""
        if not isinstance(data, dict):
            raise RunCardError(f"a run card is a JSON object, got {type(data).__name__}")
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise RunCardError(
                f"run card format_version {version!r} is not supported (expected {FORMAT_VERSION})"
            )
        required = (
            "workload",
            "micro_batch",
            "accum_steps",
            "dp",
            "global_batch",
            "accum",
            "precision",
            "seed",
        )
        missing = [key for key in required if key not in data]
        if missing:
            raise RunCardError(f"run card is missing {', '.join(missing)} (truncated or edited by hand?)")
        max_tokens = data.get("max_tokens")
        require_int("run card max_tokens", max_tokens, error=RunCardError, none_ok=True)
        try:
            plan = _plan(data, max_tokens)
        except GradAccumError as exc:
            raise RunCardError(f"run card plan is invalid: {exc}") from exc
        if data["global_batch"] != plan.global_batch:
            raise RunCardError(
                f"run card says global_batch={data['global_batch']!r} but micro_batch x dp x accum_steps = "
                f"{plan.micro_batch} x {plan.dp} x {plan.accum_steps} = {plan.global_batch}; "
                "the card is inconsistent (edited by hand?)"
            )
        if not isinstance(data["accum"], dict):
            raise RunCardError(f"run card 'accum' must be an object, got {type(data['accum']).__name__}")
        try:
            accum = AccumConfig.from_dict(data["accum"])
        except ConfigError as exc:
            raise RunCardError(f"run card 'accum' is invalid: {exc}") from exc
        if not isinstance(data["workload"], str) or not isinstance(data["seed"], int):
            raise RunCardError("run card 'workload' must be a string and 'seed' an integer")
        versions = data.get("versions") or {}
        if not isinstance(versions, dict) or not all(isinstance(v, str) for v in versions.values()):
            raise RunCardError(
                f"run card 'versions' must be an object of version strings, got {versions!r} "
                "(edited by hand?)"
            )
        extra = data.get("extra") or {}
        if not isinstance(extra, dict):
            raise RunCardError(
                f"run card 'extra' must be an object, got {type(extra).__name__} (edited by hand?)"
            )
        for key in ("git_commit", "verdict"):
            if data.get(key) is not None and not isinstance(data[key], str):
                raise RunCardError(f"run card '{key}' must be a string or null, got {data[key]!r}")
        tokens = data.get("tokens_per_step")
        require_int("run card tokens_per_step", tokens, low=0, error=RunCardError, none_ok=True)
        return cls(
            workload=data["workload"],
            plan=plan,
            accum=accum,
            precision=data["precision"],
            optimizer=data.get("optimizer", "workload"),
            lr=data.get("lr"),
            weight_decay=data.get("weight_decay"),
            denominator=str(data.get("denominator", "tokens")),
            tokens_per_step=tokens,
            seed=data["seed"],
            versions={str(k): v for k, v in versions.items()},
            device=str(data.get("device", "cpu")),
            git_commit=data.get("git_commit"),
            verdict=data.get("verdict"),
            extra=dict(extra),
            compile=data.get("compile", False),
            max_tokens=max_tokens,
            balance_cost=data.get("balance_cost"),
            balance=data.get("balance"),
            param_dtype=data.get("param_dtype"),
        )


def _plan(data: dict[str, Any], max_tokens: int | None) -> BatchPlan:
    """The card's plan. A token-budget card records ``micro_batch`` and ``accum_steps`` as null (the
    window is cut by lengths): its plan is the global batch as rows per rank in one window. Cards
    written before that record ``global_batch / dp`` and 1, which read the same."""
    micro, accum, dp = data["micro_batch"], data["accum_steps"], data["dp"]
    if max_tokens is not None and micro is None and accum is None:
        require_int("run card dp", dp, error=RunCardError)
        rows = data["global_batch"]
        require_int("run card global_batch", rows, error=RunCardError)
        if rows % dp:
            raise RunCardError(
                f"run card global_batch {rows} is not a multiple of dp {dp}: a token-budget card holds "
                "the global batch as rows per rank (edited by hand?)"
            )
        return BatchPlan(micro_batch=rows // dp, accum_steps=1, dp=dp)
    if micro is None or accum is None:
        raise RunCardError(
            "run card micro_batch and accum_steps are null, which only a token-budget card (with "
            "max_tokens) records; give both, or max_tokens (edited by hand?)"
        )
    return BatchPlan(micro_batch=micro, accum_steps=accum, dp=dp)


_BALANCE_MODES = ("exact", "lagged", "micro-batch", "off")


def _check_balance_cost(recorded: object, max_tokens: int | None) -> None:
    """A recorded cost balance: ``{"model": "transformer", "d_model": int, "layers": int}``, on a
    token-budget card only."""
    ok = (
        isinstance(recorded, dict)
        and set(recorded) == {"model", "d_model", "layers"}
        and recorded["model"] == "transformer"
        and all(
            isinstance(recorded[k], int) and not isinstance(recorded[k], bool) and recorded[k] >= 1
            for k in ("d_model", "layers")
        )
    )
    if not ok:
        raise RunCardError(
            'run card \'balance_cost\' must be null or {"model": "transformer", "d_model": D, '
            f'"layers": N}} with whole numbers >= 1, got {recorded!r} (edited by hand?)'
        )
    if max_tokens is None:
        raise RunCardError(
            "run card records balance_cost but no max_tokens: the cost balances a token budget's "
            "micro-batches (edited by hand?)"
        )


def _check_balance(balance: object) -> None:
    """A recorded load balance: ``{"mode": ..., "coef": number or null}``, nothing else."""
    if (
        not isinstance(balance, dict)
        or set(balance) != {"mode", "coef"}
        or balance["mode"] not in _BALANCE_MODES
    ):
        raise RunCardError(
            f"run card 'balance' must be null or {{\"mode\": one of {', '.join(_BALANCE_MODES)}, "
            f'"coef": a number or null}}, got {balance!r} (edited by hand?)'
        )
    coef = balance["coef"]
    if coef is not None and (isinstance(coef, bool) or not isinstance(coef, (int, float)) or coef < 0):
        raise RunCardError(f"run card 'balance' coef must be a number >= 0 or null, got {coef!r}")


def write_runcard(card: RunCard, path: str | os.PathLike[str]) -> None:
    atomic_write_text(path, json.dumps(card.to_dict(), indent=2, sort_keys=True) + "\n")


def read_runcard(path: str | os.PathLike[str]) -> RunCard:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise RunCardError(f"cannot read run card {path}: {exc}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RunCardError(f"run card {path} is not valid JSON (truncated?): {exc}") from exc
    return RunCard.from_dict(data)


def environment(device: torch.device | str = "cpu") -> dict[str, Any]:
    """Versions, device description and git commit, for a card's provenance fields."""
    from gradaccum import __version__

    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(dev)
    else:
        name = platform.processor() or platform.machine() or "cpu"
        name = f"cpu ({name}, {os.cpu_count()} cores)"
    commit: str | None = None
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=False
        )
        commit = out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {
        "versions": {"gradaccum": __version__, "torch": torch.__version__, "python": sys.version.split()[0]},
        "device": name,
        "git_commit": commit,
    }
