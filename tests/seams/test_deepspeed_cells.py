"""The ``external-step`` cells of tests/seams/table.py: every one in one two-process gloo launch,
each through a real DeepSpeed engine (``prepare_accumulator``) at every ZeRO stage, 0 to 3.

Each rank builds, per cell and stage, a float32 engine (DS_ACCELERATOR=cpu; SGD lr 1,
``gradient_accumulation_steps=2``, no clipping) from the scenario's toy model
(tests/seams/scenario.py) and steps two windows: four micro-batches of uneven rows and tokens, two
on each rank (the step refuses unequal counts under DeepSpeed, tests/integrations/test_deepspeed.py);
``token-budget`` cuts each window with ``split_by_tokens(..., equal_count=True)``; a short window is
one micro-batch per rank; a NaN window is skipped bitwise; resume goes through DeepSpeed's own
checkpoint and the accumulator's ``state_dict``, bitwise. The compiled cells (``engine.compile``, a
compiled ``loss_fn``) run at stage 0 only: compiling through ZeRO-3's hooks costs 15 s more here
(both were exact at stage 3, run once outside the suite).

The test holds rank 0's update to the float64 objective of the whole window (scenario.py, from the
engine's float32-rounded initial weights) and both ranks' states to each other bitwise. Tolerance
2e-5 relL2 on each window's update: the engine computes in float32 (each of the forward's and
backward's dozen operations per position rounds at 2^-24 = 6e-8, and a gradient entry sums at most
48 positions: a bound of 60 x 6e-8 = 4e-6 of the gradient), and storing ``p - g`` in float32 rounds
|p| at 6e-8, below 1e-6 of the update here; 2.7e-7 is measured at every stage. 2e-5 is four orders
below what a wrong gradient gives (a loss_fn that skips ZeRO-3's forward: 0.88). BatchNorm's running
statistics: 1e-6 absolute (their inputs are the float32 layer's outputs, of size ~1, each a 4-term
dot product plus a bias rounded at 6e-8 per operation, ~3e-7 at worst; the pooled moments are
float64; 3e-8 measured). ``accum_dtype`` runs a bfloat16 model (5e-2, test_cells.py's argument;
1.7e-2 measured) and proves the float32 path: each micro-batch after a window's first finds the
float32 sum in ``.grad`` (stages 0-1; at 2-3 ZeRO moved every micro-batch's gradient out of
``p.grad`` and the setting changed nothing, so it is refused there).
"""

from __future__ import annotations

import importlib.util
import os
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

from gradaccum import AccumConfig, split_by_tokens
from tests.helpers.launcher import run_ranks
from tests.seams import scenario as s
from tests.seams.table import cells

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs gradaccum[deepspeed]"),
    pytest.mark.timeout(240),  # the first test also waits for the launch (~35 s; the ranks' limit 180 s)
]

DS = "external-step"
DS_CELLS = [c for c in cells() if DS in (c.row, c.col) and c.outcome in ("exact", "refused")]
STAGES = (0, 1, 2, 3)
COMPILED = ("compile", "loss_fn-compiled")
REFUSED = {"post-scaling": STAGES, "ddp": STAGES, "accum_dtype": (2, 3), "loss_fn-submodules": (3,)}
"""The stages at which a cell is refused by name, on every rank, before any update."""
FLOAT32, BN_FLOAT32, BF16 = 2e-5, 1e-6, 5e-2
EXTENSIONS = Path(__file__).resolve().parents[2] / "build" / "torch_extensions"
"""DeepSpeed's JIT-built communication op, kept between runs (tests/integrations/test_deepspeed.py)."""


def _given(cell: Any) -> str:
    other = cell.col if cell.row == DS else cell.row
    return "dict" if other == DS else other


def _stages(given: str) -> tuple[int, ...]:
    return (0,) if given in COMPILED else STAGES


def _windows(given: str) -> list[list[list[dict[str, torch.Tensor]]]]:
    """Each window's micro-batches, per rank."""
    out = []
    for index, seed in enumerate((1, 2)):
        batch = s.global_batch(8, seed)
        if given == "token-budget":
            out.append([split_by_tokens(batch, 2 * s.T, rank=r, world=2, equal_count=True) for r in (0, 1)])
            continue
        cuts = ((0, 3), (3, 5), (5, 6), (6, 8))
        if given in COMPILED:  # one shape: one graph
            cuts = ((0, 2), (2, 4), (4, 6), (6, 8))
        if given == "short-window" and index == 1:
            cuts = ((0, 5), (5, 8))
        mbs = [{k: v[a:b] for k, v in batch.items()} for a, b in cuts]
        half = len(mbs) // 2
        out.append([mbs[:half], mbs[half:]])
    return out


def _settings(given: str) -> dict[str, Any]:
    return {
        "batchnorm-window": {"batchnorm_stats": "window"},
        "accum_dtype": {"accum_dtype": "float32"},
        "post-scaling": {"scaling": "post"},
    }.get(given, {})


_COMPILED: list[Any] = []


class Cell:
    """One cell at one stage on this rank: an engine from the scenario's initial weights."""

    def __init__(self, given: str, stage: int) -> None:
        import deepspeed
        from torch.nn.parallel import DistributedDataParallel

        from gradaccum.integrations.deepspeed import prepare_accumulator

        self.given, self.stage = given, stage
        self.bf16 = given == "accum_dtype"
        self.model = s.build(given == "batchnorm-window", torch.bfloat16 if self.bf16 else torch.float32)
        net: torch.nn.Module = self.model
        if given == "ddp":
            net = DistributedDataParallel(self.model, find_unused_parameters=True)
        config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 2,
            "gradient_clipping": 0.0,  # DeepSpeed 0.19.8 clips at 1.0 by default
            "zero_optimization": {"stage": stage},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9,
        }
        if self.bf16 and stage > 0:  # at stage 0 DeepSpeed's bf16 is BF16_Optimizer, refused apart
            config["bf16"] = {"enabled": True}
        optimizer = torch.optim.SGD(net.parameters(), lr=1.0)
        self.engine, *_ = deepspeed.initialize(model=net, optimizer=optimizer, config=config)
        if given == "compile":  # DeepSpeed's own compile; aot_eager needs no C++ toolchain
            self.engine.compile(backend="aot_eager")
        self.widths: list[torch.dtype | None] = []
        self.calls = 0
        self.acc = prepare_accumulator(self.engine, config=AccumConfig(**_settings(given)))

    def loss_fn(self, engine: Any, mb: Any) -> torch.Tensor:
        if self.bf16:
            if self.calls > 0:  # the float32 sum of the earlier micro-batches
                grad = self.model.lin.weight.grad
                self.widths.append(None if grad is None else grad.dtype)
            self.calls += 1
        if self.given == "loss_fn-compiled":
            if not _COMPILED:
                _COMPILED.append(torch.compile(s.loss_via_model, backend="aot_eager"))
            loss: torch.Tensor = _COMPILED[0](engine, mb)
            return loss
        if self.given == "loss_fn-submodules":
            return s.loss_via_submodules(engine.module, mb)
        return s.loss_via_model(engine, mb)

    def step(self, mine: list[dict[str, torch.Tensor]], nan: bool = False) -> Any:
        self.calls = 0
        if nan:
            mine = [{**mb, "y": mb["y"] * float("nan")} for mb in mine]
        return self.acc.step([s.wrap(mb, self.given) for mb in mine], self.loss_fn, s.count)

    def state(self) -> dict[str, torch.Tensor]:
        """Every parameter in full (ZeRO-3 gathers its partitions for the read) and every buffer."""
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(self.model.parameters())):
            return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


def _refused(rank: int, given: str, stage: int) -> dict[str, Any]:
    """The refusal: its class and message, and whether the parameters moved."""
    from gradaccum.errors import GradAccumError

    before = s.build(given == "batchnorm-window", torch.bfloat16 if given == "accum_dtype" else torch.float32)
    try:
        cell = Cell(given, stage)
    except GradAccumError as exc:
        return {"error": type(exc).__name__, "message": str(exc), "where": "construction"}
    try:
        cell.step(_windows(given)[0][rank])
    except GradAccumError as exc:
        after = cell.state()
        moved = any(not torch.equal(after[k], v) for k, v in before.state_dict().items())
        return {"error": type(exc).__name__, "message": str(exc), "where": "step", "moved": moved}
    return {"error": None}


def _exact(rank: int, given: str, stage: int, out_dir: str) -> dict[str, Any]:
    windows = _windows(given)
    cell = Cell(given, stage)
    states, results = [], []
    for index, window in enumerate(windows):
        results.append(cell.step(window[rank]))
        states.append(cell.state())
        if given == "resume" and index == 0:  # DeepSpeed's checkpoint and the accumulator's counters
            cell.engine.save_checkpoint(out_dir, tag="w1")
            saved = cell.acc.state_dict()
    out: dict[str, Any] = {
        "states": states,
        "applied": [r.applied for r in results],
        "widths": cell.widths,
    }
    if given == "skipped-window":  # [W1, a NaN window, W2] ends as [W1, W2]
        other = Cell(given, stage)
        other.step(windows[0][rank])
        out["skipped"] = not other.step(windows[1][rank], nan=True).applied
        other.step(windows[1][rank])
        out["bitwise"] = _equal(other.state(), states[-1])
    if given == "resume":  # a fresh engine from the checkpoint after W1, then W2
        resumed = Cell(given, stage)
        resumed.engine.load_checkpoint(out_dir, tag="w1")
        resumed.acc.load_state_dict(saved)
        resumed.step(windows[1][rank])
        out["bitwise"] = _equal(resumed.state(), states[-1])
    return out


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _ranks(rank: int, world: int, specs: list[tuple[str, int]], out_dir: str) -> dict[tuple[str, int], Any]:
    import torch.distributed as dist

    from tests.integrations import common

    os.environ["DS_ACCELERATOR"] = "cpu"  # this spawned process only
    common.distributed_env(rank, world)
    out: dict[tuple[str, int], Any] = {}
    for given, stage in specs:
        try:
            if stage in REFUSED.get(given, ()):
                out[given, stage] = _refused(rank, given, stage)
            else:
                out[given, stage] = _exact(rank, given, stage, f"{out_dir}/{given}-{stage}")
        except Exception:  # the test reports it per cell; the ranks meet before the next one
            out[given, stage] = traceback.format_exc()
        dist.barrier()
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    specs = list(dict.fromkeys((_given(c), stage) for c in DS_CELLS for stage in _stages(_given(c))))
    out = str(tmp_path_factory.mktemp("deepspeed-cells"))
    with pytest.MonkeyPatch.context() as patch:  # every rank inherits it
        if "TORCH_EXTENSIONS_DIR" not in os.environ:
            patch.setenv("TORCH_EXTENSIONS_DIR", str(EXTENSIONS))
        return run_ranks(_ranks, specs, out, timeout_s=180, pg_timeout_s=60)


def _reference_start(given: str) -> torch.nn.Module:
    """The float64 model from the engine's initial weights, exactly (float32 or bfloat16 rounded)."""
    narrow = s.build(given == "batchnorm-window", torch.bfloat16 if given == "accum_dtype" else torch.float32)
    model = s.build(given == "batchnorm-window")
    model.load_state_dict(_widened(narrow.state_dict()))
    return model


def _widened(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.double() if v.is_floating_point() else v for k, v in state.items()}


def _check_exact(given: str, stage: int, got: list[dict[str, Any]]) -> None:
    model = _reference_start(given)
    names = [n for n, _ in model.named_parameters()]
    tol = BF16 if given == "accum_dtype" else FLOAT32
    for index, window in enumerate(_windows(given)):
        ref = s.reference(model, window[0] + window[1], None)
        state = got[0]["states"][index]
        start = [p.detach().clone() for p in model.parameters()]
        update = [state[n].double() - b for n, b in zip(names, start, strict=True)]
        err = s.rel_l2(update, [-g for g in ref.grads])
        assert err <= tol, (given, stage, index, err)
        model.load_state_dict(_widened(state))
        if ref.bn_mean is not None:
            assert (state["bn.running_mean"].double() - ref.bn_mean).abs().max() <= BN_FLOAT32
            assert (state["bn.running_var"].double() - ref.bn_var).abs().max() <= BN_FLOAT32
            assert int(state["bn.num_batches_tracked"]) == index + 1
    for index in range(len(got[0]["states"])):
        assert _equal(got[0]["states"][index], got[1]["states"][index]), (given, stage, index)
    assert all(g["applied"] == [True, True] for g in got)
    if given == "accum_dtype":
        widths = [g["widths"] for g in got]
        assert all(w and all(d == torch.float32 for d in w) for w in widths), widths
    if given == "skipped-window":
        assert all(g["skipped"] and g["bitwise"] for g in got), given
    if given == "resume":
        assert all(g["bitwise"] for g in got), given


@pytest.mark.parametrize("cell", DS_CELLS, ids=lambda c: f"{c.row}-x-{c.col}")
def test_deepspeed_cell(cell: Any, ranks: list[Any]) -> None:
    assert all(o.ok for o in ranks), [o.error for o in ranks]
    given = _given(cell)
    assert (cell.outcome == "refused") == (given in REFUSED), cell
    for stage in _stages(given):
        got = [o.value[given, stage] for o in ranks]
        for g in got:
            assert not isinstance(g, str), g
        if stage not in REFUSED.get(given, ()):
            _check_exact(given, stage, got)
            continue
        error, setting = cell.note.split(": ", 1)
        for g in got:  # on every rank, naming the setting, before any update
            assert g["error"] == error, (stage, g)
            assert setting.split(" ")[0] in g["message"], (stage, g["message"])
            assert g["where"] == ("step" if "at the step" in setting else "construction"), (stage, g)
            assert not g.get("moved", False), stage
