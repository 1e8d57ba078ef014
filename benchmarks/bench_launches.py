#!/usr/bin/env python
"""What one training micro-batch asks of the host: aten ops dispatched, device values read back, new attention shapes
— for this tree and for b3a919e (the commit the 2026-11-27 H200 run measured) — and what a small cost model,
calibrated on that H200 run's profile, predicts for a Qwen3-8B-shaped step on an H200.

    python benchmarks/bench_launches.py                       # 4,096-token samples, both trees (about 10 CPU minutes)
    python benchmarks/bench_launches.py --smoke               # tiny shapes, seconds (the test runs this)
    python benchmarks/bench_launches.py --out R.json          # also write the JSON object to R.json

Prints one JSON object: `rows` (dflash, dspark, eagle3), `calibration`, `calibration_check`, `self_check`, `setup`.

What is counted (one micro-batch = the loss's forward + its backward, an unlogged step: `draft.train_metrics = False`,
train mode, fp32 on the CPU, one 4,096-token sample):

* aten ops: every op a TorchDispatchMode sees (top-level dispatches, forward and backward, activation-checkpoint
  recomputation included). `launches_per_micro_batch` leaves out the ops that launch no device kernel (views,
  `empty*`, `detach`, `_local_scalar_dense`, SDPA's backend choice); `aten_ops_per_micro_batch` is all of them, what
  the host model charges per op.
* host reads: calls that read a device value on the host inside the step, seen by a TorchFunctionMode: Tensor.tolist,
  .item, __bool__, __int__, __float__, __index__, .cpu(), .numpy(), and data-dependent shapes (nonzero, argwhere,
  masked_select, unique, one-argument where, boolean-mask indexing). `self_check` shows each one is caught on a CPU
  tensor. Reads inside torch's own Python functions are invisible to a function mode; the dispatch-level
  `dispatch_reads_in_step` (`_local_scalar_dense`, nonzero, masked_select, unique ops) is the cross-check.
  This tree's step gets the loader's plan made outside the counted region, as the loader makes it
  (`batch.plan = draft.plan_batch(batch, key=..., buckets=True)`); b3a919e has no plan (its loss draws and reads).
* new attention shapes: SDPA calls (function level) whose (q, k, v, mask) shapes did not occur in an earlier step of
  the run, per step, over `--steps` steps with fresh anchor draws; `new_attention_shapes_per_step` is the mean over
  the steps after the first. At b3a919e every such call went to cuDNN, which builds an execution plan per new shape.

The drafts: the recipes' structure (config/{dflash,dspark,eagle3}/qwen3-8b.yaml: 5 block-draft layers, block 7,
512 anchors, taps [1, 9, 17, 25, 33]; EAGLE-3.1 one layer, TTT 7) on a Qwen3 target config built in-process at
reduced width (hidden 256, 8 query / 2 KV heads of 32 — Qwen3-8B's grouping of 4 —, MLP 768, vocabulary 16,384 with
a 4,096-id EAGLE-3 draft vocabulary). The op count depends on structure, not width: chunk plans depend on the
grouping, block size, anchors and tokens; losses chunk by rows. The one width-dependent constant, the RMSNorm's
slice size (`layers._NORM_CHUNK`, elements), is scaled by the width ratio (1/16) so norms slice as at full width; for
this tree the same step counted at the full Qwen3-8B shape on the meta device (`meta_full_shape_aten_ops`) checks it.

FLOPs (per micro-batch, full Qwen3-8B shape, this tree's code): a draft built under `torch.device("meta")`, the plan
made on the CPU, the batch then moved to meta; matrix products 2mnk by formula from the dispatched ops, attention
2·B·Hq·Lq·Lk·(Dq + Dv) forward by formula at the SDPA call and at the flash ops EAGLE-3's chain calls itself
(grouped-query heads counted as query heads), backward 2x forward. `flops_exact` = without buckets (the math of b3a919e's exact chunk plans, also the MFU numerator),
`flops_bucketed` = what this tree's bucketed plan computes (padded keys included).

Baseline: `--baseline-tree` (default /tmp/deepspec-b3a919e, made with `git worktree add` when missing); this
script re-invokes itself with `--emit-row --tree PATH` and PYTHONPATH=PATH for each tree.

The cost model and every constant's source: `CostModel` below; docs/benchmarks.md says what it can and cannot tell.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("DEEPSPEC_NO_PROGRESS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
BASELINE_COMMIT = "b3a919e"
ALGORITHMS = ("dflash", "dspark", "eagle3")
# what is measured: name -> (algorithm, extra recipe overrides). `eagle3_gpu_row` is EAGLE-3 as the measured H200 row
# ran it (benchmarks/bench_train.py at b3a919e: vLLM's default three taps, [1, 17, 32] of 36 layers, not the
# recipe's five): the calibration check compares like with like
VARIANTS = {"dflash": ("dflash", []), "dspark": ("dspark", []), "eagle3": ("eagle3", []),
            "eagle3_gpu_row": ("eagle3", ["model.target_layer_ids=[1,17,32]"])}

# --- shapes -----------------------------------------------------------------------------------------------------
# target config overrides of deepspec.targets.tiny.tiny_config("qwen3", ...): Qwen3-8B's structure at reduced width
REDUCED = dict(vocab_size=16384, hidden_size=256, intermediate_size=768, num_hidden_layers=36, num_attention_heads=8,
               num_key_value_heads=2, head_dim=32, max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False)
SMOKE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=36, num_attention_heads=4,
             num_key_value_heads=1, head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False)
QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False)
FULL_HIDDEN = QWEN3_8B["hidden_size"]
# (target shape, tokens per sample, recipe overrides per algorithm)
SHAPES = {
    "reduced": (REDUCED, 4096, {"dflash": ["model.mask_token_id=16383"], "dspark": ["model.mask_token_id=16383"],
                                "eagle3": ["model.draft_vocab_size=4096"]}),
    "smoke": (SMOKE, 192, {"dflash": ["model.mask_token_id=511", "model.num_anchors=16"],
                           "dspark": ["model.mask_token_id=511", "model.num_anchors=16", "model.markov_rank=16"],
                           "eagle3": ["model.draft_vocab_size=256"]}),
    "full": (QWEN3_8B, 4096, {"dflash": [], "dspark": [], "eagle3": []}),
}

# --- counters ---------------------------------------------------------------------------------------------------
# ops that launch no device kernel (besides views, found from the schema's alias info)
NO_KERNEL = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "_unsafe_view", "detach", "alias",
             "lift_fresh", "_local_scalar_dense", "_fused_sdp_choice", "set_", "resize_", "sym_size", "sym_stride",
             "sym_numel", "sym_storage_offset", "_reshape_alias", "_nested_tensor_from_mask_left_aligned", "is_same_size"}
# dispatch-level ops that read the device on the host (a CUDA stream sync)
DISPATCH_READS = {"_local_scalar_dense", "nonzero", "nonzero_static", "masked_select", "_unique", "_unique2",
                  "unique_dim", "unique_consecutive", "unique_dim_consecutive", "argwhere"}
MATMULS = {"mm": 0, "addmm": 1, "bmm": 0, "baddbmm": 1}  # name -> index of the first matrix operand
# the flash kernel ops the TTT chain calls directly (deepspec/drafts/attention.py `flash_lse_ops`) -> index of query
FLASH_OPS = {"_scaled_dot_product_flash_attention_for_cpu": 0, "_scaled_dot_product_flash_attention": 0,
             "_scaled_dot_product_flash_attention_for_cpu_backward": 1, "_scaled_dot_product_flash_attention_backward": 1}
READ_METHODS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy"}
DATA_DEPENDENT = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive"}


def _name(func) -> str:
    return getattr(func, "__name__", None) or str(func)


def make_modes():
    """(OpCounter, HostReads): a TorchDispatchMode counting aten ops (+ matmul FLOPs) and a TorchFunctionMode counting
    host reads and recording SDPA shapes. Built lazily so that `import bench_launches` needs no torch."""
    import torch
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpCounter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = 0
            self.launches = 0
            self.by_name: Counter = Counter()
            self.launch_by_name: Counter = Counter()
            self.dispatch_reads = 0
            self.flops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = func.overloadpacket.__name__
            self.ops += 1
            self.by_name[name] += 1
            if name not in NO_KERNEL and not getattr(func, "is_view", False):
                self.launches += 1
                self.launch_by_name[name] += 1
            if name in DISPATCH_READS:
                self.dispatch_reads += 1
            if name in MATMULS:
                a, b = args[MATMULS[name]], args[MATMULS[name] + 1]
                batch = a.shape[0] if a.dim() == 3 else 1
                self.flops += 2 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1]
            if name in FLASH_OPS:  # EAGLE-3's chain calls the flash kernel itself (F.sdpa's calls: HostReads counts them)
                q, k, v = args[FLASH_OPS[name]:FLASH_OPS[name] + 3]
                fwd = 2 * math.prod(q.shape[:-2]) * q.shape[-2] * k.shape[-2] * (q.shape[-1] + v.shape[-1])
                self.flops += 2 * fwd if "backward" in name else fwd  # the same convention as HostReads
            return func(*args, **kwargs)

    class HostReads(TorchFunctionMode):
        def __init__(self, ops: OpCounter | None = None, meta_sdpa: bool = False):
            super().__init__()
            self.ops = ops
            self.meta_sdpa = meta_sdpa
            self.reads: list[tuple[str, int]] = []  # (kind, op index at the read)
            self.attention: list[tuple[tuple, int]] = []  # (shape key, op index)
            self.attention_flops = 0

        def _at(self) -> int:
            return self.ops.ops if self.ops is not None else 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = _name(func)
            if name in READ_METHODS or name in DATA_DEPENDENT or (name == "where" and len(args) + len(kwargs) == 1):
                self.reads.append((name, self._at()))
            elif name in ("__getitem__", "__setitem__") and len(args) > 1 and _bool_index(args[1]):
                self.reads.append((name + "[bool mask]", self._at()))
            if func is F.scaled_dot_product_attention:
                q, k, v = args[:3]
                mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
                key = (tuple(q.shape), tuple(k.shape), tuple(v.shape), None if mask is None else tuple(mask.shape),
                       bool(kwargs.get("is_causal", False)), str(q.dtype))
                self.attention.append((key, self._at()))
                lq, lk, hq = q.shape[-2], k.shape[-2], q.shape[-3]
                b = math.prod(q.shape[:-3])
                fwd = 2 * b * hq * lq * lk * (q.shape[-1] + v.shape[-1])
                self.attention_flops += fwd
                if self.meta_sdpa and q.device.type == "meta":
                    return _meta_sdpa(q, k, v, self, fwd)
            return func(*args, **kwargs)

    def _meta_sdpa(q, k, v, counter, fwd):
        class Fn(torch.autograd.Function):
            @staticmethod
            def forward(ctx, q_, k_, v_):
                return q_.new_empty((*q_.shape[:-1], v_.shape[-1]))

            @staticmethod
            def backward(ctx, g):
                counter.attention_flops += 2 * fwd
                return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

        return Fn.apply(q, k, v)

    return OpCounter, HostReads


def _bool_index(idx) -> bool:
    import torch

    items = idx if isinstance(idx, tuple) else (idx,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def self_check() -> dict:
    """Each read the function mode should catch, made once on a CPU tensor: {kind: caught?}; plus a non-read op."""
    import operator

    import torch

    _, HostReads = make_modes()
    t = torch.tensor([1.0, 0.0, 2.0])
    one = torch.tensor(3)
    mask = t > 0
    cases = {
        "tolist": lambda: t.tolist(), "item": lambda: one.item(), "__bool__": lambda: bool(one),
        "__int__": lambda: int(one), "__float__": lambda: float(one), "__index__": lambda: operator.index(one),
        "__index__ (list[t])": lambda: [0, 1, 2, 3][one], "cpu": lambda: t.cpu(), "numpy": lambda: t.numpy(),
        "nonzero": lambda: t.nonzero(), "torch.nonzero": lambda: torch.nonzero(t), "masked_select": lambda: t.masked_select(mask),
        "unique": lambda: torch.unique(t), "where(cond)": lambda: torch.where(mask), "t[bool mask]": lambda: t[mask],
        "if t:": lambda: 1 if one else 0,
    }
    out = {}
    for kind, fn in cases.items():
        with HostReads() as mode:
            fn()
        out[kind] = len(mode.reads) >= 1
    with HostReads() as mode:
        (t + 1).sum()
        t[1:]
    out["no read: t + 1, t[1:]"] = len(mode.reads) == 0
    return out


# --- the measurement (runs against whichever deepspec is importable: this tree or the baseline worktree) ----------
def _sample(seq: int, n_taps: int, hidden: int, vocab: int, seed: int, device=None) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (seq,), generator=g)
    mask = torch.zeros(seq, dtype=torch.bool)
    mask[seq // 4 :] = True  # the first quarter a prompt, as benchmarks/bench_train.py's samples
    if device == "meta":
        taps = torch.empty(seq, n_taps, hidden, device="meta")
        final = torch.empty(seq, hidden, device="meta")
    else:
        taps = torch.randn(seq, n_taps, hidden, generator=g)
        final = torch.randn(seq, hidden, generator=g)
    return {"input_ids": ids, "loss_mask": mask, "taps": taps, "final_hidden": final}


def _build(tree: Path, variant: str, shape: str, device: str = "cpu"):
    """(draft, cfg, target config) of `variant`'s Qwen3-8B recipe on `shape`'s target, built on `device`."""
    import torch

    from deepspec.config import load_config
    from deepspec.drafts.registry import get_algorithm
    from deepspec.targets.tiny import tiny_config

    algorithm, extra = VARIANTS[variant]
    target, _, opts = SHAPES[shape]
    cfg = load_config(str(tree / "config" / algorithm / "qwen3-8b.yaml"), list(opts[algorithm]) + extra)
    tconf = tiny_config("qwen3", **target)
    torch.manual_seed(0)
    with torch.device(device):
        draft = get_algorithm(algorithm).from_target_config(tconf, cfg.model)
    v, h = tconf.vocab_size, tconf.hidden_size
    if device == "meta":
        embed = head = torch.empty(v, h, device="meta")
        counts = torch.empty(v, device="meta")
    else:
        g = torch.Generator().manual_seed(1)
        embed, head = torch.randn(v, h, generator=g) * 0.02, torch.randn(v, h, generator=g) * 0.02
        counts = torch.bincount(torch.randint(0, v, (20 * v,), generator=g), minlength=v)
    draft.load_target_weights(embed, head)
    draft.set_token_frequencies(counts)
    draft.train()
    draft.train_metrics = False
    return draft, cfg, tconf


class _Regions:
    """Counts the forward's aten ops made inside the methods deepspec/train/compile.py compiles (where that module
    exists): the eager ops a regional compile would replace with generated kernels."""

    def __init__(self, methods: list[tuple[type, str]]):
        self.methods, self.active, self.ops, self._depth, self._counter, self._saved = methods, bool(methods), 0, 0, None, []
        self._forward = True

    @contextlib.contextmanager
    def watch(self, counter):
        self._counter, self.ops, self._forward = counter, 0, True
        for cls, name in self.methods:
            fn = cls.__dict__[name]
            self._saved.append((cls, name, fn))
            setattr(cls, name, self._wrap(fn))
        try:
            yield self
        finally:
            for cls, name, fn in self._saved:
                setattr(cls, name, fn)
            self._saved = []

    def _wrap(self, fn):
        def wrapped(*a, **k):
            start = self._counter.ops
            self._depth += 1
            try:
                return fn(*a, **k)
            finally:
                self._depth -= 1
                if self._depth == 0 and self._forward:
                    self.ops += self._counter.ops - start
        return wrapped

    def forward_only_done(self):
        self._forward = False


def _region_tracker() -> _Regions:
    try:
        from deepspec.train.compile import _regions
    except ImportError:
        return _Regions([])
    return _Regions([(cls, name) for cls, methods in _regions().items() for name in methods])


def _collate():
    """collate_features from whichever tree is measured (deepspec/data/batches.py; deepspec/train/batches.py before)."""
    try:
        from deepspec.data.batches import collate_features
    except ImportError:
        from deepspec.train.batches import collate_features
    return collate_features


def measure_algorithm(tree: Path, variant: str, shape: str, steps: int) -> dict:
    """Ops, reads and attention shapes of `steps` micro-batches (fresh anchors each) of one algorithm in this process."""
    import torch

    import deepspec.drafts.layers as layers
    collate_features = _collate()

    OpCounter, HostReads = make_modes()
    target = SHAPES[shape][0]
    scale = target["hidden_size"] / FULL_HIDDEN
    chunk0 = getattr(layers, "_NORM_CHUNK", None)
    if chunk0 is not None:  # norms slice as they would at full width (see the module docstring)
        layers._NORM_CHUNK = max(1, int(chunk0 * scale))
    try:
        draft, cfg, tconf = _build(tree, variant, shape)
        regions = _region_tracker()
        seq = SHAPES[shape][1]
        batch = collate_features([_sample(seq, len(cfg.model.target_layer_ids), tconf.hidden_size, tconf.vocab_size, 7)])
        has_plan = hasattr(draft, "plan_batch") and "plan" in getattr(type(batch), "__dataclass_fields__", {})
        torch.manual_seed(1234)  # the baseline's loss draws its anchors from torch's generator: fresh per step
        seen: set = set()
        per_step = []
        for step in range(steps):
            if has_plan:  # the loader's plan, made outside the counted region
                batch.plan = draft.plan_batch(batch, key=10_007 * (step + 1), buckets=True)
            ops = OpCounter()
            reads = HostReads(ops)
            t0 = time.perf_counter()
            with reads, ops, regions.watch(ops):
                loss, _ = draft.loss(batch)
                backward_at = ops.ops
                regions.forward_only_done()
                loss.backward()
            wall = time.perf_counter() - t0
            draft.zero_grad(set_to_none=True)
            shapes = [k for k, _ in reads.attention]
            first: dict = {}
            for k, i in reads.attention:
                first.setdefault(k, i)
            new = {k for k in shapes if k not in seen}
            seen |= set(shapes)
            per_step.append({
                "aten_ops": ops.ops, "launches": ops.launches, "host_reads": len(reads.reads),
                "read_kinds": dict(Counter(k for k, _ in reads.reads)), "dispatch_reads": ops.dispatch_reads,
                "read_op_index": [i for _, i in reads.reads], "backward_op_index": backward_at,
                "attention_calls": len(shapes), "distinct_attention_shapes": len(set(shapes)), "new_attention_shapes": len(new),
                "new_attention_op_index": sorted(first[k] for k in new),
                "top_ops": ops.by_name.most_common(12), "top_launch_ops": ops.launch_by_name.most_common(12), "cpu_s": round(wall, 2),
                "attention_shapes": [[list(k[0]), list(k[1]), k[3] and list(k[3]), k[4], n] for k, n in Counter(shapes).most_common()],
                "forward_aten_ops": backward_at, "forward_ops_in_compile_regions": regions.ops if regions.active else None,
            })
        steady = per_step[1:] or per_step

        def mean(key):
            return round(sum(s[key] for s in steady) / len(steady), 2)

        return {
            "variant": variant, "has_plan": has_plan, "steps": steps,
            "aten_ops_per_micro_batch": mean("aten_ops"), "launches_per_micro_batch": mean("launches"),
            "host_reads_in_step": mean("host_reads"), "dispatch_reads_in_step": mean("dispatch_reads"),
            "attention_calls_per_step": mean("attention_calls"), "new_attention_shapes_per_step": mean("new_attention_shapes"),
            "new_attention_shapes_by_step": [s["new_attention_shapes"] for s in per_step],
            "per_step": per_step, "norm_chunk": getattr(layers, "_NORM_CHUNK", None),
            "trainable_params_reduced": sum(p.numel() for p in draft.parameters() if p.requires_grad),
        }
    finally:
        if chunk0 is not None:
            layers._NORM_CHUNK = chunk0


# ops that launch nothing: views, metadata, no-op conversions (the profiler lists them as leaves too)
_NO_LAUNCH = {"view", "_unsafe_view", "t", "transpose", "unsqueeze", "squeeze", "slice", "select", "alias", "detach",
              "expand", "permute", "as_strided", "split", "split_with_sizes", "unbind", "reshape", "narrow", "empty",
              "empty_strided", "empty_like", "new_empty", "new_empty_strided", "resize_", "lift_fresh", "resolve_conj",
              "resolve_neg", "to", "promote_types", "result_type", "_has_compatible_shallow_copy_type", "item",
              "_local_scalar_dense", "set_", "contiguous", "flatten", "unflatten", "_reshape_alias", "view_as", "expand_as"}


def measure_profiled(tree: Path, variant: str, shape: str, compiled: bool) -> dict:
    """Kernel-launching work of one micro-batch as the CUDA path runs it, counted by torch.profiler on the CPU: leaf aten
    ops that launch a kernel (a composite op's launching children count instead of it) plus, compiled, the kernels
    Inductor generated (one event each with its kernel profiling on). This tree runs with the CUDA chunk budget and
    bucketed plans; `compiled` applies `train.compile` (deepspec.train.compile.compile_draft). Inductor's CPU kernels
    stand in for its CUDA ones: the fusion decisions are alike, the counts an estimate."""
    import torch
    import torch._inductor.config as inductor_config
    from torch.profiler import ProfilerActivity, profile

    import deepspec.drafts.attention as attention
    collate_features = _collate()

    inductor_config.cpp.enable_kernel_profile = True
    saved = getattr(attention, "_CHUNK_ELEMENTS", None)
    if hasattr(attention, "_CUDA_CHUNK_ELEMENTS"):
        attention._CHUNK_ELEMENTS = attention._CUDA_CHUNK_ELEMENTS
    try:
        draft, cfg, tconf = _build(tree, variant, shape)
        if compiled:
            from deepspec.train.compile import compile_draft

            compile_draft(draft, True, torch.device("cpu"))
        batch = collate_features([_sample(SHAPES[shape][1], len(cfg.model.target_layer_ids), tconf.hidden_size, tconf.vocab_size, 7)])
        has_plan = hasattr(draft, "plan_batch") and "plan" in getattr(type(batch), "__dataclass_fields__", {})
        torch.manual_seed(1234)

        def step(i: int) -> None:
            if has_plan:
                batch.plan = draft.plan_batch(batch, key=10_007 * (i + 1), buckets=True)
            loss, _ = draft.loss(batch)
            loss.backward()
            draft.zero_grad(set_to_none=True)

        t0 = time.perf_counter()
        for i in range(2):  # compiles (and recompiles for the second length-independent call, if any)
            step(i)
        warm = time.perf_counter() - t0
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step(2)
        kinds: Counter = Counter()
        for e in prof.events():
            if e.name.startswith("aten::"):
                op = e.name[6:]
                if op in _NO_LAUNCH or any((c.name.startswith("aten::") and c.name[6:] not in _NO_LAUNCH) or "cpp_fused" in c.name
                                           for c in e.cpu_children):
                    continue
                kinds[op] += 1
            elif "cpp_fused" in e.name:
                kinds["<inductor kernel>"] += 1
        return {"launches": sum(kinds.values()), "compiled": compiled, "top": kinds.most_common(12), "warm_s": round(warm, 1)}
    finally:
        if saved is not None:
            attention._CHUNK_ELEMENTS = saved


def meta_flops(tree: Path, variant: str, buckets: bool, metrics: bool = False) -> dict:
    """This tree only: FLOPs, aten ops and the optimizer's parameter split of one micro-batch at the full Qwen3-8B
    shape on the meta device (the plan made on the CPU first). metrics: a logged step's (the block drafts of b3a919e
    computed their metric terms, the target head's product included, on every step)."""
    import torch

    from deepspec.drafts.base import DraftBatch
    collate_features = _collate()
    from deepspec.train.optim import split_muon_params

    OpCounter, HostReads = make_modes()
    draft, cfg, tconf = _build(tree, variant, "full", device="meta")
    draft.train_metrics = metrics
    seq = SHAPES["full"][1]
    s = _sample(seq, len(cfg.model.target_layer_ids), tconf.hidden_size, tconf.vocab_size, 7, device="meta")
    small = dict(s, taps=torch.zeros(seq, 1, 1), final_hidden=torch.zeros(seq, 1))
    cpu = collate_features([small])
    plan = draft.plan_batch(cpu, key=10_007, buckets=buckets)
    batch = DraftBatch(input_ids=cpu.input_ids, loss_mask=cpu.loss_mask, attention_mask=cpu.attention_mask,
                       taps=s["taps"].unsqueeze(0), final_hidden=s["final_hidden"].unsqueeze(0), plan=plan).to("meta")
    ops = OpCounter()
    reads = HostReads(ops, meta_sdpa=True)
    with reads, ops:  # autocast questions on meta are answered by deepspec/drafts/amp.py
        loss, _ = draft.loss(batch)
        loss.backward()
    muon, adam = split_muon_params(draft)
    return {
        "flops": ops.flops + reads.attention_flops, "matmul_flops": ops.flops, "attention_flops": reads.attention_flops,
        "tokens": seq, "aten_ops": ops.ops, "launches": ops.launches, "attention_calls": len(reads.attention),
        "muon_params": sum(p.numel() for _, p in muon), "adamw_params": sum(p.numel() for _, p in adam),
        "trainable_params": sum(p.numel() for p in draft.parameters() if p.requires_grad), "optimizer": cfg.train.optimizer,
    }


def emit_rows(tree: Path, shape: str, steps: int, algorithms: list[str], flops: bool, profiled: bool = False) -> dict:
    import torch

    import deepspec

    torch.set_num_threads(1)
    out = {"tree": str(tree), "deepspec_from": str(Path(deepspec.__file__).resolve()), "torch": torch.__version__, "rows": {}}
    if not str(Path(deepspec.__file__).resolve()).startswith(str(tree.resolve())):
        raise RuntimeError(f"deepspec imported from {deepspec.__file__}, not from {tree}: check PYTHONPATH")
    for variant in algorithms:
        row = measure_algorithm(tree, variant, shape, steps)
        if profiled and variant in ALGORITHMS:
            row["profiled_eager"] = measure_profiled(tree, variant, shape, compiled=False)
            if flops:  # this tree: its CUDA path compiles the layers (train.compile: auto)
                row["profiled_compiled"] = measure_profiled(tree, variant, shape, compiled=True)
        if flops:
            row["meta_exact"] = meta_flops(tree, variant, buckets=False)
            row["meta_bucketed"] = meta_flops(tree, variant, buckets=True)
            # what b3a919e executed: its block drafts ran the metric terms on every step (EAGLE-3 skipped them unlogged)
            row["meta_baseline"] = meta_flops(tree, variant, buckets=False, metrics=variant not in ("eagle3", "eagle3_gpu_row"))
        out["rows"][variant] = row
    return out


# --- the cost model ---------------------------------------------------------------------------------------------
class CostModel:
    """Predicted H200 time of one micro-batch (one 4,096-token Qwen3-8B-shaped sample), host and GPU overlapping.

    step = sum over the segments that host reads cut the step into of max(host_i, gpu_i) + reads x DRAIN_S
           + optimizer GPU time / micro-batches per optimizer step
    host = aten ops x c_op + new cuDNN-planned attention shapes x (PLAN_FWD_S + PLAN_BWD_S)  (this tree: no cuDNN)
    gpu  = FLOPs / (efficiency x PEAK)

    Segments: host and GPU work of a segment in proportion to its share of the step's aten ops (the reads' op
    indices are measured); forward planning where its call is, backward planning in the backward's segment.
    All figures from benchmarks/results/2026-11-27-h200/ (profile_dflash_qwen3-8b_4096.txt: 4 training steps of one
    sample each, then the final checkpoint save, all under torch.profiler; README.md; rows.jsonl)."""

    PEAK = 989.4e12  # H200 dense bf16 FLOP/s (benchmarks/bench_train.py PEAK_FLOPS, the MFU of rows.jsonl)
    PROFILED_STEPS = 4
    # DFlash profile, "Self CPU time total: 10.220s"
    HOST_TOTAL_S = 10.220
    # minus the final save: cudaMemcpyAsync self CPU 5.598 s (the save's pageable DtoH copies) and cudaHostAlloc 0.274 s
    SAVE_HOST_S = 5.598 + 0.274
    # minus cuDNN planning: aten::_cudnn_attention_forward 1.251 s and _cudnn_attention_backward 1.649 s self CPU, 125 calls each
    CUDNN_FWD_S, CUDNN_BWD_S, CUDNN_CALLS = 1.251, 1.649, 125
    # minus waits on the GPU: cudaStreamSynchronize 204.297 ms self CPU (168 calls) and Command Buffer Full 108.358 ms
    WAIT_HOST_S = 0.204297 + 0.108358
    # minus the optimizer's own host time: Optimizer.step#Muon.step CPU total 284.446 ms (4 calls); modelled on the GPU
    OPT_HOST_S = 0.284446
    # a read's drain: cudaStreamSynchronize 204.297 ms / 168 calls, the mean wait at a read in the profiled steps
    DRAIN_S = 0.204297 / 168
    # GPU busy: "Self CUDA time total: 6.634s" minus the save's "Memcpy DtoH (Device -> Pageable)" 5.382 s minus
    # Optimizer.step#Muon.step 714.068 ms and Optimizer.step#AdamW.step 54.715 ms (GPU rows), over 4 steps
    GPU_FWD_BWD_S = (6.634 - 5.382 - 0.714068 - 0.054715) / 4
    # optimizer GPU time per step: Muon 714.068 ms / 4 = 178.5 ms, AdamW 54.715 ms / 4 = 13.68 ms (DFlash profile)
    MUON_STEP_S = 0.714068 / 4
    ADAMW_STEP_S = 0.054715 / 4
    # AdamW's per-parameter term: the DFlash profile's AdamW holds only the norms (~50K parameters), so its 13.7 ms is a
    # per-step floor (launches, latency) and gives no per-parameter rate. The rate is the memory bound instead: a
    # foreach AdamW step reads param, grad, exp_avg, exp_avg_sq and writes three of them in fp32 (28 B/parameter) at
    # the H200's 4.8 TB/s HBM3e (a datasheet figure, not a profile one).
    ADAMW_BYTES_PER_PARAM = 28
    HBM_BYTES_PER_S = 4.8e12
    # measured tokens/s (rows.jsonl, b3a919e): DFlash 3,542.5 and 4,001.3 (profiled run); EAGLE-3 16,885.0 (profiled)
    MEASURED = {"dflash": (3542.5, 4001.3), "eagle3": (16885.0, 16885.0)}
    # EAGLE-3 profile (not used for calibration): Optimizer.step#AdamW.step 161.593 ms GPU / 4 steps
    EAGLE3_ADAMW_PROFILED_S = 0.161593 / 4

    def __init__(self, dflash_base: dict, dflash_flops_exact: float, dflash_muon: int, dflash_adamw: int, per_call: bool = False):
        steps = self.PROFILED_STEPS
        self.per_call = per_call
        # new cuDNN shapes in the profile's 4 steps: the first step's (all new) and the later steps', as measured
        new_in_profile = sum(dflash_base["new_attention_shapes_by_step"][:steps])
        if len(dflash_base["new_attention_shapes_by_step"]) < steps:
            new_in_profile = dflash_base["new_attention_shapes_by_step"][0] + (steps - 1) * dflash_base["new_attention_shapes_per_step"]
        if per_call:  # the sensitivity check: every cuDNN call plans (125 calls each way in the profile)
            new_in_profile = self.CUDNN_CALLS
        self.plan_fwd_s = self.CUDNN_FWD_S / new_in_profile
        self.plan_bwd_s = self.CUDNN_BWD_S / new_in_profile
        host = self.HOST_TOTAL_S - self.SAVE_HOST_S - self.CUDNN_FWD_S - self.CUDNN_BWD_S - self.WAIT_HOST_S - self.OPT_HOST_S
        self.host_per_step_s = host / steps
        self.c_op = self.host_per_step_s / dflash_base["aten_ops_per_micro_batch"]
        self.efficiency = dflash_flops_exact / (self.GPU_FWD_BWD_S * self.PEAK)
        self.muon_per_param_s = self.MUON_STEP_S / dflash_muon
        self.adamw_fixed_s = self.ADAMW_STEP_S
        self.adamw_per_param_s = self.ADAMW_BYTES_PER_PARAM / self.HBM_BYTES_PER_S
        self.inputs = {"dflash_baseline_aten_ops": dflash_base["aten_ops_per_micro_batch"], "new_cudnn_shapes_in_profile": new_in_profile,
                       "dflash_flops_exact": dflash_flops_exact, "dflash_muon_params": dflash_muon, "dflash_adamw_params": dflash_adamw}

    def constants(self) -> dict:
        return {
            "c_op_us": round(self.c_op * 1e6, 2), "host_per_profiled_step_s": round(self.host_per_step_s, 4),
            "plan_fwd_ms": round(self.plan_fwd_s * 1e3, 2), "plan_bwd_ms": round(self.plan_bwd_s * 1e3, 2),
            "drain_ms": round(self.DRAIN_S * 1e3, 3), "gpu_fwd_bwd_per_step_s": round(self.GPU_FWD_BWD_S, 4),
            "gpu_efficiency": round(self.efficiency, 4), "peak_flops": self.PEAK,
            "muon_ns_per_param": round(self.muon_per_param_s * 1e9, 4), "adamw_fixed_ms": round(self.adamw_fixed_s * 1e3, 2),
            "adamw_ns_per_param": round(self.adamw_per_param_s * 1e9, 5), "inputs": self.inputs,
        }

    def optimizer_s(self, meta: dict) -> float:
        if meta["optimizer"] == "muon":
            return self.muon_per_param_s * meta["muon_params"] + self.adamw_fixed_s + self.adamw_per_param_s * meta["adamw_params"]
        return self.adamw_fixed_s + self.adamw_per_param_s * meta["trainable_params"]

    def micro_batch(self, row: dict, flops: float, cudnn: bool) -> dict:
        """Host, GPU and overlapped time of one micro-batch's forward + backward (no optimizer)."""
        steady = row["per_step"][1:] or row["per_step"]
        s = steady[-1]  # the segment layout of one measured steady step, scaled to the step means
        n_ops = row["aten_ops_per_micro_batch"]
        gpu = flops / (self.efficiency * self.PEAK)
        new = (row["attention_calls_per_step"] if self.per_call else row["new_attention_shapes_per_step"]) if cudnn else 0.0
        host = n_ops * self.c_op + new * (self.plan_fwd_s + self.plan_bwd_s)
        cuts = sorted(i / s["aten_ops"] for i in s["read_op_index"])
        bounds = [0.0] + cuts + [1.0]
        back = s["backward_op_index"] / s["aten_ops"]
        fwd_new = [i / s["aten_ops"] for i in s["new_attention_op_index"]] or [0.0]
        total = 0.0
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            frac = hi - lo
            plans = 0.0
            if cudnn and new:
                n_fwd = sum(1 for x in fwd_new if lo <= x < hi) / len(fwd_new) * new
                plans = n_fwd * self.plan_fwd_s + (new * self.plan_bwd_s if lo <= back < hi or (hi == 1.0 and back >= hi) else 0.0)
            total += max(frac * n_ops * self.c_op + plans, frac * gpu)
        reads = row["host_reads_in_step"]
        total += reads * self.DRAIN_S
        return {"host_s": host, "gpu_s": gpu, "fwd_bwd_s": total, "host_bound": host > gpu}

    def predict(self, row: dict, flops_exec: float, flops_useful: float, meta: dict, cudnn: bool, tokens: int) -> dict:
        mb = self.micro_batch(row, flops_exec, cudnn)
        opt = self.optimizer_s(meta)
        out = {"host_s": round(mb["host_s"], 4), "gpu_fwd_bwd_s": round(mb["gpu_s"], 4), "optimizer_gpu_s": round(opt, 4),
               "host_bound": mb["host_bound"]}
        for accum in (1, 16):
            t = mb["fwd_bwd_s"] + opt / accum
            out[f"accum{accum}"] = {"step_s": round(t, 4), "tokens_per_s": round(tokens / t, 1),
                                    "mfu": round(flops_useful / (t * self.PEAK), 4)}
        return out


# --- the parent ---------------------------------------------------------------------------------------------------
def ensure_worktree(path: Path) -> bool:
    if (path / "deepspec" / "__init__.py").is_file():
        return True
    r = subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), BASELINE_COMMIT],
                       capture_output=True, text=True)
    return r.returncode == 0 and (path / "deepspec" / "__init__.py").is_file()


def run_tree(tree: Path, shape: str, steps: int, algorithms: list[str], flops: bool, timeout: float, profiled: bool = False) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--emit-row", "--tree", str(tree), "--shape", shape,
           "--steps", str(steps), "--algorithms", *algorithms] + (["--flops"] if flops else []) + (["--profiled"] if profiled else [])
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=str(tree))
    if r.returncode != 0:
        raise RuntimeError(f"measurement in {tree} failed (exit {r.returncode}): {r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None


def build_report(ours: dict, base: dict | None, shape: str, steps: int) -> dict:
    tokens = SHAPES["full"][1]
    rows = {}
    model = None
    check = None
    d_ours = ours["rows"].get("dflash")
    if base is not None and d_ours is not None and "dflash" in base["rows"]:
        m = d_ours["meta_baseline"]
        model = CostModel(base["rows"]["dflash"], m["flops"], m["muon_params"], m["adamw_params"])
        check = {}
        for algo, variant in (("dflash", "dflash"), ("eagle3", "eagle3_gpu_row")):
            if variant not in base["rows"] or variant not in ours["rows"]:
                continue
            meta = ours["rows"][variant]["meta_baseline"]
            full = model.predict(base["rows"][variant], meta["flops"], meta["flops"], meta, True, tokens)
            pred = full["accum1"]["tokens_per_s"]
            lo, hi = CostModel.MEASURED[algo]
            ratios = [round(pred / lo, 3), round(pred / hi, 3)]
            check[algo] = {"predicted_tokens_per_s": pred, "measured_tokens_per_s": [lo, hi] if lo != hi else lo,
                           "ratio_predicted_over_measured": ratios if lo != hi else ratios[0],
                           "within_1.5x": all(1 / 1.5 <= r <= 1.5 for r in ratios),
                           "sample": "in-sample (calibrated on its profile)" if algo == "dflash" else "out-of-sample",
                           "measured_as": variant, "prediction": full, "baseline_aten_ops": base["rows"][variant]["aten_ops_per_micro_batch"],
                           "flops_per_token": round(meta["flops"] / meta["tokens"]), "trainable_params": meta["trainable_params"]}
        # the alternative reading of the profile: cuDNN planning every call rather than every new shape (125 calls
        # each way in 4 steps: 10.0 / 13.2 ms a call); the measured EAGLE-3 row tells the two apart
        per_call = CostModel(base["rows"]["dflash"], m["flops"], m["muon_params"], m["adamw_params"], per_call=True)
        check["if_cudnn_planned_every_call"] = {}
        for algo, variant in (("dflash", "dflash"), ("eagle3", "eagle3_gpu_row")):
            if variant in base["rows"] and variant in ours["rows"]:
                meta = ours["rows"][variant]["meta_baseline"]
                pred = per_call.predict(base["rows"][variant], meta["flops"], meta["flops"], meta, True, tokens)["accum1"]["tokens_per_s"]
                lo, hi = CostModel.MEASURED[algo]
                check["if_cudnn_planned_every_call"][algo] = {"predicted_tokens_per_s": pred, "ratio": [round(pred / lo, 3), round(pred / hi, 3)]}
        if "eagle3_gpu_row" in ours["rows"]:
            check["eagle3_adamw_predicted_vs_profiled_ms"] = [round(model.optimizer_s(ours["rows"]["eagle3_gpu_row"]["meta_exact"]) * 1e3, 2),
                                                              round(CostModel.EAGLE3_ADAMW_PROFILED_S * 1e3, 2)]
        check["passed"] = all(check[a]["within_1.5x"] for a in ("dflash", "eagle3") if a in check)
    for algo, r in ours["rows"].items():
        if algo not in ALGORITHMS:
            continue
        b = base["rows"].get(algo) if base is not None else None
        row = {
            "launches_per_micro_batch": r["launches_per_micro_batch"],
            "baseline_launches_per_micro_batch": b["launches_per_micro_batch"] if b else None,
            "launch_ratio_baseline_over_this": _ratio(b["launches_per_micro_batch"], r["launches_per_micro_batch"]) if b else None,
            "aten_ops_per_micro_batch": r["aten_ops_per_micro_batch"],
            "baseline_aten_ops_per_micro_batch": b["aten_ops_per_micro_batch"] if b else None,
            "host_reads_in_step": r["host_reads_in_step"], "baseline_host_reads_in_step": b["host_reads_in_step"] if b else None,
            "dispatch_reads_in_step": r["dispatch_reads_in_step"], "baseline_dispatch_reads_in_step": b["dispatch_reads_in_step"] if b else None,
            "baseline_read_kinds": b["per_step"][-1]["read_kinds"] if b else None,
            "attention_calls_per_step": r["attention_calls_per_step"], "baseline_attention_calls_per_step": b["attention_calls_per_step"] if b else None,
            "new_attention_shapes_per_step": r["new_attention_shapes_per_step"],
            "baseline_new_attention_shapes_per_step": b["new_attention_shapes_per_step"] if b else None,
            "new_attention_shapes_by_step": r["new_attention_shapes_by_step"],
            "baseline_new_attention_shapes_by_step": b["new_attention_shapes_by_step"] if b else None,
            "top_ops": r["per_step"][-1]["top_ops"][:10], "baseline_top_ops": b["per_step"][-1]["top_ops"][:10] if b else None,
            "top_launch_ops": r["per_step"][-1]["top_launch_ops"][:10],
            "baseline_top_launch_ops": b["per_step"][-1]["top_launch_ops"][:10] if b else None,
            "attention_shapes_last_step": r["per_step"][-1]["attention_shapes"],
            "baseline_attention_shapes_last_step": b["per_step"][-1]["attention_shapes"] if b else None,
            "cpu_s_per_step": r["per_step"][-1]["cpu_s"], "baseline_cpu_s_per_step": b["per_step"][-1]["cpu_s"] if b else None,
            "forward_aten_ops": r["per_step"][-1]["forward_aten_ops"],
            "forward_ops_in_compile_regions": r["per_step"][-1]["forward_ops_in_compile_regions"],
        }
        if "profiled_compiled" in r:  # the CUDA path: compiled layers, CUDA chunk budget, bucketed plans
            row["cuda_path_launches_per_micro_batch"] = r["profiled_compiled"]["launches"]
            row["cuda_path_eager_launches_per_micro_batch"] = r["profiled_eager"]["launches"]
            row["cuda_path_top_launch_ops"] = r["profiled_compiled"]["top"]
            if b and "profiled_eager" in b:
                row["baseline_cuda_path_launches_per_micro_batch"] = b["profiled_eager"]["launches"]
                row["cuda_path_launch_ratio_baseline_over_this"] = _ratio(b["profiled_eager"]["launches"], r["profiled_compiled"]["launches"])
        if "meta_exact" in r:
            me, mb = r["meta_exact"], r["meta_bucketed"]
            row.update({
                "flops_per_token_exact": round(me["flops"] / me["tokens"]), "flops_per_token_bucketed": round(mb["flops"] / mb["tokens"]),
                "attention_flops_share_exact": round(me["attention_flops"] / me["flops"], 4),
                "meta_full_shape_aten_ops": mb["aten_ops"], "meta_full_shape_launches": mb["launches"],
                "meta_full_shape_attention_calls": mb["attention_calls"],
                "trainable_params_full": me["trainable_params"], "muon_params_full": me["muon_params"] if me["optimizer"] == "muon" else 0,
                "adamw_params_full": me["adamw_params"] if me["optimizer"] == "muon" else me["trainable_params"], "optimizer": me["optimizer"],
            })
            if model is not None:
                row["predicted_h200"] = model.predict(r, mb["flops"], me["flops"], me, False, tokens)
                if "profiled_compiled" in r:
                    # the CUDA path compiles the layers: host work scaled by its launching ops, compiled over eager
                    # (an estimate: a compiled region's own call overhead is taken as one op's)
                    scale = r["profiled_compiled"]["launches"] / r["profiled_eager"]["launches"]
                    row["predicted_h200_compiled"] = model.predict(dict(r, aten_ops_per_micro_batch=r["aten_ops_per_micro_batch"] * scale),
                                                                   mb["flops"], me["flops"], me, False, tokens)
                    row["compiled_host_scale"] = round(scale, 3)
                if b:
                    mbase = r["meta_baseline"]
                    row["baseline_predicted_h200"] = model.predict(b, mbase["flops"], mbase["flops"], mbase, True, tokens)
                    row["baseline_flops_per_token"] = round(mbase["flops"] / mbase["tokens"])
        rows[algo] = row
    return {
        "benchmark": "launches", "date": time.strftime("%Y-%m-%d"), "shape": shape, "steps": steps,
        "baseline": BASELINE_COMMIT if base is not None else None,
        "setup": {"measured": f"{shape} width ({SHAPES[shape][0]['hidden_size']} hidden, {SHAPES[shape][0]['num_attention_heads']}/"
                              f"{SHAPES[shape][0]['num_key_value_heads']} heads), {SHAPES[shape][1]} tokens, 1 sample per micro-batch, "
                              "fp32 on CPU, train mode, unlogged step (train_metrics False), torch.set_num_threads(1)",
                  "flops": "full Qwen3-8B shape on meta, this tree's code, 4,096 tokens",
                  "torch": ours["torch"], "this_tree": ours["tree"], "baseline_tree": base["tree"] if base else None},
        "rows": rows, "calibration": model.constants() if model else None, "calibration_check": check,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, a few seconds")
    ap.add_argument("--steps", type=int, default=None, help="micro-batches per algorithm (first = warm-up; default 4, smoke 3)")
    ap.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=list(VARIANTS))
    ap.add_argument("--baseline-tree", type=Path, default=Path("/tmp/deepspec-b3a919e"))
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--timeout", type=float, default=3000)
    # child mode: measure the deepspec on PYTHONPATH
    ap.add_argument("--emit-row", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tree", type=Path, default=REPO, help=argparse.SUPPRESS)
    ap.add_argument("--shape", default=None, choices=list(SHAPES), help=argparse.SUPPRESS)
    ap.add_argument("--flops", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--profiled", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--no-compiled", action="store_true", help="skip the profiled (compiled) count of the CUDA path (minutes of CPU compile)")
    args = ap.parse_args()
    shape = args.shape or ("smoke" if args.smoke else "reduced")
    steps = args.steps or (3 if args.smoke else 4)
    if args.emit_row:
        print(json.dumps(emit_rows(args.tree, shape, steps, args.algorithms, args.flops, args.profiled)))
        return 0
    checks = self_check()
    t0 = time.perf_counter()
    variants = list(dict.fromkeys(args.algorithms + (["eagle3_gpu_row"] if "eagle3" in args.algorithms else [])))
    profiled = not (args.smoke or args.no_compiled)
    ours = run_tree(REPO, shape, steps, variants, True, args.timeout, profiled)
    base = None
    baseline_note = None
    if not args.no_baseline:
        if ensure_worktree(args.baseline_tree):
            base = run_tree(args.baseline_tree, shape, steps, variants, False, args.timeout, profiled)
        else:
            baseline_note = f"no worktree of {BASELINE_COMMIT} at {args.baseline_tree}: this tree only"
    report = build_report(ours, base, shape, steps)
    report["self_check"] = checks
    report["self_check_passed"] = all(checks.values())
    if baseline_note:
        report["baseline_note"] = baseline_note
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    from deepspec.exiting import exit_process  # no final collection of the heap a measurement left

    exit_process(main())
