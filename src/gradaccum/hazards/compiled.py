"""What breaks a *compiled* accumulation that a static scan can see: Python denominators.

Inside a region ``torch.compile`` captures (a compiled model's ``forward``, a compiled block, a
compiled loss function), a Python number is not data: dynamo bakes it into the graph as a constant
and guards on its value. A loss that divides by a number computed from the batch there (``/
len(batch)``, ``/ mask.sum().item()``, ``/ labels.numel()``, ``/ x.size(0)``,
``/ int(mask.sum())``) therefore

* takes a graph break (``.item()``) or a recompile for each new denominator; past
  ``torch._dynamo.config.recompile_limit`` (8) distinct values dynamo silently runs the region
  eagerly from then on, and ``StepResult.recompiles`` counts every one before that;
* is a mean per micro-batch: the window then averages means instead of dividing by the window's N
  (the mean of means), unless the step is told so (``loss_reduction="mean"`` with a ``count_fn``
  counting exactly those units).

gradaccum's own step never does this: it multiplies by W/N as a 0-dim tensor outside the model
(:mod:`gradaccum.step.compiled`). The rule reads the source of each compiled callable it finds
(``inspect.getsource``, parsed with :mod:`ast`); divisions by the model's own sizes
(``x.size(-1)``, ``float(self.head_dim)``) are not batch-derived and are left alone; what it cannot
read (a builtin, a lambda in a notebook) it leaves unjudged, and ``verify`` stays the empirical check.
"""

from __future__ import annotations

import ast
import inspect
import sys
import textwrap
from collections.abc import Callable, Iterator
from typing import Any

import torch.nn as nn

from gradaccum.hazards.finding import Finding

__all__ = ["COMPILED_DENOMINATOR", "compiled_findings", "compiled_regions"]

COMPILED_DENOMINATOR = "compiled-python-denominator"
"""The rule's code in a :class:`~gradaccum.hazards.finding.Finding`."""

_COUNT_METHODS = ("item", "tolist", "numel", "nelement")
"""Tensor methods that give a Python number (a count, or a value read to the host)."""
_BATCH_DIM = 0
"""``x.size(0)``, ``x.shape[0]``: the batch dimension (other dimensions are the model's own sizes,
such as the head dimension an attention divides by, and are left alone)."""


def _is_compiled_module(module: nn.Module) -> bool:
    cls = getattr(sys.modules.get("torch._dynamo.eval_frame"), "OptimizedModule", None)
    if isinstance(cls, type) and isinstance(module, cls):
        return True
    # nn.Module.compile() compiles in place: the module keeps its class, its call goes through this
    return getattr(module, "_compiled_call_impl", None) is not None


def _is_compiled_function(fn: Any) -> bool:
    # torch.compile(fn) returns a functools.wraps wrapper that dynamo marks with its original callable
    return callable(fn) and hasattr(fn, "_torchdynamo_orig_callable")


def compiled_regions(
    model: nn.Module, loss_fn: Callable[..., Any] | None = None
) -> list[tuple[str, str, Any]]:
    """``(path, kind, original function)`` for the code that runs compiled: the forward of every
    module inside a compiled one (the whole model, or blocks compiled one by one), each class once,
    and the loss (kind ``loss``)."""
    regions: list[tuple[str, str, Any]] = []
    roots: list[str] = []
    seen: set[Any] = set()
    for path, module in model.named_modules():
        inside = any(path == r or path.startswith(r + ".") or r == "" for r in roots)
        if not inside and _is_compiled_module(module):
            roots.append(path)
            inside = True
        if not inside or hasattr(module, "_orig_mod"):
            continue  # an OptimizedModule forwards to its _orig_mod, which comes next
        forward = type(module).forward
        if forward not in seen:  # twelve identical blocks are one finding, at the first
            seen.add(forward)
            regions.append((path, type(module).__name__, forward))
    if loss_fn is not None:
        unwrapped = loss_fn
        # the workload's error wrappers and torch.compile's own wrapper both set __wrapped__
        while hasattr(unwrapped, "__wrapped__"):
            if _is_compiled_function(unwrapped):
                regions.append(("", "loss", inspect.unwrap(unwrapped)))
                break
            unwrapped = unwrapped.__wrapped__
    return regions


def _is_zero(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value == _BATCH_DIM


def _number_call(node: ast.AST) -> str | None:
    """The source of the first batch-derived Python number in ``node``, or None: ``len(...)``,
    ``.item()``, ``.tolist()``, ``.numel()``, ``x.size(0)``/``x.size()``, ``x.shape[0]``, and
    ``int(...)``/``float(...)`` of a call (``int(mask.sum())``; not of an attribute such as
    ``float(self.head_dim)``)."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Subscript):
            value = sub.value
            if isinstance(value, ast.Attribute) and value.attr == "shape" and _is_zero(sub.slice):
                return ast.unparse(sub)
        if not isinstance(sub, ast.Call):
            continue
        fn = sub.func
        if isinstance(fn, ast.Name) and fn.id == "len":
            return ast.unparse(sub)
        calls_inside = any(isinstance(inner, ast.Call) for arg in sub.args for inner in ast.walk(arg))
        if isinstance(fn, ast.Name) and fn.id in ("int", "float") and calls_inside:
            return ast.unparse(sub)
        if isinstance(fn, ast.Attribute) and fn.attr in _COUNT_METHODS:
            return ast.unparse(sub)
        if isinstance(fn, ast.Attribute) and fn.attr == "size" and (not sub.args or _is_zero(sub.args[0])):
            return ast.unparse(sub)
    return None


def _denominators(fn: Any) -> Iterator[tuple[str, int]]:
    """``(expression, line)`` for each division by a batch-derived Python number in ``fn``."""
    try:
        source = textwrap.dedent(inspect.getsource(fn))
        first_line = inspect.getsourcelines(fn)[1]
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError):
        return
    for node in ast.walk(tree):
        right: ast.AST | None = None
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Div, ast.FloorDiv)):
            right = node.right
        elif isinstance(node, ast.AugAssign) and isinstance(node.op, (ast.Div, ast.FloorDiv)):
            right = node.value
        if right is not None and _number_call(right) is not None:
            yield ast.unparse(node), first_line + getattr(node, "lineno", 1) - 1


def compiled_findings(model: nn.Module, loss_fn: Callable[..., Any] | None = None) -> list[Finding]:
    """A warning for each division by a batch-derived Python number inside a compiled region."""
    findings = []
    for path, kind, fn in compiled_regions(model, loss_fn):
        name = getattr(fn, "__qualname__", repr(fn))
        for expression, line in _denominators(fn):
            findings.append(
                Finding(
                    code=COMPILED_DENOMINATOR,
                    severity="warning",
                    path=path,
                    kind=kind,
                    summary=f"divides by a Python number from the batch inside a compiled region ({name})",
                    explanation=(
                        f"`{expression}` (line {line}): torch.compile bakes that number into the graph "
                        "as a constant guarded on its value, so each new denominator recompiles (past "
                        "torch._dynamo.config.recompile_limit, 8, the region silently runs eagerly), "
                        "and a per-micro-batch mean makes the window a mean of means."
                    ),
                    fix=(
                        "return the loss summed over the micro-batch's units and let the step divide "
                        "by the window's count (a 0-dim tensor outside the graph); or keep the mean "
                        "with loss_reduction='mean' and a count_fn counting exactly those units."
                    ),
                    figures={"line": float(line)},
                )
            )
    return findings
