"""Schema of the `target` section: which LLM the draft serves."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from deepspec.errors import ConfigError


@dataclass
class TargetConfig:
    # An embedded name (`smollm2-135m-instruct`), a Hugging Face model id, or a local folder.
    name: str = "smollm2-135m-instruct"
    revision: str | None = None
    # `auto`: bf16 on GPU, fp32 on CPU. `bf16_if_native`: bf16 on GPU and on CPUs with AVX512-BF16 / AMX
    # (2-2.5x faster than fp32 there), fp32 on other CPUs (emulated bf16 is ~5x slower). Applies to the
    # HF target (cache, eval) and to vLLM (regeneration, serving) alike.
    dtype: Literal["auto", "bf16_if_native", "float32", "bfloat16", "float16"] = "auto"
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2"] = "auto"
    # Passed to the chat template everywhere (regeneration, cache, eval), e.g. enable_thinking: false.
    chat_template_kwargs: dict[str, Any] = field(default_factory=lambda: {"enable_thinking": False})
    trust_remote_code: bool = False
    # Sharded loading of the HF target (cache capture, online training, eval): null = the whole model on one
    # device; "auto" = spread over every visible GPU then CPU RAM (accelerate), for targets larger than one GPU.
    # DeepSeek-V4 / Qwen3-MoE-sized targets: prefer cache.capture_backend=vllm with tensor/expert parallelism.
    device_map: str | None = None

    def validate(self) -> None:
        if not self.name:
            raise ConfigError("target.name is empty; set it to an HF model id, a local path or 'smollm2-135m-instruct'.")
        if self.device_map not in (None, "auto", "balanced", "balanced_low_0", "sequential"):
            raise ConfigError(f"target.device_map={self.device_map!r} is not one of null, auto, balanced, balanced_low_0, sequential.")
