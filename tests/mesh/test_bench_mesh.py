"""``gradaccum bench --mesh`` under torchrun (4 gloo processes): the HSDP sync policies' collectives
per mesh dimension, counted, against the declared model; the gradient memory each holds; the
advisor's choice under a budget. And the bad input it refuses before any rank waits for another.

The tiny transformer (float64) has U = 3 FSDP2 units (two blocks and the root) and G = 42,176 B of
gradients per rank per micro-batch before sharding (5,272 parameters x 8 B); every parameter's
dim 0 is even, so FSDP2 pads nothing and the bytes are exact.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from gradaccum.bench.mesh.advice import advise_policy
from gradaccum.bench.mesh.measure import PolicyBench
from gradaccum.bench.mesh.model import Traffic, held_model, policy_model
from gradaccum.cli.main import main

K = 3
UNITS = 3
G = 42_176  # TinyTransformer's parameters in float64 (TP splits half of them on the tp mesh)
BUDGET = 30_000  # between defer's 42,176 B held and defer_replicate's 21,088 B
WORKLOAD = "tests.mesh.models:workload"


def _bench(mesh: str, *extra: str) -> dict[str, Any]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    command += ["-m", "gradaccum", "bench", "--workload", WORKLOAD, "--mesh", mesh, "--json", *extra]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=150, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out: dict[str, Any] = json.loads(proc.stdout[proc.stdout.index("{") :])
    return out


@pytest.fixture(scope="module")
def hsdp() -> dict[str, Any]:
    return _bench("dp_replicate=2,dp_shard=2", "--accum-steps", str(K), "--memory-budget", str(BUDGET))


def _calls(policy: dict[str, Any]) -> dict[tuple[str, str], int]:
    return {(t["collective"], t["dimension"]): t["calls"] for t in policy["measured"]}


# per update, 3 FSDP2 units, k micro-batches: (reduce-scatters over dp_shard, all-reduces over
# dp_replicate); the step's own: 2 all-reduces over every rank
DECLARED = {"defer": (UNITS, UNITS), "defer_replicate": (K * UNITS, UNITS), "every": (K * UNITS, K * UNITS)}


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_counted_collectives_per_dimension_are_the_declared_ones(hsdp: dict[str, Any]) -> None:
    assert hsdp["mesh"] == "dp_replicate=2 x dp_shard=2" and hsdp["world"] == 4
    assert (hsdp["accum_steps"], hsdp["fsdp_units"], hsdp["grad_bytes"]) == (K, UNITS, G)
    assert [p["policy"] for p in hsdp["policies"]] == ["defer", "defer_replicate", "every"]
    for p in hsdp["policies"]:
        calls = _calls(p)
        scatters, reduces = DECLARED[p["policy"]]
        assert calls[("reduce_scatter", "dp_shard")] == scatters, p
        assert calls[("all_reduce", "dp_replicate")] == reduces, p
        assert calls[("all_reduce", "world")] == 2, p
        # parameter all-gathers: the same under every policy
        assert calls[("all_gather", "dp_shard")] == _calls(hsdp["policies"][0])[("all_gather", "dp_shard")]
        assert p["model_disagreements"] == [], p  # bytes too: measured = modelled


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_defer_holds_the_unsharded_gradients_the_others_their_shards(hsdp: dict[str, Any]) -> None:
    held = {p["policy"]: p["grad_bytes_held"] for p in hsdp["policies"]}
    assert held["defer"] == G  # every unit's unsharded gradient, until the last micro-batch
    assert held["defer_replicate"] == held["every"] == G // 2  # dp_shard = 2
    assert held["defer"] > held["defer_replicate"]


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_the_advisor_picks_the_least_communication_that_fits_the_budget(hsdp: dict[str, Any]) -> None:
    advice = hsdp["advice"]
    assert advice["budget_bytes"] == BUDGET and advice["chosen"] == "defer_replicate"
    assert "defer communicates less but holds 41.2 KiB" in advice["sentence"]
    by_policy = {p["policy"]: p for p in hsdp["policies"]}
    assert by_policy["defer"]["comm_bytes"] < by_policy["defer_replicate"]["comm_bytes"]
    assert by_policy["defer_replicate"]["comm_bytes"] < by_policy["every"]["comm_bytes"]


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_fsdp2_x_tensor_parallel_has_no_replica_dimension_and_states_the_trade_off() -> None:
    out = _bench("dp_shard=2,tp=2", "--accum-steps", "2")
    assert [p["policy"] for p in out["policies"]] == ["defer", "every"]
    tp_bytes = out["grad_bytes"]
    assert 0 < tp_bytes < G  # the TP layers' gradients are split over tp
    for p in out["policies"]:
        calls = _calls(p)
        assert calls[("reduce_scatter", "dp_shard")] == (UNITS if p["policy"] == "defer" else 2 * UNITS)
        assert not any(dim in ("dp_replicate", "tp", "other") for _, dim in calls)
        assert p["model_disagreements"] == [], p
    assert out["advice"]["chosen"] is None and "give --memory-budget" in out["advice"]["sentence"]


def test_the_model_per_dimension() -> None:
    rows = policy_model("every", accum_steps=4, grad_bytes=800, units=2, shard=4, replicate=3)
    assert rows == (
        Traffic(collective="reduce_scatter", dimension="dp_shard", calls=8, bytes=3200),
        Traffic(collective="all_reduce", dimension="dp_replicate", calls=8, bytes=800),
        Traffic(collective="all_reduce", dimension="world", calls=2, bytes=None),
    )
    defer = policy_model("defer", accum_steps=4, grad_bytes=800, units=2, shard=4, replicate=1)
    assert [(t.collective, t.dimension, t.calls, t.bytes) for t in defer[:1]] == [
        ("reduce_scatter", "dp_shard", 2, 800)
    ]
    assert len(defer) == 2  # no replica all-reduce without dp_replicate
    assert held_model("defer", grad_bytes=800, shard=4) == 800
    assert held_model("defer_replicate", grad_bytes=800, shard=4) == 200


def _policy(name: str, comm: int, held: int) -> PolicyBench:
    traffic = (Traffic(collective="all_reduce", dimension="dp_replicate", calls=1, bytes=comm),)
    return PolicyBench(
        policy=name, measured=traffic, modelled=traffic, grad_bytes_held=held, grad_bytes_held_model=held
    )


def test_the_advisor_without_a_budget_and_when_nothing_fits() -> None:
    policies = [
        _policy("defer", 100, 4096),
        _policy("defer_replicate", 200, 1024),
        _policy("every", 300, 1024),
    ]
    assert advise_policy(policies, None).chosen is None
    assert "defer communicates least" in advise_policy(policies, None).sentence
    assert "defer_replicate holds least" in advise_policy(policies, None).sentence
    assert advise_policy(policies, 4096).chosen == "defer"
    assert advise_policy(policies, 2000).chosen == "defer_replicate"
    none = advise_policy(policies, 1000)
    assert none.chosen is None and "no policy's gradients fit" in none.sentence


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--mesh", "dp_replicate=2,dp_shard=2"], {}, "torchrun --nproc-per-node 4"),
        (["--mesh", "dp_replicate=2,dp_shard=2"], {"WORLD_SIZE": "2"}, "has 4 ranks but torchrun started 2"),
        (["--mesh", "fsdp=4"], {"WORLD_SIZE": "4"}, "play no known role"),
        (["--mesh", "dp_shard=2,dp_shard=2"], {"WORLD_SIZE": "4"}, "names dimension 'dp_shard' twice"),
        (["--mesh", "dp_shard=2,cp=2"], {"WORLD_SIZE": "4"}, "leave out cp and pp"),
        (["--mesh", "dp_shard=4", "--configs", "2x2"], {"WORLD_SIZE": "4"}, "--configs belong(s)"),
        (["--mesh", "dp_shard=4", "--memory-budget", "lots"], {"WORLD_SIZE": "4"}, "a memory size"),
    ],
)
def test_bad_mesh_input_exits_2_before_any_rank_waits(
    argv: list[str], env: dict[str, str], message: str, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert main(["bench", "--workload", WORKLOAD, *argv]) == 2
    assert message in capsys.readouterr().err
