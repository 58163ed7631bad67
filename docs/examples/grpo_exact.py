"""GRPO with TRL, made exact: a tiny Llama built from a config, a word-level tokenizer built here and
a rule for a reward, so nothing is downloaded. Run it as it is:

    python docs/examples/grpo_exact.py

One generation batch of 8 completions (2 prompts x 4) is cut into two optimizer updates of k = 2
micro-batches of 2 completions; completions of different lengths make TRL's per-micro-batch
denominators differ from the update's, which `exact_trainer` replaces by the update's own count.
`verify_accumulation` then compares one update with one pass over the same rows in float64.
"""

import tempfile
import warnings

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, PrinterCallback
from trl import GRPOConfig, GRPOTrainer

from gradaccum.integrations.trl import ExactGRPOConfig, exact_trainer

warnings.filterwarnings("ignore", category=FutureWarning)  # TRL 1.16 calls names transformers renamed

WORDS = "the a cat dog sat ran on under mat box far near home away birds fly high low red blue"


def word_tokenizer() -> PreTrainedTokenizerFast:
    raw = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.train_from_iterator([WORDS], trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]", "[EOS]"]))
    return PreTrainedTokenizerFast(
        tokenizer_object=raw, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]"
    )


def tiny_llama(vocab_size: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=2,
    )
    return LlamaForCausalLM(config)


def reward(completions: list[str], **_: object) -> list[float]:
    """A rule, not a model: longer completions score higher, and the word 'cat' more."""
    return [float(len(c.split())) + (2.0 if "cat" in c else 0.0) for c in completions]


tokenizer = word_tokenizer()
with tempfile.TemporaryDirectory() as out:
    args = GRPOConfig(
        output_dir=out,
        per_device_train_batch_size=2,  # completions per micro-batch
        gradient_accumulation_steps=2,  # k
        steps_per_generation=4,  # TRL counts micro-batches: two updates of k = 2 per generation batch
        num_generations=4,
        max_completion_length=6,
        max_steps=2,
        loss_type="dapo",
        beta=0.0,
        learning_rate=0.1,
        bf16=False,  # TRL's default autocasts to bfloat16, on CPU too
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    trainer = exact_trainer(GRPOTrainer)(
        model=tiny_llama(len(tokenizer)),
        reward_funcs=[reward],
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["the cat sat", "a dog ran on", "birds fly", "far"] * 4}),
        processing_class=tokenizer,
        exact=ExactGRPOConfig(normalize="update"),
    )
    trainer.remove_callback(PrinterCallback)  # TRL's metrics dictionary after each update
    trainer.train()
    print(f"aggregation: {trainer.exact_aggregation}, updates: {trainer.state.global_step}")
    print(trainer.verify_accumulation())
