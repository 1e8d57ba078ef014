"""Targets: load an HF id / local folder / the embedded SmolLM2, tap hidden states, tiny test models."""

from deepspec.targets.embedded import EMBEDDED_TARGETS, embedded_target_dir, is_embedded
from deepspec.targets.load import Target, chat_template_hash, load_target, load_target_from_config, load_tokenizer, resolve_target_path, template_hash
from deepspec.targets.taps import capture, default_taps, to_vllm_aux_ids, validate_taps
from deepspec.targets.tiny import save_tiny_target, tiny_config, tiny_target, tiny_tokenizer

__all__ = [
    "EMBEDDED_TARGETS", "Target", "capture", "default_taps", "embedded_target_dir", "is_embedded", "load_target",
    "chat_template_hash", "load_target_from_config", "load_tokenizer", "resolve_target_path", "save_tiny_target", "template_hash",
    "tiny_config", "tiny_target", "tiny_tokenizer", "to_vllm_aux_ids", "validate_taps",
]
