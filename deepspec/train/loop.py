"""The training loop, top to bottom: build -> resume -> (accumulate, clip, step, log, validate, save)*.

Gradient accumulation is exact across worker counts: each micro-batch contributes
loss x (its supervised tokens), and once the step's micro-batches are done the gradients are
scaled by world / (supervised tokens of the whole global batch) — so the update is the token-
weighted mean over the global batch whether it ran on 1 worker x 4 micro-batches or 2 x 2.
Randomness inside a draft (e.g. anchor sampling) is reseeded per (seed, step, micro-batch position
in the global batch), so a resumed run — on any worker count — replays exactly what the
uninterrupted run would have done.

A draft may weight its micro-batch itself: when `loss()` returns the reserved metric
`"_loss_weight": (weight, 1)` (e.g. its own count of supervised positions after packing or anchor
sampling), that weight replaces the micro-batch's supervised-token count, in backward and in the
global normalisation alike.

The loop waits for the device once per step, after the backward pass, for one scalar: whether the step's loss and
gradient norm are finite (deepspec/train/guard.py). The draft reads nothing back either: what it needs to know about
a batch on the host (anchors, sample bounds, attention chunk plans) the loader computed from the CPU batch and attached
as its step plan (deepspec/drafts/plan.py). Otherwise batches are staged to the GPU one ahead
(deepspec/train/staging.py), losses, token counts and metrics accumulate on the device, the gradient
scale is applied as a device tensor, and values come to the host only on logged steps (and for
validation / checkpoints).
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import time
from pathlib import Path

import torch

from deepspec.config import save_config
from deepspec.errors import CheckpointError, ConfigError
from deepspec.locks import folder_lock
from deepspec.log import get_logger, progress
from deepspec.train import checkpoint as ckpt
from deepspec.train.build import build_parts, default_write_draft
from deepspec.data.batches import BatchPlan, collate_fn, packing, sample_lengths, supervise_all_tokens
from deepspec.train.dist import DistInfo, all_reduce_sum, init_distributed, reduce_metrics, teardown
from deepspec.train.loggers import MetricLoggers, format_postfix
from deepspec.train.parts import TrainParts
from deepspec.train.optim import build_optimizer, build_scheduler, describe_param_groups
from deepspec.train.parallel import accumulating, full_trainable_state, release_gathered, wrap
from deepspec.train.compile import compile_draft
from deepspec.train.guard import NonFiniteGuard
from deepspec.preemption import PreemptionWatch, WaitPreempted
from deepspec.train.precision import resolve_precision, setup_precision
from deepspec.drafts.plan import resolve_kernel, use_buckets
from deepspec.train.loader import build_loader, resolve_depth, resolve_processes, step_planner
from deepspec.train.staging import DeviceStager
from deepspec.train.validate import best_metric, run_validation
from deepspec.train.weighting import micro_batch_weight

log = get_logger(__name__)

# Fault injection (tests): rank 0 SIGKILLs itself right after finishing this step.
_KILL_AFTER = int(os.environ["DEEPSPEC_TRAIN_KILL_AFTER_STEP"]) if os.environ.get("DEEPSPEC_TRAIN_KILL_AFTER_STEP") else None


def train(cfg, parts: TrainParts | None = None) -> Path:
    """Train (or resume) the run `cfg.run_dir`; returns the final checkpoint directory.

    Runs in this process as one worker, or as one of the workers of a torchrun launch.
    """
    info = init_distributed()
    try:
        with folder_lock(cfg.run_dir, "training run", enabled=info.is_main):  # one run per folder (deepspec/locks.py)
            return _train(cfg, info, parts)
    finally:
        teardown(info)


def autocast_context(cfg, device: torch.device):
    """A factory of the forward pass's precision context for `train.precision` on `device` (validation
    and bench_replay reuse it, so they measure the draft as it trained)."""
    if resolve_precision(cfg.train.precision, device) == "bf16":
        return lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def _step_seed(seed: int, step: int, chunk: int) -> int:
    """Seed of one micro-batch: its position in the global batch, not (rank, accumulation index), so
    random choices inside a draft (anchors) are the same on any worker count."""
    return (seed * 1_000_003 + step * 10_007 + chunk) % (2**63 - 1)


def _train(cfg, info: DistInfo, parts: TrainParts | None) -> Path:
    tcfg = cfg.train
    run_dir = cfg.run_dir
    if info.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(tcfg.seed)  # identical draft initialisation on every rank
    if parts is None:
        parts = build_parts(cfg, info)
    if tcfg.optimizer == "muon" and tcfg.parallel == "fsdp":
        raise ConfigError("train.optimizer=muon needs whole weight matrices; use train.parallel=ddp with Muon (or adamw with fsdp).")
    model = parts.model
    plan = BatchPlan(len(parts.train_data), tcfg.global_batch_size, tcfg.micro_batch_size, info.world, tcfg.seed, tcfg.bucketing)
    total_steps = plan.total_steps(tcfg.max_steps, tcfg.epochs)
    lengths = sample_lengths(parts.train_data)
    collate = collate_fn(parts.train_data)
    if tcfg.loss_tokens == "all":
        collate = supervise_all_tokens(collate)
    collate = packing(collate, tcfg.pack_tokens)  # train.pack_tokens > 0: several samples per row

    # ---------------------------------------------------------------- resume (weights before wrapping)
    start_step, state = 0, None
    resume_dir = ckpt.latest_step_dir(run_dir) if tcfg.resume else None
    if resume_dir is not None:
        ckpt.check_resume_settings(cfg, resume_dir)
        state = ckpt.load_trainer_state(resume_dir)
        if state.get("global_batch_size") != tcfg.global_batch_size:
            raise CheckpointError(
                f"{resume_dir} was trained with train.global_batch_size={state.get('global_batch_size')}, this run uses "
                f"{tcfg.global_batch_size}; keep the global batch to resume (the worker count may change) or start a new run with --opts run.name=<name>."
            )
        weights = ckpt.load_weights(resume_dir)
        missing, unexpected = model.load_state_dict(weights, strict=False)
        missing = [k for k in missing if k.split(".")[-1] not in ("target_embed", "target_lm_head")]
        if missing or unexpected:
            raise CheckpointError(f"{resume_dir} does not fit this draft (missing {missing[:3]}, unexpected {unexpected[:3]}); start a new run with --opts run.name=<name>.")
        start_step = int(state["step"])
        log.info("resuming from %s (step %d, saved by %d workers, now %d)", resume_dir, start_step, state.get("world_size", 1), info.world)

    model.to(info.device)
    model.train()
    dtype = setup_precision(model, tcfg.precision, info.device)  # TF32 on CUDA; frozen target tensors in the training dtype
    wrapped = wrap(model, tcfg.parallel, info.world, info.device, dtype)
    compile_draft(model, tcfg.compile, info.device)  # the layers' pieces, in place; the attention stays eager
    sharded = tcfg.parallel == "fsdp"
    optimizer = build_optimizer(wrapped, tcfg)
    scheduler = build_scheduler(optimizer, tcfg, total_steps)
    if state is not None:
        ckpt.load_optimizer(resume_dir, wrapped, optimizer, sharded)
        scheduler.load_state_dict(state["scheduler"])
        rngs = state.get("rng") or []
        if info.rank < len(rngs):
            ckpt.set_rng_state(rngs[info.rank])
    autocast = autocast_context(cfg, info.device)

    if info.is_main:
        save_config(cfg, run_dir)
        # a run killed after its last checkpoint logged steps it will now redo: drop them
        for name in ("train_log.jsonl", "val_log.jsonl"):
            truncate_jsonl(run_dir / name, start_step)
        log.info("%s", describe_param_groups(wrapped, tcfg))
        log.info(
            "training %s: %d steps (%d per epoch), global batch %d = %d workers x %d micro x %d accumulation, %s",
            type(model).__name__, total_steps, plan.steps_per_epoch, tcfg.global_batch_size, info.world,
            tcfg.micro_batch_size, plan.accum_steps, tcfg.parallel,
        )
    loggers = MetricLoggers(cfg, run_dir, enabled=info.is_main, resume_step=start_step)
    best = ckpt.read_best(run_dir) if info.is_main else None
    best_value = best["value"] if best else -math.inf

    def write_draft(directory: Path, weights: dict[str, torch.Tensor]) -> None:
        if parts.write_draft is not None:
            parts.write_draft(directory, weights)
        else:
            default_write_draft(model, directory, weights, parts.provenance)

    def save(step: int, val_metrics: dict[str, float] | None) -> None:
        weights = full_trainable_state(wrapped, tcfg.parallel, info.is_main)
        extra = {"global_batch_size": tcfg.global_batch_size, "total_steps": total_steps, "epoch": step / plan.steps_per_epoch, "val": val_metrics}
        ckpt.save_checkpoint(
            run_dir, step, weights=weights, write_draft=write_draft, optimizer=optimizer, model=wrapped,
            scheduler=scheduler, trainer_state=extra, sharded=sharded, save_config=lambda d: save_config(cfg, d),
            keep_last=tcfg.keep_last,
        )

    quiet = {} if (info.is_main and cfg.logging.progress) else {"disable": True}
    bar = progress(total=total_steps, initial=start_step, desc="train", unit="step", **quiet)
    tokens_seen, t0 = 0, time.perf_counter()
    last_dir = ckpt.latest_step_dir(run_dir) if start_step else None
    step = start_step
    schedule = (
        (s, m, idx) for s in range(start_step, total_steps) for m, idx in enumerate(plan.micro_batches(s, info.rank, lengths))
    )
    processes = resolve_processes(tcfg.loader_processes, info.device, int(os.environ.get("LOCAL_WORLD_SIZE", "1")), parts.train_data)
    depth = resolve_depth(tcfg.prefetch_depth, info.device, parts.train_data)
    # each batch's host facts (samples, anchors, chunk plans) made by the loader: the step reads nothing back
    planner = step_planner(model, lambda s, m: _step_seed(tcfg.seed, s, m * info.world + info.rank), use_buckets(info.device),
                           resolve_kernel(tcfg.attention, info.device, tcfg.pack_tokens > 0))
    loader = build_loader(parts.train_data, collate, schedule, depth=depth, processes=processes,
                          pin=info.device.type == "cuda", packed=tcfg.pack_tokens > 0, plan=planner)
    staged = DeviceStager(loader, info.device, dtype)  # features cross in the cache dtype, converted to the training dtype there
    n_micro = plan.accum_steps
    trainable = [p for p in wrapped.parameters() if p.requires_grad]
    preempt = PreemptionWatch(info.is_main)  # SIGTERM / SIGUSR1: checkpoint the step, exit 128 + signal
    staged = preempt.wait_vote(staged, parts.train_data)  # a read that waits (a spool) gives up on a signal, all ranks agree
    guard = NonFiniteGuard(tcfg.max_nonfinite_steps, plan, parts.train_data, info.is_main)
    try:
        while step < total_steps:
            local_tokens = torch.zeros((), dtype=torch.float64, device=info.device)
            loss_sum = torch.zeros((), dtype=torch.float64, device=info.device)
            metric_sums: dict[str, torch.Tensor] = {}
            logged = (step + 1) % tcfg.log_every == 0 or step + 1 == total_steps or step == start_step
            model.train_metrics = logged  # metrics of unlogged steps are never read
            for m in range(n_micro):
                s_, m_, batch, n_tok, n_real = next(staged)  # counts read on the host before the copy
                assert (s_, m_) == (step, m), "data loader out of order"  # internal invariant, not user input
                torch.manual_seed(_step_seed(tcfg.seed, step, m * info.world + info.rank))
                sync = m == n_micro - 1
                ctx = wrapped.no_sync() if (not sync and hasattr(wrapped, "no_sync")) else contextlib.nullcontext()
                if sharded:
                    accumulating(wrapped, last=sync)  # FSDP2: gather once per step, reduce after the last micro-batch
                with ctx:
                    with autocast():
                        loss, metrics = wrapped(batch)
                    weight, share = micro_batch_weight(metrics, n_tok, batch.input_ids.numel(), tcfg.loss_normalization)
                    (loss.float() * weight).backward()
                # accumulate on the device: no host sync per micro-batch or metric
                weight = weight.detach().double() if isinstance(weight, torch.Tensor) else float(weight)
                loss_sum = loss_sum + loss.detach().double() * weight
                local_tokens += share.detach().double() if isinstance(share, torch.Tensor) else share
                tokens_seen += n_real
                if not logged:
                    continue
                for k, (num, den) in metrics.items():
                    pair = torch.stack([num.detach().double().reshape(()), torch.as_tensor(den, device=num.device).double().reshape(())])
                    metric_sums[k] = metric_sums[k] + pair if k in metric_sums else pair
            if sharded:
                release_gathered(wrapped)  # FSDP2: the units stayed gathered through the step's micro-batches
            # mean over the global batch (train/weighting.py): DDP/FSDP averaged over `world`, undo and divide by N
            stats = torch.stack([local_tokens, loss_sum])
            all_reduce_sum(stats)
            scale = (info.world / stats[0].clamp(min=1.0)).float()  # stays on the device
            grads = [p.grad for p in trainable if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, scale)
            grad_norm = torch.nn.utils.clip_grad_norm_(trainable, tcfg.grad_clip if tcfg.grad_clip > 0 else float("inf"))
            if hasattr(grad_norm, "full_tensor"):
                grad_norm = grad_norm.full_tensor()
            lr = scheduler.get_last_lr()[0]
            if guard.ok(step + 1, stats[1], grad_norm):  # NaN / inf loss or gradients: no update (train/guard.py)
                optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if logged:  # the only per-step host syncs, and only on logged steps
                reduced = reduce_metrics(metric_sums, info.device)
                elapsed = time.perf_counter() - t0
                tok_rate = float(all_reduce_sum(torch.tensor(float(tokens_seen), device=info.device))) / max(elapsed, 1e-9)
                global_tokens, global_loss = (float(x) for x in stats.cpu())
                row = {"train/loss": global_loss / max(global_tokens, 1.0), "train/lr": lr, "train/grad_norm": float(grad_norm),
                       "train/tokens_per_s": tok_rate, "train/epoch": step / plan.steps_per_epoch}
                row.update({f"train/{k}": v for k, v in reduced.items()})
                if info.is_main:
                    loggers.log(row, step)
                    _append_jsonl(run_dir / "train_log.jsonl", step, row)
                    bar.set_postfix(format_postfix({"loss": row["train/loss"], "tok/s": tok_rate, "lr": lr}), refresh=False)
            if info.is_main:
                bar.update(1)

            val_metrics = None
            is_last = step == total_steps
            if parts.val_data is not None and ((tcfg.val_every and step % tcfg.val_every == 0) or is_last):
                val_metrics = run_validation(wrapped, parts.val_data, cfg, info, autocast)
                if info.is_main:
                    loggers.log({f"val/{k}": v for k, v in val_metrics.items()}, step)
                    _append_jsonl(run_dir / "val_log.jsonl", step, val_metrics)
            improved = False
            key, value = best_metric(val_metrics)
            if val_metrics is not None:  # every rank validated this step: agree on rank 0's verdict
                improved = info.is_main and value is not None and value > best_value
                improved = bool(all_reduce_sum(torch.tensor(float(improved), device=info.device)) > 0)
            if step % tcfg.save_every == 0 or is_last or improved:
                save(step, val_metrics)
                last_dir = run_dir / f"step_{step}"
                if improved and info.is_main:
                    best_value = value
                    ckpt.record_best(run_dir, step, key, value)
                    ckpt.prune(run_dir, tcfg.keep_last)  # the previous best may now be outside keep_last
            if _KILL_AFTER is not None and step == _KILL_AFTER and info.is_main:
                os.kill(os.getpid(), signal.SIGKILL)  # fault injection for the crash/resume tests
            if step < total_steps and preempt.requested():  # every rank agrees at the same step
                preempt.stop(step, lambda: last_dir == run_dir / f"step_{step}" or save(step, None))
    except WaitPreempted:  # every rank stopped waiting for its data mid-step: the same stop, at the last finished step
        preempt.stop(step, lambda: last_dir == run_dir / f"step_{step}" or save(step, None))
    finally:
        preempt.close()
        loader.close()
        bar.close()
        loggers.close()
        for finish in parts.on_finish:
            finish()
    if last_dir is None:
        last_dir = ckpt.latest_step_dir(run_dir)
    return last_dir


def truncate_jsonl(path: Path, step: int) -> None:
    """Keep the rows of a step log up to `step` (atomically); rows after it belong to work a crash lost."""
    import json

    if not path.is_file():
        return
    lines = path.read_text().splitlines()
    keep = [ln for ln in lines if ln.strip() and json.loads(ln).get("step", 0) <= step]
    if len(keep) == len(lines):
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(ln + "\n" for ln in keep))
    os.replace(tmp, path)


def _append_jsonl(path: Path, step: int, row: dict[str, float]) -> None:
    import json

    with open(path, "a") as f:
        f.write(json.dumps({"step": step, **row}) + "\n")
