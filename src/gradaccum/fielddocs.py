"""Field documentation that ``help()`` shows.

A dataclass field is documented by the string below it (an attribute docstring): the API
reference reads it from the source, but Python drops it, so ``help(AccumConfig)`` would list the
fields without a word. :func:`document_fields` reads those strings from the class's source once,
when the class is defined, and appends them to the class docstring; the text lives in one place.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import itertools
import sys
import textwrap
from pathlib import Path
from typing import TypeVar

__all__ = ["document_fields", "field_docs"]

T = TypeVar("T", bound=type)


def field_docs(cls: type) -> dict[str, str]:
    """``{field: its attribute docstring}`` for the fields of ``cls`` documented in its source."""
    for node in _classes(sys.modules[cls.__module__].__dict__.get("__file__")):
        if node.name == cls.__name__:
            return _docs_of(node)
    return {}  # no source (a compiled install), or not a top-level class: nothing to add


@functools.cache
def _classes(path: str | None) -> tuple[ast.ClassDef, ...]:
    """The top-level classes of a module's source, parsed once per module."""
    if path is None or not path.endswith(".py"):
        return ()
    try:
        source = Path(path).read_text(encoding="utf-8")
    except OSError:
        return ()
    return tuple(node for node in ast.parse(source, path).body if isinstance(node, ast.ClassDef))


def _docs_of(node: ast.ClassDef) -> dict[str, str]:
    docs: dict[str, str] = {}
    for field, after in itertools.pairwise(node.body):
        if (
            isinstance(field, ast.AnnAssign)
            and isinstance(field.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[field.target.id] = inspect.cleandoc(after.value.value)
    return docs


def document_fields(cls: T) -> T:
    """Append a "Fields" section to ``cls.__doc__`` from its fields' attribute docstrings."""
    docs = field_docs(cls)
    fields = [f for f in dataclasses.fields(cls) if f.name in docs] if dataclasses.is_dataclass(cls) else []
    if not fields:
        return cls
    lines = ["", "Fields:", ""]
    for f in fields:
        if f.default is not dataclasses.MISSING:
            default = f", default {getattr(f.default, '__name__', repr(f.default))}"
        elif f.default_factory is not dataclasses.MISSING:
            default = ", default empty"
        else:
            default = ""
        lines.append(f"    {f.name} ({f.type}{default})")
        text = " ".join(docs[f.name].split())
        lines.append(
            textwrap.fill(text, 96, initial_indent=" " * 8, subsequent_indent=" " * 8, break_on_hyphens=False)
        )
    cls.__doc__ = inspect.cleandoc(cls.__doc__ or "") + "\n" + "\n".join(lines) + "\n"
    return cls
