"""A :class:`~gradaccum.Workload` from a local transformers model folder and a local data file.

The folder holds ``config.json`` and the tokenizer's files (what ``save_pretrained`` writes), and
optionally weights (``model.safetensors``, ``pytorch_model.bin`` or a sharded index). Without
weights the model is built from the config with seed 0, the same weights on every call. The data
file's documents are tokenized once, cut at ``seq_len``, and laid out as padded rows (one
document each, ``attention_mask``) or packed rows (``position_ids`` restarting per document).
The loss is :class:`~gradaccum.CausalLMLoss` with the spec's normalization and
``mask_documents=True``, so that a packed row attends within its documents only.

Nothing is downloaded: every transformers call passes ``local_files_only=True``. transformers is
imported only here, when such a workload is loaded.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from gradaccum.batch import Batch
from gradaccum.errors import GradAccumError, WorkloadError
from gradaccum.loss import CausalLMLoss
from gradaccum.packing import Packed, pack, pad, pieces
from gradaccum.workloads.base import Workload
from gradaccum.workloads.data import read_documents
from gradaccum.workloads.spec import DEFAULT_SEQ_LEN, HFSpec

__all__ = ["EXTRA", "INIT_SEED", "hf_workload"]

EXTRA = "gradaccum[transformers]"
"""The optional extra that installs what an ``hf:`` workload imports."""
INIT_SEED = 0
"""The seed of a model built from its config alone."""
_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def _transformers() -> Any:
    try:
        import tokenizers  # noqa: F401  (the fast tokenizers transformers loads need it)
        import transformers
    except ImportError as exc:
        raise WorkloadError(
            f"an hf: workload needs transformers and tokenizers, which are not installed ({exc}); "
            f"install the optional extra: pip install '{EXTRA}'"
        ) from None
    return transformers


@contextlib.contextmanager
def _quiet(transformers: Any) -> Iterator[None]:
    """transformers' loading progress bars off, and back as they were: the library prints nothing."""
    logging: Any = getattr(getattr(transformers, "utils", None), "logging", None)
    enabled = getattr(logging, "is_progress_bar_enabled", None)
    was = bool(enabled()) if callable(enabled) else False
    if was:
        logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            logging.enable_progress_bar()


def _check_folder(folder: Path) -> tuple[bool, list[str]]:
    """Whether the folder holds weights; refuses a missing folder, config or tokenizer up front."""
    if not folder.is_dir():
        raise WorkloadError(
            f"model folder {str(folder)!r} does not exist; --workload hf:MODEL_DIR names a local folder "
            "holding config.json and tokenizer files (what save_pretrained writes)"
        )
    names = sorted(p.name for p in folder.iterdir())
    if "config.json" not in names:
        raise WorkloadError(
            f"model folder {str(folder)!r} has no config.json (it holds: {', '.join(names) or 'nothing'}); "
            "save the model's config there with model.config.save_pretrained(MODEL_DIR)"
        )
    if not any(name in names for name in _TOKENIZER_FILES):
        raise WorkloadError(
            f"model folder {str(folder)!r} has no tokenizer (none of {', '.join(_TOKENIZER_FILES)}); an hf: "
            "workload tokenizes --data with the folder's own tokenizer: tokenizer.save_pretrained(MODEL_DIR)"
        )
    return any(name in names for name in _WEIGHT_FILES), names


def _load_tokenizer(transformers: Any, folder: Path) -> Any:
    try:
        return transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:
        raise WorkloadError(
            f"cannot load the tokenizer of {str(folder)!r}: {type(exc).__name__}: {exc}. Save a fast "
            "tokenizer there with tokenizer.save_pretrained(MODEL_DIR)"
        ) from None


def _load_config(transformers: Any, folder: Path) -> Any:
    try:
        return transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:
        raise WorkloadError(
            f"cannot read the config of {str(folder)!r}: {type(exc).__name__}: {exc}"
        ) from None


def _model_builder(transformers: Any, folder: Path, config: Any, weights: bool) -> Callable[[], nn.Module]:
    """``build_model``: the folder's model (float32, ``use_cache`` off), loaded once and copied."""
    template: list[nn.Module] = []

    def load() -> nn.Module:
        auto = transformers.AutoModelForCausalLM
        with _quiet(transformers):
            if weights:
                model = auto.from_pretrained(str(folder), local_files_only=True)
            else:
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(INIT_SEED)
                    model = auto.from_config(copy.deepcopy(config))
        model.config.use_cache = False  # no key/value cache in training forwards
        return model.to(torch.float32).train()

    def build_model() -> nn.Module:
        if not template:
            try:
                template.append(load())
            except GradAccumError:
                raise
            except Exception as exc:
                kind = "load the weights" if weights else "build the model from the config"
                raise WorkloadError(
                    f"cannot {kind} of {str(folder)!r}: {type(exc).__name__}: {exc}"
                ) from None
        return copy.deepcopy(template[0])

    return build_model


def _tokenize(tokenizer: Any, texts: list[str], data: str) -> list[list[int]]:
    encoded = tokenizer(texts, add_special_tokens=True)["input_ids"]
    documents = [list(ids) for ids in encoded if len(ids)]
    if not documents:
        raise WorkloadError(f"the tokenizer turns every document of {data!r} into no tokens")
    return documents


def _seq_len(config: Any, spec: HFSpec, folder: Path) -> int:
    """The spec's row length, or the default capped at the model's positions; refuses a longer one."""
    limit = getattr(config, "max_position_embeddings", None)
    limit = limit if isinstance(limit, int) and limit >= 2 else None
    if spec.seq_len is None:
        return DEFAULT_SEQ_LEN if limit is None else min(DEFAULT_SEQ_LEN, limit)
    if limit is not None and spec.seq_len > limit:
        raise WorkloadError(
            f"--seq-len {spec.seq_len} is longer than the model's max_position_embeddings={limit} "
            f"({str(folder)!r}); use --seq-len {limit} or less"
        )
    return spec.seq_len


def _check_vocab(config: Any, documents: list[list[int]], folder: Path) -> None:
    vocab = getattr(config, "vocab_size", None)
    top = max(max(doc) for doc in documents)
    if isinstance(vocab, int) and top >= vocab:
        raise WorkloadError(
            f"the tokenizer of {str(folder)!r} produces token id {top}, but the model's vocab_size is "
            f"{vocab}: tokenizer and config do not belong together"
        )


def _sampler(rows: dict[str, torch.Tensor]) -> Callable[[int, int], Batch]:
    """``make_batch(n, seed)``: n rows in an order drawn from ``seed``, cycling past the last row."""
    count = int(rows["input_ids"].shape[0])

    def make_batch(n_examples: int, seed: int) -> Batch:
        generator = torch.Generator().manual_seed(seed)
        rounds = -(-n_examples // count)
        order = torch.cat([torch.randperm(count, generator=generator) for _ in range(rounds)])[:n_examples]
        return {key: value[order] for key, value in rows.items()}

    return make_batch


def hf_workload(spec: HFSpec, *, batch_size: int = 8, micro_batch: int = 2) -> Workload:
    """The workload ``spec`` names: its model, its data as rows, and :class:`CausalLMLoss`."""
    if spec.data is None:
        raise WorkloadError(
            f"workload hf:{spec.model_dir} needs a data file: add --data FILE (a local .txt or .jsonl)"
        )
    folder = Path(spec.model_dir)
    weights, _ = _check_folder(folder)
    texts = read_documents(spec.data, text_field=spec.text_field)
    transformers = _transformers()
    with _quiet(transformers):
        tokenizer = _load_tokenizer(transformers, folder)
        config = _load_config(transformers, folder)
    documents = _tokenize(tokenizer, texts, spec.data)
    seq_len = _seq_len(config, spec, folder)
    _check_vocab(config, documents, folder)
    pad_id = next(
        (i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id) if isinstance(i, int) and i >= 0), 0
    )
    docs = pieces(documents, seq_len, "split").docs  # what the rows hold: the packed check's input
    layout: Packed = (pack if spec.pack else pad)(documents, seq_len, pad_id=pad_id)
    loss = CausalLMLoss(spec.normalization, mask_documents=True)
    model_type = getattr(config, "model_type", type(config).__name__)
    origin = "weights" if weights else f"config only, seeded init {INIT_SEED}"
    return Workload(
        name=f"hf:{folder.name}",
        build_model=_model_builder(transformers, folder, config, weights),
        make_batch=_sampler(layout.batch),
        loss_fn=loss.loss_fn,
        count_fn=loss.count_fn,
        batch_size=batch_size,
        micro_batch=micro_batch,
        unit=loss.unit,
        description=(
            f"{model_type} from {folder} ({origin}) on {Path(spec.data).name}: {layout.summary()}; "
            f"{spec.normalization} normalization"
        ),
        extras={
            "documents": tuple(tuple(doc) for doc in docs),
            "seq_len": seq_len,
            "pad_id": pad_id,
            "loss": loss,
            "layout": layout,
            "spec": spec,
        },
    )
