"""The exit codes of every command, in a module light enough to import before anything else.

0 success; 1 a check that ran and failed, or a run that failed on its own (another rank, the
disk, memory); 2 bad input; 3 a measurement that could not decide (accept's INCONCLUSIVE);
130 interrupted by SIGINT (128 + 2) and 143 stopped by SIGTERM (128 + 15), as shells and job
schedulers expect.
"""

from __future__ import annotations

__all__ = [
    "EXIT_BAD_INPUT",
    "EXIT_FAILED",
    "EXIT_INCONCLUSIVE",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_TERMINATED",
]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_INCONCLUSIVE = 3
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143
