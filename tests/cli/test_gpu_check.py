"""``make gpu-check`` (benchmarks/gpu_check.py): on a machine without CUDA it says so and exits 0;
its table renders every path's row, and a failed path makes the exit code 1."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _gpu_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-device message is for machines without CUDA")
@pytest.mark.timeout(120)
def test_make_gpu_check_says_there_is_no_cuda_device_and_exits_0() -> None:
    venv = Path(sys.prefix)  # the target's own python, this interpreter's environment
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    command = ["make", "-s", "-C", str(ROOT), f"VENV={venv}", "-o", f"{venv}/.installed", "gpu-check"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=100, check=False, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == _gpu_check().NO_DEVICE


def test_the_table_has_a_row_per_path_and_a_failed_path_fails_the_run() -> None:
    check = _gpu_check()
    results = [
        check.PathResult(path="pytest -m cuda", ok=True, figure="21 passed, 0 failed", seconds=61.25),
        check.PathResult(path="DDP over NCCL", ok=False, figure="2 rank(s), update rel. difference 3.0e-05"),
    ]
    lines = check.render_table(results).splitlines()
    assert lines[0].split() == ["path", "result", "figure", "s"]
    assert set(lines[1]) == {"-", " "}
    assert lines[2].startswith("pytest -m cuda") and " ok " in lines[2] and lines[2].endswith("61.2")
    assert "FAILED" in lines[3] and "3.0e-05" in lines[3]
    assert lines[2].index("ok") == lines[0].index("result") == lines[3].index("FAILED")  # aligned
    assert check.exit_code(results) == 1 and check.exit_code(results[:1]) == 0


def test_the_pytest_summary_is_read_from_pytests_last_line() -> None:
    check = _gpu_check()
    assert check.pytest_summary("....\n21 passed, 1712 deselected in 60.1s\n") == (21, 0)
    assert check.pytest_summary("F.\n1 failed, 20 passed, 2 errors in 5s\n") == (20, 3)
    assert check.pytest_summary("1712 deselected in 1.0s\n") == (0, 0)
