"""Model FLOPs of a training step, counted from the ops it runs, split by the dtype each op computes in.

`count_flops(fn)` runs `fn` (a forward + backward) under a torch dispatch mode, which sees every op after autocast
chose its dtype, and adds up:

- matrix products (mm, addmm, bmm, baddbmm, _scaled_mm, convolutions): torch's own formulas
  (torch.utils.flop_counter.flop_registry);
- attention: every scaled-dot-product-attention kernel op and its backward, found by name (an op whose name holds
  "attention" and whose schema names `query`, `key` and `value`: the flash, memory-efficient, cuDNN, CPU-flash and
  overrideable kernels of every device, the lower-level `_flash_attention_*` / `_efficient_attention_*` /
  `_cudnn_attention_*` ops, and FlexAttention's higher-order ops), counted by `attention_flops` from the shapes.
  torch's own attention formulas are not used: up to torch 2.11 they assert on grouped-query attention (fewer key /
  value heads than query heads), which every GQA draft runs on CUDA.

The attention count follows torch's convention: per query head (a grouped key / value head is counted once for every
query head that reads it), the whole score matrix (a causal or block mask is not subtracted), forward = two matrix
products (QK^T, PV) = 2 * B * Hq * Lq * Lk * (Dqk + Dv), backward = five (the scores recomputed, dP, dV, dQ, dK) =
2 * B * Hq * Lq * Lk * (3 * Dqk + 2 * Dv), i.e. 2.5x the forward when Dqk = Dv. The math fallback kernel is composite:
its matrix products reach the mode one by one and are counted as such.

bf16 and fp16 ops count as "bf16" (the same tensor-core peak); everything else as "fp32" (autocast keeps some
products in fp32 on purpose; MFU against the bf16 peak leaves them out).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

LOW_PRECISION = (torch.bfloat16, torch.float16)


def attention_flops(q_shape, k_shape, v_shape, backward: bool = False) -> int:
    """FLOPs of one attention call on [B, Hq, Lq, D] queries and [B, Hkv, Lk, D] / [B, Hkv, Lk, Dv] keys / values
    (Hq a multiple of Hkv: grouped-query attention), per query head; the backward's five products when `backward`."""
    b, hq, lq, dqk = (int(x) for x in q_shape)
    bk, hkv, lk, dk = (int(x) for x in k_shape)
    bv, hv, lv, dv = (int(x) for x in v_shape)
    if not (b == bk == bv and hkv == hv and lk == lv and dqk == dk):
        raise ValueError(f"attention shapes do not fit together: query {list(q_shape)}, key {list(k_shape)}, value {list(v_shape)}")
    if hkv < 1 or hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv}): query {list(q_shape)}, key {list(k_shape)}")
    per_pair = 2 * b * hq * lq * lk
    return per_pair * (3 * dqk + 2 * dv) if backward else per_pair * (dqk + dv)


# how each family of attention ops lays out its 4-D inputs: SDPA's [B, H, L, D], or [B, L, H, D]
_BLHD_PREFIXES = ("_flash_attention", "_efficient_attention")
_VARLEN_KEYS = (("cum_seq_q", "cum_seq_k"), ("cu_seqlens_q", "cu_seqlens_k"))


def _bound_args(func, args, kwargs) -> dict[str, Any]:
    """The op's arguments by their schema names."""
    names = [a.name for a in func._schema.arguments]
    bound = dict(zip(names, args))
    bound.update(kwargs)
    return bound


def is_attention_op(name: str, arg_names: list[str]) -> bool:
    return "attention" in name and {"query", "key", "value"} <= set(arg_names)


def attention_op_flops(name: str, bound: dict[str, Any]) -> int:
    """FLOPs of one attention kernel op from its bound arguments (query / key / value and, for variable-length
    batches, the cumulative sequence offsets)."""
    q, k, v = bound["query"], bound["key"], bound["value"]
    backward = "backward" in name
    if q.dim() == 4 and k.dim() == 4 and v.dim() == 4:
        if name.startswith(_BLHD_PREFIXES):
            q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        return attention_flops(q.shape, k.shape, v.shape, backward)
    if q.dim() == 3 and k.dim() == 3 and v.dim() == 3:  # variable-length batch: [total tokens, H, D] + offsets
        for qk, kk in _VARLEN_KEYS:
            cq, ck = bound.get(qk), bound.get(kk)
            if isinstance(cq, torch.Tensor) and isinstance(ck, torch.Tensor) and cq.device.type != "meta":
                total = 0
                for lq, lk in zip(cq.diff().tolist(), ck.diff().tolist()):
                    total += attention_flops((1, q.shape[1], lq, q.shape[2]), (1, k.shape[1], lk, k.shape[2]),
                                             (1, v.shape[1], lk, v.shape[2]), backward)
                return total
        # no offsets: one sequence of all the tokens (an upper bound)
        return attention_flops((1, q.shape[1], q.shape[0], q.shape[2]), (1, k.shape[1], k.shape[0], k.shape[2]),
                               (1, v.shape[1], v.shape[0], v.shape[2]), backward)
    raise ValueError(f"{name}: query / key / value of {q.dim()}, {k.dim()}, {v.dim()} dimensions are not an attention layout")


def _flex_flops(name: str, args) -> int:
    """FlexAttention's higher-order ops: flex_attention(query, key, value, ...), flex_attention_backward(query, key,
    value, out, logsumexp, grad_out, ...), [B, H, L, D]; the dense count (the block mask's skipped blocks are not
    subtracted, as torch counts)."""
    q, k, v = args[0], args[1], args[2]
    return attention_flops(q.shape, k.shape, v.shape, backward="backward" in name)


@dataclass
class FlopCount:
    """Totals of one counted region: FLOPs by dtype class, by op, and the attention ops that could not be counted."""

    by_dtype: dict[str, float] = field(default_factory=lambda: {"bf16": 0.0, "fp32": 0.0})
    by_op: dict[str, float] = field(default_factory=dict)
    uncounted: dict[str, str] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.by_dtype.values())

    def add(self, op: str, flops: float, dtype: torch.dtype | None) -> None:
        self.by_dtype["bf16" if dtype in LOW_PRECISION else "fp32"] += flops
        self.by_op[op] = self.by_op.get(op, 0.0) + flops


def _first_float_dtype(values) -> torch.dtype | None:
    for a in values:
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return a.dtype
    return None


# ops whose first tensor is the accumulator added to the product, not one of its factors
_ACCUMULATING = ("addmm", "baddbmm", "addbmm", "addmv")


def _product_dtype(name: str, args) -> torch.dtype | None:
    """The dtype a matrix product computes in: its factors', not its accumulator's. Liger's fused loss accumulates a
    bf16 product into an fp32 weight gradient (`addmm(..., out_dtype=float32)`); that product runs at the bf16 peak."""
    return _first_float_dtype(args[1:] if name in _ACCUMULATING else args)


def _formula_flops(formula: Callable, args, kwargs: dict, out) -> float:
    """torch's formula for one op. The `.dtype` overloads (`addmm.dtype_out`, `bmm.dtype`, ...) pass their output
    dtype positionally, which torch's formulas (2.11 to 2.13) take for their `out_shape` argument and raise
    ("got multiple values for argument 'out_shape'"): a dtype carries no FLOPs, so it is left out."""
    return float(formula(*(a for a in args if not isinstance(a, torch.dtype)), **kwargs, out_val=out))


class FlopCounter:
    """`with FlopCounter() as c: ...` counts the FLOPs of the ops run inside into `c.count` (a FlopCount)."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils.flop_counter import flop_registry

        count = self.count = FlopCount()

        class Mode(TorchDispatchMode):
            supports_higher_order_operators = True  # FlexAttention reaches the mode as a higher-order op

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if isinstance(func, torch._ops.HigherOrderOperator):
                    name = func.name() if callable(getattr(func, "name", None)) else str(func)
                    out = func(*args, **kwargs)
                    if name.startswith("flex_attention"):
                        count.add(name, float(_flex_flops(name, args)), _first_float_dtype(args[:1]))
                    return out
                out = func(*args, **kwargs)
                packet = func._overloadpacket
                name = packet.__name__
                arg_names = [a.name for a in func._schema.arguments]
                if is_attention_op(name, arg_names):
                    bound = _bound_args(func, args, kwargs)
                    try:
                        flops = attention_op_flops(name, bound)
                    except (ValueError, KeyError) as e:
                        count.uncounted[name] = str(e)
                    else:
                        count.add(name, float(flops), bound["query"].dtype)
                    return out
                formula = flop_registry.get(packet)
                if formula is not None:
                    count.add(name, _formula_flops(formula, args, kwargs, out), _product_dtype(name, args))
                return out

        self._mode = Mode()

    def __enter__(self) -> "FlopCounter":
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)


def count_flops(fn: Callable[[], Any]) -> FlopCount:
    """Run `fn` once under a FlopCounter; its FlopCount."""
    with FlopCounter() as c:
        fn()
    return c.count
