"""Tiny randomly initialised targets for tests, one per adapter family, built in-process (no downloads).

The tokenizer is byte-level (256 byte tokens + ChatML specials) with a ChatML chat template,
so chat rendering, offsets and loss masks behave like a real model's. The model vocabulary is
padded past the tokenizer's, leaving unused ids (e.g. for a DFlash mask token), like Qwen3.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
TINY_VOCAB = 320  # 256 bytes + 4 specials, padded (ids 260..319 are unused)


def tiny_tokenizer():
    """A byte-level fast tokenizer with ChatML specials and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(byte_chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None, unk_token=None
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def tiny_families() -> list[str]:
    """Families with a tiny config: one per built-in adapter (llama, qwen3, gemma3, qwen3_moe, mixtral, tiny_mhc)."""
    from deepspec.targets.adapters import families

    return sorted(f for f, a in families().items() if a.tiny_config is not None)


def tiny_config(family: str = "llama", **overrides: Any):
    """A small config of the given family (see `tiny_families`); overrides set any field."""
    from deepspec.targets.adapters import families

    adapter = families().get(family)
    if adapter is None or adapter.tiny_config is None:
        raise ValueError(f"unknown tiny family {family!r}; use one of {', '.join(tiny_families())}")
    return adapter.tiny_config(**overrides)


def tiny_target(family: str = "llama", seed: int = 0, **overrides: Any):
    """Build (model, tokenizer): a random tiny causal LM in fp32, eval mode, frozen."""
    import torch
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval().requires_grad_(False)
    return model, tiny_tokenizer()


def save_tiny_target(path: str | Path, family: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    """Write a tiny target as an HF folder, so stages that load targets by path can use it."""
    path = Path(path)
    model, tok = tiny_target(family, seed, **overrides)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path
