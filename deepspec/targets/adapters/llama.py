"""Llama layout (also Mistral, Qwen2, SmolLM): model.embed_tokens / model.layers / model.norm / lm_head."""

from __future__ import annotations

from typing import Any

from deepspec.targets.adapters.base import TargetAdapter, register

TINY_COMMON: dict[str, Any] = dict(
    vocab_size=320,  # deepspec.targets.tiny.TINY_VOCAB: 256 bytes + 4 specials, padded
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    bos_token_id=None,
    eos_token_id=258,  # <|im_end|>
    pad_token_id=256,
)


def tiny_llama_config(**overrides: Any):
    from transformers import LlamaConfig

    return LlamaConfig(**{**TINY_COMMON, "tie_word_embeddings": True, **overrides})


LLAMA = register(TargetAdapter("llama", ("llama", "mistral", "qwen2"), tiny_config=tiny_llama_config))
