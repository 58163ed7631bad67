"""Plain progress lines when stdout is not a terminal (a log file, a pipe, CI).

A spinner or a progress bar draws nothing into a pipe, so ``make run | tee log`` printed nothing for
~45 s and then every frame at once. :class:`Heartbeat` prints ``accept: <stage> (<elapsed> s)`` at
once when the stage changes and again at least every ``every_s`` seconds from a daemon thread, each
line flushed; on a terminal it prints nothing (the spinner and the bar are there).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from types import TracebackType
from typing import Any, TextIO

__all__ = ["EVERY_S", "Heartbeat", "progress_stage"]

EVERY_S = 10.0
"""The longest silence between two lines."""


@dataclass(eq=False)
class Heartbeat:
    """``with Heartbeat("accept", enabled=...) as beat: beat.stage("measuring")``."""

    command: str
    _: KW_ONLY
    enabled: bool
    every_s: float = EVERY_S
    out: TextIO | None = None
    clock: Callable[[], float] = time.monotonic
    current: str = field(default="starting", init=False)
    start: float = field(init=False)
    last: float = field(init=False)
    """When the last line was printed: the ticker speaks only after ``every_s`` of silence."""

    def __post_init__(self) -> None:
        self.start = self.last = self.clock()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Heartbeat:
        if self.enabled:
            self._thread = threading.Thread(target=self._beat, name="gradaccum-heartbeat", daemon=True)
            self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)

    def stage(self, text: str) -> None:
        """A new stage: printed now (when enabled), and repeated with its elapsed time until the next."""
        with self._lock:
            changed = text != self.current
            self.current = text
        if changed:
            self._line()

    def _line(self) -> None:
        if not self.enabled:
            return
        out = self.out or sys.stdout
        with self._lock:
            self.last = self.clock()
            line = f"{self.command}: {self.current} ({self.last - self.start:.0f} s)"
        print(line, file=out, flush=True)

    def _beat(self) -> None:
        wait = self.every_s
        while not self._stop.wait(wait):
            silent = self.clock() - self.last
            if silent >= self.every_s:
                self._line()
                silent = 0.0
            wait = max(self.every_s - silent, 0.01)


def progress_stage(beat: Heartbeat, inner: Callable[[Any], None] | None) -> Callable[[Any], None]:
    """An ``on_progress`` callback for a sweep's runs that also names the run in ``beat``."""

    def on_progress(event: Any) -> None:
        if event.record is None:
            beat.stage(
                f"measuring {event.spec.label} run {event.run_index + 1} ({event.done}/{event.total} done)"
            )
        if inner is not None:
            inner(event)

    return on_progress
