"""Regeneration engines behind one interface: in-process vLLM, OpenAI-compatible servers, transformers."""

from __future__ import annotations

import importlib.util

from deepspec.data.engines.base import ConversationState, Engine, Job, JobResult, LengthGuard, TurnOutput
from deepspec.errors import ConfigError

__all__ = ["ConversationState", "Engine", "Job", "JobResult", "LengthGuard", "TurnOutput", "create_engine", "resolve_engine_name"]


def resolve_engine_name(name: str, urls: list[str]) -> str:
    """`auto`: openai when server URLs are given, else vllm when importable, else hf."""
    if name != "auto":
        return name
    if urls:
        return "openai"
    return "vllm" if importlib.util.find_spec("vllm") is not None else "hf"


def _local_tokenizer(cfg):
    """The target's tokenizer for length checks and the template hash; None if it cannot be loaded here."""
    from deepspec.log import get_logger
    from deepspec.targets import load_tokenizer

    try:
        return load_tokenizer(cfg.target.name, cfg.target.revision, cfg.target.trust_remote_code)
    except Exception as e:  # noqa: BLE001 - a remote-only target is fine for the openai engine
        get_logger(__name__).warning("no local tokenizer for %s (%s); prompt lengths are not checked", cfg.target.name, e)
        return None


def create_engine(cfg, name: str, urls: list[str]) -> Engine:
    """Build the engine named by `data.regenerate.engine` (or the CLI) from the config."""
    rc = cfg.data.regenerate
    kwargs = cfg.target.chat_template_kwargs
    if name == "vllm":
        from deepspec.data.engines.vllm_engine import VLLMEngine
        from deepspec.targets import resolve_target_path
        from deepspec.targets.load import resolve_dtype_name

        # vLLM runs the target in the recipe's dtype (not the checkpoint's own, bf16 for the embedded
        # target): emulated bf16 on a CPU without AVX512-BF16 is ~5x slower than fp32.
        vllm_kwargs = {"dtype": resolve_dtype_name(cfg.target.dtype), **rc.vllm_kwargs}
        return VLLMEngine(resolve_target_path(cfg.target.name), rc.sampling, kwargs, batch_size=rc.batch_size,
                          max_model_len=rc.max_model_len, vllm_kwargs=vllm_kwargs)
    if name == "openai":
        from deepspec.data.engines.openai_engine import OpenAIEngine

        return OpenAIEngine(urls, rc.sampling, kwargs, concurrency_per_server=rc.resolved_concurrency(),
                            timeout_s=rc.timeout_s, max_retries=rc.max_retries, model=rc.model,
                            tokenizer=_local_tokenizer(cfg), max_model_len=rc.max_model_len)
    if name == "hf":
        from deepspec.data.engines.hf_engine import HFEngine

        return HFEngine(cfg.target, rc.sampling, kwargs, batch_size=rc.batch_size, max_model_len=rc.max_model_len)
    raise ConfigError(f"Unknown regeneration engine '{name}'; use auto, vllm, openai or hf.")
