"""Exact accumulation on a DeviceMesh: data, context, tensor and pipeline parallel dimensions.

:mod:`~gradaccum.mesh.layout` reads the mesh by role, :mod:`~gradaccum.mesh.reduction` knows what
the gradient reductions divide by and assembles the norm of gradients spread over the mesh.
``Accumulator(model, optimizer, mesh=mesh)`` uses both; :mod:`gradaccum.pipeline` drives a
pipeline schedule with the same rules.
"""
