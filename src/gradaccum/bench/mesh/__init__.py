"""HSDP sync policies measured on a DeviceMesh: collectives per mesh dimension, gradient memory held.

:mod:`~gradaccum.bench.mesh.counting` counts every collective of one update by the mesh dimension
its group spans and the gradient bytes a rank holds mid-window; :mod:`~gradaccum.bench.mesh.model`
writes the same figures down from k, the gradient bytes and the mesh's sizes;
:mod:`~gradaccum.bench.mesh.measure` runs each sync policy on a workload's parallelized model;
:mod:`~gradaccum.bench.mesh.advice` picks the policy for a memory budget. ``gradaccum bench --mesh``
and ``benchmarks/mesh_sync.py`` use them.
"""

from __future__ import annotations

from gradaccum.bench.mesh.advice import PolicyAdvice, advise_policy
from gradaccum.bench.mesh.counting import MeshCommCounter, MeshComms, gradient_bytes_held
from gradaccum.bench.mesh.measure import MeshBench, PolicyBench, bench_mesh
from gradaccum.bench.mesh.model import Traffic, policy_model

__all__ = [
    "MeshBench",
    "MeshCommCounter",
    "MeshComms",
    "PolicyAdvice",
    "PolicyBench",
    "Traffic",
    "advise_policy",
    "bench_mesh",
    "gradient_bytes_held",
    "policy_model",
]
