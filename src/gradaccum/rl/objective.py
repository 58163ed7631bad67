"""The per-token policy objective: the taken tokens' log-probs, PPO's clipped surrogate, GRPO's KL.

Token t's log-prob comes from the logits at t - 1, so every per-token tensor here is aligned with
the *targets* ``input_ids[:, 1:]`` (``seq - 1`` columns); the caller's tensors, aligned with
``input_ids``, lose their first column. With r_t = exp(lp_t - old_t) and d_t = ref_t - lp_t:

    l_t = -min(r_t A_t, clip(r_t, 1 - eps, 1 + eps) A_t) + kl_coef (exp(d_t) - d_t - 1)

Inputs at positions outside the response mask are replaced by zeros before any arithmetic: a
padding value (``inf``, ``nan``) would otherwise reach the gradient through ``0 * inf``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["clipped_surrogate", "kl_estimate", "per_token_loss", "token_logprobs"]


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """``(rows, seq - 1)``: the log-prob of token t under the logits at t - 1 (half upcast to float32)."""
    shifted = logits[:, :-1, :]
    if shifted.dtype in (torch.float16, torch.bfloat16):
        shifted = shifted.float()  # log-softmax in half precision loses the small probabilities
    flat = shifted.reshape(-1, shifted.shape[-1])
    targets = input_ids[:, 1:].reshape(-1)
    return -F.cross_entropy(flat, targets, reduction="none").reshape(input_ids.shape[0], -1)


def clipped_surrogate(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, clip_eps: float
) -> torch.Tensor:
    """PPO's clipped surrogate, negated (a loss): -min(r A, clip(r, 1 - eps, 1 + eps) A)."""
    ratio = torch.exp(logprobs - old_logprobs)
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps)
    return -torch.minimum(ratio * advantages, clipped * advantages)


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """GRPO's per-token KL(policy || reference) estimator exp(d) - d - 1 with d = ref - lp (>= 0)."""
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1.0


def per_token_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    *,
    clip_eps: float,
    kl_coef: float,
) -> torch.Tensor:
    """l_t for every target position (the module docstring); masking and weighting are the caller's."""
    loss = clipped_surrogate(logprobs, old_logprobs, advantages, clip_eps)
    if kl_coef != 0.0 and ref_logprobs is not None:
        loss = loss + kl_coef * kl_estimate(logprobs, ref_logprobs)
    return loss
