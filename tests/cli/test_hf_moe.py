"""``verify --workload hf:DIR`` on a transformers MoE folder saved with its default expert kernel:
the float64 check runs the experts on the eager kernel (the fused ones take no float64) and says
so, the balancing term included; a kernel that cannot be switched exits 2 naming
``experts_implementation`` and ``--check-precision float32``. ``train --precision float64`` on the
folder switches it the same way."""

from __future__ import annotations

from pathlib import Path

import pytest

from gradaccum.cli.main import main
from tests.helpers import hf as h


def _moe_folder(tmp_path: Path) -> tuple[Path, Path]:
    from transformers import MixtralConfig

    folder = tmp_path / "moe"
    folder.mkdir()
    tokenizer = h.word_tokenizer(h.WORDS)
    tokenizer.save_pretrained(folder)
    config = MixtralConfig(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, num_local_experts=4,
        num_experts_per_tok=2, pad_token_id=0, output_router_logits=True, router_aux_loss_coef=0.05,
    )  # fmt: skip
    assert config._experts_implementation != "eager"  # saved with its default kernel
    config.save_pretrained(folder)
    return folder, h.write_txt(tmp_path / "data.txt", h.texts())


def _verify(folder: Path, data: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str]:
    code = main(["verify", "--workload", f"hf:{folder}", "--data", str(data), "--trace-steps", "0", *extra])
    captured = capsys.readouterr()
    return code, " ".join((captured.out + captured.err).split())


def test_an_moe_folder_passes_the_float64_check_on_eager_experts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = _verify(*_moe_folder(tmp_path), capsys)
    assert code == 0, out
    assert "runs hf:moe's experts on transformers' eager kernel" in out
    assert "load balance: exact" in out and "from the full batch's objective (tolerance 1e-10) PASS" in out
    assert "verdict: PASS" in out


def test_a_kernel_that_cannot_be_switched_is_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import MixtralForCausalLM

    def refuse(self: object, implementation: object) -> None:
        raise RuntimeError("locked at load time")

    monkeypatch.setattr(MixtralForCausalLM, "set_experts_implementation", refuse)
    code, out = _verify(*_moe_folder(tmp_path), capsys)
    assert code == 2, out
    assert "experts_implementation" in out and "--check-precision float32" in out
    assert "got Double" not in out


def test_the_float32_check_keeps_the_folders_kernel(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = _verify(*_moe_folder(tmp_path), capsys, "--check-precision", "float32")
    assert code == 0, out
    assert "eager kernel" not in out


def test_float64_training_of_an_moe_folder_runs_eager_experts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder, data = _moe_folder(tmp_path)
    argv = ["train", "--workload", f"hf:{folder}", "--data", str(data), "--precision", "float64"]
    code = main(
        [*argv, "--steps", "1", "--global-batch", "4", "--micro-batch", "2", "--run-dir", str(tmp_path / "r")]
    )
    captured = capsys.readouterr()
    out = " ".join((captured.out + captured.err).split())
    assert code == 0, out
    assert "experts: float64 training runs hf:moe's experts on transformers' eager kernel" in out
    assert "load balance: exact, coefficient 0.05" in out
