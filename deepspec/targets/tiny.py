"""Tiny randomly initialised targets for tests, one per adapter family, built in-process (no downloads).

The tokenizer is byte-level (256 byte tokens + ChatML specials) with a ChatML chat template,
so chat rendering, offsets and loss masks behave like a real model's. The model vocabulary is
padded past the tokenizer's, leaving unused ids (e.g. for a DFlash mask token), like Qwen3.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from deepspec.targets.tiny_tokenizer import tiny_tokenizer

TINY_VOCAB = 320  # 256 bytes + 4 specials, padded (ids 260..319 are unused)


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
