"""Every exported dataclass documents its fields where ``help()`` looks, from the attribute
docstrings of its source (the same text the API reference shows)."""

from __future__ import annotations

import dataclasses
import pydoc
import re
from dataclasses import dataclass

import pytest

import gradaccum
from gradaccum.fielddocs import document_fields, field_docs

DATACLASSES = sorted(n for n in gradaccum._EXPORTS if dataclasses.is_dataclass(getattr(gradaccum, n)))


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def test_the_public_dataclasses_are_found() -> None:
    assert {"AccumConfig", "StepResult", "BatchPlan", "Workload", "EquivalenceReport"} <= set(DATACLASSES)


@pytest.mark.parametrize("name", DATACLASSES)
def test_help_shows_every_field_with_its_documentation(name: str) -> None:
    cls = getattr(gradaccum, name)
    docs = field_docs(cls)
    rendered = pydoc.render_doc(cls, renderer=pydoc.plaintext)
    text = _flat(re.sub(r"^ \|  ?", "", rendered, flags=re.M))  # pydoc's left margin
    assert "Fields:" in text
    for f in dataclasses.fields(cls):
        assert f.name in docs, f"{name}.{f.name} has no docstring in the source"
        assert f"{f.name} (" in text and _flat(docs[f.name]) in text, f.name


def test_a_class_without_field_docstrings_is_left_as_it_is() -> None:
    @document_fields
    @dataclass
    class Plain:
        """Nothing below."""

        x: int = 1

    assert Plain.__doc__ == "Nothing below."
    assert Plain().x == 1
