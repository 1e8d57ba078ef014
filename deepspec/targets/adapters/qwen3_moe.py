"""Qwen3-MoE: the Qwen3 layout with sparse MoE MLPs. The draft never runs the target's MLP, so MoE only
changes loading and memory; taps are decoder-layer outputs as for dense models."""

from __future__ import annotations

from typing import Any

from deepspec.targets.adapters.base import TargetAdapter, register
from deepspec.targets.adapters.llama import TINY_COMMON


def tiny_qwen3_moe_config(**overrides: Any):
    from transformers import Qwen3MoeConfig

    fields = {**TINY_COMMON, "tie_word_embeddings": False, "num_experts": 4, "num_experts_per_tok": 2,
              "moe_intermediate_size": 32, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True}
    return Qwen3MoeConfig(**{**fields, **overrides})


QWEN3_MOE = register(TargetAdapter("qwen3_moe", ("qwen3_moe",), tiny_config=tiny_qwen3_moe_config, moe=True))
