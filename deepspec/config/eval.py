"""Schema of the `eval` and `export` sections."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass
class EvalConfig:
    tasks: list[str] = field(
        default_factory=lambda: [
            "gsm8k", "math500", "aime25", "humaneval", "mbpp", "livecodebench", "mt-bench", "alpaca", "arena-hard-v2",
        ]
    )
    datasets_dir: str = "eval_datasets"
    max_samples: int | None = None
    max_new_tokens: int = 2048
    temperature: float = 0.0
    num_draft_tokens: int = 7
    seed: int = 980406
    num_workers: int = 1
    output_dir: str = ""  # empty = <checkpoint>/eval
    # Engine-backed eval: the same prompts through vLLM with --speculative-config.
    engine: Literal["none", "vllm"] = "none"
    engine_num_speculative_tokens: int = 3
    engine_url: str | None = None
    engine_extra_args: list[str] = field(default_factory=list)


@dataclass
class ExportConfig:
    format: Literal["vllm", "sglang"] = "vllm"
    dir: str = ""  # empty = <checkpoint>/export-<format>
    extra: dict[str, Any] = field(default_factory=dict)
