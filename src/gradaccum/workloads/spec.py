"""The ``hf:`` workload spec: one string that names a model folder, a data file and how to read it.

``hf:MODEL_DIR?data=FILE&text_field=text&seq_len=128&pack=0&normalization=token``. The command line
builds it from ``--workload hf:MODEL_DIR --data FILE`` and the data options; worker processes, run
cards and resumed runs carry it as it is, so that every one of them rebuilds the same workload.
Values are percent-encoded, so any path fits. No torch here: the command line parses it cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import parse_qsl, quote, unquote, urlencode

from gradaccum.errors import WorkloadError
from gradaccum.names import DEFAULT_SEQ_LEN, DEFAULT_TEXT_FIELD, HF_PREFIX, NORMALIZATIONS, Normalization

__all__ = ["DEFAULT_SEQ_LEN", "DEFAULT_TEXT_FIELD", "HF_PREFIX", "HFSpec"]

_KEYS = ("data", "text_field", "seq_len", "pack", "normalization")


@dataclass(frozen=True, kw_only=True, slots=True)
class HFSpec:
    """What an ``hf:`` workload is built from."""

    model_dir: str
    """A local transformers model folder: ``config.json``, optional weights, tokenizer files."""
    data: str | None = None
    """A local ``.txt`` (one document per non-empty line) or ``.jsonl`` (one JSON object per line)."""
    text_field: str = DEFAULT_TEXT_FIELD
    """The ``.jsonl`` field that holds each document's text."""
    seq_len: int | None = None
    """Tokens per row; longer documents are cut into row-sized documents of their own. ``None``:
    ``DEFAULT_SEQ_LEN``, or the model's ``max_position_embeddings`` where that is shorter."""
    pack: bool = False
    """Pack documents into rows (position_ids restart per document) instead of one per row."""
    normalization: Normalization = "token"
    """The loss's denominator: ``token``, ``sequence`` or ``document``."""

    def __post_init__(self) -> None:
        if not self.model_dir:
            raise WorkloadError("an hf: workload names a model folder: --workload hf:MODEL_DIR")
        if self.normalization not in NORMALIZATIONS:
            raise WorkloadError(
                f"normalization must be one of {', '.join(NORMALIZATIONS)}, got {self.normalization!r}"
            )
        bad = isinstance(self.seq_len, bool) or not isinstance(self.seq_len, int) or self.seq_len < 2
        if self.seq_len is not None and bad:
            raise WorkloadError(
                f"seq_len must be an integer >= 2 (a row of 1 token has no target), got {self.seq_len!r}"
            )
        if not self.text_field:
            raise WorkloadError("text_field must name a field of the .jsonl objects, got an empty name")

    def to_spec(self) -> str:
        """The string that :meth:`parse` reads back (every setting written out)."""
        query = {
            "data": self.data if self.data is not None else "",
            "text_field": self.text_field,
            "seq_len": "" if self.seq_len is None else str(self.seq_len),
            "pack": "1" if self.pack else "0",
            "normalization": self.normalization,
        }
        query = {key: value for key, value in query.items() if value != ""}
        return f"{HF_PREFIX}{quote(self.model_dir, safe='/:')}?{urlencode(query, safe='/:')}"

    def with_absolute_paths(self) -> HFSpec:
        """The same spec with the folder and file resolved, for processes started elsewhere."""
        data = None if self.data is None else str(Path(self.data).expanduser().resolve())
        return replace(self, model_dir=str(Path(self.model_dir).expanduser().resolve()), data=data)

    @classmethod
    def parse(cls, spec: str) -> HFSpec:
        """``hf:MODEL_DIR`` with an optional ``?key=value&...`` query of the fields above."""
        if not spec.startswith(HF_PREFIX):
            raise WorkloadError(f"an hf: workload spec starts with {HF_PREFIX!r}, got {spec!r}")
        path, _, query = spec[len(HF_PREFIX) :].partition("?")
        settings = dict(parse_qsl(query, keep_blank_values=True, strict_parsing=False)) if query else {}
        unknown = sorted(set(settings) - set(_KEYS))
        if unknown:
            raise WorkloadError(
                f"workload {spec!r} has unknown setting(s) {unknown}; an hf: spec takes {list(_KEYS)}"
            )
        seq_len = settings.get("seq_len")
        if seq_len is not None and not seq_len.isdigit():
            raise WorkloadError(f"workload {spec!r}: seq_len must be an integer, got {seq_len!r}")
        pack = settings.get("pack", "0")
        if pack not in ("0", "1"):
            raise WorkloadError(f"workload {spec!r}: pack must be 0 or 1, got {pack!r}")
        normalization = settings.get("normalization", "token")
        if normalization not in NORMALIZATIONS:
            raise WorkloadError(
                f"workload {spec!r}: normalization must be one of {', '.join(NORMALIZATIONS)}, "
                f"got {normalization!r}"
            )
        return cls(
            model_dir=unquote(path),
            data=settings.get("data") or None,
            text_field=settings.get("text_field", DEFAULT_TEXT_FIELD),
            seq_len=None if seq_len is None else int(seq_len),
            pack=pack == "1",
            normalization=normalization,  # type: ignore[arg-type]
        )
