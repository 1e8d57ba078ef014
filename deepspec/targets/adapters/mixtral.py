"""Mixtral: the Llama layout with a sparse MoE block (top-2 of 8 experts in the real model)."""

from __future__ import annotations

from typing import Any

from deepspec.targets.adapters.base import TargetAdapter, register
from deepspec.targets.adapters.llama import TINY_COMMON


def tiny_mixtral_config(**overrides: Any):
    from transformers import MixtralConfig

    fields = {**TINY_COMMON, "tie_word_embeddings": False, "num_local_experts": 4, "num_experts_per_tok": 2}
    return MixtralConfig(**{**fields, **overrides})


MIXTRAL = register(TargetAdapter("mixtral", ("mixtral",), tiny_config=tiny_mixtral_config, moe=True))
