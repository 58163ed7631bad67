"""Plain progress lines when stdout is not a terminal: at once on a stage change, then every few s."""

from __future__ import annotations

import io
import time

from gradaccum.cli.heartbeat import Heartbeat


def test_a_stage_is_printed_at_once_and_repeated_while_it_lasts() -> None:
    out = io.StringIO()
    with Heartbeat("accept", enabled=True, every_s=0.05, out=out) as beat:
        beat.stage("measuring")
        assert out.getvalue().startswith("accept: measuring (0 s)\n")  # at once, before any tick
        deadline = time.monotonic() + 5
        while out.getvalue().count("accept: measuring") < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert out.getvalue().count("accept: measuring") >= 3


def test_nothing_is_printed_on_a_terminal() -> None:
    out = io.StringIO()
    with Heartbeat("accept", enabled=False, every_s=0.01, out=out) as beat:
        beat.stage("measuring")
        time.sleep(0.05)
    assert out.getvalue() == ""
