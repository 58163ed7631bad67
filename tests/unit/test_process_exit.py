"""A process that held a process group ends without interpreter finalization, and loses nothing.

The abort this avoids (gloo's worker thread taking the GIL during finalization) is a race; what is
checked here is the mechanism: the exit code, stdout and stderr flushed, the ``atexit`` handlers
run, and the teardown of module objects (where the race is) skipped exactly when a group was held.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import atexit, os, sys
from gradaccum.distributed.process_exit import exit_process

class Teardown:
    def __del__(self):
        os.write(1, b" torn down")

kept = Teardown()  # deleted when the interpreter tears its modules down
atexit.register(lambda: print(" atexit", end="", flush=True))
sys.stdout.write("out, unflushed")
sys.stderr.write("err, unflushed")
exit_process(3, held_process_group={held})
"""


@pytest.mark.parametrize("held", [True, False])
def test_exit_process_keeps_the_code_the_output_and_the_atexit_handlers(held: bool) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(held=held)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 3
    assert done.stdout.startswith("out, unflushed atexit")
    assert "err, unflushed" in done.stderr
    assert ("torn down" in done.stdout) is (not held)
