"""Lazy package exports (PEP 562): a package names its public objects and the modules that define
them, and each is imported on first access, then bound in the package like a plain import. So
``import gradaccum`` (and ``gradaccum --help``) loads no torch until a name that needs it is used."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str,
    exports: Mapping[str, str],
    namespace: dict[str, Any],
    public: Sequence[str],
    *,
    subpackages: Sequence[str] = (),
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``: ``exports`` maps a name to its module,
    ``namespace`` is the package's ``globals()`` (where a loaded name is bound, so the next access
    is a plain lookup), ``public`` its ``__all__``; ``subpackages`` are imported by name."""

    def get(name: str) -> Any:
        if name in subpackages:
            return importlib.import_module(f"{package}.{name}")  # the import binds it as an attribute
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def names() -> list[str]:
        return sorted(set(namespace) | set(public))

    return get, names
