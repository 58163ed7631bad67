"""First contact with ``gradaccum verify``: every output line true on its own.

A new user runs verify on the bundled workloads, on a workload of their own and on a mixture of
experts. What must hold on every line: a line that says FAIL names its cause on that line (the
denominator, a figure over its tolerance, a non-finite value) or shows a figure beside a tolerance
it exceeds; no PASS output carries an ``[error]`` line (what gradaccum's own path handles is a note
that says so); the count lines say what they count and over which examples. And the causal-LM
count a user writes from the docs (``count_tokens("labels", shift=True)``) counts exactly the
positions the loss sums over, while the shift-less call is refused naming ``shift``.

The workloads below are imported by the CLI as ``tests.journeys.test_verify_output:NAME``.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import gradaccum
from gradaccum.cli.main import main
from gradaccum.examples import tiny_gpt
from tests.helpers import hf as h

HERE = "tests.journeys.test_verify_output"
CAUSES = ("the denominator", "(over tol", "non-finite", "over the tolerance", "skipped different")
"""What a FAIL line outside a table names: one of these, each with its figure."""
VOCAB, SEQ = 40, 12


def miscounted() -> gradaccum.Workload:
    """The bundled GPT, whose labels are already aligned, counted as if they were shifted."""
    return dataclasses.replace(
        tiny_gpt(), name="miscounted", count_fn=gradaccum.count_tokens("labels", shift=True)
    )


def _gpt2() -> nn.Module:
    from tests.integrations import common

    return common.gpt2(0, 0.0, layers=1, vocab=VOCAB, positions=SEQ)


def _rows(n: int, seed: int) -> dict[str, torch.Tensor]:
    """Padded rows of 0 to 12 tokens, labels == inputs (a Hugging Face causal LM's), -100 at pads."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (n, SEQ), generator=gen)
    lengths = torch.randint(0, SEQ + 1, (n,), generator=gen)
    lengths[0] = 0  # an all-padding row
    mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
    return {"input_ids": ids * mask, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _shifted_sum(model: nn.Module, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits
    return gradaccum.summed_cross_entropy(logits, mb["labels"], shift=True)


def causal_lm() -> gradaccum.Workload:
    """A transformers GPT-2 counted and summed as the docs write it for a causal LM."""
    return gradaccum.Workload(
        name="causal-lm",
        build_model=_gpt2,
        make_batch=_rows,
        loss_fn=_shifted_sum,
        count_fn=gradaccum.count_tokens("labels", shift=True),
        description="a tiny transformers GPT-2, labels == inputs",
    )


def shiftless() -> gradaccum.Workload:
    """The same, with the count the README once showed: no shift."""
    return dataclasses.replace(causal_lm(), count_fn=gradaccum.count_tokens("labels"))


def _verify(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str], str]:
    code = main(["verify", *argv])
    out, err = capsys.readouterr()
    return code, out.splitlines(), err


def _assert_fail_lines_name_their_cause(lines: list[str]) -> None:
    for line in lines:
        if "FAIL" not in line:
            continue
        if "│" in line:  # a table row: check │ error │ tolerance │ result
            _, error, tol, _ = (cell.strip() for cell in line.split("│"))
            if tol == "equal":
                counted, used = map(int, re.findall(r"\d+", error))
                assert counted != used, line
            else:
                assert not float(error) <= float(tol), line
        else:
            assert any(cause in line for cause in CAUSES), line


def _assert_no_error_line(lines: list[str]) -> None:
    assert not [line for line in lines if "[error]" in line]


def test_the_first_verify_passes_with_counts_that_say_what_and_where(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, lines, _ = _verify(capsys, "--trace-steps", "0")
    assert code == 0
    assert not [line for line in lines if "FAIL" in line]
    _assert_no_error_line(lines)
    assert (
        "  tokens counted per micro-batch of the verification batch (8 examples, seed 0): 27, 50, 40, 19 "
        "(N = 136 tokens)" in lines
    )
    assert (
        "  denominator: consistent: count_fn counts exactly the 136 tokens the loss sums over in the 8 "
        "examples of the checked batch (the output positions that receive a gradient)"
    ) in lines
    assert lines[-2] == "verdict: PASS"


def test_a_wrong_count_fails_on_lines_that_name_the_denominator(capsys: pytest.CaptureFixture[str]) -> None:
    code, lines, _ = _verify(capsys, "--workload", f"{HERE}:miscounted", "--trace-steps", "0")
    assert code == 1
    _assert_fail_lines_name_their_cause(lines)
    # the gradients agree (both sides divide by the same wrong count): the denominator is the cause
    (row,) = [line for line in lines if line.lstrip().startswith("denominator audit")]
    assert re.search(r"│ 128 counted, 136 used │ +equal │ +FAIL", row), row
    for line in lines:
        if line.lstrip().startswith(("gradients before", "parameters after")):
            assert line.rstrip().endswith("PASS"), line
    denominator = (
        "the denominator: count_fn counts 128 tokens where the loss uses 136 output positions "
        "(4 of 4 micro-batches)"
    )
    assert f"verdict: FAIL (stage 1: {denominator})" in lines
    (stage1,) = [line for line in lines if line.startswith("  stage 1: ")]
    assert stage1.startswith(f"  stage 1: FAIL: {denominator}; gradient max rel err ")


def test_batch_norm_fails_on_figures_over_their_tolerance(capsys: pytest.CaptureFixture[str]) -> None:
    code, lines, _ = _verify(capsys, "--workload", "gradaccum.examples:bn_cnn", "--trace-steps", "0")
    assert code == 1
    _assert_fail_lines_name_their_cause(lines)
    (verdict,) = [line for line in lines if line.startswith("verdict: ")]
    assert (
        verdict.startswith("verdict: FAIL (stage 1: gradient max rel err ") and "(over tol 1e-10)" in verdict
    )
    (stage1,) = [line for line in lines if line.startswith("  stage 1: ")]
    assert re.match(
        r"  stage 1: FAIL: gradient max rel err \S+ \(over tol 1e-10\), parameter max abs diff", stage1
    )


def test_an_moe_router_balanced_by_gradaccum_is_a_note_under_pass(capsys: pytest.CaptureFixture[str]) -> None:
    code, lines, _ = _verify(
        capsys, "--workload", "tests.helpers.moe_workloads:routing_mixtral", "--trace-steps", "0"
    )
    assert code == 0
    _assert_no_error_line(lines)
    assert (
        "[info] moe-router: the MixtralForCausalLM routes tokens with load-balancing statistics computed per "
        "forward, handled here by the window's exact load balance (LoadBalance mode 'exact')"
    ) in lines
    assert any(line.startswith("load balance: exact ") and ") PASS; from exact:" in line for line in lines)
    assert "verdict: PASS" in lines


def test_an_hf_moe_folder_passes_without_an_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import MixtralConfig

    folder = tmp_path / "moe"
    folder.mkdir()
    tokenizer = h.word_tokenizer(h.WORDS)
    tokenizer.save_pretrained(folder)
    MixtralConfig(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64, num_local_experts=4,
        num_experts_per_tok=2, pad_token_id=0, output_router_logits=True, router_aux_loss_coef=0.05,
    ).save_pretrained(folder)  # fmt: skip
    data = h.write_txt(tmp_path / "data.txt", h.texts())
    code, lines, _ = _verify(capsys, "--workload", f"hf:{folder}", "--data", str(data), "--trace-steps", "0")
    assert code == 0
    _assert_no_error_line(lines)
    assert any(
        line.startswith("[info] moe-router: ") and "handled here by the window's exact" in line
        for line in lines
    )
    (counts,) = [line for line in lines if " counted per micro-batch " in line]
    assert counts.startswith(
        "  tokens counted per micro-batch of the verification batch (8 examples, seed 0): "
    )
    assert "verdict: PASS" in lines


def test_the_docs_causal_lm_count_is_the_positions_the_loss_sums_over(
    capsys: pytest.CaptureFixture[str],
) -> None:
    batch = _rows(8, 0)
    count = int(gradaccum.count_tokens("labels", shift=True)(batch))
    logits = _gpt2()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.detach()
    logits.requires_grad_(True)
    gradaccum.summed_cross_entropy(logits, batch["labels"], shift=True).backward()
    assert logits.grad is not None
    assert int((logits.grad != 0).any(dim=-1).sum()) == count == int(gradaccum.CausalLMLoss().count_fn(batch))

    code, lines, _ = _verify(capsys, "--workload", f"{HERE}:causal_lm", "--trace-steps", "0")
    assert code == 0
    assert (
        f"  denominator: consistent: count_fn counts exactly the {count} tokens the loss sums over in the 8 "
        "examples of the checked batch (the output positions that receive a gradient)" in lines
    )

    code, lines, err = _verify(capsys, "--workload", f"{HERE}:shiftless", "--trace-steps", "0")
    assert code == 2 and lines == []
    assert (
        "count_tokens('labels'): give shift explicitly, it has no default: shift=True for labels equal to "
        "the inputs, as Hugging Face causal LMs take them" in " ".join(err.split())
    )
