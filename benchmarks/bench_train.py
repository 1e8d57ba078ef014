#!/usr/bin/env python
"""Training throughput and memory at users' sequence lengths, ours and the peer trainer's, same run, same data.

    python benchmarks/bench_train.py --shape smollm2 --seq-len 2048 --algorithms eagle3
    python benchmarks/bench_train.py --shape smollm2 --seq-len 4096 16384 --algorithms eagle3 --no-peer
    python benchmarks/bench_train.py --shape qwen3-8b --seq-len 4096 --algorithms eagle3 dflash   # on a GPU

The target is random weights built in-process from its config (`--shape`: smollm2, qwen3-1.7b, qwen3-8b); only the
parts a draft trainer reads are written (embedding, final norm, LM head: a "verifier stub" folder), so a Qwen3-8B
shape costs no 16 GB checkpoint. Each sample is exactly `--seq-len` tokens (random ids, the first quarter a prompt, the
rest supervised) with random tap features. Ours trains like its recipe (config/<algorithm>/<target>.yaml: optimizer,
anchors, precision, layers): `--accum` (8) micro-batches of `--micro-batch` (1) samples per optimizer step, cycling
through `--distinct-samples` (4) distinct samples held in memory (an in-memory feature dataset, what the cache reader
yields). The same tensors are written for the peer — `speculators` 0.9.0 in its own venv (benchmarks/peer_setup.sh):
an Arrow dataset (input_ids, loss_mask, seq_len), hidden_states/hs_{i}.safetensors ([seq, n_taps + 1, H], the last slot
the final hidden state) and token_freq.pt. Both train EAGLE-3 with the same taps, depth (TTT 7, loss decay 0.8), draft
vocabulary, fc/output norms and precision (bf16 where the hardware computes it, else fp32). The peer has no gradient
accumulation (it packs sequences up to --total-seq-len and steps once per packed batch), so it runs beside ours only
with `--accum 1 --micro-batch 1`: one sample per optimizer step for both. On a GPU it trains with its unfused loss
(`--peer-loss eager`, its `--loss-implementation eager`): its fused Triton loss fails in backward under torch 2.11.

Prints one JSON line per row as soon as the row is done (and appends it to `--jsonl PATH`, flushed), then the
whole result as one JSON object on the last line. A row is one (algorithm, seq_len):
  tokens_per_s       non-padding tokens per second of training, ours, over the timed steps: every optimizer step but the
                     first (start-up) and the profiled one; `step_s` lists their times
  steady_tokens_per_s  the median timed step's rate (`steady_mfu` likewise): a one-off cost inside one timed step (a
                     compiled region meeting a new kind of input: the first step without metrics, a new attention
                     shape) moves the mean, not this; what a long run settles at
  phase_s            seconds before the timed steps: `start_to_draft_built` (process start to the draft and data in
                     place), `flop_count` (the FLOP count's forward + backward; null where not counted), `first_step`
                     (the trainer's set-up and plan step 0, every compilation its inputs trigger included)
  length_spread      with --length-spread MIN: sample lengths uniform in [MIN, seq_len] (FLOPs per token counted on the
                     first sample, so MFU is approximate there)
  peak_memory_mb     peak allocated GPU memory (torch.cuda.max_memory_allocated) / peak RSS of the training process on CPU
  padding_fraction   padded positions / all positions of the timed steps' micro-batches
  mfu                GPU only: the model's bf16 FLOPs x tokens/s / the GPU's dense bf16 peak. FLOPs are counted on one
                     forward+backward of one sample (deepspec/train/flops.py: torch's formulas for matrix products, our
                     own for every attention kernel op, grouped-query attention included), split by the dtype each op
                     runs in (`flops_per_token` = bf16, `fp32_flops_per_token` = the products autocast leaves in fp32,
                     which the bf16 peak does not cover and MFU leaves out); `attention_flops_share` of the whole
  profile            one optimizer step (`profiled_step`, the next to last; with --steps 3 or more) under torch.profiler:
                     its wall time, the GPU-busy time (the union of its kernels, copies and memsets) and its share of the
                     step (also of an unprofiled step's time: `gpu_busy_share_of_timed_step`), device ops, kernel launches,
                     host syncs, and the aten ops dispatched; on a CPU only the aten ops. `--profile-dir` also writes
                     torch.profiler's table of the step (profile_<algorithm>_<reader>_<seq_len>.txt)
  peer_tokens_per_s  the peer on the same data, same machine, same run, first step left out (its own per-step timer);
                     null with `peer_note` under --no-peer, without the peer venv, for algorithms it is not run for, with
                     --accum / --micro-batch above 1, or on failure. `peer_steady_tokens_per_s` its median step's rate,
                     `peer_step_s` its step times; `ours_over_peer` compares the means, `ours_over_peer_steady` the
                     medians (one slow step - ours compiles its loss region a second time in its first step without
                     metrics - moves the first, not the second)
  reader             `memory` (samples held in memory) or `disk` (--from-cache: an on-disk cache of the shape's taps,
                     width and dtype, written with deepspec.data.cache.format and read through the trainer's own data
                     path: open_cache, the cache reader and the training loader)
  liger_kernel       whether EAGLE-3's loss ran Liger-Kernel's fused kernel in the row's process
  eagle3_chain       EAGLE-3 rows: how its TTT steps 1-6 merge the causal attention with the diagonal ("flash
                     log-sum-exp", or "sentinel call (...)" with the reason)
Each row trains in a fresh subprocess in a process group of its own (benchmarks/_procs.py), so peak memory is per row
and a row that runs past --row-timeout is killed with every process it started. The row's process prints progress
lines on stderr ("[bench_train row] ...": each phase, each optimizer step with its time and peak GPU memory); a row
killed for time gets an error that quotes them. Run under a limit of its own (BENCH_TIME_LIMIT_S, which gpu_check.sh's
row runner sets), every row's limit is shortened so the row is written before that. --require-peer exits 1 when the
peer did not run beside an EAGLE-3 row. The run's final checkpoint is not
written (it would follow the measured steps and cost seconds of copies). --smoke: the tiny shape, 64-token samples,
3 steps of 2 micro-batches — a CPU check of every code path above; its rows train one after the other in this
process (`row_process`: "shared (--smoke)"; a new interpreter would spend 3-4 s importing torch and transformers on
seconds of work), so a smoke row's CPU peak RSS is the process's so far and --row-timeout does not apply to it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

os.environ.setdefault("DEEPSPEC_NO_PROGRESS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
# the repository first: the peer's interpreter runs this file too (--_peer_data, the peer's own `datasets` writing its
# data), and on a GPU machine that interpreter has no deepspec installed
sys.path[:0] = [str(REPO / "benchmarks"), str(REPO)]

from _procs import GroupTimeout, last_error, pythonpath_with, run_group  # noqa: E402

STARTED = time.perf_counter()  # BENCH_TIME_LIMIT_S counts from the process start (see time_left)
PROGRESS = "[bench_train row]"
PEER_VENV = Path(os.environ.get("PEER_VENV", REPO / ".peer-venv"))
PEER_CPU_SHIM = Path(os.environ.get("PEER_CPU_SHIM", "/work/shared/peers/speculators_cpu.py"))

# --shape -> (family, config overrides of deepspec.targets.tiny.tiny_config, recipe target, draft vocabulary)
SHAPES = {
    "smollm2": ("llama", dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                              num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=32768,
                              rms_norm_eps=1e-5, tie_word_embeddings=True), "smollm2", 8192),
    "qwen3-1.7b": ("qwen3", dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                                 rms_norm_eps=1e-6, tie_word_embeddings=True), "qwen3-8b", 32000),
    "qwen3-8b": ("qwen3", dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                               num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                               rms_norm_eps=1e-6, tie_word_embeddings=False), "qwen3-8b", 32000),
    # --smoke: a tiny Qwen3 on the Qwen3-8B recipes (a CPU check of the code paths, seconds per row)
    "tiny": ("qwen3", dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, max_position_embeddings=65536, rms_norm_eps=1e-6,
                           tie_word_embeddings=False), "qwen3-8b", 256),
}
# dense bf16 / fp32 peaks (FLOP/s) for MFU; other GPUs report mfu null
PEAK_FLOPS = {"H100": (989.4e12, 66.9e12), "H200": (989.4e12, 66.9e12), "A100": (312e12, 19.5e12)}


def taps_for(algorithm: str, num_layers: int) -> list[int]:
    """EAGLE-3: vLLM's default three (layers 1, L/2 - 1, L - 4, 0-based outputs); block drafts: five spread evenly."""
    if algorithm == "eagle3":
        return [1, num_layers // 2 - 1, num_layers - 4]
    return [1 + round(i * (num_layers - 3) / 4) for i in range(5)]


def target_config(shape: str):
    from deepspec.targets.tiny import tiny_config

    family, overrides, _, _ = SHAPES[shape]
    return tiny_config(family, **overrides)


def write_verifier_stub(path: Path, shape: str) -> Path:
    """config.json + model.safetensors with only the embedding, final norm and LM head (random, bf16): all a draft
    trainer reads from its target (ours: deepspec.train.build.load_target_head; the peer: its load_model_layers),
    plus the tests' byte-level tokenizer (the peer opens one; the token ids are random anyway)."""
    import torch
    from safetensors.torch import save_file

    if (path / "model.safetensors").is_file():
        return path
    # written beside it and renamed into place: a process killed while writing (a check's row past its limit) leaves no
    # folder a later row would take for a whole stub
    from deepspec.locks import pid_alive

    part = path.with_name(f"{path.name}.part-{os.getpid()}")
    for old in [part, *path.parent.glob(f"{path.name}.part-*")]:  # ours, and those of killed rows (2.5 GB each)
        pid = old.name.rsplit("-", 1)[-1]  # a name that is no process id is left alone
        if old == part or (pid.isdigit() and not pid_alive(int(pid))):
            shutil.rmtree(old, ignore_errors=True)
    cfg = target_config(shape)
    g = torch.Generator().manual_seed(0)
    V, H = cfg.vocab_size, cfg.hidden_size

    def matrix() -> torch.Tensor:  # in place: at Qwen3-8B's 151,936 x 4,096 each fp32 temporary is 2.5 GB
        return torch.randn(V, H, generator=g).mul_(0.02).to(torch.bfloat16)

    embed = matrix()
    tensors = {"model.embed_tokens.weight": embed, "model.norm.weight": torch.ones(H, dtype=torch.bfloat16)}
    tensors["lm_head.weight"] = embed.clone() if cfg.tie_word_embeddings else matrix()
    part.mkdir(parents=True)
    cfg.dtype = "bfloat16"
    cfg.save_pretrained(part)
    from deepspec.targets.tiny import tiny_tokenizer

    tiny_tokenizer().save_pretrained(part)  # the peer loads a tokenizer from the verifier folder
    save_file(tensors, str(part / "model.safetensors"), metadata={"format": "pt"})
    try:
        part.rename(path)
    except OSError:  # another process put its stub there first: the same seeded weights
        shutil.rmtree(part, ignore_errors=True)
    return path


def make_samples(n: int, seq_len: int, n_taps: int, hidden: int, vocab: int, seed: int,
                 min_len: int | None = None) -> list[dict]:
    """Random token ids (the first quarter unsupervised: a prompt) and random tap / final features (bf16, as cached).
    min_len: each sample's length drawn uniformly from [min_len, seq_len] (users' data: many context lengths, so many
    attention shapes), else every sample is seq_len long."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = seq_len if min_len is None else int(torch.randint(min_len, seq_len + 1, (1,), generator=g))
        ids = torch.randint(0, vocab, (length,), generator=g)
        mask = torch.zeros(length, dtype=torch.bool)
        mask[length // 4 :] = True
        feats = torch.randn(length, n_taps + 1, hidden, generator=g).to(torch.bfloat16)
        out.append({"input_ids": ids, "loss_mask": mask, "taps": feats[:, :n_taps], "final_hidden": feats[:, n_taps]})
    return out


class FeatureSamples:
    """The samples as the trainer sees a cache: len / [i] / lengths / token_counts. With `length` > len(samples) the
    distinct samples repeat (sample i is samples[i % n]): a step of many micro-batches without as many distinct
    samples in memory (throughput does not depend on the values)."""

    def __init__(self, samples: list[dict], vocab: int, length: int | None = None):
        self.samples, self.vocab = samples, vocab
        self.length = max(length or 0, len(samples))
        self.lengths = [int(samples[i % len(samples)]["input_ids"].shape[0]) for i in range(self.length)]

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < self.length:
            raise IndexError(f"sample {i} of {self.length}")
        return self.samples[i % len(self.samples)]

    def token_counts(self):
        import torch

        counts = torch.zeros(self.vocab, dtype=torch.long)
        for s in self.samples:
            counts += torch.bincount(s["input_ids"][s["loss_mask"]], minlength=self.vocab)
        return counts


def write_peer_data(directory: Path, samples: list[dict]) -> Path:
    """The same samples in the layout `speculators train --data-path` reads."""
    import torch
    from datasets import Dataset
    from safetensors.torch import save_file

    if (directory / "token_freq.pt").is_file():
        return directory
    (directory / "hidden_states").mkdir(parents=True, exist_ok=True)
    rows = {"input_ids": [], "loss_mask": [], "seq_len": []}
    freq: dict[int, int] = {}
    for i, s in enumerate(samples):
        ids = s["input_ids"]
        rows["input_ids"].append(ids.tolist())
        rows["loss_mask"].append(s["loss_mask"].long().tolist())
        rows["seq_len"].append(int(ids.shape[0]))
        hs = torch.cat([s["taps"], s["final_hidden"].unsqueeze(1)], dim=1).contiguous()
        save_file({"hidden_states": hs, "token_ids": ids.clone()}, str(directory / "hidden_states" / f"hs_{i}.safetensors"))
        u, c = torch.unique(ids[s["loss_mask"]], return_counts=True)
        for t, k in zip(u.tolist(), c.tolist()):
            freq[t] = freq.get(t, 0) + k
    Dataset.from_dict(rows).with_format("torch").save_to_disk(str(directory))
    torch.save(freq, directory / "token_freq.pt")
    return directory


def write_feature_cache(directory: Path, samples: list[dict], cfg, per_shard: int = 4) -> dict:
    """The samples as a complete on-disk cache (shards, index, ids, token counts, manifest), written with the cache
    format's own functions, and with the provenance a run of `cfg` expects (so open_cache accepts it as a cache of
    this target, taps, width and dtype). Returns its size."""
    import numpy as np

    from deepspec.data.cache import format as fmt
    from deepspec.data.cache.reader import expected_provenance

    train = directory / "train"
    if (train / fmt.MANIFEST).is_file():
        return json.loads((train / fmt.MANIFEST).read_text())["bytes_info"]
    train.mkdir(parents=True, exist_ok=True)
    index = np.zeros(len(samples), dtype=fmt.INDEX_DTYPE)
    counts = None
    n_shards = -(-len(samples) // per_shard)
    for shard in range(n_shards):
        offset = 0
        with open(train / fmt.shard_name(shard), "wb") as f:
            for i in range(shard * per_shard, min(len(samples), (shard + 1) * per_shard)):
                x = samples[i]
                feats = torch_cat_features(x)
                rec = fmt.encode_record(x["input_ids"].numpy(), x["loss_mask"].numpy(), feats, cfg.cache.dtype)
                f.write(rec)
                n = int(x["input_ids"].shape[0])
                index[i] = (shard, offset, n, len(rec), zlib_crc(rec), int(x["loss_mask"].sum()), 0)
                offset += len(rec)
                c = np.bincount(x["input_ids"][x["loss_mask"]].numpy(), minlength=1)
                counts = c if counts is None else np.pad(counts, (0, max(0, len(c) - len(counts)))) + np.pad(c, (0, max(0, len(counts) - len(c))))
    np.save(train / fmt.INDEX, index)
    np.save(train / fmt.TOKEN_COUNTS, counts.astype(np.int64))
    (train / fmt.IDS).write_text(json.dumps([f"bench-{i}" for i in range(len(samples))]))
    info = {"samples": len(samples), "bytes": int(index["nbytes"].sum()), "shards": n_shards}
    manifest = {**expected_provenance(cfg), "format_version": fmt.FORMAT_VERSION, "num_shards": n_shards,
                "counts": {"samples": len(samples), "tokens": int(index["length"].sum()),
                           "loss_tokens": int(index["num_loss_tokens"].sum())},
                "bytes": info["bytes"], "bytes_info": info, "data_path": "benchmarks/bench_train.py (random features)"}
    fmt.write_json_atomic(train / fmt.MANIFEST, manifest)  # last: its presence makes the cache complete
    return info


def torch_cat_features(sample: dict):
    """[T, n_taps + 1, H]: the taps then the final hidden state, as a cache record stores them."""
    import torch

    return torch.cat([sample["taps"], sample["final_hidden"].unsqueeze(1)], dim=1)


def zlib_crc(data: bytes) -> int:
    import zlib

    return zlib.crc32(data)


# ----------------------------------------------------------------------------- our row (a subprocess)


def _our_row(spec: dict) -> dict:
    """Train `spec["steps"]` optimizer steps of our trainer in this process (each `accum` micro-batches); figures of
    this process. With spec["cache"] the data comes through the trainer's own path (build_parts: open_cache, the
    reader, the loader), else from memory. Plan step 0 is the warm-up; plan step `profiled` (steps - 2, when there are
    at least 3) runs under torch.profiler; tokens/s comes from the others."""
    import torch
    from transformers import AutoConfig

    import deepspec.train.loop as loop
    from deepspec.config import load_config
    from deepspec.drafts.registry import get_algorithm
    from deepspec.drafts.plan import resolve_kernel
    from deepspec.train.build import build_parts, load_target_head
    from deepspec.train.dist import init_distributed, teardown
    from deepspec.train.parts import TrainParts

    cfg = load_config(spec["recipe"], spec["opts"])
    steps = cfg.train.max_steps
    profiled = steps - 2 if steps >= 3 and spec.get("profile", True) else None
    info = init_distributed()
    clock = StepClock(loop, profiled, info.device, steps)
    progress(f"{cfg.model.algorithm}: process started, {steps} steps to train", clock.started)
    restore_save = _skip_checkpoints(loop)
    try:
        torch.manual_seed(cfg.train.seed)
        if spec.get("cache"):
            parts = build_parts(cfg, info)
            parts.val_data = None
            draft, data = parts.model, parts.train_data
            first = data[0]
        else:
            samples = torch.load(spec["samples"], weights_only=False)
            tconf = AutoConfig.from_pretrained(spec["target"])
            draft = get_algorithm(cfg.model.algorithm).from_target_config(tconf, cfg.model)
            draft.load_target_weights(*load_target_head(spec["target"], tconf))
            data = FeatureSamples(samples, tconf.vocab_size, spec.get("length"))
            draft.set_token_frequencies(data.token_counts())
            parts = TrainParts(model=draft, train_data=data, provenance={"target": "random " + spec["shape"]},
                               write_draft=lambda d, w: None)
            first = samples[0]
        out: dict = {"liger_kernel": _liger_state(cfg, info.device)}
        chain = _chain_state(cfg, draft, info.device)
        if chain:
            out["eagle3_chain"] = chain
        progress(f"draft built, {len(data)} samples in memory or cache; Liger-Kernel {out['liger_kernel']}"
                 + (f"; TTT steps merge by {chain}" if chain else ""), clock.started)
        built = time.perf_counter()
        counted = None
        if info.device.type == "cuda" or spec.get("count_flops"):  # counted on the plain draft, before the trainer wraps it
            try:
                out.update(flops_per_token(draft, cfg, first, info.device))
            except Exception as e:  # the row's other figures still count
                out["flops_error"] = f"{type(e).__name__}: {e}"[-500:]
            counted = time.perf_counter() - built
            progress("FLOPs counted (one forward + backward of one sample)", clock.started)
        if info.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(info.device)
        clock.stamps[0] = time.perf_counter()  # plan step 0 (start-up, compilation) starts here
        progress("training", clock.started)
        loop._train(cfg, info, parts)
        if clock.completed != steps:
            raise RuntimeError(f"the step clock saw {clock.completed} of {steps} optimizer steps: the trainer loop no longer "
                               "calls build_scheduler(...).step() once per step, which bench_train.py times")
        t = cfg.train
        lengths = [int(x) for x in (data.lengths() if callable(data.lengths) else data.lengths)]
        timed = [s for s in range(1, steps) if s != profiled]
        per_step = _step_tokens(data, lengths, t, info.world, steps)
        seconds = [clock.duration(s) for s in timed]
        real = sum(per_step[s][0] for s in timed)
        padded = sum(per_step[s][1] for s in timed)
        out["tokens_per_s"] = round(real / sum(seconds), 1) if timed else None
        # the median timed step's rate: a one-off cost in one timed step (a compiled region meeting its second kind of
        # input, e.g. the first step without metrics) moves the mean, not this; a long run sees this rate
        steady = statistics.median(per_step[s][0] / d for s, d in zip(timed, seconds)) if timed else None
        out["steady_tokens_per_s"] = round(steady, 1) if steady else None
        out["padding_fraction"] = round(1 - real / padded, 4) if padded else None
        out["measured_steps"] = len(timed)
        out["step_s"] = [round(x, 3) for x in seconds]
        out["tokens_per_step"] = per_step[timed[0]][0] if timed else None
        out["accum"], out["micro_batch"], out["global_batch"] = t.global_batch_size // (t.micro_batch_size * info.world), t.micro_batch_size, t.global_batch_size
        out["optimizer"] = t.optimizer
        # where a row's time before its timed steps goes (a console keeps only the tail of the progress lines): the
        # process up to the built draft, the FLOP count, and plan step 0 — the trainer's set-up, the first batch and
        # every compilation its kinds of input trigger (regions, FlexAttention's kernels and block masks)
        out["phase_s"] = {"start_to_draft_built": round(built - clock.started, 2),
                          "flop_count": None if counted is None else round(counted, 2),
                          "first_step": round(clock.duration(0), 2) if 1 in clock.stamps else None}
        out["attention"] = resolve_kernel(t.attention, info.device, t.pack_tokens > 0) if cfg.model.algorithm != "eagle3" else "sdpa"
        out["num_anchors"] = getattr(cfg.model, "num_anchors", None) if cfg.model.algorithm != "eagle3" else None
        if info.device.type == "cuda":
            out["peak_memory_mb"] = round(torch.cuda.max_memory_allocated(info.device) / 2**20, 1)
            out["mfu"] = _mfu(out.get("flops_per_token"), real / sum(seconds), cfg, info.device) if timed else None
            out["steady_mfu"] = _mfu(out.get("flops_per_token"), steady, cfg, info.device) if timed else None
        else:
            out["peak_memory_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
            out["mfu"] = out["steady_mfu"] = None
        if profiled is not None:
            out["profiled_step"] = profiled
            out["profile"] = clock.summary
            if clock.summary and clock.summary.get("gpu_busy_ms") is not None and seconds:
                # the profiler slows the host: the same GPU work over an unprofiled step's time
                mean_s = sum(seconds) / len(seconds)
                clock.summary["gpu_busy_share_of_timed_step"] = round(min(1.0, clock.summary["gpu_busy_ms"] / 1000 / mean_s), 4)
            if clock.profile_error:
                out["profile_error"] = clock.profile_error
            if spec.get("profile_path") and clock.table:
                head = (f"# {cfg.model.algorithm}, {spec.get('seq_len')} tokens per sample, {out['accum']} micro-batches of "
                        f"{t.micro_batch_size} per optimizer step, reader {spec.get('reader', 'memory')}, device {info.device}: "
                        f"plan step {profiled} under torch.profiler\n# {json.dumps(clock.summary)}\n")
                Path(spec["profile_path"]).parent.mkdir(parents=True, exist_ok=True)
                Path(spec["profile_path"]).write_text(head + clock.table + "\n")
        rows = [json.loads(x) for x in (cfg.run_dir / "train_log.jsonl").read_text().splitlines()]
        out["final_loss"] = round(rows[-1]["train/loss"], 4)
        out["trainable_params"] = sum(p.numel() for p in draft.parameters() if p.requires_grad)
        out["activation_checkpointing"] = bool(cfg.model.activation_checkpointing)
        out["device"] = str(info.device)
        return out
    finally:
        clock.restore()
        restore_save()
        teardown(info)


def _step_tokens(data, lengths: list[int], t, world: int, steps: int) -> dict[int, tuple[int, int]]:
    """(real tokens, positions of the padded micro-batches) of each plan step, from the trainer's batch plan."""
    from deepspec.data.batches import BatchPlan

    plan = BatchPlan(len(data), t.global_batch_size, t.micro_batch_size, world, t.seed, t.bucketing)
    out = {}
    for s in range(steps):
        micro = plan.micro_batches(s, 0, lengths)
        out[s] = (sum(lengths[i] for m in micro for i in m), sum(len(m) * max(lengths[i] for i in m) for m in micro))
    return out


def _skip_checkpoints(loop) -> Callable[[], None]:
    """The run's last step writes a checkpoint (weights, optimizer state: seconds of device-to-host copies for a
    billion-parameter draft) after the measured steps; a benchmark row does not need it. Returns the restorer."""
    from deepspec.train import checkpoint as ckpt

    saved = {}
    for owner, name, stub in ((ckpt, "save_checkpoint", lambda *a, **k: None), (loop, "full_trainable_state", lambda *a, **k: {})):
        if hasattr(owner, name):
            saved[(owner, name)] = getattr(owner, name)
            setattr(owner, name, stub)

    def restore() -> None:
        for (owner, name), fn in saved.items():
            setattr(owner, name, fn)

    return restore


# launches and host waits, by the CUDA runtime / driver call that makes them
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchCooperativeKernel",
                "cudaGraphLaunch")
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


class StepClock:
    """Times every optimizer step of loop._train and profiles one: it wraps the scheduler that loop.build_scheduler
    returns, whose step() the loop calls once per optimizer step (after the optimizer's own step), and stamps the
    step's end after a device sync. `stamps[n]` = the end of the n-th step (plan step n - 1). Plan step `profiled`
    runs under torch.profiler (CPU + CUDA activities on a GPU); the profiler's start and stop (and the reading of its
    events) fall outside every step's time. Each finished step prints a progress line on stderr (`progress`): a row
    killed at its time limit still says how far it got and how long each step took."""

    def __init__(self, loop, profiled: int | None, device, steps: int | None = None):
        self.loop, self.profiled, self.device, self.steps = loop, profiled, device, steps
        self.started = time.perf_counter()
        self.stamps: dict[int, float] = {}
        self.completed = 0
        self.summary: dict | None = None
        self.table = ""
        self.profile_error: str | None = None
        self._prof = None
        self._build = loop.build_scheduler
        loop.build_scheduler = self._build_scheduler

    def restore(self) -> None:
        self.loop.build_scheduler = self._build
        if self._prof is not None:  # a run that failed inside the profiled step
            try:
                self._prof.stop()
            except Exception:
                pass
            self._prof = None

    def _sync(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _build_scheduler(self, *args, **kwargs):
        sched = self._build(*args, **kwargs)
        step = sched.step

        def stepped(*a, **k):
            r = step(*a, **k)
            self._sync()
            self.completed += 1
            n = self.completed
            now = time.perf_counter()
            if self.profiled is not None and n == self.profiled + 1 and self._prof is not None:
                self._finish_profile(now - self.stamps[n - 1])
                now = time.perf_counter()  # the next step starts after the profiler's stop and the reading of its events
            if self.profiled is not None and n == self.profiled:
                self._start_profile()
                now = time.perf_counter()
            self.stamps[n] = now
            took = now - self.stamps.get(n - 1, self.started)
            progress(f"optimizer step {n}/{self.steps or '?'} done in {took:.2f} s{_peak_memory(self.device)}", self.started)
            return r

        sched.step = stepped
        return sched

    def duration(self, plan_step: int) -> float:
        return self.stamps[plan_step + 1] - self.stamps[plan_step]

    def _start_profile(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        try:
            self._prof = profile(activities=activities)
            self._prof.start()
        except Exception as e:
            self._prof, self.profile_error = None, f"{type(e).__name__}: {e}"[-500:]
        self._sync()

    def _finish_profile(self, wall_s: float) -> None:
        prof, self._prof = self._prof, None
        try:
            prof.stop()
            self.summary = summarize_profile(profile_events(prof), wall_s, traced_device=self.device.type == "cuda")
            self.table = profile_table(prof, self.device.type == "cuda")
        except Exception as e:
            self.profile_error = f"{type(e).__name__}: {e}"[-500:]


def _liger_state(cfg, device) -> str:
    """Whether this row's EAGLE-3 loss runs Liger-Kernel's fused kernel (deepspec/drafts/liger.py), as the row
    records it: a row that should have used it and did not is visible in its own line."""
    import torch

    from deepspec.drafts import liger

    if liger.fused_linear_kl is None:
        return "not importable"
    if cfg.model.algorithm != "eagle3":
        return "importable (EAGLE-3's loss only)"
    used = liger.available(torch.empty(0, device=device))
    return "used by the loss" if used else "importable, not used (CPU, or DEEPSPEC_LIGER=0)"


def _chain_state(cfg, draft, device) -> str | None:
    """How this row's EAGLE-3 TTT steps 1-6 merge their causal part with the diagonal (deepspec/drafts/attention.py
    `chain_attention`), as the row records it: the flash kernel's log-sum-exp, or the sentinel call where that kernel
    is missing for the device and dtype or DEEPSPEC_CHAIN_SENTINEL=1 asks for it (an A/B row, or a GPU where the
    flash path failed its test), or where the flash merge disagreed with the sentinel call in its one-time check on
    this GPU (deepspec/drafts/attention.py `merge_check`). None for the block drafts."""
    import torch

    from deepspec.drafts.attention import flash_lse_ops, merge_check_failure

    if cfg.model.algorithm != "eagle3":
        return None
    att = draft.midlayer.self_attn
    dtype = torch.float32 if cfg.train.precision == "fp32" else torch.bfloat16
    probe = torch.empty(1, att.num_heads, 1, att.head_dim, device=device, dtype=dtype)
    if flash_lse_ops(probe) is not None:
        return "flash log-sum-exp"
    if os.environ.get("DEEPSPEC_CHAIN_SENTINEL", "0") == "1":
        return "sentinel call (DEEPSPEC_CHAIN_SENTINEL=1)"
    why = merge_check_failure(probe.device, dtype, att.head_dim)
    if why is not None:
        return f"sentinel call (the flash merge disagreed with it on this GPU: {why})"
    return "sentinel call (no flash kernel with a log-sum-exp for this device and dtype)"


def progress(message: str, since: float) -> None:
    """A progress line on stderr (flushed): a row's parent keeps the last ones when it has to kill the row."""
    print(f"{PROGRESS} {time.perf_counter() - since:7.1f} s: {message}", file=sys.stderr, flush=True)


def _peak_memory(device) -> str:
    import torch

    if device.type != "cuda":
        return ""
    return f", peak GPU memory {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB"


def time_left(limit: float, margin_s: float = 15.0) -> float:
    """`limit` seconds, or fewer when the caller kills this process earlier (BENCH_TIME_LIMIT_S seconds after it
    started, which a check's row runner sets: benchmarks/_procs.py): a child stopped `margin_s` before that (its kill
    grace included) leaves time to write its row."""
    caller = os.environ.get("BENCH_TIME_LIMIT_S")
    if not caller:
        return limit
    return max(1.0, min(limit, float(caller) - (time.perf_counter() - STARTED) - margin_s))


def progress_tail(stderr: str, last_steps: int = 2) -> str:
    """Where a row that ran out of time got to, from its stderr: every phase it finished, its first optimizer step
    (start-up and compilation) and its last ones."""
    # a progress bar's carriage returns can share a line with ours
    lines = [ln.split(PROGRESS, 1)[1].strip() for ln in re.split(r"[\r\n]", stderr) if PROGRESS in ln]
    if not lines:
        return "none: killed before the process had started training"
    step = re.compile(r"optimizer step \d+/")
    steps = [ln for ln in lines if step.search(ln)]
    keep = [ln for ln in lines if not step.search(ln)] + steps[:1] + steps[1:][-last_steps:]
    return " | ".join(sorted(set(keep), key=lines.index))


def profile_events(prof) -> list[tuple[str, bool, float, float, str | None]]:
    """(name, on the device, start us, end us, the enclosing host op's name) of every event torch.profiler recorded,
    less the user annotations it mirrors on the device timeline (an optimizer step's range, say: a span, not work)."""
    from torch.autograd import DeviceType

    out = []
    for e in prof.events():
        on_device = e.device_type != DeviceType.CPU
        if on_device and getattr(e, "is_user_annotation", False):
            continue
        parent = getattr(e, "cpu_parent", None)
        out.append((e.name, on_device, float(e.time_range.start), float(e.time_range.end), parent.name if parent is not None else None))
    return out


def summarize_profile(events, wall_s: float, traced_device: bool) -> dict:
    """One profiled step in figures: its wall time; the time the GPU was busy (the union of its kernels', copies' and
    memsets' intervals: overlapping streams count once) and its share of the wall time; device operations, kernel
    launches (the runtime / driver launch calls) and host waits on the device (synchronize calls); and the aten ops
    dispatched (outside another aten op: what Python and autograd call, each a host round trip). Without a traced
    device (a CPU run) the device figures are null."""
    spans = sorted((start, end) for name, on_device, start, end, _ in events if on_device and end > start)
    busy, cur_start, cur_end = 0.0, None, None
    for start, end in spans:
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                busy += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        busy += cur_end - cur_start
    host = [(name, parent) for name, on_device, _, _, parent in events if not on_device]
    out = {
        "step_wall_ms": round(wall_s * 1000, 2),
        "aten_ops": sum(1 for name, parent in host if name.startswith("aten::") and not (parent or "").startswith("aten::")),
        "gpu_busy_ms": None, "gpu_busy_share": None, "device_ops": None, "launches": None, "host_syncs": None,
    }
    if traced_device:
        out.update(gpu_busy_ms=round(busy / 1000, 2), gpu_busy_share=round(min(1.0, busy / 1e6 / wall_s), 4) if wall_s > 0 else None,
                   device_ops=len(spans), launches=sum(1 for name, _ in host if name in LAUNCH_CALLS),
                   host_syncs=sum(1 for name, _ in host if name in SYNC_CALLS))
    return out


def profile_table(prof, cuda: bool, rows: int = 60) -> str:
    """torch.profiler's table of the profiled step, by device time on a GPU (host time on a CPU)."""
    averages = prof.key_averages()
    for key in (("self_device_time_total", "self_cuda_time_total") if cuda else ()) + ("self_cpu_time_total",):
        try:
            return averages.table(sort_by=key, row_limit=rows, max_name_column_width=70)
        except Exception:
            continue
    return ""


def flops_per_token(draft, cfg, sample: dict, device) -> dict[str, float]:
    """Model FLOPs of one forward + backward of one sample, per token, split by the dtype each op runs in
    (deepspec/train/flops.py: torch's formulas for matrix products, our own for every attention kernel op, grouped-
    query attention included): {"flops_per_token": bf16 (fp16 counts as bf16: the same tensor-core peak),
    "fp32_flops_per_token": the products autocast keeps in fp32 (outside the bf16 peak), "attention_flops_share"}.
    The step counted is an unlogged one (no metrics pass)."""
    import torch

    from deepspec.data.batches import collate_features
    from deepspec.train.flops import count_flops
    from deepspec.train.loop import autocast_context

    draft.to(device).train()
    metrics = getattr(draft, "train_metrics", None)
    if metrics is not None:
        draft.train_metrics = False
    batch = collate_features([sample]).to(device, torch.float32)

    def step():
        with autocast_context(cfg, device)():
            loss, _ = draft.loss(batch)
        loss.backward()

    try:
        count = count_flops(step)
    finally:
        draft.zero_grad(set_to_none=True)
        if metrics is not None:
            draft.train_metrics = metrics
    n = int(batch.attention_mask.sum())
    attention = sum(v for k, v in count.by_op.items() if "attention" in k)
    out = {"flops_per_token": count.by_dtype["bf16"] / n, "fp32_flops_per_token": count.by_dtype["fp32"] / n,
           "attention_flops_share": round(attention / count.total, 4) if count.total else None}
    if count.uncounted:
        out["flops_uncounted_ops"] = count.uncounted
    return out


def _mfu(flops_per_token: float | None, tokens_per_s: float, cfg, device) -> float | None:
    """Model bf16 FLOPs per second over the GPU's dense bf16 peak (null for GPUs not in PEAK_FLOPS, or fp32 runs)."""
    import torch

    name = torch.cuda.get_device_name(device)
    peak = next((v for k, v in PEAK_FLOPS.items() if k in name), None)
    if peak is None or not flops_per_token or cfg.train.precision == "fp32":
        return None
    return round(flops_per_token * tokens_per_s / peak[0], 4)


def _clock_logged_steps(loop) -> tuple[dict[int, float], Callable[[], None]]:
    """Time each logged step (train_child): rank 0 writes a logged step's train_log row right after its optimizer
    step, so wrapping the loop's row writer (after a CUDA sync) stamps the step's end. Returns (stamps, restore)."""
    import torch

    stamps: dict[int, float] = {}
    append = loop._append_jsonl

    def stamped(path, step, row):
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        stamps[step] = time.perf_counter()
        append(path, step, row)

    loop._append_jsonl = stamped

    def restore() -> None:
        loop._append_jsonl = append

    return stamps, restore


# ----------------------------------------------------------------------------- the peer's row (its own venv)


def peer_interpreter(peer_python: str | None, peer_venv: Path) -> Path:
    """The peer's interpreter: --peer-python as given (a bare name such as `python3` found on PATH, as gpu_check.sh
    passes the machine's own), else the venv's python."""
    if not peer_python:
        return peer_venv / "bin" / "python"
    if os.sep not in peer_python:
        found = shutil.which(peer_python)
        if found:
            return Path(found)
    return Path(peer_python)


def peer_available(python: Path, pythonpath: str | None = None, explicit: bool = False) -> str | None:
    """None when the peer can run with this interpreter, else why not."""
    if not python.is_file():
        if explicit:
            return f"--peer-python {python} is not an interpreter on this machine (give a path, or a name on PATH)"
        return f"no peer venv at {python.parent.parent} (create it with: bash benchmarks/peer_setup.sh)"
    env = _peer_env(pythonpath)
    probe = subprocess.run([str(python), "-c", "import speculators.train.trainer"], capture_output=True, text=True, env=env)
    if probe.returncode != 0:
        return "the peer does not import: " + (probe.stderr.strip().splitlines() or ["?"])[-1]
    return None


def _peer_env(pythonpath: str | None) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WANDB_MODE="disabled")
    env.pop("PYTHONPATH", None)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return env


def _peer_row(python: Path, pythonpath: str | None, target: Path, data: Path, out: Path, spec: dict, device: str,
              timeout: int) -> dict:
    """Train the peer's EAGLE-3 on `data`; its steady tokens/s from its per-step timer (first step left out)."""
    args = [
        "--speculator-type", "eagle3", "--verifier-name-or-path", str(target), "--data-path", str(data),
        "--target-layer-ids", *[str(k + 1) for k in spec["taps"]],  # speculators' aux ids are vLLM's: our tap k + 1
        "--draft-vocab-size", str(spec["draft_vocab"]), "--no-norm-before-fc", "--fc-norm", "--norm-output",
        "--ttt-steps", str(spec["ttt"]), "--ttt-step-loss-decay", str(spec["decay"]),
        "--total-seq-len", str(spec["seq_len"]), "--lr", "6e-4",
        "--epochs", "1", "--max-steps", str(spec["steps"]), "--log-freq", "1",
        # it needs a validation split: all samples but the last train
        "--train-data-ratio", str((spec["steps"] + 0.5) / (spec["steps"] + 1)),
        "--num-workers", "0", "--hidden-states-dtype", "bfloat16" if spec["bf16"] else "float32",
        "--save-path", str(out),
    ]
    if device == "cpu":  # flex attention has no CPU backward and the fused loss is a Triton kernel
        cmd = [str(python), str(PEER_CPU_SHIM), *args, "--draft-attn-impl", "sdpa", "--loss-implementation", "eager"]
    else:  # on a GPU: its default flex-attention block masks; its loss as spec["loss"] says (fused: its default)
        cmd = [str(python), "-m", "speculators.train", *args, "--loss-implementation", spec.get("loss", "eager")]
    env = _peer_env(pythonpath)
    t0 = time.perf_counter()
    try:
        proc = run_group(cmd, timeout, env=env)
    except GroupTimeout as e:
        (out.parent / (out.name + ".log")).write_text(e.stdout + e.stderr)
        raise
    wall = time.perf_counter() - t0
    log = proc.stdout + proc.stderr
    (out.parent / (out.name + ".log")).write_text(log)
    if proc.returncode != 0:
        tail = [ln for ln in log.splitlines() if ln.strip()][-3:]
        raise RuntimeError(f"peer exit {proc.returncode}: " + " | ".join(tail))
    steps = _peer_steps(log)
    if len(steps) < 2:
        raise RuntimeError(f"the peer logged {len(steps)} step profiles (see {out.name}.log)")
    return {**_peer_rates(steps), "peer_wall_s": round(wall, 1), "peer_loss": "eager" if device == "cpu" else spec.get("loss", "eager")}


def _peer_rates(steps: list[tuple[float, float]]) -> dict:
    """The peer's rates measured as ours are: its first step left out, the mean over the rest (`peer_tokens_per_s`,
    beside our `tokens_per_s`) and the median step's (`peer_steady_tokens_per_s`, beside our `steady_tokens_per_s`),
    so that one slow step on either side is seen as such rather than read as a difference of speed."""
    steady = steps[1:]
    tokens = sum(tok for tok, _ in steady)
    seconds = sum(ms for _, ms in steady) / 1000
    return {"peer_tokens_per_s": round(tokens / seconds, 1), "peer_measured_steps": len(steady),
            "peer_steady_tokens_per_s": round(statistics.median(tok / ms * 1000 for tok, ms in steady), 1),
            "peer_step_s": [round(ms / 1000, 3) for _, ms in steady]}


def _peer_steps(log: str) -> list[tuple[float, float]]:
    """(tokens, step ms) per logged step, from the peer's profile records (`profile/step_ms=...`,
    `profile/tokens_per_s=...`; its console wraps one record over several lines, so they are paired in order)."""
    ms = [float(x) for x in re.findall(r"profile/step_ms\s*[=:]\s*([0-9.eE+-]+)", log)]
    rates = [float(x) for x in re.findall(r"profile/tokens_per_s\s*[=:]\s*([0-9.eE+-]+)", log)]
    return [(rate * step / 1000, step) for step, rate in zip(ms, rates)]


# ----------------------------------------------------------------------------- driver


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    p.add_argument("--seq-len", type=int, nargs="+", default=None, help="default: 2048 (64 with --smoke)")
    p.add_argument("--algorithms", nargs="+", default=["eagle3"])
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per row: the first (start-up) and, with 3 or "
                   "more, the next to last (profiled) are left out of tokens/s; default 4 (3 with --smoke)")
    p.add_argument("--accum", type=int, default=None, help="micro-batches per optimizer step, default 8 (2 with --smoke; a "
                   "recipe accumulates 16 on 8 GPUs); the peer runs beside ours only with 1, as it trains one packed "
                   "sequence per optimizer step")
    p.add_argument("--micro-batch", type=int, default=1, help="samples per micro-batch (more than 1: packed into rows of the "
                   "recipe's train.pack_tokens, as the recipe does)")
    p.add_argument("--distinct-samples", type=int, default=4, help="distinct random samples held in memory; the steps cycle "
                   "through them (in-memory rows)")
    p.add_argument("--profile-dir", default=None, help="write each row's profiled step as a torch.profiler table here "
                   "(profile_<algorithm>_<reader>_<seq_len>.txt)")
    p.add_argument("--profile-tag", default="", help="appended to the profile tables' names (e.g. flex: profile_dflash_memory_4096_flex.txt)")
    p.add_argument("--no-profile", action="store_true", help="profile no step")
    p.add_argument("--peer-loss", choices=["eager", "fused"], default="eager",
                   help="the peer's --loss-implementation on a GPU (its fused Triton loss fails in backward under torch 2.11)")
    p.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto",
                   help="both trainers: auto = bf16 on GPUs and CPUs with native bf16, else fp32")
    p.add_argument("--no-peer", action="store_true", help="do not run the peer trainer")
    p.add_argument("--peer-venv", default=str(PEER_VENV))
    p.add_argument("--peer-python", default=None, help="the peer's interpreter (default: the venv's python)")
    p.add_argument("--peer-pythonpath", default=None, help="PYTHONPATH for the peer (wheels installed with pip --target)")
    p.add_argument("--require-peer", action="store_true", help="exit 1 when the peer did not run beside an EAGLE-3 row "
                   "(its row's peer_note says why): for a check whose point is the side-by-side figure")
    p.add_argument("--peer-timeout", type=int, default=1200)
    p.add_argument("--workdir", default=None)
    p.add_argument("--stub-dir", default=None, help="where the random target stub is kept (default: the workdir): a folder "
                   "that outlives one run saves rewriting it (Qwen3-8B's: 2.5 GB, tens of seconds)")
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--jsonl", default=None, help="append each row here as one JSON line when it is done (flushed)")
    p.add_argument("--row-timeout", type=int, default=3600, help="seconds per row of ours; past it the row's process tree is killed")
    p.add_argument("--from-cache", action="store_true",
                   help="train from an on-disk cache through the trainer's data path (reader + loader), not from memory")
    p.add_argument("--cache-samples", type=int, default=16, help="samples in the on-disk cache (--from-cache)")
    p.add_argument("--length-spread", type=int, default=None, metavar="MIN_LEN",
                   help="sample lengths drawn uniformly from [MIN_LEN, seq_len] (seeded) instead of all seq_len: the "
                        "attention shapes of users' data; rows then say length_spread")
    p.add_argument("--smoke", action="store_true", help="the tiny shape, 3 steps, sequences of 64 tokens unless given")
    p.add_argument("--extra-opts", nargs="*", default=[], help="more --opts for our trainer (e.g. train.compile=true)")
    p.add_argument("--_row", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_peer_data", nargs=2, metavar=("SAMPLES", "DIR"), help=argparse.SUPPRESS)
    p.add_argument("--_child", nargs=2, metavar=("RECIPE", "OPTS_JSON"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._row:
        print(json.dumps(_our_row(json.loads(args._row))))
        return 0
    if args._peer_data:  # run by the peer's interpreter: its own `datasets` writes the Arrow files it reads
        import torch

        write_peer_data(Path(args._peer_data[1]), torch.load(args._peer_data[0], weights_only=False))
        return 0
    if args._child:  # the cache-stage path bench_gpu.py's recipe runs use
        print(json.dumps(train_child(args._child[0], json.loads(args._child[1]))))
        return 0

    import torch

    from deepspec.cpus import cpu_has_native_bf16

    if args.smoke:
        args.shape = "tiny"
    args.seq_len = args.seq_len or ([64] if args.smoke else [2048])
    args.steps = args.steps or (3 if args.smoke else 4)
    args.accum = args.accum or (2 if args.smoke else 8)
    for name in ("steps", "accum", "micro_batch", "distinct_samples", "cache_samples"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(args, name)})")
    if args.length_spread is not None and not 1 <= args.length_spread <= min(args.seq_len):
        p.error(f"--length-spread {args.length_spread} must be between 1 and the shortest --seq-len ({min(args.seq_len)})")
    if args.steps < 2:
        p.error("--steps must be at least 2: the first step (start-up) is left out of tokens/s")
    global_batch = args.accum * args.micro_batch
    if args.from_cache and args.cache_samples < global_batch:
        p.error(f"--cache-samples {args.cache_samples} is smaller than one optimizer step's samples "
                f"(--accum x --micro-batch = {global_batch})")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    bf16 = args.precision == "bf16" or (args.precision == "auto" and (device == "cuda" or cpu_has_native_bf16()))
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-train-"))
    work.mkdir(parents=True, exist_ok=True)
    tconf = target_config(args.shape)
    _, _, recipe_target, draft_vocab = SHAPES[args.shape]
    t0 = time.perf_counter()
    # progress lines of this process too: a check that kills it during its set-up (the target stub, the samples) then
    # still shows how far it got in its log
    target = write_verifier_stub(Path(args.stub_dir or work) / f"target-{args.shape}", args.shape)
    progress(f"target stub ready ({args.shape}: embedding, final norm, LM head)", t0)
    peer_venv = Path(args.peer_venv)
    peer_python = peer_interpreter(args.peer_python, peer_venv)
    peer_why = "--no-peer" if args.no_peer else peer_available(peer_python, args.peer_pythonpath, bool(args.peer_python))
    result = {
        "benchmark": "train", "date": time.strftime("%Y-%m-%d"), "shape": args.shape, "device": _device_name(),
        "threads": torch.get_num_threads(), "precision": "bf16" if bf16 else "fp32", "steps_per_row": args.steps,
        "samples_per_step": global_batch, "accum": args.accum, "micro_batch": args.micro_batch,
        "reader": "disk" if args.from_cache else "memory",
        "note": ("random-weight target from its config and random features: throughput and memory are real, losses are not "
                 "meaningful; both trainers read the same samples, EAGLE-3 with the same taps, TTT depth, draft vocabulary, "
                 "norms and precision"),
        "peer": {"name": "speculators", "version": "0.9.0", "python": str(peer_python), "available": peer_why is None},
        "rows": [],
    }
    if peer_why:
        result["peer"]["note"] = peer_why

    def emit(row: dict | None = None) -> None:
        if row is not None:  # the row on its own line now: whatever happens later, it is out
            line = json.dumps({"benchmark": "train", "shape": args.shape, "device": result["device"], **row})
            print(line, flush=True)
            if args.jsonl:
                Path(args.jsonl).parent.mkdir(parents=True, exist_ok=True)
                with open(args.jsonl, "a") as f:
                    f.write(line + "\n")
                    f.flush()
                    os.fsync(f.fileno())
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=2) + "\n")

    peer_missing: list[str] = []  # why the peer did not run, per EAGLE-3 row that should have had it
    for seq_len in args.seq_len:
        for algorithm in args.algorithms:
            taps = taps_for(algorithm, tconf.num_hidden_layers)
            needed = args.steps * global_batch
            n_samples = args.cache_samples if args.from_cache else min(needed, args.distinct_samples)
            samples_path = work / f"samples-{algorithm}-{seq_len}.pt"
            samples = make_samples(n_samples, seq_len, len(taps), tconf.hidden_size, tconf.vocab_size, seed=seq_len,
                                   min_len=args.length_spread)
            torch.save(samples, samples_path)
            progress(f"{algorithm}: {n_samples} random samples of up to {seq_len} tokens written", t0)
            recipe = str(REPO / "config" / algorithm / f"{recipe_target}.yaml")
            opts = [
                f"output_root={work}", f"train.output_root={work / 'ckpt'}", f"exp={algorithm}-{seq_len}",
                f"model.target_layer_ids=[{','.join(map(str, taps))}]", "model.init_copy_heads=false",
                "model.init_from_target_layer=null", f"train.global_batch_size={global_batch}",
                f"train.micro_batch_size={args.micro_batch}", f"train.max_steps={args.steps}", f"train.save_every={10**6}",
                f"train.val_every={10**6}",
                # the first and the last step are logged (a run logging every N steps), the others run without metrics
                f"train.log_every={10**6}",
                "train.resume=false", f"train.precision={'bf16' if bf16 else 'fp32'}", "logging.wandb=false",
                "logging.tensorboard=false", "logging.progress=false",
            ]
            if args.micro_batch == 1:  # one sample is its own row
                opts.append("train.pack_tokens=0")
            if algorithm == "eagle3":
                opts += [f"model.draft_vocab_size={draft_vocab}", "model.ttt_length=7", "model.step_loss_decay=0.8",
                         "model.fc_norm=true", "model.norm_output=true", "model.num_draft_layers=1"]
            elif args.shape == "tiny":  # the recipe's mask token is a Qwen3 id outside the tiny vocabulary
                opts += [f"model.mask_token_id={tconf.vocab_size - 1}", "model.num_anchors=8"]
            opts += args.extra_opts
            row = {"algorithm": algorithm, "shape": args.shape, "seq_len": seq_len, "length_spread": args.length_spread,
                   "reader": result["reader"], "tokens_per_s": None,
                   "peak_memory_mb": None, "padding_fraction": None, "mfu": None, "peer_tokens_per_s": None}
            spec = {"recipe": recipe, "opts": opts, "samples": str(samples_path), "target": str(target), "shape": args.shape,
                    "count_flops": args.smoke, "length": needed, "seq_len": seq_len, "reader": result["reader"],
                    "profile": not args.no_profile}
            if args.profile_dir:
                tag = f"_{args.profile_tag}" if args.profile_tag else ""
                spec["profile_path"] = str(Path(args.profile_dir) / f"profile_{algorithm}_{result['reader']}_{seq_len}{tag}.txt")
            try:
                if args.from_cache:
                    from deepspec.config import load_config

                    cache_dir = work / f"cache-{algorithm}-{seq_len}"
                    spec["opts"] = opts = [*opts, f"target.name={target}", f"cache.dir={cache_dir}", "cache.mode=offline"]
                    t_cache = time.perf_counter()
                    row["cache"] = write_feature_cache(cache_dir, samples, load_config(recipe, opts))
                    row["cache"]["write_s"] = round(time.perf_counter() - t_cache, 1)
                    spec["cache"] = str(cache_dir)
                if args.smoke:  # a check of the row's code: in this process (see the module docstring)
                    row.update(json.loads(json.dumps(_our_row(spec))))
                    row["row_process"] = "shared (--smoke)"
                else:
                    try:
                        proc = run_group([sys.executable, __file__, "--_row", json.dumps(spec)], time_left(args.row_timeout),
                                         env=dict(os.environ, PYTHONPATH=pythonpath_with(REPO)), grace_s=5.0)
                    except GroupTimeout as e:  # where it got to: the row's last progress lines
                        raise GroupTimeout(f"{e}; its last progress: {progress_tail(e.stderr)}", e.stdout, e.stderr) from None
                    if proc.returncode != 0:
                        raise RuntimeError(last_error(proc.stderr) or f"exit {proc.returncode}")
                    row.update(json.loads(proc.stdout.strip().splitlines()[-1]))
            except Exception as e:  # report and go on
                row["error"] = f"{type(e).__name__}: {e}"[-2000:]
            if algorithm != "eagle3":
                row["peer_note"] = "the peer is run for EAGLE-3 only"
            elif peer_why:
                row["peer_note"] = peer_why
                peer_missing.append(peer_why)
            elif global_batch != 1:
                row["peer_note"] = ("the peer trains one packed sequence per optimizer step (speculators has no gradient "
                                    "accumulation): it runs beside ours with --accum 1 --micro-batch 1")
            else:
                try:
                    data = work / f"peer-data-{algorithm}-{seq_len}"
                    peer_samples = work / f"peer-samples-{algorithm}-{seq_len}.pt"
                    # one sample per step, and one more for its validation split
                    torch.save([samples[i % len(samples)] for i in range(args.steps + 1)], peer_samples)
                    made = run_group([str(peer_python), __file__, "--_peer_data", str(peer_samples), str(data)], time_left(1800),
                                     env=_peer_env(args.peer_pythonpath))
                    if made.returncode != 0:
                        raise RuntimeError("writing the peer's data: " + (made.stderr.strip().splitlines() or ["?"])[-1])
                    peer_spec = {"taps": taps, "draft_vocab": draft_vocab, "ttt": 7, "decay": 0.8, "seq_len": seq_len,
                                 "steps": args.steps, "bf16": bf16, "loss": args.peer_loss}
                    row.update(_peer_row(peer_python, args.peer_pythonpath, target, data, work / f"peer-out-{algorithm}-{seq_len}", peer_spec, device,
                                         time_left(args.peer_timeout)))
                    if row.get("tokens_per_s") and row.get("peer_tokens_per_s"):
                        row["ours_over_peer"] = round(row["tokens_per_s"] / row["peer_tokens_per_s"], 3)
                    if row.get("steady_tokens_per_s") and row.get("peer_steady_tokens_per_s"):
                        row["ours_over_peer_steady"] = round(row["steady_tokens_per_s"] / row["peer_steady_tokens_per_s"], 3)
                except Exception as e:
                    row["peer_note"] = f"peer run failed: {type(e).__name__}: {e}"[-2000:]
                    peer_missing.append(row["peer_note"])
            del samples
            result["rows"].append(row)
            emit(row)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    emit()
    print(json.dumps(result))
    if args.require_peer and peer_missing:
        print(f"bench_train.py: --require-peer: the peer did not run: {peer_missing[0]}", file=sys.stderr)
        return 1
    return 0


def _device_name() -> str:
    import platform

    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    model = ""
    try:
        model = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"cpu: {model or platform.processor()}"


# ----------------------------------------------------------------------------- the cache-stage path (bench_gpu.py)

_WORDS = (
    "the a model learns to predict next token from hidden states of target layers while training on cached features "
    "speculative decoding drafts several tokens then verifies them in one pass accepted prefix bonus token length "
    "python code function returns list of numbers sorted by value math answer is seven because two plus five"
).split()


def _conversations(n: int, seed: int, answer_words: tuple[int, int] = (20, 60)) -> list[dict]:
    """Synthetic conversations for the cache stage (bench_gpu.py's recipe runs)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        q = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(6, 20)))
        a = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(*answer_words)))
        out.append({"id": f"s{seed}-{i}", "conversations": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
    return out


def _opts(work: Path, algorithm: str, args) -> list[str]:
    return [
        f"output_root={work}", f"data.dir={work / 'data'}", f"cache.dir={work / ('cache-' + algorithm)}",
        f"train.output_root={work / 'ckpt'}", f"train.global_batch_size={args.global_batch}",
        f"train.micro_batch_size={args.micro_batch}", f"train.max_steps={args.steps}", f"train.save_every={10**6}",
        f"train.val_every={10**6}", "train.log_every=1", "logging.wandb=false", "logging.tensorboard=false",
        "logging.progress=false",
    ]


def train_child(recipe: str, opts: list[str]) -> dict:
    """Train a recipe on its cache in this process (alone, or as the rank of a torchrun launch); its figures.
    `steady_tokens_per_s` leaves the first step out; on a GPU `peak_gpu_mb` is the peak allocated."""
    import torch

    import deepspec.train.loop as loop
    from deepspec.config import load_config
    from deepspec.data.batches import BatchPlan, sample_lengths
    from deepspec.train.build import build_parts
    from deepspec.train.dist import init_distributed, teardown

    cfg = load_config(recipe, opts)
    info = init_distributed()
    stamps, restore = _clock_logged_steps(loop)
    try:
        torch.manual_seed(cfg.train.seed)
        parts = build_parts(cfg, info)
        parts.val_data = None
        t0 = time.perf_counter()
        loop._train(cfg, info, parts)
        wall = time.perf_counter() - t0
    finally:
        restore()
        teardown(info)
    rows = [json.loads(line) for line in (cfg.run_dir / "train_log.jsonl").read_text().splitlines()]
    last = rows[-1]
    out = {
        "draft_tokens_per_s": round(last["train/tokens_per_s"], 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "steps": last["step"], "train_wall_s_incl_final_save": round(wall, 2),
        "trainable_params": sum(p.numel() for p in parts.model.parameters() if p.requires_grad),
        "final_loss": round(last["train/loss"], 4),
    }
    logged = sorted(stamps)
    if info.world == 1 and len(logged) >= 2:
        t = cfg.train
        plan = BatchPlan(len(parts.train_data), t.global_batch_size, t.micro_batch_size, info.world, t.seed, t.bucketing)
        lengths = sample_lengths(parts.train_data)
        if lengths is not None:
            tokens = sum(lengths[i] for s in range(logged[0], logged[-1]) for i in plan.global_indices(s))
            out["steady_tokens_per_s"] = round(tokens / (stamps[logged[-1]] - stamps[logged[0]]), 1)
    if info.device.type == "cuda":
        out["peak_gpu_mb"] = round(torch.cuda.max_memory_allocated(info.device) / 2**20, 1)
    out["device"] = str(info.device)
    out["run_dir"] = str(cfg.run_dir)
    return out


if __name__ == "__main__":
    from deepspec.exiting import exit_process  # no final collection of the heap a measurement left

    exit_process(main())
