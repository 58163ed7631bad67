import pytest

from gradaccum import BatchPlan, ConfigError, PlanError, windows
from gradaccum.plan import compare_plans, factorizations


def test_batch_equation() -> None:
    assert BatchPlan(micro_batch=4, accum_steps=8, dp=8).global_batch == 256


def test_from_world_divides_out_model_parallel_ranks() -> None:
    plan = BatchPlan.from_world(world_size=64, tp=8, pp=1, cp=1, micro_batch=4, accum_steps=8)
    assert plan.dp == 8
    assert plan.global_batch == 256  # TP ranks do not multiply the batch


def test_from_world_names_the_numbers_when_not_divisible() -> None:
    with pytest.raises(PlanError, match=r"world_size=48 .* tp\*pp\*cp = 8\*4\*1 = 32"):
        BatchPlan.from_world(world_size=48, tp=8, pp=4, micro_batch=1, accum_steps=1)


def test_solve_and_its_error_names_nearest_batches() -> None:
    assert BatchPlan.solve(global_batch=256, micro_batch=4, dp=8).accum_steps == 8
    with pytest.raises(PlanError, match="nearest reachable global batches are 256 or 288"):
        BatchPlan.solve(global_batch=260, micro_batch=4, dp=8)
    with pytest.raises(PlanError, match="are 32"):
        BatchPlan.solve(global_batch=20, micro_batch=4, dp=8)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "4", None])
def test_sizes_must_be_positive_integers(bad: object) -> None:
    with pytest.raises(PlanError, match="micro_batch must be a positive integer"):
        BatchPlan(micro_batch=bad, accum_steps=1)  # type: ignore[arg-type]


def test_seeds_update_counts() -> None:
    assert BatchPlan(micro_batch=4, dp=8, accum_steps=1).optimizer_updates(25_600) == 800
    assert BatchPlan(micro_batch=4, dp=8, accum_steps=8).optimizer_updates(25_600) == 100
    plan = BatchPlan(micro_batch=4, dp=8, accum_steps=8)
    assert plan.optimizer_updates(25_601) == 101  # the final partial window is one more update
    assert plan.optimizer_updates(25_601, final_window="drop") == 100
    assert plan.tokens_per_step(2048) == 524_288


def test_seeds_table_comparison() -> None:
    cmp = compare_plans(
        {
            "A": BatchPlan(micro_batch=8, dp=8, accum_steps=4),
            "B": BatchPlan(micro_batch=4, dp=8, accum_steps=8),
            "changed": BatchPlan(micro_batch=4, dp=8, accum_steps=1),
        },
        seq_len=2048,
        dataset_size=25_600,
    )
    a, b, changed = cmp.rows
    assert a.controlled and b.controlled and not changed.controlled
    assert (b.same_global_batch, b.same_tokens, b.same_updates) == (True, True, True)
    assert (changed.same_global_batch, changed.same_tokens, changed.same_updates) == (False, False, False)
    assert changed.optimizer_updates == 800 and b.optimizer_updates == 100
    verdicts = cmp.verdicts()
    assert "held fixed" in verdicts[0]
    assert "NOT a controlled comparison" in verdicts[1] and "updates 100 -> 800" in verdicts[1]


def test_factorizations_cover_every_divisor() -> None:
    plans = factorizations(16, dp=2)
    assert [(p.micro_batch, p.accum_steps) for p in plans] == [(8, 1), (4, 2), (2, 4), (1, 8)]
    assert all(p.global_batch == 16 for p in plans)


def test_windows_keep_the_short_final_window() -> None:
    assert list(windows(range(7), 3)) == [[0, 1, 2], [3, 4, 5], [6]]
    assert list(windows([], 3)) == []
    with pytest.raises(PlanError):
        list(windows(range(3), 0))


def test_from_mesh_multiplies_the_batch_by_data_replicas_and_shards_only() -> None:
    shape = {"dp_replicate": 2, "dp_shard": 4, "cp": 2, "tp": 2, "pp": 2}
    plan = BatchPlan.from_mesh(shape, micro_batch=2, accum_steps=8)
    assert plan.dp == 8 and plan.global_batch == 2 * 8 * 8
    renamed = BatchPlan.from_mesh(
        {"fsdp": 4, "tp": 2}, micro_batch=1, accum_steps=2, mesh_dims={"dp_shard": "fsdp"}
    )
    assert renamed.dp == 4
    with pytest.raises(ConfigError, match="play no known role"):
        BatchPlan.from_mesh({"fsdp": 4}, micro_batch=1, accum_steps=1)
