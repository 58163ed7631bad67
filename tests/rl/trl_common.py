"""TRL runs for the tests and the benchmark: a tiny Llama from a config, a word-level tokenizer
built here, a rule-based reward, short generations on CPU (nothing is downloaded).

Each run records, per optimizer update, the weights it started from and the gradient it stepped
with, so an update can be compared with a full-batch reference at its own starting weights.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, cast

import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast, TrainerCallback

from tests.helpers.hf import tiny_llama_config, word_tokenizer

WORDS = [
    "the",
    "a",
    "cat",
    "dog",
    "sat",
    "ran",
    "on",
    "under",
    "mat",
    "box",
    "far",
    "near",
    "home",
    "away",
    "birds",
    "fly",
    "high",
    "low",
    "red",
    "blue",
]
PROMPTS = ["the cat sat", "a dog ran on", "birds fly", "the red box far"]
K, MICRO, UPDATES = 2, 2, 2  # accumulation steps, rows per micro-batch, updates per generation batch
MAX_COMPLETION = 6


def tokenizer() -> PreTrainedTokenizerFast:
    return cast(PreTrainedTokenizerFast, word_tokenizer(WORDS, eos=True))


def model(tok: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    config = tiny_llama_config(len(tok), layers=1, eos_token_id=2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return LlamaForCausalLM(config).to(torch.float64)


def reward(completions: list[str], **_: Any) -> list[float]:
    """Longer completions and the word 'cat' score higher: a rule, no model."""
    return [float(len(c.split())) + (2.0 if "cat" in c else 0.0) for c in completions]


class Updates(TrainerCallback):
    """Each update's starting weights and the gradient it steps with (before clipping: none here)."""

    def __init__(self) -> None:
        self.starts: list[dict[str, torch.Tensor]] = []
        self.grads: list[dict[str, torch.Tensor]] = []

    def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **_: Any) -> None:
        self.starts.append({k: v.detach().clone() for k, v in model.state_dict().items()})

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **_: Any) -> None:
        self.grads.append(
            {
                n: torch.zeros_like(p) if p.grad is None else p.grad.clone()
                for n, p in model.named_parameters()
            }
        )


COMMON: dict[str, Any] = {
    "learning_rate": 0.1,
    "optim": "sgd",
    "lr_scheduler_type": "constant",
    "max_grad_norm": 0.0,
    "logging_steps": 1,
    "report_to": [],
    "use_cpu": True,
    "save_strategy": "no",
    "seed": 0,
    "disable_tqdm": True,
    "bf16": False,  # TRL defaults to bf16 autocast, which would hide any weighting error
}


def grpo(cls: type, out: Path, loss_type: str, **extra: Any) -> tuple[Any, Updates]:
    """A GRPO run of two updates over one generation batch: 8 completions (2 prompts x 4), k = 2
    micro-batches of 2 per update; TRL counts steps_per_generation in micro-batches (k x 2 updates)."""
    from datasets import Dataset
    from trl import GRPOConfig

    tok = tokenizer()
    kwargs = {"exact": extra.pop("exact")} if "exact" in extra else {}
    args = GRPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=K,
        steps_per_generation=K * UPDATES,
        num_generations=4,
        max_completion_length=MAX_COMPLETION,
        max_steps=UPDATES,
        loss_type=loss_type,
        beta=0.0,
        shuffle_dataset=False,
        **{**COMMON, **extra},
    )
    updates = Updates()
    data = Dataset.from_dict({"prompt": PROMPTS * 4})
    trainer = cls(
        model=model(tok),
        reward_funcs=[reward],
        args=args,
        train_dataset=data,
        processing_class=tok,
        callbacks=[updates],
        **kwargs,
    )
    trainer.train()
    return trainer, updates


PAIRS = {
    "prompt": ["the cat", "a dog ran", "birds", "the red box", "home", "blue"],
    "chosen": [" sat on the mat", " far", " fly high home", " near", " away away", " low red"],
    "rejected": [" ran", " under the box", " low", " on the mat far", " sat", " birds fly high"],
}
"""Six pairs: micro-batches of 4 and 2 pairs in one update of k = 2."""

PAIRS_8 = {
    key: [*values, *extra]
    for (key, values), extra in zip(
        PAIRS.items(), (["a cat", "far"], [" on the mat", " home"], [" ran away", " near"]), strict=True
    )
}
"""Eight pairs: one window of 2 micro-batches of 2 pairs on each of two ranks."""


def dpo(
    cls: type, out: Path, pairs: dict[str, list[str]] = PAIRS, per_device: int = 4, precompute: bool = True
) -> tuple[Any, Updates]:
    """A DPO run of one update; ``precompute=False`` computes the reference log-probs per micro-batch
    (TRL's precomputed ones need a dataset on disk under DDP: rank 0 writes them into its own
    temporary folder for an in-memory dataset, where the other rank cannot read them)."""
    from datasets import Dataset
    from trl import DPOConfig

    tok = tokenizer()
    args = DPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=K,
        max_steps=1,
        beta=0.5,
        precompute_ref_log_probs=precompute,
        **COMMON,
    )
    updates = Updates()
    reference = {} if precompute else {"ref_model": model(tok)}  # the same initial weights, frozen
    trainer = cls(
        model=model(tok),
        args=args,
        train_dataset=Dataset.from_dict(pairs),
        processing_class=tok,
        callbacks=[updates],
        **reference,
    )
    trainer.train()
    return trainer, updates


def start_model(run: Updates, update: int) -> LlamaForCausalLM:
    fresh = model(tokenizer())
    fresh.load_state_dict(run.starts[update])
    return fresh


def pairs_batch(trainer: Any, reference: torch.nn.Module | None = None) -> dict[str, torch.Tensor]:
    """The training set's pairs in PreferenceLoss's contract, right-padded to one length; the
    reference log-probs from the dataset (precomputed) or from ``reference`` (float64)."""
    rows = [trainer.train_dataset[i] for i in range(len(trainer.train_dataset))]
    seqs = {side: [r["prompt_ids"] + r[f"{side}_ids"] for r in rows] for side in ("chosen", "rejected")}
    width = max(len(s) for side in seqs.values() for s in side)
    out: dict[str, torch.Tensor] = {}
    for side, items in seqs.items():
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        attention = torch.zeros(len(rows), width, dtype=torch.long)
        for i, (row, seq) in enumerate(zip(rows, items, strict=True)):
            ids[i, : len(seq)] = torch.tensor(seq)
            attention[i, : len(seq)] = 1
            mask[i, len(row["prompt_ids"]) : len(seq)] = 1
        out[f"{side}_input_ids"], out[f"{side}_response_mask"] = ids, mask
        out[f"{side}_attention_mask"] = attention
        if reference is None:
            refs = torch.tensor([r[f"ref_{side}_logps"] for r in rows], dtype=torch.float64)
        else:
            with torch.no_grad():
                logp = torch.log_softmax(reference(input_ids=ids, attention_mask=attention).logits, dim=-1)
            taken = logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
            refs = (taken * mask[:, 1:]).sum(dim=1)
        out[f"ref_{side}_logprobs"] = refs
    return out


def snapshot(trainer: Any) -> list[dict[str, torch.Tensor]]:
    return copy.deepcopy(list(trainer._buffered_inputs))


def update_rows(trainer: Any, update: int) -> dict[str, torch.Tensor]:
    """The policy rows of one optimizer update: the k micro-batches TRL buffered for it, joined."""
    from gradaccum.integrations.trl import policy_batch

    slices = trainer._buffered_inputs[update * K : (update + 1) * K]
    keys = [
        key
        for key in (
            "prompt_ids",
            "prompt_mask",
            "completion_ids",
            "completion_mask",
            "advantages",
            "old_per_token_logps",
        )
        if key in slices[0]
    ]
    return policy_batch({key: torch.cat([s[key] for s in slices]) for key in keys})
