"""Start-up of ``gradaccum --help`` and ``gradaccum train --help`` against ``python -c "import torch"``.

Each is a fresh interpreter, timed from spawn to exit, in rounds with the order rotated (paired
ratios, :mod:`paired`). ``--before SRC`` also times the ``--help`` of another checkout's ``src``
folder in the same rounds (e.g. main before a change)::

    PYTHONPATH=src python benchmarks/help_startup.py --rounds 5 --before ../main/src
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

from paired import paired_ratios


def _runner(argv: list[str], src: str | None = None) -> Callable[[], object]:
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = src
    return lambda: subprocess.run([sys.executable, *argv], env=env, check=True, capture_output=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--before", metavar="SRC", help="another checkout's src folder to time too")
    args = parser.parse_args()
    runners = {
        "import torch": _runner(["-c", "import torch"]),
        "gradaccum --help": _runner(["-m", "gradaccum", "--help"]),
        "gradaccum train --help": _runner(["-m", "gradaccum", "train", "--help"]),
    }
    if args.before:
        runners["gradaccum --help (before)"] = _runner(["-m", "gradaccum", "--help"], args.before)
    seconds: dict[str, list[float]] = {name: [] for name in runners}

    def timed(name: str) -> Callable[[], object]:
        def run() -> None:
            start = time.perf_counter()
            runners[name]()
            seconds[name].append(time.perf_counter() - start)

        return run

    ratios = paired_ratios({name: timed(name) for name in runners}, "import torch", args.rounds)
    print(f"{args.rounds} rounds (after 3 warm-up rounds); median seconds, and median ratio to import torch:")
    median = {name: statistics.median(took[-args.rounds :]) for name, took in seconds.items()}
    print(f"  {'import torch':28s} {median['import torch']:6.3f} s")
    for name, ratio in ratios.items():
        print(f"  {name:28s} {median[name]:6.3f} s   {ratio:5.2f} x import torch")


if __name__ == "__main__":
    main()
