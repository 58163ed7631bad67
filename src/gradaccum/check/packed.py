"""The packed check: the same documents packed and padded give the same update.

Under ``token`` normalization every target weighs 1/N and under ``document`` every document's
targets weigh 1/(D n_d), whatever rows hold them; so for a model that attends within documents
(``CausalLMLoss(mask_documents=True)`` hands a transformers model the block-diagonal causal
mask; a position-wise model needs none), packing changes the arithmetic's order but not its
terms. ``sequence`` normalization weighs *rows*, and packing changes the rows: there the two
layouts differ, as they must, and the report says so instead of failing.

Three comparisons, each from the same initial weights, in full precision:

1. packed rows: the accumulated update (uneven micro-batches) against one full batch (:func:`verify`);
2. padded rows: the same;
3. the full-batch update of the packed rows against that of the padded rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from gradaccum.batch import Batch, cast
from gradaccum.check.controls import randomness_off
from gradaccum.check.equivalence import verify
from gradaccum.check.report import EquivalenceReport, against
from gradaccum.check.runs import FLOOR_RATIO
from gradaccum.check.tolerances import Tolerance
from gradaccum.check.workload import OptimizerFactory, Workload, sgd
from gradaccum.errors import PlanError, WorkloadError
from gradaccum.fielddocs import document_fields
from gradaccum.loss import CausalLMLoss, Normalization
from gradaccum.packing import Packed, pack, pad
from gradaccum.precision import dtype_name

__all__ = ["LAYOUT_TOLERANCES", "PACKED_DOCUMENTS", "PackedReport", "verify_packed", "verify_packed_workload"]

PACKED_DOCUMENTS = 16
"""Documents a workload's packed check uses by default (its first ones)."""
LAYOUT_TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float64: Tolerance(
        value=1e-10,
        reason="relative L2 per parameter between the two layouts' full-batch gradients. The terms are "
        "the same; attention over a longer row adds exact zeros (masked keys weigh exp(min) = 0) and "
        "the sums run in another order, which moves float64 results by ~1e-15. Attention across "
        "documents, or positions that do not restart, change them by far more than 1e-3",
    ),
    torch.float32: Tolerance(
        value=1e-4,
        reason="relative L2 per parameter between the two layouts' full-batch gradients; float32 "
        "reorderings move them by ~1e-6, attention across documents by more than 1e-3",
    ),
}


@document_fields
@dataclass(frozen=True, kw_only=True, slots=True)
class PackedReport:
    """The outcome of :func:`verify_packed`."""

    normalization: str
    """The loss's denominator: token, sequence or document."""
    packed: EquivalenceReport
    """Packed rows: accumulated update against the full batch."""
    padded: EquivalenceReport
    """Padded rows: accumulated update against the full batch."""
    layout_grad_max_rel_err: float
    """Worst per-parameter relative L2 difference of the two layouts' full-batch gradients."""
    layout_param_max_abs_diff: float
    """Worst absolute parameter difference after each layout's full-batch update."""
    layout_tol: Tolerance
    """The float64 tolerance of the layout comparison, with its justification."""
    packed_loss: float
    """The packed rows' full-batch mean loss at the initial weights."""
    padded_loss: float
    """The padded rows' full-batch mean loss at the initial weights."""
    packing: str
    """What packing did (:meth:`gradaccum.packing.Packed.summary`)."""
    padding: str
    """The padded layout, the same way."""
    expect_same: bool
    """Whether the normalization makes the update independent of the layout (token, document)."""
    likely_causes: tuple[str, ...] = ()
    """Why a check failed, most specific first; empty when everything passed."""

    @property
    def layouts_agree(self) -> bool:
        return self.layout_grad_max_rel_err <= self.layout_tol.value

    @property
    def passed(self) -> bool:
        """Both layouts accumulate exactly, and (token, document) they agree with each other."""
        agree = self.layouts_agree or not self.expect_same
        return self.packed.passed and self.padded.passed and agree

    @property
    def failures(self) -> tuple[str, ...]:
        """What failed, one clause each with its figure and the layout it is on; empty on a pass."""
        causes = [f"packed rows: {c}" for c in self.packed.failures]
        causes += [f"padded rows: {c}" for c in self.padded.failures]
        if self.expect_same and not self.layouts_agree:
            causes.append(
                f"packed and padded differ by {self.layout_grad_max_rel_err:.1e} "
                f"{against(self.layout_grad_max_rel_err, self.layout_tol, self.layout_tol.value)}"
            )
        return tuple(causes)

    def summary(self) -> str:
        verdict = "PASS" if self.passed else f"FAIL ({'; '.join(self.failures)})"
        if self.expect_same:
            layouts = (
                f"packed and padded {'agree' if self.layouts_agree else 'DIFFER'}: "
                f"{self.layout_grad_max_rel_err:.1e} (tolerance {self.layout_tol})"
            )
        else:
            layouts = (
                f"packed and padded differ by {self.layout_grad_max_rel_err:.1e}, as {self.normalization} "
                "normalization must (it weighs rows, and packing changes the rows)"
            )
        return (
            f"{verdict}: {self.normalization} normalization; accumulation against the full batch "
            f"{self.packed.grad_max_rel_err:.1e} on packed rows, {self.padded.grad_max_rel_err:.1e} on "
            f"padded rows; {layouts}"
        )


def uneven_sizes(rows: int, accum_steps: int) -> list[int]:
    """``rows`` cut into ``accum_steps`` micro-batches of growing size (1, 2, ... in proportion)."""
    k = max(1, min(accum_steps, rows))
    total = k * (k + 1) // 2
    sizes = [max(1, rows * (i + 1) // total) for i in range(k)]
    sizes[-1] += rows - sum(sizes)
    while sizes[-1] < 1:  # only when rounding up the first ones overshot
        i = max(range(k - 1), key=lambda j: sizes[j])
        sizes[i] -= 1
        sizes[-1] += 1
    return sizes


def _full_batch(
    build: Callable[[], nn.Module], batch: Batch, loss: CausalLMLoss, factory: OptimizerFactory
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], float]:
    model = build()
    with randomness_off(model):
        optimizer = factory(model.parameters())
        optimizer.zero_grad(set_to_none=True)
        count = int(loss.count_fn(batch))
        summed = loss.loss_fn(model, batch)
        (summed / count).backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return grads, params, float(summed.detach()) / count


def _layout_errors(
    a: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], float],
    b: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], float],
) -> tuple[float, float]:
    grads_a, params_a, _ = a
    grads_b, params_b, _ = b
    norm = math.sqrt(sum(float(g.double().norm()) ** 2 for g in grads_b.values()))
    floor = FLOOR_RATIO * norm
    grad_err = 0.0
    for name in grads_a.keys() | grads_b.keys():
        x, y = grads_a.get(name), grads_b.get(name)
        like = x if x is not None else y
        assert like is not None
        x = torch.zeros_like(like) if x is None else x
        y = torch.zeros_like(like) if y is None else y
        diff = float((x - y).double().norm())
        denom = max(float(y.double().norm()), floor)
        grad_err = max(grad_err, diff / denom if denom > 0 else (0.0 if diff == 0 else math.inf))
    param_err = max((float((params_a[n] - params_b[n]).abs().max()) for n in params_b), default=0.0)
    return grad_err, param_err


def verify_packed(
    build_model: Callable[[], nn.Module],
    documents: Sequence[Sequence[int]],
    *,
    seq_len: int,
    normalization: Normalization = "token",
    accum_steps: int = 3,
    pad_id: int = 0,
    optimizer_factory: OptimizerFactory | None = None,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str = "cpu",
    seed: int = 0,
    name: str = "",
) -> PackedReport:
    """Check that ``documents`` (token-id sequences) give the same update packed and padded.

    The documents are packed (:func:`gradaccum.pack`) and padded (one per row) at ``seq_len``;
    each layout is accumulated in ``accum_steps`` uneven micro-batches and checked against its
    full batch, and the two layouts' full-batch updates are compared. The loss is
    ``CausalLMLoss(normalization, mask_documents=True)``: ``build_model()`` must return a model
    that attends within documents given that mask (a transformers causal LM), or one that
    attends to nothing but its own position.
    """
    if dtype not in LAYOUT_TOLERANCES:
        supported = ", ".join(dtype_name(d) for d in LAYOUT_TOLERANCES)
        raise PlanError(f"verify_packed runs in {supported}, not {dtype}")
    loss = CausalLMLoss(normalization, mask_documents=True)
    factory = optimizer_factory or sgd
    packed = pack(documents, seq_len, pad_id=pad_id)
    padded = pad(documents, seq_len, pad_id=pad_id)
    reports = []
    for layout in (packed, padded):
        reports.append(
            verify(
                build_model,
                layout.batch,
                loss.loss_fn,
                loss.count_fn,
                sizes=uneven_sizes(layout.rows, accum_steps),
                optimizer_factory=factory,
                dtype=dtype,
                device=device,
                seed=seed,
                name=name,
                unit=loss.unit,
            )
        )
    where = torch.device(device)

    def build() -> nn.Module:
        torch.manual_seed(seed)
        return build_model().to(device=where, dtype=dtype)

    with torch.random.fork_rng(devices=[where.index or 0] if where.type == "cuda" else []):
        ref_packed = _full_batch(build, cast(packed.batch, dtype, where), loss, factory)
        ref_padded = _full_batch(build, cast(padded.batch, dtype, where), loss, factory)
    grad_err, param_err = _layout_errors(ref_packed, ref_padded)
    tol = LAYOUT_TOLERANCES[dtype]
    expect_same = normalization != "sequence"
    causes: list[str] = []
    if expect_same and grad_err > tol.value:
        causes.append(_layout_cause(packed, grad_err))
    for label, report in (("packed", reports[0]), ("padded", reports[1])):
        causes.extend(f"{label} rows: {cause}" for cause in report.likely_causes)
    return PackedReport(
        normalization=normalization,
        packed=reports[0],
        padded=reports[1],
        layout_grad_max_rel_err=grad_err,
        layout_param_max_abs_diff=param_err,
        layout_tol=tol,
        packed_loss=ref_packed[2],
        padded_loss=ref_padded[2],
        packing=packed.summary(),
        padding=padded.summary(),
        expect_same=expect_same,
        likely_causes=tuple(causes),
    )


def _layout_cause(packed: Packed, err: float) -> str:
    return (
        f"the packed rows do not compute what the padded rows compute ({err:.1e} relative): the model "
        f"attends across the documents of a packed row ({packed.rows} rows hold {packed.documents} "
        "documents) or reads absolute positions that do not restart. A transformers model must accept "
        "the 4D block-diagonal attention_mask that CausalLMLoss(mask_documents=True) passes (eager or "
        "sdpa attention); a custom model must use position_ids and attend within documents"
    )


def verify_packed_workload(
    workload: Workload,
    *,
    normalization: Normalization | None = None,
    documents: int = PACKED_DOCUMENTS,
    accum_steps: int | None = None,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> PackedReport:
    """:func:`verify_packed` on a workload's first ``documents`` documents.

    The workload provides ``extras["documents"]`` (token-id sequences), ``extras["seq_len"]`` and
    optionally ``extras["pad_id"]`` and ``extras["loss"]`` (its :class:`CausalLMLoss`, whose
    normalization is the default); ``hf:`` workloads do. ``accum_steps`` defaults to the
    workload's batch_size / micro_batch.
    """
    extras = workload.extras
    if "documents" not in extras or "seq_len" not in extras:
        raise WorkloadError(
            f"the packed check needs the workload's tokenized documents, and workload {workload.name!r} "
            "provides none: set extras['documents'] (token-id sequences) and extras['seq_len'], or use "
            "--workload hf:MODEL_DIR --data FILE, which does"
        )
    if normalization is None:
        given = extras.get("loss")
        normalization = given.normalization if isinstance(given, CausalLMLoss) else "token"
    k = accum_steps if accum_steps is not None else max(2, workload.batch_size // workload.micro_batch)
    return verify_packed(
        workload.build_model,
        list(extras["documents"])[:documents],
        seq_len=int(extras["seq_len"]),
        normalization=normalization,
        accum_steps=k,
        pad_id=int(extras.get("pad_id", 0)),
        optimizer_factory=workload.optimizer_factory,
        dtype=dtype,
        device=device,
        seed=seed,
        name=workload.name,
    )
