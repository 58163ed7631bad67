"""Signals for ``gradaccum train``, as job schedulers expect.

SIGUSR1 checkpoints at the next boundary and carries on. The first SIGINT or SIGTERM finishes the
current window, checkpoints at its boundary and exits 130 (SIGINT) or 143 (SIGTERM), printing the
resume command. A second one, a second or more after the first, stops at once: it removes the
unfinished checkpoint folder and exits 130; the newest complete checkpoint is untouched. (A repeat
within the second is the same request arriving twice, as torchrun forwards the terminal's Ctrl-C
to workers that already got it.) Before the first window nothing has been written, so a signal
then ends the process at once, with one line. The second signal and the start-up case are served
by a watcher thread woken by ``signal.set_wakeup_fd``, so they act even while the main thread is
inside torch (a forward, a collective, ``torch.save``). SIGXFSZ is ignored, so a file-size limit
surfaces as an error naming the file rather than killing the process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from gradaccum.cli.exitcodes import EXIT_INTERRUPTED, EXIT_TERMINATED

if TYPE_CHECKING:
    from gradaccum.train.loop import TrainControl

__all__ = ["REPEAT_S", "TrainSignals"]

REPEAT_S = 1.0
"""A second stop signal sooner than this after the first is the same request delivered twice."""

_NAMES: dict[int, str] = {int(signal.SIGINT): "SIGINT", int(signal.SIGTERM): "SIGTERM"}


class TrainSignals:
    """The signal handling described in the module docstring, for the duration of a ``with``.

    The Python-level handlers run in the main thread between bytecodes and only count requests
    (:class:`TrainControl`), so a request is never lost and is served at the next boundary. The
    watcher thread reads the signal numbers that the C-level handler writes into a pipe the moment
    a signal arrives, and acts when the main thread cannot: at start-up, and on the second signal.
    """

    def __init__(self, *, leader: bool) -> None:
        self.control: TrainControl | None = None
        """Set once the training code is imported; until then every signal ends start-up."""
        self.leader = leader
        self.run_dir: Path | None = None
        self.resume_command = ""
        self.training = False
        self.first: int | None = None
        self._first_at = 0.0
        self._first_wall = 0.0
        """The first signal's wall-clock time: a checkpoint modified since is the stop checkpoint."""
        self._installed = False
        self._previous: dict[int, Any] = {}
        self._previous_fd = -1
        self._pipe: tuple[int, int] | None = None
        self._thread: threading.Thread | None = None

    @property
    def exit_code(self) -> int:
        """What a run stopped by this process's first signal exits with (143 when another rank's
        request stopped it: it was terminated from outside)."""
        return EXIT_INTERRUPTED if self.first == signal.SIGINT else EXIT_TERMINATED

    def __enter__(self) -> TrainSignals:
        if threading.current_thread() is not threading.main_thread():
            return self  # a library caller's thread: signals are its business
        read, write = os.pipe()
        os.set_blocking(write, False)
        self._pipe = (read, write)
        handlers: dict[int, Any] = {signal.SIGINT: self._on_stop, signal.SIGTERM: self._on_stop}
        if hasattr(signal, "SIGUSR1"):
            handlers[signal.SIGUSR1] = self._on_checkpoint
        if hasattr(signal, "SIGXFSZ"):
            handlers[signal.SIGXFSZ] = signal.SIG_IGN  # a file-size limit: an error, not a kill
        self._previous = {sig: signal.signal(sig, handler) for sig, handler in handlers.items()}
        self._previous_fd = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        self._installed = True
        self._thread = threading.Thread(target=self._watch, name="gradaccum-signals", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._installed or self._pipe is None:
            return
        signal.set_wakeup_fd(self._previous_fd)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        read, write = self._pipe
        with contextlib.suppress(OSError):
            os.write(write, b"\0")  # wakes the watcher to leave
        if self._thread is not None:
            self._thread.join(timeout=5)
        os.close(read)
        os.close(write)
        self._installed = False

    def _on_stop(self, signum: int, frame: FrameType | None) -> None:
        if self.control is not None:
            self.control.request_stop()

    def _on_checkpoint(self, signum: int, frame: FrameType | None) -> None:
        if self.control is not None:
            self.control.request_checkpoint()

    def _watch(self) -> None:
        assert self._pipe is not None
        while True:
            try:
                data = os.read(self._pipe[0], 64)
            except OSError:
                return
            for signum in data:
                if signum == 0:
                    return
                if signum in _NAMES:
                    self._on_signal(signum)

    def _on_signal(self, signum: int) -> None:
        name = _NAMES[signum]
        if not self.training:
            code = EXIT_TERMINATED if signum == signal.SIGTERM else EXIT_INTERRUPTED
            self._exit_now(
                code, f"interrupted ({name}) during start-up; nothing was trained or written", resume=False
            )
        now = time.monotonic()
        if self.first is None:
            self.first, self._first_at, self._first_wall = signum, now, time.time()
            self._say(
                f"{name}: finishing this window, then checkpointing and stopping; a second signal "
                "(Ctrl-C again) stops at once, without the checkpoint"
            )
        elif now - self._first_at >= REPEAT_S:
            self._exit_now(EXIT_INTERRUPTED, self._stopped_now(name))

    def _stopped_now(self, name: str) -> str:
        from gradaccum.train.checkpoint import find_intact, remove_partial_checkpoints

        if self.run_dir is None:
            return f"second signal ({name}): stopped at once"
        removed: list[Path] = []
        if self.leader:
            for _ in range(2):  # the main thread may have been creating the folder meanwhile
                removed += remove_partial_checkpoints(self.run_dir)
        point = find_intact(self.run_dir, checksums=False)
        stop_written = point is not None and _modified(point.path) >= self._first_wall
        if point is None:
            written = "no checkpoint was complete yet"
        elif stop_written:
            written = f"written: the stop checkpoint, {point.path}, intact"
        else:
            written = f"the newest complete checkpoint, {point.path}, is intact"
        gone = (
            "removed, unfinished: " + ", ".join(dict.fromkeys(p.name for p in removed))
            if removed
            else "nothing was being written, so nothing was removed"
        )
        when = "after the stop checkpoint was written" if stop_written else "mid-window"
        return f"second signal ({name}): stopped at once, {when}; {written}; {gone}"

    def _say(self, text: str) -> None:
        if self.leader:
            with contextlib.suppress(OSError):
                os.write(2, f"gradaccum train: {text}\n".encode())

    def _exit_now(self, code: int, text: str, *, resume: bool = True) -> None:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        command = self.resume_command if resume else ""
        self._say(text + (f"\n  resume with: {command}" if command else ""))
        os._exit(code)


def _modified(path: Path) -> float:
    try:
        return Path(path).stat().st_mtime
    except OSError:
        return 0.0
