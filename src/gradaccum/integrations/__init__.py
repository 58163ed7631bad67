"""Exact accumulation inside the loops users already train with; each is an optional extra.

* :mod:`gradaccum.integrations.transformers`: ``ExactTrainer`` and ``exact_trainer(SomeTrainer)``
  for the Hugging Face ``Trainer`` (``pip install gradaccum[transformers]``);
* :mod:`gradaccum.integrations.accelerate`: ``prepare_accumulator`` builds an ``Accumulator`` from
  what ``accelerator.prepare`` returns (``gradaccum[accelerate]``);
* :mod:`gradaccum.integrations.lightning`: ``window_step`` for the Lightning ``Trainer`` (manual
  optimization over windows); Fabric's ``fabric.setup`` objects go straight into ``Accumulator``
  (``gradaccum[lightning]``);
* :mod:`gradaccum.integrations.deepspeed`: ``prepare_accumulator(engine)`` drives a DeepSpeed engine
  (ZeRO 0-3) through exact windows (``gradaccum[deepspeed]``);
* :mod:`gradaccum.integrations.torchft`: ``FaultTolerantAccumulator`` shares each step's global
  batch among a torchft quorum's replica groups, exactly, whatever groups come and go
  (``gradaccum[torchft]``).

Importing this package imports none of those libraries: each submodule imports its own on import,
except ``accelerate`` and ``deepspeed``, whose functions import them when they run (the step calls
the scheduler check of the first), and ``torchft``, which drives the caller's ``Manager`` and never
imports torchft itself.
"""

from __future__ import annotations

__all__: list[str] = []
