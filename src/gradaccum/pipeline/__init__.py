"""Pipeline parallelism: :class:`PipelineAccumulator` drives a ``torch.distributed.pipelining``
schedule through the window engine, with the denominator known before the schedule runs."""

from gradaccum.pipeline.accumulator import SCHEDULES, PipelineAccumulator, StageLossFn

__all__ = ["SCHEDULES", "PipelineAccumulator", "StageLossFn"]
