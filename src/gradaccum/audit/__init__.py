"""The stack audit: how far the accumulation a user already trains with is from the full batch.

* :func:`audit_trainer` (:mod:`gradaccum.audit.trainer`): a ``transformers.Trainer`` (or a subclass)
  audited for one optimizer update on a float64 copy of its model, beside ``exact_trainer`` on the
  same window; also importable from ``gradaccum.integrations.transformers``.

It returns frozen values (:mod:`gradaccum.audit.report`); the figure compared is the accumulated
gradient, the one the optimizer receives at the end of the window, against the full batch's, in
float64. Nothing here prints. The framework modules are imported on first use.
"""

from __future__ import annotations

from gradaccum.lazy import lazy_exports

__all__ = ["AuditReport", "Cause", "audit_trainer"]

_EXPORTS = {
    "AuditReport": "gradaccum.audit.report",
    "Cause": "gradaccum.audit.report",
    "audit_trainer": "gradaccum.audit.trainer",
}

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals(), __all__)
