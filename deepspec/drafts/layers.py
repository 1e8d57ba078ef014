"""Building blocks shared by every draft: sizes from the target config, RMSNorm, RoPE, GQA attention, MLP.

Written once and parameterised by the target's HF config (Llama, Qwen3, Gemma-style options), so no
algorithm keeps a per-family copy. Module and weight names follow HF/vLLM (`q_proj`, `input_layernorm`,
...), which keeps the export a pure renaming-free copy.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from deepspec.errors import ConfigError


@dataclass
class DraftArch:
    """Resolved draft sizes (target config + ModelConfig overrides); stored in the checkpoint."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_layers: int
    vocab_size: int  # target vocabulary
    target_hidden_size: int  # width of one tap as the draft reads it: H, or S*H for a concat-reduced multi-stream target
    target_num_layers: int
    target_hc_mult: int = 1  # residual streams of the target (hyper-connections); taps reduced by tap_reduction
    tap_reduction: str = "mean"
    rms_norm_eps: float = 1e-6
    rope_parameters: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    max_position_embeddings: int = 4096
    hidden_act: str = "silu"
    attention_bias: bool = False
    qk_norm: bool = False
    logit_softcap: float | None = None
    target_model_type: str = "llama"
    # Gemma-style options: RMSNorm scales by (1 + weight); embeddings are multiplied by sqrt(hidden).
    norm_offset: float = 0.0
    embed_scale: float = 1.0
    # per draft layer "full_attention" / "sliding_attention" (None = all full); window in positions
    layer_types: list[str] | None = None
    sliding_window: int | None = None

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window (a key is visible iff q_pos - k_pos < window), None = full attention."""
        if self.layer_types and self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def make_norm(self, dim: int) -> "RMSNorm":
        return RMSNorm(dim, self.rms_norm_eps, self.norm_offset)


def _rope_parameters(cfg: Any) -> dict[str, Any]:
    params = getattr(cfg, "rope_parameters", None)
    if isinstance(params, dict) and params:
        out = dict(params)
    else:
        out = {"rope_type": "default"}
        scaling = getattr(cfg, "rope_scaling", None)
        if isinstance(scaling, dict):
            out.update(scaling)
            out["rope_type"] = scaling.get("rope_type", scaling.get("type", "default"))
    if "rope_theta" not in out:
        out["rope_theta"] = float(getattr(cfg, "rope_theta", 10000.0))
    return out


def arch_from_target(target_config: Any, model_cfg: Any, *, qk_norm: bool | None = None) -> DraftArch:
    """Draft sizes default to the target's; ModelConfig fields override. hidden_size must match the
    target because the draft shares the target's embeddings (and, for DFlash/DSpark, its LM head)."""
    cfg = getattr(target_config, "text_config", None) or target_config
    hidden = cfg.hidden_size
    if model_cfg.hidden_size not in (None, hidden):
        raise ConfigError(
            f"model.hidden_size={model_cfg.hidden_size} differs from the target's hidden size {hidden}; drafts share the "
            "target's embeddings, so leave model.hidden_size unset (shrink intermediate_size or heads instead)."
        )
    heads = model_cfg.num_attention_heads or cfg.num_attention_heads
    kv_heads = model_cfg.num_key_value_heads or getattr(cfg, "num_key_value_heads", None) or heads
    if model_cfg.num_attention_heads and not model_cfg.num_key_value_heads:
        kv_heads = min(kv_heads, heads)
    if heads % kv_heads:
        raise ConfigError(f"model.num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}; pick divisible values.")
    head_dim = getattr(cfg, "head_dim", None) or hidden // cfg.num_attention_heads
    from deepspec.targets.taps import tap_width

    streams = int(getattr(cfg, "hc_mult", None) or 1)
    reduction = getattr(model_cfg, "tap_reduction", "mean")
    model_type = getattr(cfg, "model_type", "llama")
    if qk_norm is None:
        qk_norm = model_type.startswith(("qwen3", "gemma3", "gemma4"))
    gemma = model_type.startswith("gemma")
    softcap = model_cfg.logit_softcap if model_cfg.logit_softcap is not None else getattr(cfg, "final_logit_softcapping", None)
    return DraftArch(
        hidden_size=hidden,
        intermediate_size=model_cfg.intermediate_size or cfg.intermediate_size,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        num_layers=model_cfg.num_draft_layers,
        vocab_size=cfg.vocab_size,
        target_hidden_size=tap_width(hidden, streams, reduction),
        target_num_layers=cfg.num_hidden_layers,
        target_hc_mult=streams,
        tap_reduction=reduction,
        rms_norm_eps=float(getattr(cfg, "rms_norm_eps", 1e-6)),
        rope_parameters=_rope_parameters(cfg),
        max_position_embeddings=int(getattr(cfg, "max_position_embeddings", 4096)),
        hidden_act=getattr(cfg, "hidden_act", None) or getattr(cfg, "hidden_activation", None) or "silu",
        attention_bias=bool(getattr(cfg, "attention_bias", False)),
        qk_norm=bool(qk_norm),
        logit_softcap=softcap,
        target_model_type=model_type,
        norm_offset=1.0 if gemma else 0.0,
        embed_scale=float(hidden) ** 0.5 if gemma else 1.0,
        layer_types=list(model_cfg.layer_types) if getattr(model_cfg, "layer_types", None) else None,
        sliding_window=getattr(model_cfg, "sliding_window", None),
    )


def _rms_scale(xhat: torch.Tensor, weight: torch.Tensor, offset: float, dtype: torch.dtype) -> torch.Tensor:
    """The weight applied to the fp32-normalised xhat, rounded as HF does: Gemma-style (offset) norms scale in fp32,
    Llama/Qwen3-style norms round xhat to the input dtype first."""
    if offset:
        return ((offset + weight.float()) * xhat).to(dtype)
    return (weight * xhat.to(dtype)).to(dtype)


# elements per slice of the norm's fp32 arithmetic (64 MiB of fp32): bounds its temporaries, forward and backward
_NORM_CHUNK = 1 << 24


def _row_slices(x: torch.Tensor) -> list[tuple[int, int]]:
    """[s, e) slices of x's second-to-last axis (tokens), each holding at most ~_NORM_CHUNK elements."""
    if x.dim() < 2:
        return [(0, 0)]
    n = x.shape[-2]
    step = max(1, _NORM_CHUNK // max(1, x.numel() // max(1, n)))
    return [(s, min(n, s + step)) for s in range(0, n, step)]


def _rows(x: torch.Tensor, s: int, e: int) -> torch.Tensor:
    return x if x.dim() < 2 else x[..., s:e, :]


class _RMSNormFn(torch.autograd.Function):
    """RMSNorm that keeps only its input (in its own dtype) and the fp32 inverse RMS for backward, and does its fp32
    arithmetic in slices of tokens. Autograd through the eager formula keeps an fp32 copy of the input and the
    normalised tensor (3x the input's bytes in bf16) and makes several input-sized fp32 temporaries at once: for a
    draft's q_norm (query rows x heads x head dim) the largest tensors of a layer."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
        out = torch.empty_like(x)
        rstd = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)
        for s, e in _row_slices(x):
            xf = _rows(x, s, e).float()
            r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
            _rows(rstd, s, e).copy_(r)
            _rows(out, s, e).copy_(_rms_scale(xf * r, weight, offset, x.dtype))
        ctx.save_for_backward(x, weight, rstd)
        ctx.offset = offset
        return out

    @staticmethod
    def backward(ctx, gy: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        w = weight.float() + ctx.offset
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gx = torch.empty_like(x) if need_x else None
        gw = torch.zeros(x.shape[-1], dtype=torch.float32, device=x.device) if need_w else None
        for s, e in _row_slices(x):
            r = _rows(rstd, s, e)
            xhat = _rows(x, s, e).float() * r
            g = _rows(gy, s, e).float()
            if need_w:
                seen = xhat if ctx.offset else xhat.to(x.dtype).float()  # what the weight multiplied in forward
                gw += (g * seen).reshape(-1, x.shape[-1]).sum(0)
            if need_x:
                g = g * w
                _rows(gx, s, e).copy_(r * (g - xhat * (g * xhat).mean(-1, keepdim=True)))
        return gx, (gw.to(weight.dtype) if need_w else None), None, None


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 (as HF Llama/Qwen3 do) so bf16 training matches the engines; returns the input's dtype
    (bf16 in, bf16 out: an fp32 weight must not turn the residual stream fp32 under autocast). Backward recomputes the
    normalisation from the input (`_RMSNormFn`) instead of keeping fp32 intermediates; compiled
    (deepspec/train/compile.py) it is the formula, which Inductor fuses and which then saves for backward no more than
    `_RMSNormFn` does (tests/test_compile.py).

    Not `torch.nn.functional.rms_norm`: it scales by the weight in fp32 and rounds once (the Gemma rule), where Llama /
    Qwen3 round the normalised value to the input dtype before the weight; and with fp32 master weights under bf16
    autocast its input and weight dtypes differ, so it leaves its fused kernel for a composite that keeps fp32
    intermediates for backward."""

    def __init__(self, dim: int, eps: float = 1e-6, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - offset))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            # Inside a compiled region (deepspec/train/compile.py) the formula itself: Inductor fuses it into one kernel
            # each way and its partitioner keeps only what the backward cannot cheaply recompute, which is the memory
            # _RMSNormFn saves by hand; _RMSNormFn's slicing loop over the token count would guard on that count and
            # recompile for every new length.
            return self.reference(x)
        return _RMSNormFn.apply(x, self.weight, self.eps, self.offset)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The eager formula, differentiated by autograd (tests compare forward() with it)."""
        xf = x.float()
        return _rms_scale(xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps), self.weight, self.offset, x.dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for explicit position ids (drafts use non-contiguous positions)."""

    def __init__(self, arch: DraftArch):
        super().__init__()
        params = dict(arch.rope_parameters)
        rope_type = params.get("rope_type", "default")
        base = float(params.get("rope_theta", 10000.0))
        dim = arch.head_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        self.attention_scaling = 1.0
        if rope_type == "linear":
            inv_freq = inv_freq / float(params["factor"])
        elif rope_type != "default":
            try:
                from transformers import PretrainedConfig
                from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

                cfg = PretrainedConfig(
                    rope_parameters=params, head_dim=dim, hidden_size=arch.num_attention_heads * dim,
                    num_attention_heads=arch.num_attention_heads, max_position_embeddings=arch.max_position_embeddings,
                )
                inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu")
            except Exception as e:  # noqa: BLE001 - report any failure as one config error
                raise ConfigError(f"RoPE type '{rope_type}' of the target is not supported by the draft layers ({e}).") from None
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [..., T] -> cos, sin [..., T, head_dim]."""
        freqs = position_ids.float().unsqueeze(-1) * self.inv_freq.to(position_ids.device)
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, h, T, d]; cos/sin [B, T, d] (neox/HF rotate-half style, as Llama/Qwen3 and vLLM use)."""
    return x * cos.unsqueeze(1) + _rotate_half(x) * sin.unsqueeze(1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """SDPA with GQA; mask is boolean (True = may attend), broadcastable to [B, h, Tq, Tk].

    Every query row must see at least one key (callers guarantee it) or SDPA returns NaN.
    """
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class Attention(nn.Module):
    """GQA attention whose q/k/v read `in_dim` features (2H for EAGLE-3's first layer).

    The drafts run the attention itself (their chunk plans are data-dependent Python); this module holds what surrounds
    it. `project_q`, `project_kv` and `output` are the regions deepspec/train/compile.py compiles, so they take tensors
    only and keep their Python to shapes and module attributes.
    """

    def __init__(self, arch: DraftArch, in_dim: int | None = None):
        super().__init__()
        in_dim = in_dim or arch.hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
        bias = arch.attention_bias
        self.q_proj = nn.Linear(in_dim, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(in_dim, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(in_dim, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, arch.hidden_size, bias=False)
        if arch.qk_norm:
            self.q_norm = arch.make_norm(self.head_dim)
            self.k_norm = arch.make_norm(self.head_dim)
        else:
            self.q_norm = self.k_norm = None

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, n, self.head_dim).transpose(1, 2)

    def project_q(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q = self._heads(self.q_proj(x), self.num_heads)
        if self.q_norm is not None:
            q = self.q_norm(q)
        return apply_rope(q, cos, sin)

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = self._heads(self.k_proj(x), self.num_kv_heads)
        v = self._heads(self.v_proj(x), self.num_kv_heads)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return apply_rope(k, cos, sin), v

    def output(self, attn: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = attn.shape
        return self.o_proj(attn.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


_ACTS = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class MLP(nn.Module):
    """Gated MLP (SwiGLU for Llama/Qwen3, GeGLU for Gemma)."""

    def __init__(self, arch: DraftArch):
        super().__init__()
        if arch.hidden_act not in _ACTS:
            raise ConfigError(f"Activation '{arch.hidden_act}' of the target is not supported by the draft MLP; use one of {sorted(_ACTS)}.")
        self.act = _ACTS[arch.hidden_act]
        self.gate_proj = nn.Linear(arch.hidden_size, arch.intermediate_size, bias=False)
        self.up_proj = nn.Linear(arch.hidden_size, arch.intermediate_size, bias=False)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """A pre-norm decoder layer; attention is driven by the caller (who owns caches and masks)."""

    def __init__(self, arch: DraftArch, attn_in_dim: int | None = None):
        super().__init__()
        self.input_layernorm = arch.make_norm(arch.hidden_size)
        self.self_attn = Attention(arch, attn_in_dim)
        self.post_attention_layernorm = arch.make_norm(arch.hidden_size)
        self.mlp = MLP(arch)


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Gemma-style final-logit soft-capping (identity when cap is None)."""
    return logits if not cap else torch.tanh(logits / cap) * cap


def causal_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """[Tq, Tk] boolean: key position <= query position (and q_pos - k_pos < window for a sliding layer)."""
    m = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)
    if window is not None:
        m = m & (q_pos.unsqueeze(1) - k_pos.unsqueeze(0) < window)
    return m
