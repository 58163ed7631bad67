"""The equivalence check (``gradaccum.verify``), its traces stage, reports, tolerances and workloads."""
