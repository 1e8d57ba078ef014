"""Schema of the `eval` and `export` sections."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass
class EvalConfig:
    # Benchmark names, `heldout` (the same-pool validation split), `heldout:<split>` (a held-out split of
    # data.prompts.sources, e.g. heldout:general) or a path to the user's own .jsonl / .json prompts, reported
    # under the file stem (docs/data.md, "Custom eval tasks").
    tasks: list[str] = field(
        default_factory=lambda: [
            "gsm8k", "math500", "aime25", "humaneval", "mbpp", "livecodebench", "mt-bench", "alpaca", "arena-hard-v2",
        ]
    )
    datasets_dir: str = "eval_datasets"
    # null = DeepSpec's per-benchmark caps (gsm8k 500, aime25 30, ...); larger files are shuffled with `seed`, then cut.
    max_samples: int | None = None
    # Per-task caps that win over max_samples, e.g. {heldout: 24}: every held-out prompt, a few of each benchmark.
    task_max_samples: dict[str, int] = field(default_factory=dict)
    max_new_tokens: int = 2048
    temperature: float = 0.0
    # How drafts are drawn at T > 0 (same name and values as vLLM's speculative-config field): `probabilistic` samples
    # drafts from the draft's softmax(z / T) and accepts with min(1, p / q) — DeepSpec's protocol, the one the papers
    # report, so it stays the default and published figures compare; `greedy` drafts the argmax and accepts iff
    # u < p(x), as vLLM serves unless told otherwise (lower acceptance at the same draft). The engine-backed eval starts
    # vLLM with the same value. At T = 0 both are greedy verification. Every tau reported names its protocol.
    draft_sample_method: Literal["probabilistic", "greedy"] = "probabilistic"
    num_draft_tokens: int = 7
    seed: int = 980406
    # 0 = one worker per visible GPU, or 1 on CPU; N = N workers (samples strided over them, results merged).
    num_workers: int = 0
    # Time target-only decoding on the same prompts in the same process (for tokens/s and speedup).
    measure_speedup: bool = True
    # T=0 without timing: the target answers the prompts in batches (replay_batch_size at a time), then each answer's
    # verify rounds are replayed against it (one target forward per answer instead of one per round). Greedy
    # verification accepts exactly the drafts equal to the target's greedy tokens, so the counters are the speculative
    # loop's (pinned by tests/test_eval_replay.py). Meant for GPUs, where batched generation is cheap (not timed there
    # yet); on 2 CPU cores it was slower than decoding (docs/evaluation.md). Needs temperature 0, measure_speedup false.
    greedy_replay: bool = False
    replay_batch_size: int = 16
    output_dir: str = ""  # empty = <checkpoint>/eval
    # Engine-backed eval: the same prompts through vLLM with --speculative-config.
    engine: Literal["none", "vllm"] = "none"
    engine_num_speculative_tokens: int | None = None  # null = num_draft_tokens (compare at the same S)
    engine_url: str | None = None  # an already running server (its counters are shared with other clients!)
    # Several running servers (same target, same draft): each conversation runs on one of them; a server that dies is
    # left out and its conversations of the benchmark run again elsewhere, so every count is exact (docs/reliability.md).
    # engine_urls_file: one URL per line, `URL  # log: PATH` names a server's log for the error when all are gone.
    engine_urls: list[str] = field(default_factory=list)
    engine_urls_file: str | None = None
    engine_down_grace_s: float = 60.0  # how long the eval waits for any server to answer again before it stops
    engine_extra_args: list[str] = field(default_factory=list)
    engine_max_concurrency: int = 8
    engine_max_model_len: int = 4096
    # Served speedup: vLLM's output tokens/s with and without the draft (same prompts, same server settings), one
    # request at a time and 16 in flight. null = follow measure_speedup. It decodes every timed prompt four times and
    # starts a second server, so the knobs below bound it: the tasks timed (empty = every eval task), the prompts per
    # task (the first N of that task's eval prompts) and the answer cap while timing (null = eval.max_new_tokens).
    engine_speedup: bool | None = None
    engine_speedup_tasks: list[str] = field(default_factory=list)
    engine_speedup_max_samples: int = 16
    engine_speedup_max_new_tokens: int | None = None
    # Acceptance by context length: each answer's verify rounds are also counted in the bucket of its rendered prompt's
    # token count; these edges cut the buckets (<256, 256-1k, 1k-4k, 4k-16k, >=16k). [] = one bucket (docs/evaluation.md).
    context_length_buckets: list[int] = field(default_factory=lambda: [256, 1024, 4096, 16384])
    # Thinking modes compared on the held-out splits (every task when eval.tasks has none), e.g. [on, off]: each mode
    # decodes them with target.chat_template_kwargs + enable_thinking true / false (YAML reads on / off as booleans).
    # [] = decode once, as configured.
    thinking_modes: list[bool] = field(default_factory=list)

    def validate(self) -> None:
        from deepspec.errors import ConfigError

        if self.num_draft_tokens < 1:
            raise ConfigError(f"eval.num_draft_tokens must be >= 1, got {self.num_draft_tokens}.")
        if self.temperature < 0:
            raise ConfigError(f"eval.temperature must be >= 0 (0 = greedy), got {self.temperature}.")
        if self.draft_sample_method not in ("probabilistic", "greedy"):
            raise ConfigError(f"eval.draft_sample_method must be probabilistic or greedy, got {self.draft_sample_method!r}.")
        if self.max_new_tokens < 1:
            raise ConfigError(f"eval.max_new_tokens must be >= 1, got {self.max_new_tokens}.")
        if self.num_workers < 0:
            raise ConfigError(f"eval.num_workers must be >= 0 (0 = auto), got {self.num_workers}.")
        if self.max_samples is not None and self.max_samples < 1:
            raise ConfigError(f"eval.max_samples must be >= 1 or null, got {self.max_samples}.")
        if self.greedy_replay and (self.temperature != 0 or self.measure_speedup):
            raise ConfigError(
                "eval.greedy_replay replays greedy verification and times nothing: it needs eval.temperature=0 and "
                "eval.measure_speedup=false (or set eval.greedy_replay=false to decode every answer)."
            )
        if self.replay_batch_size < 1:
            raise ConfigError(f"eval.replay_batch_size must be >= 1, got {self.replay_batch_size}.")
        if self.engine_down_grace_s < 0:
            raise ConfigError(f"eval.engine_down_grace_s must be >= 0 seconds, got {self.engine_down_grace_s}.")
        if self.engine_speedup_max_samples < 1:
            raise ConfigError(f"eval.engine_speedup_max_samples must be >= 1, got {self.engine_speedup_max_samples}.")
        if self.engine_speedup_max_new_tokens is not None and self.engine_speedup_max_new_tokens < 1:
            raise ConfigError(f"eval.engine_speedup_max_new_tokens must be >= 1 or null, got {self.engine_speedup_max_new_tokens}.")
        edges = self.context_length_buckets
        if any(not isinstance(e, int) or e < 1 for e in edges) or any(a >= b for a, b in zip(edges, edges[1:])):
            raise ConfigError(f"eval.context_length_buckets must be increasing token counts >= 1 (e.g. [256, 1024, 4096, 16384]), got {edges}.")
        if len(set(self.thinking_modes)) != len(self.thinking_modes):
            named = ["on" if m else "off" for m in self.thinking_modes]
            raise ConfigError(f"eval.thinking_modes names a mode twice ({named}); list on and/or off once each, e.g. [on, off].")
        bad = {task: n for task, n in self.task_max_samples.items() if not isinstance(n, int) or n < 1}
        if bad:
            raise ConfigError(f"eval.task_max_samples needs a count >= 1 per task, got {bad}.")


@dataclass
class ExportConfig:
    format: Literal["vllm", "sglang"] = "vllm"
    dir: str = ""  # empty = <checkpoint>/export-<format>
    extra: dict[str, Any] = field(default_factory=dict)
