"""``verify --mesh`` on the bundled default workload under torchrun (4 gloo processes).

The tiny GPT declares ``parallelize`` (:func:`gradaccum.examples.gpt.parallelize_gpt`: the MLPs
tensor-parallel, FSDP2 over ``dp_shard``), so the command the launch error suggests runs as it is.
Its float64 errors are summation order only (~1e-15 against a tolerance of 1e-10). A mesh that
leaves one micro-batch per data rank accumulates nothing; verify must say so.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from gradaccum.check.mesh import MESH_TOLERANCE, MeshReport

pytestmark = pytest.mark.distributed

PAGE = Path(__file__).resolve().parents[2] / "docs" / "distributed.md"
COMMAND = "torchrun --standalone --nproc-per-node 4 -m gradaccum verify --mesh dp_shard=2,tp=2"


def _shown_output() -> list[str]:
    """The output docs/distributed.md shows under the command, its figures masked."""
    text = PAGE.read_text(encoding="utf-8")
    assert COMMAND in text
    block = re.search(re.escape(COMMAND) + r"\n```\n\n```text\n(.*?)```", text, re.S)
    assert block is not None
    return _masked(block.group(1))


def _masked(text: str) -> list[str]:
    return [re.sub(r"\d\.\de-\d+", "E", line) for line in text.strip().splitlines()]


def _verify_mesh(mesh: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    command += ["-m", "gradaccum", "verify", "--mesh", mesh]
    return subprocess.run(command, capture_output=True, text=True, timeout=150, check=False)


@pytest.mark.timeout(180)
def test_verify_mesh_dp_shard_tp_on_the_default_workload() -> None:
    proc = _verify_mesh("dp_shard=2,tp=2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "verify --mesh dp_shard=2 x tp=2 on tiny_gpt" in proc.stdout
    assert "2 micro-batches per data rank" in proc.stdout and "PASS" in proc.stdout
    assert "weak check" not in proc.stdout
    assert _masked(proc.stdout) == _shown_output()  # the page shows this run's lines


@pytest.mark.timeout(180)
def test_verify_mesh_with_one_micro_batch_per_rank_says_the_check_was_weak() -> None:
    proc = _verify_mesh("dp_shard=4")  # 8 examples over 4 data ranks: one micro-batch of 2 each
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 micro-batches per data rank" in proc.stdout and "PASS" in proc.stdout
    assert "weak check: one micro-batch per data rank: nothing was accumulated" in proc.stdout
    assert "--micro-batch 1" in proc.stdout


def _report(micro_batches: int, examples_per_rank: int | None) -> MeshReport:
    return MeshReport(
        mesh="dp_shard=4",
        micro_batches=micro_batches,
        global_count=100,
        accumulated_vs_one_pass=0.0,
        accumulated_vs_single_process=1e-15,
        tolerance=MESH_TOLERANCE,
        examples_per_rank=examples_per_rank,
    )


def test_mesh_report_weakness_names_the_fix() -> None:
    assert _report(2, 4).weakness is None
    assert "--micro-batch 3" in (_report(1, 6).weakness or "")  # the largest proper divisor of 6
    assert "fewer data ranks" in (_report(1, 1).weakness or "")
