"""Qwen3 (dense): Llama layout plus q/k norms (the draft picks those up from model_type)."""

from __future__ import annotations

from typing import Any

from deepspec.targets.adapters.base import TargetAdapter, register
from deepspec.targets.adapters.llama import TINY_COMMON


def tiny_qwen3_config(**overrides: Any):
    from transformers import Qwen3Config

    return Qwen3Config(**{**TINY_COMMON, "tie_word_embeddings": False, **overrides})


QWEN3 = register(TargetAdapter("qwen3", ("qwen3",), tiny_config=tiny_qwen3_config))
