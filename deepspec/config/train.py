"""Schema of the `train` and `logging` sections."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from deepspec.errors import ConfigError


@dataclass
class TrainConfig:
    output_root: str = "checkpoints"
    # `muon`: Muon for the 2-D hidden weight matrices of the draft body (attention, MLP, fc), AdamW for
    # everything else: output heads, Markov/confidence heads, embeddings, norms, biases (as DFlash recipes do).
    optimizer: Literal["adamw", "muon"] = "adamw"
    # AdamW's learning rate (with muon: the heads', norms' and biases').
    lr: float = 6e-4
    # Muon's learning rate for the body matrices, with Muon's original shape scaling (the DFlash recipe's
    # "muon_lr 0.02, lr 6e-4"); null = `lr` for both, Muon's update RMS-matched to AdamW's.
    muon_lr: float | None = None
    muon_momentum: float = 0.95
    # Under DDP with several ranks, each rank orthogonalises its share of Muon's matrices and broadcasts the results
    # (deepspec/train/muon_shard.py): the same updates, 1/world of the Newton–Schulz work per rank. Not under FSDP.
    muon_shard: bool = True
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    warmup_ratio: float = 0.04
    min_lr_ratio: float = 0.0
    epochs: float = 10.0
    max_steps: int | None = None
    # Samples per optimizer step over all workers; accumulation = global / (world x micro).
    global_batch_size: int = 512
    micro_batch_size: int = 1
    # Reserved: a cap on padded tokens per micro-batch (not supported yet; must stay null).
    max_tokens_per_batch: int | None = None
    # Sequence packing: each micro-batch's samples are packed back to back into rows of about this many
    # tokens (padding < 5%); attention, labels and blocks never cross samples. 0 = one sample per row.
    pack_tokens: int = 0
    # `length`: sort each global batch by length before cutting micro-batches (minimal padding).
    bucketing: Literal["length", "none"] = "length"
    # Which positions carry loss. `assistant`: the answer tokens (the cache's loss mask). `all`: prompt
    # tokens too — the labels are the target's distributions, valid everywhere; helps small datasets.
    loss_tokens: Literal["assistant", "all"] = "assistant"
    # How micro-batches weigh in a step's loss (deepspec/train/weighting.py). `tokens`: the mean over every
    # supervised token of the global batch. `positions`: each micro-batch's supervised sum over its B x T positions,
    # micro-batches averaged (DeepSpec's per-B·T). Measured side by side in benchmarks/bench_loss_normalization.py.
    loss_normalization: Literal["tokens", "positions"] = "tokens"
    grad_clip: float = 1.0
    # A step whose loss or gradient norm is NaN / inf is skipped (no weight update, logged with its samples); this
    # many in a row stop training with an error (0 = never stop). deepspec/train/guard.py
    max_nonfinite_steps: int = 10
    parallel: Literal["ddp", "fsdp"] = "ddp"
    # `auto`: bf16 autocast on GPU, fp32 on CPU. `bf16_if_native`: bf16 also on CPUs with AVX512-BF16 / AMX.
    precision: Literal["auto", "bf16_if_native", "bf16", "fp32"] = "auto"
    # torch.compile of the draft layers' norms, projections + RoPE and MLPs; the attention stays eager
    # (deepspec/train/compile.py). `auto`: compiled on CUDA, eager on the CPU. true / false: always / never.
    compile: bool | Literal["auto"] = "auto"
    # Block drafts' attention kernel: `sdpa` = a few chunked SDPA calls per layer (deepspec/drafts/attention.py),
    # `flex` = one FlexAttention call per layer with a block mask built once per step (deepspec/drafts/flex.py; compiled
    # on CUDA, an unfused reference on the CPU). `auto`: flex on CUDA when samples are packed (pack_tokens > 0: rows
    # near one length, so few context buckets to compile), sdpa otherwise (deepspec/drafts/plan.py resolve_kernel). EAGLE-3's
    # chain always runs on SDPA.
    attention: Literal["auto", "sdpa", "flex"] = "auto"
    # Micro-batches read + collated ahead by a background thread while the current one trains (0 = inline).
    # null: 2 where loading overlaps something (a GPU's compute, a streamed spool's producers), else 0 (inline on a
    # CPU, where the thread only takes cores from training: deepspec/train/loader.py resolve_depth).
    prefetch_depth: int | None = None  # was `num_workers` (still read, with a warning)
    # DataLoader worker processes per rank (deepspec/train/loader.py). null / 0: the background thread, which reads
    # the cache faster than processes do (benchmarks/bench_loader.py); > 0 for Python-bound datasets.
    loader_processes: int | None = None
    seed: int = 0
    save_every: int = 500
    keep_last: int = 3
    # Resume from <run_dir>/step_latest when it exists.
    resume: bool = True
    val_every: int = 500  # 0: validate at the end only
    val_max_samples: int = 64
    val_batch_size: int = 4
    log_every: int = 10

    def validate(self) -> None:
        if self.lr <= 0:
            raise ConfigError(f"train.lr must be positive, got {self.lr}.")
        if self.loss_normalization not in ("tokens", "positions"):
            raise ConfigError(f"train.loss_normalization must be tokens or positions, got {self.loss_normalization!r}.")
        if self.global_batch_size < 1 or self.micro_batch_size < 1:
            raise ConfigError("train.global_batch_size and train.micro_batch_size must be >= 1.")
        if not 0 <= self.warmup_ratio < 1:
            raise ConfigError(f"train.warmup_ratio must be in [0, 1), got {self.warmup_ratio}.")
        if self.keep_last < 1:
            raise ConfigError(f"train.keep_last must be >= 1, got {self.keep_last}.")
        if self.max_tokens_per_batch is not None:
            raise ConfigError(
                "train.max_tokens_per_batch is not supported yet (every worker must run the same number of micro-batches); "
                "leave it null and size batches with train.micro_batch_size (global batches are length-bucketed)."
            )
        if self.pack_tokens < 0:
            raise ConfigError(f"train.pack_tokens must be >= 0 (0 = no packing), got {self.pack_tokens}.")
        if self.loader_processes is not None and self.loader_processes < 0:
            raise ConfigError(f"train.loader_processes must be >= 0 or null (auto), got {self.loader_processes}.")
        if self.max_nonfinite_steps < 0:
            raise ConfigError(f"train.max_nonfinite_steps must be >= 0 (0 = never stop), got {self.max_nonfinite_steps}.")
        for key in ("save_every", "val_every", "log_every"):
            if getattr(self, key) < (0 if key == "val_every" else 1):
                raise ConfigError(f"train.{key} must be {'>= 0 (0: at the end only)' if key == 'val_every' else '>= 1'}, "
                                  f"got {getattr(self, key)}.")
        if self.prefetch_depth is not None and self.prefetch_depth < 0:
            raise ConfigError(f"train.prefetch_depth must be >= 0 or null (auto), got {self.prefetch_depth}.")
        if self.attention not in ("auto", "sdpa", "flex"):
            raise ConfigError(f"train.attention must be auto, sdpa or flex (the block drafts' attention kernel), got {self.attention!r}.")
        if not (isinstance(self.compile, bool) or self.compile == "auto"):
            raise ConfigError(f"train.compile must be true, false or auto (compiled on CUDA, eager on the CPU), got {self.compile!r}.")
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError(f"train.max_steps must be >= 1 or null, got {self.max_steps}.")


@dataclass
class LoggingConfig:
    wandb: bool = True
    # `offline` writes a local run under <run_dir>/wandb (sync later with `wandb sync`).
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    wandb_project: str | None = None
    wandb_entity: str | None = None
    tensorboard: bool = True
    # Console progress bar with loss, tokens/s and ETA.
    progress: bool = True
