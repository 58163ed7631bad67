"""``make gpu-check``: every CUDA path the CPU suite never runs, on the machine's GPUs, in one table.

On a machine with a CUDA device it runs, each under its own deadline (8 minutes in all on one GPU):

* ``pytest -m cuda``: every test marked ``cuda`` (skipped on a CPU machine);
* the CUDA memory of one update against the tensor-bytes model (``bench/memory.py``): what stays
  allocated against ``persistent_bytes`` (parameters, gradients, optimizer state), and the peak
  ``max_memory_allocated`` against the model's tensor peak (those plus one micro-batch's saved
  activations), a bound it cannot be below;
* float16 autocast with a ``GradScaler`` through the step, and bfloat16 autocast, each against the
  same autocast's full-batch gradient;
* DDP over NCCL on every device present: ``docs/examples/ddp_accumulate.py`` under torchrun, which
  picks NCCL where CUDA is available and checks the update against one process's full batch.

Then it prints one table (path, result, figure) and exits 1 if a path failed. Without a CUDA device
it says so and exits 0.

    .venv/bin/python benchmarks/gpu_check.py
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NO_DEVICE = "gpu-check: no CUDA device on this machine (torch.cuda.is_available() is False); nothing to run"


@dataclass(frozen=True, kw_only=True, slots=True)
class PathResult:
    """One CUDA path's outcome."""

    path: str
    """What ran (``pytest -m cuda``, ``fp16 + GradScaler``, ...)."""
    ok: bool
    """Whether it met its bound."""
    figure: str
    """The measured figure, with its bound."""
    seconds: float = 0.0


def render_table(results: Sequence[PathResult]) -> str:
    """The results as one fixed-width table: path, result, figure, seconds."""
    rows = [("path", "result", "figure", "s")]
    rows += [(r.path, "ok" if r.ok else "FAILED", r.figure, f"{r.seconds:.1f}") for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def exit_code(results: Sequence[PathResult]) -> int:
    """0 when every path met its bound, else 1."""
    return 0 if all(r.ok for r in results) else 1


def pytest_summary(output: str) -> tuple[int, int]:
    """(passed, failed or errored) from pytest's last summary line."""
    passed = sum(int(n) for n in re.findall(r"(\d+) passed", output))
    failed = sum(int(n) for n in re.findall(r"(\d+) (?:failed|errors?)\b", output))
    return passed, failed


def _cuda_tests() -> PathResult:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda", "tests"]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    passed, failed = pytest_summary(proc.stdout)
    ok = proc.returncode == 0 and passed > 0 and failed == 0
    return PathResult(path="pytest -m cuda", ok=ok, figure=f"{passed} passed, {failed} failed")


def _gpt_window(device: str) -> tuple[object, list[dict[str, object]]]:
    from gradaccum import split
    from gradaccum.examples.gpt import sample_sequences

    batch = {k: v.to(device) for k, v in sample_sequences(8, seed=3, max_len=24).items()}
    return batch, split(batch, sizes=[1, 3, 4])


def _rel(got: list[object], want: list[object]) -> float:
    import torch

    num = sum(float((g.double() - w.double()).square().sum()) for g, w in zip(got, want, strict=True))  # type: ignore[attr-defined]
    den = sum(float(w.double().square().sum()) for w in want)  # type: ignore[attr-defined]
    return (num / den) ** 0.5 if den else float(torch.inf)


def _autocast(dtype_name: str, bound: float) -> PathResult:
    """The step under autocast (and a GradScaler for float16) against the same autocast's full-batch
    gradient. Both run the same low-precision matmuls on the same rows; the bound is a few units of
    the dtype's rounding (float16 2**-11, bfloat16 2**-8) amplified by the model's depth."""
    import torch

    from gradaccum import Accumulator
    from gradaccum.examples import build_tiny_gpt, gpt_loss
    from gradaccum.loss import count_tokens

    dtype = getattr(torch, dtype_name)
    count = count_tokens("labels", shift=False)

    def loss_fn(model: torch.nn.Module, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.autocast("cuda", dtype=dtype):
            return gpt_loss(model, mb).float()

    batch, window = _gpt_window("cuda")
    reference = build_tiny_gpt(0).cuda()
    (loss_fn(reference, batch) / count(batch)).backward()  # type: ignore[arg-type]
    want = [p.grad for p in reference.parameters()]
    model = build_tiny_gpt(0).cuda()
    # 2**10, not the default 2**16: the first window of a tiny model must not overflow and skip
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10) if dtype is torch.float16 else None
    acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0), scaler=scaler, max_grad_norm=None)
    result = acc.step(window, loss_fn, count)
    err = _rel([p.grad for p in model.parameters()], want)
    scaled = " + GradScaler" if scaler is not None else ""
    return PathResult(
        path=f"{dtype_name} autocast{scaled}",
        ok=result.applied and err <= bound,
        figure=f"grad relL2 {err:.1e} (<= {bound:.0e})",
    )


def _memory() -> PathResult:
    """CUDA memory of one AdamW update against the tensor-bytes model (``bench/memory.py``).

    Held after the update: parameters, gradients, AdamW state and the model's buffers; the two agree
    to the allocator's 512-byte rounding a tensor (AdamW keeps its ``step`` counters on the host,
    counted by the model; the step keeps a few 0-dim tensors on the device). The peak: at the
    start of the last (largest) micro-batch's backward the device holds at least the parameters,
    the AdamW state (a first update made it), every gradient (the earlier micro-batches made them)
    and that micro-batch's saved activations (``saved_bytes``): ``max_memory_allocated`` cannot be
    below that sum, the model's ``tensor_peak_bytes``; kernels' workspace and temporaries come on
    top, so the ratio is printed, not bounded above."""
    import torch

    from gradaccum import Accumulator
    from gradaccum.bench.memory import persistent_bytes, saved_bytes
    from gradaccum.examples import build_tiny_gpt, gpt_loss
    from gradaccum.loss import count_tokens

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    model = build_tiny_gpt(0).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _, window = _gpt_window("cuda")
    count = count_tokens("labels", shift=False)
    acc = Accumulator(model, optimizer)
    first = acc.step(window, gpt_loss, count)  # the AdamW state exists from here on
    saved: list[int] = []

    def counted_loss(model: torch.nn.Module, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        with saved_bytes(model) as counter:
            loss = gpt_loss(model, mb)
        saved.append(counter.bytes)
        return loss

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    result = acc.step(window, counted_loss, count)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - base
    peak = torch.cuda.max_memory_allocated() - base
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    parameters, gradients, state = persistent_bytes(model, optimizer)
    modelled = parameters + gradients + state + buffers
    modelled_peak = modelled + saved[-1]  # the last micro-batch is the largest (sizes 1, 3, 4)
    tensors = sum(1 for _ in model.parameters()) * 2 + sum(len(s) for s in optimizer.state.values())
    tensors += sum(1 for _ in model.buffers()) + 16
    ok = (
        first.applied
        and result.applied
        and abs(held - modelled) <= 512 * tensors
        and peak + 512 * tensors >= modelled_peak
    )
    figure = (
        f"held {held:,} B / modelled {modelled:,} B; peak {peak:,} B / modelled "
        f"{modelled_peak:,} B ({peak / max(modelled_peak, 1):.2f}x)"
    )
    return PathResult(path="CUDA memory vs tensor bytes", ok=ok, figure=figure)


def _ddp_nccl(devices: int) -> PathResult:
    script = ROOT / "docs" / "examples" / "ddp_accumulate.py"
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(devices)]
    proc = subprocess.run([*launch, str(script)], capture_output=True, text=True, timeout=180, check=False)
    match = re.search(r"largest relative difference from the full batch: (\S+)", proc.stdout)
    err = float(match.group(1)) if match else float("nan")
    ok = proc.returncode == 0 and match is not None and err <= 1e-12  # float64: summation order only
    figure = f"{devices} rank(s), update rel. difference {err:.1e} (<= 1e-12)"
    if not ok and match is None:
        last = (proc.stderr.strip().splitlines() or [""])[-1][:80]
        figure = f"{devices} rank(s), exit {proc.returncode}: {last}"
    return PathResult(path="DDP over NCCL", ok=ok, figure=figure)


def _timed(path: str, check: Callable[[], PathResult]) -> PathResult:
    start = time.monotonic()
    try:
        result = check()
    except Exception as exc:  # one path's failure is a row of the table, not the end of the run
        result = PathResult(path=path, ok=False, figure=f"{type(exc).__name__}: {str(exc)[:80]}")
    return PathResult(path=result.path, ok=result.ok, figure=result.figure, seconds=time.monotonic() - start)


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print(NO_DEVICE)
        return 0
    devices = torch.cuda.device_count()
    print(f"gpu-check: {devices} CUDA device(s), {torch.cuda.get_device_name(0)}; torch {torch.__version__}")
    checks: list[tuple[str, Callable[[], PathResult]]] = [
        ("pytest -m cuda", _cuda_tests),
        ("CUDA memory vs tensor bytes", _memory),
        ("float16 autocast + GradScaler", lambda: _autocast("float16", 1e-2)),
        ("bfloat16 autocast", lambda: _autocast("bfloat16", 5e-2)),
        ("DDP over NCCL", lambda: _ddp_nccl(devices)),
    ]
    results = [_timed(path, check) for path, check in checks]
    print(render_table(results))
    return exit_code(results)


if __name__ == "__main__":
    sys.exit(main())
