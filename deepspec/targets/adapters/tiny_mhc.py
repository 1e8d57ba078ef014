"""`tiny-mhc` (deepspec.targets.tiny_mhc): Llama-like names, S residual streams (hc_mult), MoE MLPs."""

from __future__ import annotations

from typing import Any

from deepspec.targets.adapters.base import TargetAdapter, register


def tiny_mhc_config(**overrides: Any):
    from deepspec.targets.tiny_mhc import TinyMHCConfig

    return TinyMHCConfig(**overrides)


TINY_MHC = register(TargetAdapter("tiny_mhc", ("deepspec_tiny_mhc",), tiny_config=tiny_mhc_config, moe=True))
