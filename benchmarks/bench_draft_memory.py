"""Peak memory of one EAGLE-3 / DFlash training step (forward + backward) against the sample length.

A SmolLM2-shaped target config (hidden 576, 9 heads / 3 KV heads, 30 layers, vocabulary 49,152) with random
weights; one sample of T tokens per step; each length runs in a fresh child process and reports its peak RSS
(ru_maxrss) and step time. Memory linear in T means peak(4T) / peak(T) <= 4 (plus the fixed part).

    python benchmarks/bench_draft_memory.py --lengths 4096 16384 --ttt 7
Prints one JSON object.

`--recipe CONFIG`: one training step of a published recipe at its real size (docs/training.md, "Memory of the
published recipes"): measured on a CUDA device (the draft built there under a torch.device context), estimated on a
CPU. `--recipe CONFIG --smoke`: the measured path at a tiny width and length on whatever device is present (a check of
the code path in seconds; benchmarks/gpu_check.sh --smoke runs it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path


def _rss_kib() -> int:
    """Resident memory now (the high-water mark ru_maxrss may still hold start-up peaks)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def child(algorithm: str, t: int, ttt: int, draft_vocab: int | None, ckpt: bool) -> dict:
    import torch
    from transformers import LlamaConfig

    from deepspec.config.model import ModelConfig
    from deepspec.drafts import DraftBatch, get_algorithm

    torch.manual_seed(0)
    torch.set_num_threads(2)
    tc = LlamaConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=30,
                     vocab_size=49152, max_position_embeddings=max(8192, 2 * t))
    kw = dict(activation_checkpointing=ckpt) if ckpt else {}
    cfg = ModelConfig(algorithm=algorithm, target_layer_ids=[1, 14, 26], ttt_length=ttt, draft_vocab_size=draft_vocab, num_anchors=512, **kw)
    draft = get_algorithm(algorithm).from_target_config(tc, cfg)
    draft.load_target_weights(torch.randn(49152, 576) * 0.02, torch.randn(49152, 576) * 0.02)
    draft.train()
    draft.train_metrics = False
    ids = torch.randint(0, 49152, (1, t))
    ones = torch.ones(1, t, dtype=torch.bool)
    batch = DraftBatch(ids, ones, ones, torch.randn(1, t, 3, 576), torch.randn(1, t, 576))
    base = _rss_kib()
    t0 = time.perf_counter()
    loss, _ = draft.loss(batch)
    loss.backward()
    dt = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"tokens": t, "peak_rss_mib": round(peak / 1024, 1), "step_peak_over_start_mib": round((peak - base) / 1024, 1), "step_s": round(dt, 2),
            "loss": round(float(loss), 4)}



# ----------------------------------------------------------------------------- --recipe: one step of a published recipe

# The real targets' configs (published sizes; transformers' config classes, no download). DeepSeek-V4-Flash: the
# DeepseekV4Config defaults (43 layers, hidden 4096, 64 heads x head_dim 512, 1 KV head, vocab 129280, hc_mult 4).
TARGETS = {
    "Qwen/Qwen3-4B": ("qwen3", dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                                    num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)),
    "Qwen/Qwen3-8B": ("qwen3", dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                                    num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False)),
    "Qwen/Qwen3-14B": ("qwen3", dict(vocab_size=151936, hidden_size=5120, intermediate_size=17408, num_hidden_layers=40,
                                     num_attention_heads=40, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False)),
    # Qwen3-MoE: the draft reads intermediate_size (the dense MLP width in the config) when it sizes its own MLP
    "Qwen/Qwen3-30B-A3B": ("qwen3_moe", dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                                             num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                                             num_experts_per_tok=8, moe_intermediate_size=768, tie_word_embeddings=False)),
    "deepseek-ai/DeepSeek-V4-Flash": ("deepseek_v4", {}),
}
GB = 1e9


def scaled_target_config(name: str, factor: float):
    """The target's config with its width scaled by `factor`: hidden and MLP sizes and the number of attention heads
    (KV heads too, at least one), the head dim, vocabulary and layer count kept."""
    from transformers import AutoConfig

    if name not in TARGETS:
        raise SystemExit(f"no published config for target {name!r} here; known: {', '.join(TARGETS)}")
    family, kw = TARGETS[name]
    cfg = AutoConfig.for_model(family, **kw)
    cfg.max_position_embeddings = max(int(getattr(cfg, "max_position_embeddings", 0) or 0), 65536)
    if factor != 1:
        inter = "moe_intermediate_size" if family == "deepseek_v4" else "intermediate_size"
        for key in ("hidden_size", inter):
            setattr(cfg, key, int(round(getattr(cfg, key) * factor)))
        cfg.num_attention_heads = max(1, int(round(cfg.num_attention_heads * factor)))
        cfg.num_key_value_heads = max(1, int(round(cfg.num_key_value_heads * factor)))
    return cfg


def recipe_batch(cfg, arch, n_taps: int, dtype):
    """The recipe's largest micro-batch: micro_batch_size samples of cache.max_length tokens (the first quarter a
    prompt), packed into rows of train.pack_tokens when the recipe packs; features in the dtype the trainer widens
    them to on the device."""
    import torch

    from deepspec.data.batches import collate_features, pack_batch

    t = cfg.cache.max_length
    g = torch.Generator().manual_seed(0)
    items = []
    for _ in range(cfg.train.micro_batch_size):
        ids = torch.randint(0, arch.vocab_size, (t,), generator=g)
        lm = torch.zeros(t, dtype=torch.bool)
        lm[t // 4 :] = True
        items.append({"input_ids": ids, "loss_mask": lm, "taps": torch.randn(t, n_taps, arch.target_hidden_size, generator=g, dtype=dtype),
                      "final_hidden": torch.randn(t, arch.hidden_size, generator=g, dtype=dtype)})
    batch = collate_features(items)
    if cfg.train.pack_tokens:
        batch = pack_batch(batch, cfg.train.pack_tokens)
    return batch


def build_recipe_draft(cfg, factor: float, device):
    """The recipe's draft on `device` (meta: sizes only) for the target scaled by `factor`, built under
    `torch.device(device)` so that no full-size tensor is ever made elsewhere first."""
    import torch

    from deepspec.drafts.registry import get_algorithm

    tconf = scaled_target_config(cfg.target.name, factor)
    with torch.device(device):
        draft = get_algorithm(cfg.model.algorithm).from_target_config(tconf, cfg.model)
    if str(device) != "meta":
        draft.to(device)  # anything a constructor placed on the CPU explicitly
    return draft, tconf


def state_bytes(draft, cfg, world: int) -> dict[str, float]:
    """Bytes of everything a training step holds besides activations, at this draft's width: trainable parameters in
    fp32 + their gradients + the optimizer's state (AdamW 8 B/param; Muon 4 B for the body matrices it takes) + DDP's
    gradient buckets (a second fp32 copy of the gradients), or under FSDP2 over `world` ranks the shards of those plus
    the gathered bf16 parameters (reshard_after_forward=False keeps them) and fp32 unsharded gradients before the
    reduce-scatter; frozen target tensors (embedding / LM head held in the training dtype, the draft vocabulary's head
    rows, d2t / t2d)."""
    from deepspec.train.optim import split_muon_params

    n = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    n_muon = sum(p.numel() for _, p in split_muon_params(draft)[0]) if cfg.train.optimizer == "muon" else 0
    opt = 4 * n_muon + 8 * (n - n_muon)
    bf16 = cfg.train.precision in ("bf16", "auto")
    frozen = 0
    for name, b in list(draft.named_buffers()) + [(k, p) for k, p in draft.named_parameters() if not p.requires_grad]:
        size = b.element_size()
        if name in ("target_embed", "target_lm_head") and bf16 and b.is_floating_point():
            size = 2  # hold_target_in(bf16)
        frozen += b.numel() * size
    if cfg.train.parallel == "fsdp":
        trainable = (4 * n + 4 * n + opt) / world + (2 * n if bf16 else 0) + 4 * n
        how = f"fsdp over {world} ranks: (fp32 params + fp32 grads + optimizer) / {world} + gathered bf16 params + fp32 unsharded grads"
    else:
        trainable = 4 * n + 4 * n + opt + 4 * n
        how = "ddp: fp32 params + fp32 grads + optimizer + DDP's fp32 gradient buckets"
    return {"trainable_params": n, "muon_params": n_muon, "trainable_state_bytes": trainable, "frozen_bytes": frozen, "how": how}


class LiveBytes:
    """A TorchDispatchMode counting the bytes of every storage an op creates while it lives (weak references to the
    storages: freed storages leave the count), and the peak of that count. Module-free (torch's MemTracker refuses
    modules called more than once per step, which the TTT chain and the block layers are)."""

    def __init__(self, bf16_in_fp32: bool = False, skip_compute: bool = False):
        import weakref

        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves, tree_map

        state = self
        self.current = self.peak = 0
        self.peak_op = ""
        self.live: dict[int, tuple[object, str]] = {}  # storage -> (weak reference, the op / shape / dtype that made it)
        self.known: set[int] = set()  # storages that existed before the step (parameters, buffers): views of them are not new
        self.at_peak: list[tuple[str, int]] = []  # the largest live storages when the peak was last raised by >1%
        self._snap = 0
        self.emulated = 0
        aten = torch.ops.aten
        # the step's compute: with skip_compute their outputs come from the meta kernels, zero-filled (same shapes,
        # dtypes, strides and lifetimes, so the same bytes); with bf16_in_fp32 (a CPU without native bf16 runs bf16
        # GEMMs at ~0.3 GFLOP/s, 100x below fp32) they are computed in fp32 and rounded to bf16. Either way the step
        # takes minutes instead of hours, and inputs converted inside the mode are never counted.
        slow = {aten.mm.default: None, aten.addmm.default: None, aten.bmm.default: None, aten.baddbmm.default: None,
                aten._scaled_dot_product_flash_attention_for_cpu.default: (0,),  # (out, logsumexp): lse stays fp32
                aten._scaled_dot_product_flash_attention_for_cpu_backward.default: None}

        def up(x):
            return x.float() if isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16 else x

        def free(key: int, n: int, _ref=None) -> None:
            if state.live.pop(key, None) is not None:
                state.current -= n

        def on_meta(x):
            return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta") if isinstance(x, torch.Tensor) else x

        def zeros_like_meta(x):
            return torch.zeros_like(x, device="cpu") if isinstance(x, torch.Tensor) else x

        def call(func, args, kwargs):
            if skip_compute and func in slow:
                # bytes only: the op's outputs from its meta kernel (shapes, dtypes, strides), zero-filled
                state.emulated += 1
                return tree_map(zeros_like_meta, func(*tree_map(on_meta, args), **tree_map(on_meta, kwargs)))
            if bf16_in_fp32 and func in slow and any(isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16
                                                     for a in tree_leaves((args, kwargs))):
                state.emulated += 1
                out = func(*tree_map(up, args), **tree_map(up, kwargs))
                which = slow[func]
                if isinstance(out, torch.Tensor):
                    return out.to(torch.bfloat16)
                return type(out)(o.to(torch.bfloat16) if isinstance(o, torch.Tensor) and (which is None or i in which) else o
                                 for i, o in enumerate(out))
            return func(*args, **kwargs)

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = call(func, args, kwargs or {})
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor) and t.device.type != "meta":
                        st = t.untyped_storage()
                        key = st._cdata
                        if key not in state.live and key not in state.known:
                            n = st.nbytes()
                            desc = f"{func} {list(t.shape)} {str(t.dtype).replace('torch.', '')}"
                            state.live[key] = (weakref.ref(st, lambda r, key=key, n=n: free(key, n)), desc)
                            state.current += n
                            if state.current > state.peak:
                                state.peak, state.peak_op = state.current, str(func)
                                if state.peak > state._snap * 1.01:
                                    state._snap = state.peak
                                    state.snapshot()
                return out

        self.mode = Mode()

    def ignore(self, tensors) -> None:
        """Storages allocated before the step (the draft's parameters and frozen buffers, counted exactly in `state`):
        an op returning a view of one (a transposed frozen LM head) allocates nothing."""
        self.known.update(t.untyped_storage()._cdata for t in tensors)

    def snapshot(self) -> None:
        """What is live now, grouped by op / shape / dtype, largest first (bytes summed over same-described storages)."""
        groups: dict[str, int] = {}
        for ref, desc in self.live.values():
            st = ref()
            if st is not None:
                groups[desc] = groups.get(desc, 0) + st.nbytes()
        self.at_peak = sorted(groups.items(), key=lambda kv: -kv[1])[:20]


class SdpaLog:
    """A TorchFunctionMode that records every scaled_dot_product_attention call and the kernel this CPU runs for it
    (torch._fused_sdp_choice: 1 = flash, which keeps O(T * d) + LSE for backward, like CUDA's flash / memory-efficient
    kernels; 0 = math, which keeps every score)."""

    def __init__(self):
        from torch.overrides import TorchFunctionMode

        log = self.calls = []

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                import torch.nn.functional as F

                kwargs = kwargs or {}
                if func is F.scaled_dot_product_attention:
                    import torch

                    q, k, v = args[:3]
                    try:
                        choice = int(torch._fused_sdp_choice(q, k, v, kwargs.get("attn_mask"), kwargs.get("dropout_p", 0.0),
                                                             kwargs.get("is_causal", False), scale=kwargs.get("scale"),
                                                             enable_gqa=kwargs.get("enable_gqa", False)))
                    except Exception:
                        choice = -1
                    log.append({"q": list(q.shape), "k": list(k.shape), "dtype": str(q.dtype).replace("torch.", ""),
                                "mask": kwargs.get("attn_mask") is not None, "kernel": {1: "flash", 0: "math"}.get(choice, str(choice))})
                return func(*args, **kwargs)

        self.mode = Mode()


def measure_activations(cfg, factor: float, precision: str, compute: bool = False) -> dict:
    """One forward + backward of the recipe's largest micro-batch at width `factor`, on CPU, under LiveBytes
    (every tensor the step allocates, by its real size and dtype, freed when its storage dies): its peak, less the
    gradients of the trainable parameters (counted exactly in state_bytes). Run in a child process."""
    import torch

    from deepspec.train.precision import setup_precision

    torch.manual_seed(0)
    draft, tconf = build_recipe_draft(cfg, factor, "cpu")
    v, h = draft.arch.vocab_size, draft.arch.hidden_size
    draft.load_target_weights(torch.randn(v, h) * 0.02, torch.randn(v, h) * 0.02)
    if getattr(draft, "reduced_vocab", False) or getattr(draft, "draft_vocab_size", v) < v:
        draft.set_token_frequencies(torch.randint(1, 1000, (v,)))
    setup_precision(draft, precision, torch.device("cpu"))
    draft.train()
    draft.train_metrics = True  # logged steps: the metrics' full-vocabulary pass too (the larger peak)
    n_grad = sum(p.numel() * 4 for p in draft.parameters() if p.requires_grad)
    n_rows = len(draft.taps) * (draft.arch.target_hc_mult if draft.arch.tap_reduction == "concat" else 1)
    sdpa = SdpaLog()
    from deepspec.cpus import cpu_has_native_bf16

    mt = LiveBytes(bf16_in_fp32=precision == "bf16" and not cpu_has_native_bf16(), skip_compute=not compute)
    mt.ignore([*draft.parameters(), *draft.buffers()])
    t0 = time.perf_counter()
    with sdpa.mode, mt.mode:
        batch = recipe_batch(cfg, draft.arch, len(draft.taps), torch.float32)
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
        with ctx:
            loss, _ = draft.loss(batch)
        loss.backward()
        del batch, loss
    seconds = time.perf_counter() - t0
    total = mt.peak
    kernels: dict[str, int] = {}
    for c in sdpa.calls:
        kernels[c["kernel"]] = kernels.get(c["kernel"], 0) + 1
    return {"factor": factor, "hidden_size": h, "q_width": draft.arch.num_attention_heads * draft.arch.head_dim,
            "tap_width": draft.arch.target_hidden_size, "tap_rows": n_rows, "tokens": int(cfg.cache.max_length * cfg.train.micro_batch_size),
            "peak_bytes": total, "grad_bytes": n_grad, "activation_bytes": total - n_grad, "step_s": round(seconds, 1),
            "sdpa_kernels": kernels, "sdpa_calls": len(sdpa.calls), "gemm_attention_ops_" + ("emulated" if compute else "shape_only"): mt.emulated,
            "peak_at_op": mt.peak_op,
            "live_at_peak_mb": {desc: round(n / 2**20, 1) for desc, n in mt.at_peak}}


def _get(cfg, dotted: str):
    obj = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def recipe_main(args) -> dict:
    import torch

    from deepspec.config import load_config

    cfg = load_config(args.recipe, args.opts)
    precision = "bf16" if cfg.train.precision in ("bf16", "auto") else "fp32"
    real, _ = build_recipe_draft(cfg, 1.0, "meta")
    state = state_bytes(real, cfg, args.world)
    out = {
        "benchmark": "draft_memory", "recipe": args.recipe, "opts": args.opts, "date": time.strftime("%Y-%m-%d"),
        "target": cfg.target.name, "algorithm": cfg.model.algorithm, "layers": cfg.model.num_draft_layers,
        "seq_len": cfg.cache.max_length, "micro_batch": cfg.train.micro_batch_size, "pack_tokens": cfg.train.pack_tokens,
        "num_anchors": getattr(cfg.model, "num_anchors", None) if cfg.model.algorithm != "eagle3" else None,
        "block_size": cfg.model.block_size if cfg.model.algorithm != "eagle3" else None,
        "ttt_length": cfg.model.ttt_length if cfg.model.algorithm == "eagle3" else None,
        "draft_vocab_size": cfg.model.draft_vocab_size, "parallel": cfg.train.parallel, "optimizer": cfg.train.optimizer,
        "precision": precision, "activation_checkpointing": bool(cfg.model.activation_checkpointing),
        "hidden_size": real.arch.hidden_size, "q_width": real.arch.num_attention_heads * real.arch.head_dim,
        "state": state,
    }
    if args.smoke:  # the measured path at a small width and length, on whatever device this machine has
        out.update(measured_step(cfg, "cuda" if torch.cuda.is_available() and not args.cpu else "cpu", SMOKE_FACTOR))
        return out
    if torch.cuda.is_available() and not args.cpu:
        out.update(measured_step(cfg, "cuda"))
        return out
    axis_values = [None]
    if args.axis:
        key, *vals = args.axis
        axis_values = [int(v) for v in vals]
        if len(axis_values) != 2:
            raise SystemExit("--axis takes a recipe key and two smaller values, e.g. --axis model.num_anchors 384 768")
        published = int(_get(cfg, key))
    runs = []
    for x in axis_values:
        for f in args.factors:
            opts = list(args.opts) + ([f"{args.axis[0]}={x}"] if x is not None else [])
            cmd = [sys.executable, __file__, "--recipe", args.recipe, "--opts", *opts, "--_factor", str(f)]
            cmd += ["--compute"] if args.compute else []
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode:
                raise SystemExit(f"width x{f}: " + " | ".join(proc.stderr.strip().splitlines()[-3:]))
            run = json.loads(proc.stdout.strip().splitlines()[-1])
            if x is not None:
                run[args.axis[0]] = x
            print(json.dumps(run), file=sys.stderr, flush=True)
            runs.append(run)
    w = real.arch.hidden_size
    (w1, a1), (w2, a2) = [(r["hidden_size"], r["activation_bytes"]) for r in runs[:2]]
    slope = (a2 - a1) / (w2 - w1)
    fixed = a1 - slope * w1
    if args.axis:
        # bilinear in (width, axis): activations at the second axis value give the same line; both lines are
        # extended to the published axis value (linear in it: tokens / anchors), then to the real width
        (v1, b1), (v2, b2) = [(r["hidden_size"], r["activation_bytes"]) for r in runs[2:4]]
        slope_b = (b2 - b1) / (v2 - v1)
        fixed_b = b1 - slope_b * v1
        x1, x2 = axis_values
        t = (published - x1) / (x2 - x1)
        slope, fixed = slope + t * (slope_b - slope), fixed + t * (fixed_b - fixed)
        out["axis"] = {"key": args.axis[0], "measured_at": axis_values, "published": published,
                       "why": "the published value does not fit this machine's memory / time: activations are measured at "
                              "two smaller values and extended linearly to the published one (linear in tokens / anchors "
                              "at fixed width: flash-style attention keeps no score matrix; a mask or key range that grows "
                              "faster than linearly below the window makes the extension an over-estimate, not an under-estimate)"}
    activations = fixed + slope * w
    peak = activations + state["trainable_state_bytes"] + state["frozen_bytes"]
    math_calls = sum(r["sdpa_kernels"].get("math", 0) for r in runs)
    out.update({
        "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores (this run)",
        "method": (
            "One forward + backward of the recipe's largest micro-batch (micro_batch_size samples of cache.max_length "
            "tokens, packed as the recipe packs; the recipe's anchors, layers, block / TTT depth, draft vocabulary and "
            f"{precision} autocast) on CPU at reduced width: hidden size, MLP size and attention heads x"
            f"{' and x'.join(str(f) for f in args.factors)} (head dim, vocabulary, tokens, layers as published). torch's "
            "dispatch mode (LiveBytes) counts every storage the step allocates at its real size and dtype while it lives (matrix products and "
            "attention take their outputs from the ops' meta kernels, zero-filled, unless --compute); its peak less the trainable "
            "parameters' gradients is the step's activation memory. Activations are linear in the width at fixed tokens "
            "(hidden states, projections, heads, tap features: T x width; logits chunks, labels, indices, the single KV "
            "head's keys: width-free), so two widths give activations = fixed + slope x hidden, extrapolated to the real "
            "hidden size. Parameters, gradients, optimizer state, DDP buckets / FSDP shards and the frozen target tensors "
            "are counted exactly at the real width (`state`). Every attention call ran PyTorch's flash kernel on this CPU "
            "(`sdpa_kernels`), which keeps the output and its log-sum-exp for backward, not the scores: what CUDA's "
            "flash / memory-efficient kernels keep, so no score matrix of the CPU math kernel is counted. The estimate "
            "leaves out the CUDA caching allocator's fragmentation and the CUDA context (~0.5-1 GB)."
        ),
        "runs": runs,
        "activations_fixed_gb": round(fixed / GB, 2),
        "activations_per_hidden_unit_mb": round(slope / 1e6, 3),
        "activations_gb": round(activations / GB, 2),
        "trainable_state_gb": round(state["trainable_state_bytes"] / GB, 2),
        "frozen_gb": round(state["frozen_bytes"] / GB, 2),
        "estimated_peak_gb": round(peak / GB, 2),
        "fits_80gb_gpu": bool(peak <= 70 * GB),
        "scaling": (
            "activations_gb = activations_fixed_gb + activations_per_hidden_unit_mb x hidden / 1000: the fixed part grows "
            "with the tokens and the vocabulary (vocab_chunk_rows x V logits chunks) but not the width; the per-hidden-unit "
            "part grows with tokens x width (x layers; for block drafts with anchors x block size too). trainable_state_gb "
            "grows with width^2 x layers (+ draft vocabulary x width for trainable heads), frozen_gb with vocabulary x width."
        ),
        "sdpa_math_calls": math_calls,
    })
    return out


def measured_step(cfg, device, factor: float = 1.0) -> dict:
    """The draft (the target's width x `factor`) built on `device` under a torch.device context, the recipe's
    optimizer, two full training steps (forward, backward, optimizer step) on the largest micro-batch. On CUDA the
    peak is torch.cuda.max_memory_allocated; on a CPU (--smoke) the process's peak RSS."""
    import torch

    from deepspec.train.loop import autocast_context
    from deepspec.train.optim import build_optimizer
    from deepspec.train.precision import setup_precision

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    torch.manual_seed(0)
    draft, _ = build_recipe_draft(cfg, factor, dev)
    v, h = draft.arch.vocab_size, draft.arch.hidden_size
    draft.load_target_weights(torch.randn(v, h, device=dev) * 0.02, torch.randn(v, h, device=dev) * 0.02)
    if getattr(draft, "draft_vocab_size", v) < v:
        draft.set_token_frequencies(torch.randint(1, 1000, (v,)))
    setup_precision(draft, cfg.train.precision, dev)
    draft.train()
    draft.train_metrics = True
    opt = build_optimizer(draft, cfg.train)
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    for _ in range(2):  # the second step holds the optimizer state
        batch = recipe_batch(cfg, draft.arch, len(draft.taps), torch.float32).to(dev)
        with autocast_context(cfg, dev)():
            loss, _ = draft.loss(batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del batch, loss
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(dev)
        machine, how = torch.cuda.get_device_name(dev), "torch.cuda.max_memory_allocated"
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        machine, how = f"{platform.machine()} CPU (smoke: width x{factor:g})", "the process's peak RSS"
    return {"machine": machine, "measured_on": str(dev), "width_factor": factor,
            "method": f"measured: {how} over two full training steps (the plain draft, no DDP buckets / FSDP: add "
                      "state.how's parallel terms for a multi-GPU run)",
            "measured_peak_gb": round(peak / GB, 2), "estimated_peak_gb": round(peak / GB, 2), "fits_80gb_gpu": bool(peak <= 70 * GB),
            "two_steps_s": round(time.perf_counter() - t0, 1)}


# --smoke: the recipe's own code path on a CPU in seconds: these overrides, the width x SMOKE_FACTOR
SMOKE_FACTOR = 1 / 64
SMOKE_OPTS = ["cache.max_length=64", "train.micro_batch_size=1", "train.pack_tokens=0"]


def _smoke_opts(recipe: str, opts: list[str]) -> list[str]:
    from deepspec.config import load_config

    cfg = load_config(recipe, opts)
    extra = list(SMOKE_OPTS)
    if cfg.model.algorithm != "eagle3":
        extra.append("model.num_anchors=4")
    return [*opts, *extra]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--algorithm", default="eagle3")
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--draft-vocab", type=int, default=0, help="0 = the full 49,152-token vocabulary")
    ap.add_argument("--activation-checkpointing", action="store_true")
    ap.add_argument("--child", type=int, default=0)
    ap.add_argument("--recipe", default=None, help="a recipe: one training step's peak at its published length, anchors, layers")
    ap.add_argument("--opts", nargs="*", default=[], help="--opts for the recipe")
    ap.add_argument("--factors", type=float, nargs=2, default=[0.125, 0.25], help="the two reduced widths measured on CPU")
    ap.add_argument("--axis", nargs=3, default=None, metavar=("KEY", "V1", "V2"),
                    help="also shrink this recipe key (model.num_anchors, cache.max_length) to V1 and V2 and extend linearly "
                         "to the published value: for recipes whose published step does not fit the machine measuring it")
    ap.add_argument("--world", type=int, default=8, help="ranks an FSDP recipe shards over (one node)")
    ap.add_argument("--cpu", action="store_true", help="the CPU estimate even where CUDA is available")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--jsonl", default=None, help="also append the result to this file as one JSON line (flushed)")
    ap.add_argument("--smoke", action="store_true",
                    help="the measured path (the draft built under a torch.device context, the recipe's optimizer, two "
                         f"steps) at width x{SMOKE_FACTOR:g}, {SMOKE_OPTS[0]} and 4 anchors, on CUDA if present else the "
                         "CPU: a check of the code path in seconds")
    ap.add_argument("--compute", action="store_true",
                    help="compute every matrix product and attention call (default on CPU: their outputs come from the ops' "
                         "meta kernels, zero-filled, which allocates the same bytes in a fraction of the time)")
    ap.add_argument("--_factor", type=float, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.recipe:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        if a._factor is not None:
            from deepspec.config import load_config

            cfg = load_config(a.recipe, a.opts)
            prec = "bf16" if cfg.train.precision in ("bf16", "auto") else "fp32"
            print(json.dumps(measure_activations(cfg, a._factor, prec, a.compute)))
            return
        if a.smoke:
            a.opts = _smoke_opts(a.recipe, a.opts)
        res = recipe_main(a)
        text = json.dumps(res, indent=2)
        if a.out:
            Path(a.out).write_text(text + "\n")
        if a.jsonl:
            Path(a.jsonl).parent.mkdir(parents=True, exist_ok=True)
            with open(a.jsonl, "a") as f:
                f.write(json.dumps(res) + "\n")
                f.flush()
                os.fsync(f.fileno())
        print(text)
        return
    dv = a.draft_vocab or None
    if a.child:
        print(json.dumps(child(a.algorithm, a.child, a.ttt, dv, a.activation_checkpointing)))
        return
    rows = []
    for t in a.lengths:
        cmd = [sys.executable, __file__, "--algorithm", a.algorithm, "--ttt", str(a.ttt), "--draft-vocab", str(a.draft_vocab), "--child", str(t)]
        if a.activation_checkpointing:
            cmd.append("--activation-checkpointing")
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode:
            rows.append({"tokens": t, "error": out.stderr.strip().splitlines()[-1:]})
        else:
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    res = {"algorithm": a.algorithm, "ttt_length": a.ttt, "draft_vocab": dv or 49152, "activation_checkpointing": a.activation_checkpointing, "runs": rows}
    ok = [r for r in rows if "peak_rss_mib" in r]
    if len(ok) >= 2:
        res["peak_ratio_last_over_first"] = round(ok[-1]["peak_rss_mib"] / ok[0]["peak_rss_mib"], 2)
        res["step_ratio_last_over_first"] = round(ok[-1]["step_peak_over_start_mib"] / max(ok[0]["step_peak_over_start_mib"], 1e-9), 2)
        res["length_ratio"] = ok[-1]["tokens"] / ok[0]["tokens"]
    print(json.dumps(res))


if __name__ == "__main__":
    from deepspec.exiting import exit_process  # no final collection of the heap a measurement left

    main()
    exit_process(0)
