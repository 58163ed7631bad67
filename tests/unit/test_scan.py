"""The static hazard scan: what it recognises, the figures it reports, and how it reads."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from gradaccum.errors import PlanError
from gradaccum.examples import bn_cnn, contrastive, tiny_gpt
from gradaccum.hazards.scanner import Finding, effective_momentum, matched_momentum, scan

# Momentum figures are a few float operations on numbers near 1: exact to ~1e-16, so 1e-12 is a
# tolerance on arithmetic, not on a model.
EXACT = 1e-12


def _by_code(findings: list[Finding], code: str) -> list[Finding]:
    return [f for f in findings if f.code == code]


def test_effective_batchnorm_momentum_for_k_4_is_0_3439() -> None:
    assert effective_momentum(0.1, 4) == pytest.approx(0.3439, abs=EXACT)
    # the per-forward momentum that restores 0.1 per step, applied 4 times, gives 0.1 back
    assert effective_momentum(matched_momentum(0.1, 4), 4) == pytest.approx(0.1, abs=EXACT)

    (finding,) = _by_code(
        scan(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)), accum_steps=4), "batch-norm"
    )
    assert finding.severity == "error" and finding.breaks_equivalence
    assert finding.path == "1" and finding.kind == "BatchNorm1d"
    assert finding.figures["effective_momentum"] == pytest.approx(0.3439, abs=EXACT)
    assert finding.figures["matched_momentum"] == pytest.approx(0.0260, abs=1e-4)
    text = str(finding)
    assert "1 - (1 - 0.1)^4 = 0.3439 instead of 0.1" in text
    assert "momentum=0.0260" in text
    assert "SyncBatchNorm" in text and "GroupNorm/LayerNorm" in text and "16+" in text


def test_bundled_cnn_names_every_batchnorm_by_path() -> None:
    workload = bn_cnn()
    findings = scan(workload.build_model(), accum_steps=4, micro_batch=2)
    assert [f.path for f in _by_code(findings, "batch-norm")] == ["bn1", "layer1.0.bn1", "layer1.0.bn2"]
    first = _by_code(findings, "batch-norm")[1]
    assert first.headline == "BatchNorm2d at `layer1.0.bn1` normalizes each micro-batch separately"
    assert "2 examples per forward instead of 8" in first.explanation


def test_momentum_none_is_a_cumulative_average_without_a_momentum_figure() -> None:
    (finding,) = _by_code(scan(nn.BatchNorm1d(4, momentum=None), accum_steps=4), "batch-norm")
    assert finding.path == "" and finding.headline.startswith("the BatchNorm1d")
    assert "cumulative average (momentum=None)" in finding.explanation
    assert "num_batches_tracked counts micro-batches (4 per optimizer step)" in finding.explanation
    assert "effective_momentum" not in finding.figures
    assert "momentum=0." not in finding.fix


def test_batchnorm_modes_decide_the_severity() -> None:
    # eval mode with running statistics: no coupling now, only a note
    eval_bn = nn.Sequential(nn.BatchNorm2d(3)).eval()
    (note,) = [f for f in scan(eval_bn, 4) if f.path == "0"]
    assert note.severity == "info" and not note.breaks_equivalence
    # no running statistics: batch statistics even in eval mode, and no momentum to report
    (stateless,) = _by_code(
        scan(nn.Sequential(nn.BatchNorm2d(3, track_running_stats=False)).eval(), 4), "batch-norm"
    )
    assert stateless.severity == "error" and "momentum" not in stateless.figures
    # SyncBatchNorm does not suggest itself as the fix
    (sync,) = _by_code(scan(nn.Sequential(nn.SyncBatchNorm(3)), 4), "batch-norm")
    assert "already pools statistics across GPUs, but not across micro-batches in time" in sync.fix


def test_instance_norm_gradients_are_exact_only_running_stats_see_k() -> None:
    assert [f.code for f in scan(nn.InstanceNorm2d(3), 4)] == ["verify"]
    (finding,) = _by_code(
        scan(nn.Sequential(nn.InstanceNorm2d(3, track_running_stats=True)), 4), "running-stats"
    )
    assert finding.severity == "warning"
    assert "gradients are exact" in finding.explanation
    assert finding.figures["effective_momentum"] == pytest.approx(0.3439, abs=EXACT)


def test_random_layers_are_warnings_and_switched_off_ones_are_silent() -> None:
    model = nn.Sequential(
        nn.Linear(4, 4),
        nn.Dropout(0.1),
        nn.Dropout(0.0),  # draws nothing
        nn.RReLU(),
        nn.MultiheadAttention(4, 2, dropout=0.2),
        nn.FractionalMaxPool2d(2, output_size=1),
    )
    found = _by_code(scan(model, 4), "random-layer")
    assert [f.path for f in found] == ["1", "3", "4", "5"]
    assert all(f.severity == "warning" for f in found)
    assert "verify switches it off" in found[0].fix
    assert "verify switches it off" not in found[3].fix  # fractional pooling cannot be switched off
    model.eval()
    assert [f.path for f in _by_code(scan(model, 4), "random-layer")] == ["5"]  # random in eval too


class Top2Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 4)
        self.num_experts = 4
        self.l_aux = torch.zeros(())


class SparseMoEBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = Top2Gate()
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.num_experts = 4
        self.drop = nn.Dropout(0.1)


class GatedMLP(nn.Module):
    """A GLU MLP: 'gate' in its name, but no experts and no balancing loss."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(8, 16)
        self.up_proj = nn.Linear(8, 16)


def test_moe_routers_are_recognised_once_per_block() -> None:
    model = nn.Sequential(SparseMoEBlock(), GatedMLP(), nn.Sequential(Top2Gate()))
    found = _by_code(scan(model, 4), "moe-router")
    # the block by its class name and expert count; its own gate is the same finding; a bare gate by l_aux
    assert [(f.path, f.kind) for f in found] == [("0", "SparseMoEBlock"), ("2.0", "Top2Gate")]
    assert found[0].severity == "error" and found[0].figures["num_experts"] == 4
    assert "balancing loss once per optimizer step" in found[0].fix
    # it points to the fix and says what its modes do
    assert "gradaccum.moe.LoadBalance.from_model(model)" in found[0].fix
    assert all(f"'{mode}'" in found[0].fix for mode in ("exact", "lagged", "micro-batch"))
    # other rules still look inside the block
    assert [f.path for f in _by_code(scan(model, 4), "random-layer")] == ["0.drop"]


def test_declared_hazards_known_and_unknown() -> None:
    findings = scan(nn.Linear(2, 2), 4, micro_batch=2, declared_hazards=["in-batch-negatives", "odd"])
    known, unknown = _by_code(findings, "declared-hazard")
    assert known.headline.startswith("the loss uses in-batch negatives")
    assert "each example meets 1 instead of 7 negatives" in known.explanation
    assert "gradient cache" in known.fix
    assert unknown.severity == "error" and "'odd'" in unknown.summary
    # without a micro-batch size the explanation stays true without figures
    (unsized,) = _by_code(
        scan(nn.Linear(2, 2), 3, declared_hazards=["in-batch-negatives"]), "declared-hazard"
    )
    assert "Split into 3 micro-batches" in unsized.explanation


def test_contrastive_workload_declares_in_batch_negatives() -> None:
    workload = contrastive()
    findings = scan(workload.build_model(), 4, declared_hazards=workload.declared_hazards)
    assert [f.code for f in findings] == ["declared-hazard", "verify"]


def test_every_scan_ends_with_the_verify_note_and_errors_come_first() -> None:
    model = nn.Sequential(nn.Dropout(0.5), nn.BatchNorm1d(3), nn.InstanceNorm1d(3, track_running_stats=True))
    findings = scan(model, 2)
    assert [f.severity for f in findings] == ["error", "warning", "warning", "info"]
    last = findings[-1]
    assert last.code == "verify" and "`gradaccum verify` is the empirical check" in str(last)
    assert [f.code for f in scan(tiny_gpt().build_model(), 4)] == ["verify"]


def test_one_micro_batch_per_step_splits_nothing() -> None:
    codes = [f.code for f in scan(nn.Sequential(nn.BatchNorm1d(3), nn.Dropout(0.5)), 1)]
    assert codes == ["note", "verify"]


def test_str_reads_as_one_sentence_chain() -> None:
    (finding,) = _by_code(scan(nn.Sequential(nn.BatchNorm1d(4)), 4, micro_batch=4), "batch-norm")
    text = str(finding)
    assert text.startswith("[error] batch-norm: BatchNorm1d at `0` normalizes each micro-batch separately. ")
    assert "4 examples per forward instead of 16" in text and " Fix: accept it" in text


def test_scan_leaves_the_model_alone() -> None:
    model = nn.Sequential(nn.BatchNorm1d(3), nn.Dropout(0.5))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    scan(model, 4)
    assert model.training and all(m.training for m in model.modules())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize(("accum_steps", "micro_batch"), [(0, None), (True, None), (2.0, None), (2, 0)])
def test_bad_plan_is_refused(accum_steps: object, micro_batch: object) -> None:
    with pytest.raises(PlanError, match="must be a positive integer"):
        scan(nn.Linear(2, 2), accum_steps, micro_batch=micro_batch)  # type: ignore[arg-type]


class _Config:
    def __init__(self, **values: object) -> None:
        self.__dict__.update(values)


class MoEModel(nn.Module):
    """Like transformers' Mixtral: the model holds the coefficient, its config the switch."""

    def __init__(self, output_router_logits: bool, capacity_factor: float | None = None) -> None:
        super().__init__()
        self.config = _Config(output_router_logits=output_router_logits, capacity_factor=capacity_factor)
        self.router_aux_loss_coef = 0.02
        self.block = SparseMoEBlock()


def test_a_router_whose_balancing_loss_is_off_is_a_note_not_an_error() -> None:
    (off,) = _by_code(scan(MoEModel(False), 4), "moe-router")
    assert off.severity == "info" and not off.breaks_equivalence
    assert "output_router_logits=False" in off.explanation and "exact" in off.explanation
    assert "LoadBalance" in off.fix
    (on,) = _by_code(scan(MoEModel(True), 4), "moe-router")
    assert on.severity == "error"
    # an expert capacity drops tokens per forward: still an error with the loss off
    (capped,) = _by_code(scan(MoEModel(False, capacity_factor=1.25), 4), "moe-router")
    assert capped.severity == "error"


def test_transformers_mixtral_with_its_default_config_is_a_note() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
    )  # fmt: skip
    assert config.output_router_logits is False  # the default: no balancing loss in the forward
    (found,) = _by_code(scan(transformers.MixtralForCausalLM(config), 4), "moe-router")
    assert found.severity == "info"
    config.output_router_logits = True
    (found,) = _by_code(scan(transformers.MixtralForCausalLM(config), 4), "moe-router")
    assert found.severity == "error"


def test_seven_dropouts_are_one_finding_with_their_places(capsys: pytest.CaptureFixture[str]) -> None:
    from gradaccum.cli.common import render_findings

    model = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1)) for _ in range(7)])
    render_findings(scan(model, 4))
    out = capsys.readouterr().out
    assert out.count("random-layer") == 1 and out.count("draws random numbers") == 1
    assert "Dropout at `0.1`, `1.1`, `2.1`, `3.1`, `4.1`, `5.1` and `6.1`" in out
    assert "(p -> 0, restored afterwards)" in out
