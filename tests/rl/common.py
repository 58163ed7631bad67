"""A tiny causal policy, rollout batches with uneven responses, and an independent reference.

The reference walks each row's response tokens in Python with ``log_softmax`` and the issue's
formulas written out (it shares no code with ``gradaccum.rl``): the per-token clipped surrogate
with GRPO's KL, then each aggregation's mean over the whole batch, in one forward and backward.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn

VOCAB = 19
SEQ = 12
ROWS = 8
CLIP = 0.2
KL = 0.05
MAX_RESPONSE = 9
# (prompt length, response length) per row: uneven responses, one row with none
SHAPES = ((3, 6), (4, 2), (2, 9), (3, 0), (5, 5), (2, 1), (4, 7), (3, 3))


class TinyPolicy(nn.Module):
    """Causal: position t sees tokens 0..t through a running mean of embeddings (float64)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.embed = nn.Embedding(VOCAB, 8)
            self.mix = nn.Linear(16, 16)
            self.head = nn.Linear(16, VOCAB)
        self.double()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(input_ids)
        steps = torch.arange(1, input_ids.shape[1] + 1, dtype=x.dtype).reshape(1, -1, 1)
        context = x.cumsum(dim=1) / steps
        return self.head(torch.tanh(self.mix(torch.cat([x, context], dim=-1))))


def rollout(seed: int = 0, shapes: tuple[tuple[int, int], ...] = SHAPES, per_token: bool = False) -> dict:
    """A batch of rows: prompt then response then padding; old and reference log-probs near the
    model's own (so some ratios fall outside the clip range), advantages per row or per token."""
    gen = torch.Generator().manual_seed(seed)
    rows = len(shapes)
    ids = torch.randint(1, VOCAB, (rows, SEQ), generator=gen)
    mask = torch.zeros(rows, SEQ, dtype=torch.long)
    for r, (prompt, response) in enumerate(shapes):
        mask[r, prompt : prompt + response] = 1
        ids[r, prompt + response :] = 0
    with torch.no_grad():
        logp = torch.log_softmax(TinyPolicy()(ids), dim=-1)
    current = torch.zeros(rows, SEQ, dtype=torch.float64)
    current[:, 1:] = logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    old = current + 0.3 * torch.randn(rows, SEQ, generator=gen, dtype=torch.float64)
    ref = current + 0.2 * torch.randn(rows, SEQ, generator=gen, dtype=torch.float64)
    old[mask == 0] = float("nan")  # padding values must never reach the gradient
    shape = (rows, SEQ) if per_token else (rows,)
    advantages = torch.randn(*shape, generator=gen, dtype=torch.float64)
    return {
        "input_ids": ids,
        "response_mask": mask,
        "old_logprobs": old,
        "advantages": advantages,
        "ref_logprobs": ref,
    }


def reference_loss(
    model: nn.Module, batch: dict, aggregation: str, max_len: int | None = None
) -> torch.Tensor:
    """The aggregation's mean over the whole batch, token by token (the issue's definitions)."""
    logp = torch.log_softmax(model(batch["input_ids"]), dim=-1)
    sequences: list[list[torch.Tensor]] = []
    for r in range(batch["input_ids"].shape[0]):
        tokens = []
        for t in range(1, batch["input_ids"].shape[1]):
            if not batch["response_mask"][r, t]:
                continue
            lp = logp[r, t - 1, batch["input_ids"][r, t]]
            adv = batch["advantages"][r] if batch["advantages"].ndim == 1 else batch["advantages"][r, t]
            ratio = torch.exp(lp - batch["old_logprobs"][r, t])
            surrogate = -torch.minimum(ratio * adv, torch.clamp(ratio, 1 - CLIP, 1 + CLIP) * adv)
            d = batch["ref_logprobs"][r, t] - lp
            tokens.append(surrogate + KL * (torch.exp(d) - d - 1))
        if tokens:
            sequences.append(tokens)
    n_tokens = sum(len(s) for s in sequences)
    if aggregation == "token-mean":
        return sum(sum(s) for s in sequences) / n_tokens  # type: ignore[return-value]
    if aggregation == "seq-mean-token-mean":
        return sum(sum(s) / len(s) for s in sequences) / len(sequences)  # type: ignore[return-value]
    if aggregation == "seq-mean-token-sum":
        return sum(sum(s) for s in sequences) / len(sequences)  # type: ignore[return-value]
    assert aggregation == "seq-mean-token-sum-norm" and max_len is not None
    return sum(sum(s) for s in sequences) / (len(sequences) * max_len)  # type: ignore[return-value]


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def reference_grads(batch: dict, aggregation: str, scale: float = 1.0) -> dict[str, torch.Tensor]:
    model = TinyPolicy()
    max_len = MAX_RESPONSE if aggregation == "seq-mean-token-sum-norm" else None
    (reference_loss(model, batch, aggregation, max_len) * scale).backward()
    return grads(model)


def loss_kwargs(aggregation: str) -> dict[str, Any]:
    extra = {"max_response_len": MAX_RESPONSE} if aggregation == "seq-mean-token-sum-norm" else {}
    return {"aggregation": aggregation, "clip_eps": CLIP, "kl_coef": KL, **extra}


def rel_err(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert got.keys() == want.keys()
    num = math.sqrt(sum(float((got[k] - want[k]).norm()) ** 2 for k in want))
    den = math.sqrt(sum(float(want[k].norm()) ** 2 for k in want))
    return num / den


# -- preference pairs -------------------------------------------------------------------------------

PAIR_SHAPES = ((3, 4, 6), (2, 7, 2), (4, 1, 5), (3, 6, 6), (2, 3, 8), (5, 2, 1), (3, 5, 3), (2, 8, 4))
"""(prompt length, chosen response length, rejected response length) per pair."""
BETA = 0.5


def pairs(seed: int = 1) -> dict:
    gen = torch.Generator().manual_seed(seed)
    n = len(PAIR_SHAPES)
    out: dict[str, torch.Tensor] = {}
    for side, col in (("chosen", 1), ("rejected", 2)):
        ids = torch.randint(1, VOCAB, (n, SEQ), generator=gen)
        mask = torch.zeros(n, SEQ, dtype=torch.long)
        for r, shape in enumerate(PAIR_SHAPES):
            mask[r, shape[0] : shape[0] + shape[col]] = 1
            ids[r, shape[0] + shape[col] :] = 0
        out[f"{side}_input_ids"], out[f"{side}_response_mask"] = ids, mask
        out[f"ref_{side}_logprobs"] = -2.0 * shape_lengths(mask) + torch.randn(
            n, generator=gen, dtype=torch.float64
        )
    return out


def shape_lengths(mask: torch.Tensor) -> torch.Tensor:
    return mask.sum(dim=1).to(torch.float64)


def reference_preference_loss(model: nn.Module, batch: dict, objective: str) -> torch.Tensor:
    """Mean over pairs of DPO's or IPO's loss, each response's log-prob summed token by token."""
    losses = []
    for r in range(batch["chosen_input_ids"].shape[0]):
        ratios, lengths = [], []
        for side in ("chosen", "rejected"):
            ids = batch[f"{side}_input_ids"][r : r + 1]
            logp = torch.log_softmax(model(ids), dim=-1)[0]
            total = sum(
                (logp[t - 1, ids[0, t]] for t in range(1, SEQ) if batch[f"{side}_response_mask"][r, t]),
                torch.zeros((), dtype=torch.float64),
            )
            ratios.append(total - batch[f"ref_{side}_logprobs"][r])
            lengths.append(max(int(batch[f"{side}_response_mask"][r, 1:].sum()), 1))
        if objective == "dpo":
            losses.append(-torch.nn.functional.logsigmoid(BETA * (ratios[0] - ratios[1])))
        else:
            losses.append((ratios[0] / lengths[0] - ratios[1] / lengths[1] - 1 / (2 * BETA)) ** 2)
    return torch.stack(losses).mean()


def reference_preference_grads(batch: dict, objective: str) -> dict[str, torch.Tensor]:
    model = TinyPolicy()
    reference_preference_loss(model, batch, objective).backward()
    return grads(model)
