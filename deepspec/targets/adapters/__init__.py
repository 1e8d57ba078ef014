"""Target adapters: one file per family, each registering where its pieces live (see base.py)."""

from deepspec.targets.adapters import deepseek_v4, gemma, llama, mixtral, qwen3, qwen3_moe, tiny_mhc  # noqa: F401  (registration)
from deepspec.targets.adapters.base import TargetAdapter, adapter_for, families, register, registered, text_config

__all__ = ["TargetAdapter", "adapter_for", "families", "register", "registered", "text_config"]
