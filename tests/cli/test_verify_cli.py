"""``gradaccum verify`` and ``gradaccum scan``: exit codes 0 pass / 1 fail / 2 bad input, and messages."""

from __future__ import annotations

import pytest

from gradaccum.cli.main import main


def not_a_workload() -> dict[str, int]:
    """A workload function returning the wrong type (imported by the CLI in a test below)."""
    return {"batch_size": 8}


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_default_workload_passes_both_stages(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "verify", "--trace-steps", "2")
    assert code == 0
    assert "verify tiny_gpt" in out
    assert "tokens counted per micro-batch" in out
    assert "gradient tolerance: relative L2 per parameter. float64 rounds at 1.1e-16" in out
    assert "stage 2: 2 optimizer steps in float32" in out
    assert "trace tolerance:" in out
    assert "verdict: PASS" in out and "likely causes" not in out
    # the scan's section says what it found in one line; its "run verify" note is not repeated here
    assert "  scan for accum_steps=4: no layer or loss that couples examples found\n" in out
    assert "verify: the scan recognises" not in out


def test_explicit_partition_and_float32(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "verify", "--sizes", "1,3,4", "--dtype", "float32", "--trace-steps", "0")
    assert code == 0
    assert "micro-batches [1, 3, 4]" in out and "one update in float32" in out
    assert "stage 2" not in out


def test_batchnorm_cnn_fails_with_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "verify", "--workload", "gradaccum.examples:bn_cnn")
    assert code == 1
    assert "verdict: FAIL" in out
    assert "BatchNorm2d at `layer1.0.bn1` normalizes each micro-batch separately" in out
    assert "stage 2: not run, because stage 1 failed" in out
    assert "details and fixes: gradaccum scan --workload gradaccum.examples:bn_cnn" in out


def test_contrastive_encoder_fails_with_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(
        capsys, "verify", "--workload", "gradaccum.examples:contrastive", "--micro-batch", "4"
    )
    assert code == 1
    assert "the loss uses in-batch negatives" in out


@pytest.mark.parametrize(
    ("workload", "message"),
    [
        ("no_such_module_xyz:build", "cannot import workload module 'no_such_module_xyz'"),
        (
            "gradaccum.examples:no_such_function",
            "module 'gradaccum.examples' has no callable 'no_such_function'",
        ),
        ("gradaccum.examples.tiny_gpt", "workload must be written MODULE:FUNCTION"),
    ],
)
def test_unknown_workload_path_exits_2(
    capsys: pytest.CaptureFixture[str], workload: str, message: str
) -> None:
    for command in ("verify", "scan"):
        code, out, err = _run(capsys, command, "--workload", workload)
        assert code == 2, command
        assert message in err and out == ""


@pytest.mark.parametrize(
    ("argv", "messages"),
    [
        (
            ["--workload", "tests.cli.test_verify_cli:not_a_workload"],
            ["returned dict; it must return gradaccum.Workload"],
        ),
        (
            ["--micro-batch", "3"],
            [
                "--micro-batch 3 does not divide the batch of 8 examples of workload 'tiny_gpt'",
                "use a divisor of 8 (1, 2, 4, 8) or an explicit partition such as --sizes 3,3,2",
            ],
        ),
        (
            ["--sizes", "1,3"],
            ["--sizes 1,3 sums to 4, but workload 'tiny_gpt' verifies on a batch of 8 examples"],
        ),
        (["--trace-steps", "51"], ["at most 50"]),
    ],
    ids=["wrong-type", "micro-batch-not-dividing", "partition-short", "trace-too-long"],
)
def test_bad_verify_settings_exit_2_naming_the_fix(
    argv: list[str], messages: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _run(capsys, "verify", *argv)
    assert code == 2 and out == ""
    for message in messages:
        assert message in err


@pytest.mark.parametrize(
    "argv",
    [
        ["verify", "--sizes", "1,x"],
        ["verify", "--sizes", "0,8"],
        ["verify", "--micro-batch", "2", "--sizes", "4,4"],
        ["verify", "--micro-batch", "0"],
        ["verify", "--dtype", "bfloat16"],
        ["scan", "--accum-steps", "0"],
    ],
)
def test_malformed_arguments_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_scan_prints_the_effective_momentum(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "scan", "--workload", "gradaccum.examples:bn_cnn", "--accum-steps", "4")
    assert code == 0
    assert (
        "BatchNorm2d at `bn1`, `layer1.0.bn1` and `layer1.0.bn2`: normalizes each micro-batch separately"
        in out
    )
    assert "1 - (1 - 0.1)^4 = 0.3439 instead of 0.1" in out
    assert "3 findings break equivalence" in out
    assert "`gradaccum verify` is the empirical check" in out


def test_scan_strict_exits_1_only_on_breaking_findings(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(capsys, "scan", "--workload", "gradaccum.examples:contrastive", "--strict")[0] == 1
    code, out, _ = _run(capsys, "scan", "--strict")
    assert code == 0
    assert "nothing found that breaks equivalence" in out


def test_scan_needs_accum_steps_when_the_micro_batch_does_not_divide(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, _, err = _run(capsys, "scan", "--micro-batch", "3")
    assert code == 2 and "give --accum-steps" in err


def test_unknown_device_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, "verify", "--device", "floppy")
    assert code == 2 and out == ""
    assert "--device 'floppy' is not a device" in err


def test_precision_is_the_one_name_and_the_old_names_are_aliases(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["verify", "--sizes", "2,6", "--trace-steps", "1"]
    code, out, _ = _run(capsys, *args, "--precision", "float64", "--check-precision", "float32")
    assert code == 0 and "one update in float32" in out and "optimizer steps in float64" in out
    code, old, _ = _run(capsys, *args, "--trace-dtype", "float64", "--dtype", "float32")
    assert code == 0 and "one update in float32" in old and "optimizer steps in float64" in old
