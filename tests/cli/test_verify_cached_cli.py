from __future__ import annotations

import pytest

from gradaccum.cli.main import main


def test_contrastive_fails_plainly_but_passes_through_the_gradient_cache(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["verify", "--workload", "gradaccum.examples:contrastive", "--trace-steps", "0"]) == 1
    assert "in-batch negatives" in capsys.readouterr().out
    assert main(["verify", "--workload", "gradaccum.examples:contrastive", "--cached"]) == 0
    out = capsys.readouterr().out
    assert "verdict: PASS" in out
    # scan and verify --cached say the same thing: the hazard is real, and the cache handles it
    assert "[error] declared-hazard" not in out
    assert "in-batch negatives, handled here by the gradient cache (CachedAccumulator)" in out


def test_cached_needs_the_workload_extras(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "--workload", "gradaccum.examples:tiny_gpt", "--cached"]) == 2
    assert "extras lack encode_fn and rep_loss_fn" in capsys.readouterr().err
