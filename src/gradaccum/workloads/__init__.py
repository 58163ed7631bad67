"""Workloads built from files: ``--workload hf:MODEL_DIR --data FILE``.

:func:`load_hf_workload` reads an ``hf:`` spec (:mod:`~gradaccum.workloads.spec`) and builds the
workload (:mod:`~gradaccum.workloads.hf`) from a local transformers model folder and a local
``.txt``/``.jsonl`` file (:mod:`~gradaccum.workloads.data`). transformers is imported only then.
The :class:`~gradaccum.Workload` type itself is in :mod:`~gradaccum.workloads.base`, below both this
builder and the loader (:mod:`gradaccum.check.workload`).
"""

from __future__ import annotations

from gradaccum.workloads.base import Workload
from gradaccum.workloads.hf import EXTRA, hf_workload
from gradaccum.workloads.spec import HF_PREFIX, HFSpec

__all__ = ["EXTRA", "HF_PREFIX", "HFSpec", "hf_workload", "load_hf_workload"]


def load_hf_workload(spec: str) -> Workload:
    """The workload an ``hf:MODEL_DIR?data=FILE&...`` spec names."""
    return hf_workload(HFSpec.parse(spec))
