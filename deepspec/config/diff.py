"""What changed between a run's saved settings and this invocation's (for resuming a named run).

Only settings that change what is trained count: where and how fast it runs (workers, logging cadence, eval and
export settings, engine addresses, the run's own name) may differ between a run and its resume.
"""

from __future__ import annotations

from typing import Any

# Dotted prefixes whose values may differ between a run and its resume.
IGNORED = (
    "run.", "overrides", "eval.", "export.", "logging.",
    "train.resume", "train.prefetch_depth", "train.log_every", "train.save_every", "train.keep_last", "train.val_every",
    "train.compile", "train.output_root", "train.preempt_grace_s", "train.max_bad_steps",
    "data.regenerate.engine", "data.regenerate.urls", "data.regenerate.concurrency_per_server",
    "data.regenerate.timeout_s", "data.regenerate.max_retries", "data.regenerate.batch_size",
    "data.regenerate.vllm_kwargs", "data.regenerate.model", "data.regenerate.api_key",
    "cache.num_workers", "cache.batch_tokens", "cache.vllm_kwargs", "cache.capture_backend", "cache.shard_bytes", "cache.max_gb",
    "target.device_map",
)
REDACTED = "<redacted>"


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1}; lists and other values are leaves."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value and all(isinstance(k, str) for k in value) and not dotted.endswith(
            ("kwargs", "task_max_samples", "extra")
        ):
            out.update(flatten(value, dotted + "."))
        else:
            out[dotted] = value
    return out


def settings_diff(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """One line `key: saved -> current` per setting that differs (ignored prefixes and redacted secrets skipped)."""
    a, b = flatten(saved), flatten(current)
    lines = []
    for key in sorted(set(a) | set(b)):
        if key.startswith(IGNORED) or key == "overrides":
            continue
        old, new = a.get(key, "<unset>"), b.get(key, "<unset>")
        if REDACTED in (old, new):
            continue
        if isinstance(old, (int, float)) and isinstance(new, (int, float)) and not isinstance(old, bool):
            if float(old) == float(new):
                continue
        if old != new:
            lines.append(f"{key}: {old!r} -> {new!r}")
    return lines
