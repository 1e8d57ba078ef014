"""Every attention call of one training step of each draft (EAGLE-3, DFlash, DSpark; padded, packed, sliding-window)
is one that PyTorch's CUDA SDPA dispatcher hands to the flash or the memory-efficient kernel, never the fp32 math
kernel that keeps every score for the backward.

The step runs on CPU under bf16 autocast (the dtypes a GPU run has); a wrapper around
torch.nn.functional.scaled_dot_product_attention records each call (forward, and the recomputation of activation
checkpointing) and the rules below, transcribed from aten/src/ATen/native/transformers/cuda/sdp_utils.cpp,
sdp_utils_cpp.h and attention.cpp (`can_use_flash_attention`, `can_use_mem_efficient_attention`,
`preprocess_mask`), judge it. On a machine with CUDA the same step also asks torch's own
torch.backends.cuda.can_use_flash_attention / can_use_efficient_attention about every call.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

import deepspec.drafts.attention as attention
from deepspec.config.model import ModelConfig
from deepspec.drafts import get_algorithm
from deepspec.drafts.checkpoint import target_weights
from deepspec.targets import capture, tiny_target
from deepspec.data.batches import collate_features, pack_batch


# --- PyTorch's CUDA rules ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype  # as the kernel sees it: after autocast's cast
    requires_grad: bool

    @classmethod
    def of(cls, t: torch.Tensor, autocast: torch.dtype | None) -> TensorInfo:
        # autocast's lower_precision_fp list holds scaled_dot_product_attention (CUDA and CPU): every floating
        # argument but fp64, the mask included, is cast to the autocast dtype
        dtype = autocast if autocast is not None and t.is_floating_point() and t.dtype != torch.float64 else t.dtype
        return cls(tuple(t.shape), tuple(t.stride()), t.storage_offset(), dtype, t.requires_grad)


@dataclass(frozen=True)
class Call:
    q: TensorInfo
    k: TensorInfo
    v: TensorInfo
    mask: TensorInfo | None
    is_causal: bool
    enable_gqa: bool
    dropout_p: float


def _common(c: Call) -> list[str]:
    """Dense-input constraints both fused kernels share (check_tensor_shapes, check_nonzero_sequence_lengths_dense,
    check_batch_size_and_num_heads_dense's batch part, validate_sdpa_input)."""
    out = []
    if not (len(c.q.shape) == len(c.k.shape) == len(c.v.shape) == 4):
        return ["q, k, v must be 4-D"]
    if c.q.shape[2] == 0 or c.k.shape[2] == 0:
        out.append("zero sequence length")
    if not (c.q.shape[0] == c.k.shape[0] == c.v.shape[0]):
        out.append("q, k, v batch sizes differ")
    if c.mask is not None and c.is_causal:
        out.append("attn_mask together with is_causal")
    if c.dropout_p != 0.0:
        out.append("dropout (training drafts use none)")
    return out


def _heads(c: Call, supports_gqa: bool) -> list[str]:
    hq, hk, hv = c.q.shape[1], c.k.shape[1], c.v.shape[1]
    if hq == hk == hv:
        return []
    if c.enable_gqa and supports_gqa and hk == hv and hq % hk == 0:
        return []
    return [f"head counts q={hq} k={hk} v={hv} need {'enable_gqa' if supports_gqa else 'equal heads (no GQA)'}"]


def flash_refusals(c: Call) -> list[str]:
    """Why `can_use_flash_attention` (sm80+) would refuse the call; [] = flash runs it."""
    out = _common(c)
    if c.mask is not None:
        out.append("flash takes no attn_mask")
    dq, dk, dv = c.q.shape[-1], c.k.shape[-1], c.v.shape[-1]
    if not (dq == dk == dv and dq <= 256):
        out.append(f"flash needs equal head dims <= 256 (q={dq} k={dk} v={dv})")
    if dq % 8:
        # accepted by the dispatcher, but the composite pads q/k/v to a multiple of 8 (a copy per call): refused here
        out.append(f"head dim {dq} not a multiple of 8")
    if c.is_causal and c.q.shape[2] != c.k.shape[2]:
        out.append("flash is_causal needs seqlen_q == seqlen_k")
    if not (c.q.dtype == c.k.dtype == c.v.dtype and c.q.dtype in (torch.float16, torch.bfloat16)):
        out.append(f"flash needs fp16/bf16 q/k/v, got {c.q.dtype}/{c.k.dtype}/{c.v.dtype}")
    if any(t.stride[-1] != 1 and t.shape[-1] != 1 for t in (c.q, c.k, c.v)):
        out.append("last dim stride != 1")
    return out + _heads(c, supports_gqa=True)


def mem_efficient_refusals(c: Call) -> list[str]:
    """Why `can_use_mem_efficient_attention` (sm80+, CUTLASS) would refuse the call; [] = it runs it."""
    out = _common(c)
    dq, dk, dv = c.q.shape[-1], c.k.shape[-1], c.v.shape[-1]
    half = c.q.dtype in (torch.float16, torch.bfloat16)
    align = 8 if half else 4  # minimum_gemm_alignment on sm80+
    if not (dq == dk and dq % align == 0 and dv % align == 0):
        out.append(f"mem-efficient needs q/k head dims equal and q/v head dims multiples of {align} (q={dq} k={dk} v={dv})")
    if not (c.q.dtype == c.k.dtype == c.v.dtype and c.q.dtype in (torch.float16, torch.bfloat16, torch.float32)):
        out.append(f"mem-efficient needs one dtype of fp16/bf16/fp32, got {c.q.dtype}/{c.k.dtype}/{c.v.dtype}")
    # check_data_ptr_alignment_mem_efficient: storage offsets aligned to the GEMM alignment in bytes
    for name, t in (("q", c.q), ("k", c.k), ("v", c.v)):
        if (t.offset * t.dtype.itemsize) % (align * c.q.dtype.itemsize):
            out.append(f"{name} storage offset {t.offset} not aligned")
    # check_last_dim_stride_equals_1_dense<ignore_singleton_dim=false>: q, k, v and the mask
    if any(t.stride[-1] != 1 for t in (c.q, c.k, c.v)):
        out.append("last dim stride != 1")
    if c.mask is not None:
        m = c.mask
        if m.stride[-1] != 1:
            out.append("mask last dim stride != 1")
        if m.dtype not in (torch.bool, c.q.dtype):  # the CUTLASS kernel takes a bias in the query's dtype only
            out.append(f"mask dtype {m.dtype} is neither bool nor the query's {c.q.dtype}")
        if m.requires_grad:
            out.append("mask requires grad")
        target = (c.q.shape[0], c.q.shape[1], c.q.shape[2], c.k.shape[2])
        if len(m.shape) not in (2, 4) or any(s not in (1, t) for s, t in zip(m.shape[::-1], target[::-1])):
            out.append(f"mask {m.shape} does not broadcast to {target}")
        # preprocess_mask: a bias whose strides are not multiples of 8 is padded (a copy of the mask per call)
        if any(s % 8 for s in m.stride[:-1]):
            out.append(f"mask strides {m.stride} not multiples of 8 (padded per call)")
    # GQA entered the CUDA memory-efficient kernel only in 2026; on older torch enable_gqa sends it to math
    return out + _heads(c, supports_gqa=False)


def kernel(c: Call) -> str | None:
    """The fused kernel the CUDA dispatcher picks for c by these rules (flash first), or None (math)."""
    if not flash_refusals(c):
        return "flash"
    if not mem_efficient_refusals(c):
        return "mem_efficient"
    return None


# --- recording a training step ----------------------------------------------------------------------------------
class Recorder:
    """Wraps F.scaled_dot_product_attention (the module attribute every caller resolves at call time)."""

    def __init__(self, monkeypatch, on_call=None):
        self.calls: list[Call] = []
        original = F.scaled_dot_product_attention

        def wrapped(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
            dev = query.device.type
            ac = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
            self.calls.append(
                Call(TensorInfo.of(query, ac), TensorInfo.of(key, ac), TensorInfo.of(value, ac),
                     None if attn_mask is None else TensorInfo.of(attn_mask, ac), bool(is_causal), bool(enable_gqa), float(dropout_p))
            )
            if on_call is not None:
                on_call(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)

        monkeypatch.setattr(F, "scaled_dot_product_attention", wrapped)


SLIDING = {"num_draft_layers": 2, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 5}
LENGTHS = [23, 31, 12, 18]


def _setup(algorithm: str, layout: str, device: str = "cpu"):
    torch.manual_seed(0)
    model, _ = tiny_target("llama" if algorithm == "eagle3" else "qwen3")
    kw = dict(SLIDING) if layout == "sliding" else {"num_draft_layers": 2}
    cfg = ModelConfig(algorithm=algorithm, target_layer_ids=[0, 2, 4], ttt_length=4, block_size=4, num_anchors=3, markov_rank=8,
                      activation_checkpointing=layout == "padded", **kw)
    draft = get_algorithm(algorithm).from_target_config(model.config, cfg)
    draft.load_target_weights(*target_weights(model))
    g = torch.Generator().manual_seed(3)
    items = []
    for i, n in enumerate(LENGTHS):
        ids = torch.randint(0, 250, (1, n), generator=g)
        taps, final = capture(model, ids, draft.taps)
        lm = torch.ones(n, dtype=torch.bool)
        lm[: 2 + i] = False
        items.append({"input_ids": ids[0], "loss_mask": lm, "taps": taps[0], "final_hidden": final[0]})
    batch = collate_features(items)
    if layout == "packed":
        batch = pack_batch(batch, pack_tokens=48)
        assert batch.segment_ids is not None and batch.input_ids.shape[0] < len(items)
    return draft.to(device).train(), batch.to(device)


def _train_step(draft, batch, device: str = "cpu") -> None:
    with torch.autocast(device, dtype=torch.bfloat16):
        loss, _ = draft.loss(batch)
    loss.backward()


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunk and sentinel spacing small enough that the tiny step takes every path: several chunks per call, key
    ranges that start inside the key tensor (storage offsets), interior sentinel slots."""
    monkeypatch.setattr(attention, "_SPAN", 8)
    monkeypatch.setattr(attention, "_WINDOW_CHUNK", 8)
    monkeypatch.setattr(attention, "_CHUNK_ELEMENTS", 1200)


@pytest.mark.parametrize("layout", ["padded", "packed", "sliding"])
@pytest.mark.parametrize("algorithm", ["eagle3", "dflash", "dspark"])
def test_every_attention_call_of_a_training_step_is_flash_or_mem_efficient(algorithm, layout, monkeypatch, small_chunks):
    draft, batch = _setup(algorithm, layout)
    rec = Recorder(monkeypatch)
    _train_step(draft, batch)
    assert rec.calls, "the step made no SDPA call: the recorder missed the attention"
    refused = [(c, flash_refusals(c), mem_efficient_refusals(c)) for c in rec.calls if kernel(c) is None]
    assert not refused, f"{len(refused)} of {len(rec.calls)} calls would run the math kernel; first: {refused[0]}"
    kinds = {kernel(c) for c in rec.calls}
    assert all(c.q.dtype == torch.bfloat16 for c in rec.calls)
    if algorithm == "eagle3" and layout != "sliding":
        assert kinds == {"flash"}  # causal parts, one is_causal call per sample
    else:
        assert "mem_efficient" in kinds  # windowed and block-context chunks carry a mask
    if algorithm != "eagle3":
        assert all(c.mask is not None for c in rec.calls)


def test_the_rules_flag_the_former_sentinel_and_mask_pattern(monkeypatch):
    """What the block drafts called before (head dim d + 1 for the sentinel, a boolean mask) and other near misses are
    refused by both kernels: the rules can fail a call."""
    rec = Recorder(monkeypatch)
    b, h, hk, t, d = 1, 4, 2, 16, 16
    q, k, v = torch.randn(b, h, t, d + 1), torch.randn(b, hk, t + 1, d + 1), torch.randn(b, hk, t + 1, d + 1)
    mask = torch.ones(b, 1, t, t + 1, dtype=torch.bool).tril(1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)  # the former block-context call
        qd, kd = torch.randn(b, h, t, d), torch.randn(b, hk, t, d)
        F.scaled_dot_product_attention(qd, kd, kd, attn_mask=mask[..., :t], enable_gqa=True)  # GQA with a mask
        F.scaled_dot_product_attention(qd, kd, kd, attn_mask=torch.zeros(t, 3 * t)[:, ::3], enable_gqa=True)
    F.scaled_dot_product_attention(qd, qd, qd, is_causal=True)  # fp32 outside autocast: flash refuses
    old, gqa_mask, strided, fp32 = rec.calls
    assert kernel(old) is None
    assert any("attn_mask" in r for r in flash_refusals(old)) and any("multiples of 8" in r for r in mem_efficient_refusals(old))
    assert kernel(gqa_mask) is None and any("no GQA" in r for r in mem_efficient_refusals(gqa_mask))
    assert any("stride" in r for r in mem_efficient_refusals(strided))
    assert flash_refusals(fp32) and kernel(fp32) == "mem_efficient"  # fp32: only the memory-efficient kernel


def _chain_inputs(step: int, packed: bool, dtype=torch.float32, t: int = 41):
    torch.manual_seed(step)
    b, h, hk, d = 2, 6, 2, 16
    q = torch.randn(b, h, t, d, dtype=dtype, requires_grad=True)
    kv = [torch.randn(b, hk, t, d, dtype=dtype, requires_grad=True) for _ in range(2 + 2 * step)]
    diag = [(kv[2 + 2 * j], kv[3 + 2 * j]) for j in range(step)]
    seg = torch.tensor([[0] * 9 + [1] * 21 + [2] * 5 + [-1] * 6, [0] * 30 + [1] * 11]) if packed else None
    return q, kv[0], kv[1], diag, seg


def _block_inputs(dtype=torch.float32):
    torch.manual_seed(1)
    b, h, hk, d, a, k, s = 2, 4, 2, 16, 9, 4, 60
    q = torch.randn(b, h, a * k, d, dtype=dtype, requires_grad=True)
    kvs = [torch.randn(b, hk, n, d, dtype=dtype, requires_grad=True) for n in (a * k, a * k, s, s)]
    anchors = torch.tensor([[0, 3, 10, 20, 25, 33, 40, 51, 59], [1, 2, 5, 9, 28, 29, 30, 44, 0]])
    start = torch.tensor([[0, 0, 0, 15, 15, 15, 15, 45, 45], [0] * 9])  # row 0 packs three samples
    keep = torch.tensor([[True] * 8 + [False], [True] * 8 + [False]])
    valid = torch.ones(b, s, dtype=torch.bool)
    valid[1, 50:] = False
    return [q, *kvs], (anchors, start, keep, valid)


@pytest.mark.parametrize("window", [None, 4, 11])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("step", [0, 1, 3])
def test_chunked_chain_equals_the_dense_reference(step, packed, window, small_chunks):
    """With sentinel slots every 8 keys and chunks of 8 rows, values and gradients still equal the [T, (k+1)T] mask's."""
    q, k0, v0, diag, seg = _chain_inputs(step, packed)
    out = attention.chain_attention(q, k0, v0, diag, attention.sample_ranges(seg, 2, q.shape[2]), window)
    ref = attention.dense_chain_reference(q, k0, v0, diag, seg, window)
    real = (torch.ones(2, q.shape[2], dtype=torch.bool) if seg is None else seg >= 0)[:, None, :, None].float()
    torch.testing.assert_close(out * real, ref * real, rtol=1e-5, atol=1e-5)
    w = torch.randn_like(out) * real
    inputs = [q, k0, v0, *[x for kv in diag for x in kv]]
    for a, r in zip(torch.autograd.grad((out * w).sum(), inputs), torch.autograd.grad((ref * w).sum(), inputs)):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("window", [None, 3, 13])
def test_chunked_blocks_equal_the_dense_reference(window, recompute, small_chunks):
    """Several chunks, key ranges inside packed samples, a padded context tail, dropped blocks: exact in fp32, with the
    chunks' masks kept for backward or rebuilt in it."""
    tensors, meta = _block_inputs()
    plan = attention.BlockBounds.of(*meta[:3]).chunks(window, 4, 2, 2)
    assert len(plan) > 3 and (window is None or any(lo > 0 for _, _, lo, hi in plan if hi > lo))  # ranges start inside
    out = attention.block_attention(*tensors, *meta, window, recompute=recompute)
    ref = attention.dense_block_reference(*tensors, *meta, window)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    w = torch.randn_like(out)
    for a, r in zip(torch.autograd.grad((out * w).sum(), tensors), torch.autograd.grad((ref * w).sum(), tensors)):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5)


def test_recomputed_chunks_keep_no_query_alive_inside_a_checkpointed_layer(small_chunks):
    """Under the layer's checkpoint, recomputed chunks must not keep the layer's queries until backward (a chunk
    function that read `q` from block_attention's scope did, for every layer); gradients still equal the dense
    reference."""
    import gc
    import weakref

    from torch.utils.checkpoint import checkpoint

    tensors, meta = _block_inputs()
    alive = {}

    def layer(q0, *kv):
        q = q0 * 1.0  # made inside the layer, as its queries are
        alive["q"] = weakref.ref(q)
        return attention.block_attention(q, *kv, *meta, 3, recompute=True)

    out = checkpoint(layer, *tensors, use_reentrant=False)
    gc.collect()
    assert alive["q"]() is None, "the layer's queries outlived its checkpointed forward"
    ref = attention.dense_block_reference(*tensors, *meta, 3)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    w = torch.randn(out.shape)
    for a, r in zip(torch.autograd.grad((out * w).sum(), tensors), torch.autograd.grad((ref * w).sum(), tensors)):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["chain", "block"])
def test_bf16_error_is_a_bf16_kernels(kind):
    """In bf16 the merged output is as close to the exact (fp64) attention of the same bf16 inputs as a dense bf16
    kernel is: the merge adds one rounding of the small part's share, no bf16 log-sum-exp. (The former one-channel
    sentinel, measured on these cases: chain mean 1.75x / max 5.8x, blocks mean 1.78x / max 1.84x a dense kernel's error;
    this one: chain 1.22x / 1.83x, blocks 1.21x / 1.31x.)"""
    if kind == "chain":
        q, k0, v0, diag, _ = _chain_inputs(3, False, t=256)
        with torch.no_grad():
            q, k0, v0 = q * 3, k0, v0
            bf = [x.bfloat16() for x in (q, k0, v0)]
            bdiag = [(a.bfloat16() * 1.5, c.bfloat16()) for a, c in diag]
            new = attention.chain_attention(*bf, bdiag, attention.sample_ranges(None, 2, 256)).double()
            dense = attention.dense_chain_reference(*bf, bdiag).double()
            exact = attention.dense_chain_reference(*[x.double() for x in bf], [(a.double(), c.double()) for a, c in bdiag])
    else:
        tensors, meta = _block_inputs()
        with torch.no_grad():
            bf = [x.detach().bfloat16() * (3 if i == 0 else 1) for i, x in enumerate(tensors)]
            new = attention.block_attention(*bf, *meta, 13).double()
            dense = attention.dense_block_reference(*bf, *meta, 13).double()
            exact = attention.dense_block_reference(*[x.double() for x in bf], *meta, 13)
    err, ref = (new - exact).abs(), (dense - exact).abs()
    assert err.mean() < 1.4 * ref.mean() and err.max() < 2.5 * ref.max(), (float(err.mean() / ref.mean()), float(err.max() / ref.max()))


def test_the_sentinel_merge_is_exact_to_fp32_in_bf16():
    """The small part's log-sum-exp reaches the kernel as three bf16 parts: the chain's bf16 error is the output
    rounding only, not a bf16 lse (which made the diagonal's share off by ~|lse| * 2^-9 in log space)."""
    torch.manual_seed(0)
    lse = torch.randn(4096) * 8 + 10
    ch = attention._lse_channels(lse, 0.125, torch.bfloat16, torch.empty((), dtype=torch.bfloat16))
    assert ch.dtype == torch.bfloat16 and ch.shape == (4096, attention._EXTRA)
    back = (ch.float()[:, :3].sum(-1)) * 0.125  # what a kernel's fp32 accumulation scores against key channels of 1
    assert float((back - lse).abs().max()) < 1e-5
    assert float((ch.float()[:, 0] * 0.125 - lse).abs().max()) > 1e-2  # one bf16 channel alone would not be


@pytest.mark.cuda(reason="torch's own dispatcher checks")
@pytest.mark.parametrize("layout", ["padded", "packed", "sliding"])
@pytest.mark.parametrize("algorithm", ["eagle3", "dflash", "dspark"])
def test_on_cuda_torch_itself_puts_every_call_on_a_fused_kernel(algorithm, layout, monkeypatch):
    from torch.backends.cuda import SDPAParams, can_use_efficient_attention, can_use_flash_attention

    refused = []

    def ask(q, k, v, mask, dropout, causal, gqa):
        cast = [x.to(torch.bfloat16) if x is not None and x.is_floating_point() else x for x in (q, k, v, mask)]
        p = SDPAParams(*cast, dropout, causal, gqa)
        if not (can_use_flash_attention(p, debug=False) or can_use_efficient_attention(p, debug=False)):
            can_use_efficient_attention(p, debug=True)
            refused.append(tuple(q.shape))

    draft, batch = _setup(algorithm, layout, "cuda")
    rec = Recorder(monkeypatch, on_call=ask)
    _train_step(draft, batch, "cuda")
    assert rec.calls and not refused
