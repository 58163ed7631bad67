"""A :class:`~gradaccum.Workload` from a local transformers model folder and a local data file.

The folder holds ``config.json`` and the tokenizer's files (what ``save_pretrained`` writes), and
optionally weights (``model.safetensors``, ``pytorch_model.bin`` or a sharded index). Without
weights the model is built from the config with seed 0, the same weights on every call. The data
file's documents are tokenized once, cut at ``seq_len``, and laid out as padded rows (one
document each, ``attention_mask``) or packed rows (``position_ids`` restarting per document).
The loss is :class:`~gradaccum.CausalLMLoss` with the spec's normalization and
``mask_documents=True``, so that a packed row attends within its documents only.

A tenth of the rows (at least one; none when the file has fewer than ``MIN_ROWS_TO_HOLD_OUT``) is
held out: ``make_batch`` never draws them, and evaluation draws only them (``make_batch.held_out``,
which :class:`~gradaccum.train.data.ShardedStream` uses), so a "held-out" loss is not measured on
rows the run trained on. A file too small to split refuses evaluation instead of faking it. A
batch larger than the verification batch that would repeat the training rows (a micro-batch of 512
on a 200-row file) is refused; a verification batch that repeats rows is allowed and ``verify``
reports the check as weak.

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
from gradaccum.workloads.data import count_of, read_data_file
from gradaccum.workloads.spec import DEFAULT_SEQ_LEN, HFSpec

__all__ = [
    "EXTRA",
    "HELD_OUT_FRACTION",
    "INIT_SEED",
    "MIN_ROWS_TO_HOLD_OUT",
    "hf_workload",
    "repeats",
    "saved_dtype",
]

EXTRA = "gradaccum[transformers]"
"""The optional extra that installs what an ``hf:`` workload imports."""
INIT_SEED = 0
"""The seed of a model built from its config alone."""
HELD_OUT_FRACTION = 0.1
"""The share of the rows held out for evaluation (rounded, at least one row)."""
MIN_ROWS_TO_HOLD_OUT = 10
"""Fewer rows than this are too few to split: nothing is held out and evaluation is refused."""
SPLIT_SEED = 0
"""The seed of the fixed permutation that picks the held-out rows."""
_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
_SAVED_DTYPES = ("float32", "bfloat16", "float16", "float64")
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
    fix = ". Save a fast tokenizer there with tokenizer.save_pretrained(MODEL_DIR)"
    return _from_pretrained(transformers.AutoTokenizer, folder, "load the tokenizer", fix)


def _load_config(transformers: Any, folder: Path) -> Any:
    return _from_pretrained(transformers.AutoConfig, folder, "read the config", "")


def _from_pretrained(auto: Any, folder: Path, what: str, fix: str) -> Any:
    """``auto.from_pretrained`` of the local folder; any failure as a WorkloadError naming it."""
    try:
        return auto.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:
        raise WorkloadError(f"cannot {what} of {str(folder)!r}: {type(exc).__name__}: {exc}{fix}") from None


def saved_dtype(config: Any) -> str:
    """The dtype the folder's parameters were saved in (``config.json``'s ``dtype``, ``torch_dtype``
    before transformers 4.56), by name; float32 when the config names none."""
    value = getattr(config, "dtype", None)
    if value is None:
        value = vars(config).get("torch_dtype")
    name = str(value).removeprefix("torch.") if value is not None else "float32"
    return name if name in _SAVED_DTYPES else "float32"


def _model_builder(transformers: Any, folder: Path, config: Any, weights: bool) -> Callable[[], nn.Module]:
    """``build_model``: the folder's model (float32, ``use_cache`` off), loaded once and copied.
    float32 whatever the folder's dtype, as ``verify``, ``bench`` and ``accept`` measure; ``train``
    stores the parameters in the saved dtype (``extras["saved_dtype"]``) or ``--param-dtype``'s: a
    bfloat16 or float16 folder's values survive the float32 copy exactly."""
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


def _draw(rows: dict[str, torch.Tensor], n_examples: int, seed: int) -> Batch:
    """n rows in an order drawn from ``seed``, cycling past the last row."""
    count = int(rows["input_ids"].shape[0])
    generator = torch.Generator().manual_seed(seed)
    rounds = -(-n_examples // count)
    order = torch.cat([torch.randperm(count, generator=generator) for _ in range(rounds)])[:n_examples]
    return {key: value[order] for key, value in rows.items()}


def _split(rows: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
    """(training rows, held-out rows): a fixed tenth held out, or ``None`` when too few to split."""
    count = int(rows["input_ids"].shape[0])
    if count < MIN_ROWS_TO_HOLD_OUT:
        return rows, None
    held = max(1, round(count * HELD_OUT_FRACTION))
    order = torch.randperm(count, generator=torch.Generator().manual_seed(SPLIT_SEED))
    train_idx, held_idx = order[held:].sort().values, order[:held].sort().values
    return (
        {key: value[train_idx] for key, value in rows.items()},
        {key: value[held_idx] for key, value in rows.items()},
    )


def repeats(rows: int, examples: int, data: str) -> str | None:
    """The sentence for a batch of ``examples`` drawn from ``rows`` training rows when it repeats them."""
    if examples <= rows:
        return None
    return (
        f"a batch of {examples:,} examples from {Path(data).name}, which holds {count_of(rows, 'row')} "
        f"to train on, repeats rows (about {examples / rows:.1f} times each)"
    )


def _sampler(
    rows: dict[str, torch.Tensor], held_out: dict[str, torch.Tensor] | None, data: str, verify_batch: int
) -> Callable[[int, int], Batch]:
    """``make_batch(n, seed)`` over the training rows, with ``make_batch.held_out(n, seed)`` over the
    held-out rows (refused when the file was too small to hold any out)."""
    count = int(rows["input_ids"].shape[0])
    total = count + (0 if held_out is None else int(held_out["input_ids"].shape[0]))

    def make_batch(n_examples: int, seed: int) -> Batch:
        repeated = repeats(count, n_examples, data)
        if repeated is not None and n_examples > verify_batch:
            raise WorkloadError(
                f"{repeated}: training on copies of the same rows. Ask for at most {count:,} examples per "
                "window (micro-batch x accumulation x dp, or --global-batch), or use a larger data file"
            )
        return _draw(rows, n_examples, seed)

    def draw_held_out(n_examples: int, seed: int) -> Batch:
        if held_out is None:
            raise WorkloadError(
                f"{Path(data).name} holds {count_of(total, 'row')}, too few to hold any out for evaluation "
                f"(at least {MIN_ROWS_TO_HOLD_OUT}: a tenth is held out), and a loss on the rows the run "
                "trains on is not a held-out loss. Use a larger data file, or evaluate without one (leave "
                "out --eval-every, --quality-steps)"
            )
        return _draw(held_out, n_examples, seed)

    make_batch.held_out = draw_held_out  # type: ignore[attr-defined]
    return make_batch


def hf_workload(spec: HFSpec, *, batch_size: int = 8, micro_batch: int = 2) -> Workload:
    """The workload ``spec`` names: its model, its data as rows, and :class:`CausalLMLoss`."""
    if spec.data is None:
        raise WorkloadError(
            f"workload hf:{spec.model_dir} needs a data file: add --data FILE (a local .txt or .jsonl)"
        )
    folder = Path(spec.model_dir)
    weights, _ = _check_folder(folder)
    data_file = read_data_file(spec.data, text_field=spec.text_field)
    texts = data_file.documents
    transformers = _transformers()
    with _quiet(transformers):
        tokenizer = _load_tokenizer(transformers, folder)
        config = _load_config(transformers, folder)
    documents = _tokenize(tokenizer, texts, spec.data)
    data = data_file.summary(untokenized=len(texts) - len(documents))  # nothing dropped unsaid
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
    train_rows, held_out = _split(layout.batch)
    n_train = int(train_rows["input_ids"].shape[0])
    n_held = 0 if held_out is None else int(held_out["input_ids"].shape[0])
    split = (
        f"{n_train:,} rows to train on, {n_held:,} held out for evaluation"
        if held_out is not None
        else f"all {count_of(n_train, 'row')} to train on, too few to hold any out (evaluation is refused)"
    )
    return Workload(
        name=f"hf:{folder.name}",
        build_model=_model_builder(transformers, folder, config, weights),
        make_batch=_sampler(train_rows, held_out, spec.data, batch_size),
        loss_fn=loss.loss_fn,
        count_fn=loss.count_fn,
        batch_size=batch_size,
        micro_batch=micro_batch,
        unit=loss.unit,
        description=(
            f"{model_type} from {folder} ({origin}) on {Path(spec.data).name}: {layout.summary()}; "
            f"{split}; {spec.normalization} normalization"
        ),
        extras={
            "documents": tuple(tuple(doc) for doc in docs),
            "seq_len": seq_len,
            "pad_id": pad_id,
            "loss": loss,
            "layout": layout,
            "spec": spec,
            "train_rows": n_train,
            "held_out_rows": n_held,
            "saved_dtype": saved_dtype(config),
            "data": data,
        },
    )
