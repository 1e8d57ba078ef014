"""Gemma-style (Gemma 2 / Gemma 3 text): the embedding module scales by sqrt(H) itself, so the embeddings
tap (-1) is what the first layer reads; final logit soft-capping and (1 + w) norms are the draft's business."""

from __future__ import annotations

from typing import Any

from deepspec.targets.adapters.base import TargetAdapter, register
from deepspec.targets.adapters.llama import TINY_COMMON


def tiny_gemma3_config(**overrides: Any):
    from transformers import Gemma3TextConfig

    fields = {**TINY_COMMON, "tie_word_embeddings": True, "sliding_window": 16, "query_pre_attn_scalar": 16,
              "hidden_activation": "gelu_pytorch_tanh", "bos_token_id": 257}
    fields.pop("rms_norm_eps")
    return Gemma3TextConfig(**{**fields, **overrides})


GEMMA = register(TargetAdapter("gemma3", ("gemma", "gemma2", "gemma3_text"), tiny_config=tiny_gemma3_config))
