"""The stack audit: how far the accumulation a user already trains with is from the full batch.

* :func:`audit_trainer` (:mod:`gradaccum.audit.trainer`): a ``transformers.Trainer`` (or a subclass)
  audited for one optimizer update on a float64 copy of its model, beside ``exact_trainer`` on the
  same window; also importable from ``gradaccum.integrations.transformers``.
* :func:`audit_stack` (:mod:`gradaccum.audit.recipes`): one window of a model and its data through
  each installed framework's accumulation recipe (a hand-written ``loss / k`` loop, Accelerate,
  Lightning, DeepSpeed, the transformers ``Trainer`` on ``hf:`` workloads) and gradaccum's
  ``Accumulator``, one row each (:mod:`gradaccum.audit.stack`), chosen by name
  (:mod:`gradaccum.audit.rows`); what ``gradaccum audit`` prints.

It returns frozen values (:mod:`gradaccum.audit.report`); the figure compared is the accumulated
gradient, the one the optimizer receives at the end of the window, against the full batch's, in
float64. Nothing here prints. The framework modules are imported on first use.
"""

from __future__ import annotations

from gradaccum.lazy import lazy_exports

__all__ = ["AuditReport", "Cause", "RecipeRow", "StackAudit", "audit_stack", "audit_trainer"]

_EXPORTS = {
    "AuditReport": "gradaccum.audit.report",
    "Cause": "gradaccum.audit.report",
    "audit_trainer": "gradaccum.audit.trainer",
    "audit_stack": "gradaccum.audit.recipes",
    "RecipeRow": "gradaccum.audit.stack",
    "StackAudit": "gradaccum.audit.stack",
}

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals(), __all__)
