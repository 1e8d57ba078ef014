"""A deepspec DFlash draft for transformers' `trust_remote_code` loading, shipped in every DFlash export.

`AutoModel.from_pretrained(EXPORT, trust_remote_code=True)` returns `DFlashDraftModel` from this file (the
export's config.json maps AutoModel here), and

    out = draft.spec_generate(target=target, input_ids=ids, max_new_tokens=256, stop_token_ids=[eos], temperature=0.0)

runs greedy speculative decoding with the target: the output equals the target's own greedy decoding.

The draft is what deepspec trained (deepspec/drafts/block.py), restated with torch and transformers only so the
export runs without deepspec installed:
  * context: ctx = hidden_norm(fc(taps)), taps = the outputs of the target decoder layers listed in
    dflash_config.target_layer_ids (-1 = the embeddings), concatenated per position;
  * every layer attends from the block [anchor token, mask x (block_size - 1)] (positions a .. a+K-1) to the
    context keys of positions < a (k_proj / v_proj of ctx, k_norm, RoPE) and to the whole block;
  * a sliding layer sees keys with |q_pos - k_pos| < sliding_window (deepspec refuses windows shorter than the
    block, so inside a block this is every key, as in training);
  * slot j >= 1 predicts token a + j: with the target's LM head, or with the draft's own `lm_head` rows and `d2t`
    (target id = draft id + d2t[draft id]) when it was trained with a reduced draft vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config

_ACTS = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def _get(config: Any, name: str, default: Any = None) -> Any:
    """A field from dflash_config, else the top level (both layouts exist among published DFlash configs)."""
    sub = getattr(config, "dflash_config", None) or {}
    return sub[name] if name in sub else getattr(config, name, default)


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * y.to(dtype)).to(dtype)


def _rope_inv_freq(config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling of the config's RoPE (transformers' own init for scaled types)."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    base = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if rope_type == "default":
        return inv, 1.0
    if rope_type == "linear":
        return inv / float(params["factor"]), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return inv.float(), float(scaling)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class _Attention(nn.Module):
    def __init__(self, config: Any, layer_idx: int):
        super().__init__()
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        bias = bool(getattr(config, "attention_bias", False))
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=False)
        self.q_norm = _RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = _RMSNorm(self.head_dim, config.rms_norm_eps)
        types = getattr(config, "layer_types", None)
        sliding = bool(types) and types[layer_idx] == "sliding_attention"
        self.window = int(config.sliding_window) if sliding else None

    def _split(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.view(x.shape[0], x.shape[1], n, self.head_dim).transpose(1, 2)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.k_norm(self._split(self.k_proj(x), self.kv_heads))
        v = self._split(self.v_proj(x), self.kv_heads)
        return k * cos[:, None] + _rotate_half(k) * sin[:, None], v

    def forward(self, x, cos, sin, k_ctx, v_ctx, mask):
        q = self.q_norm(self._split(self.q_proj(x), self.heads))
        q = q * cos[:, None] + _rotate_half(q) * sin[:, None]
        k, v = self.kv(x, cos, sin)
        k, v = torch.cat([k_ctx, k], dim=2), torch.cat([v_ctx, v], dim=2)
        if self.kv_heads != self.heads:
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(o.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))


class _MLP(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        self.act = _ACTS[getattr(config, "hidden_act", "silu")]
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, config: Any, layer_idx: int):
        super().__init__()
        self.input_layernorm = _RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = _Attention(config, layer_idx)
        self.post_attention_layernorm = _RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = _MLP(config)


class ContextCache:
    """Per-layer keys / values of the committed context positions (and the positions themselves)."""

    def __init__(self) -> None:
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.positions: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.positions is None else int(self.positions.shape[-1])

    def append(self, kv: list[tuple[torch.Tensor, torch.Tensor]], positions: torch.Tensor) -> None:
        if self.kv is None:
            self.kv, self.positions = kv, positions
        else:
            self.kv = [(torch.cat([a, k], 2), torch.cat([b, v], 2)) for (a, b), (k, v) in zip(self.kv, kv)]
            self.positions = torch.cat([self.positions, positions], -1)


class DFlashDraftModel(PreTrainedModel):
    """deepspec's DFlash draft (see the module docstring); embeddings and, by default, the LM head are the target's."""

    config_class = Qwen3Config
    base_model_prefix = "dflash"
    _no_split_modules = ["_Layer"]
    _keys_to_ignore_on_load_unexpected = [r"rotary"]

    def __init__(self, config: Qwen3Config):
        super().__init__(config)
        h = config.hidden_size
        self.target_layer_ids = list(_get(config, "target_layer_ids"))
        tap_width = int(getattr(config, "target_hidden_size", None) or h)
        self.fc = nn.Linear(len(self.target_layer_ids) * tap_width, h, bias=False)
        self.hidden_norm = _RMSNorm(h, config.rms_norm_eps)
        self.layers = nn.ModuleList([_Layer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = _RMSNorm(h, config.rms_norm_eps)
        self.block_size = int(_get(config, "block_size", 16))
        self.mask_token_id = int(_get(config, "mask_token_id"))
        self.draft_vocab_size = int(getattr(config, "draft_vocab_size", None) or config.vocab_size)
        if self.draft_vocab_size < config.vocab_size:  # a reduced draft vocabulary: its own head rows and the id map
            self.lm_head = nn.Linear(h, self.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        else:
            self.lm_head = None
        self._rope_cache: tuple[torch.Tensor, float] | None = None  # built on first use (not a buffer: loading skips those)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        """Weights come from the checkpoint; only fill what it lacks deterministically."""
        if isinstance(module, _RMSNorm):
            module.weight.data.fill_(1.0)

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self._rope_cache is None:
            self._rope_cache = _rope_inv_freq(self.config, self.layers[0].self_attn.head_dim)
        inv, scale = self._rope_cache
        freqs = positions.float()[..., None] * inv.to(positions.device)
        emb = torch.cat([freqs, freqs], -1)
        return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)

    def context(self, taps: torch.Tensor) -> torch.Tensor:
        """taps [B, C, n_taps * width] (concatenated in target_layer_ids order) -> context features [B, C, H]."""
        return self.hidden_norm(self.fc(taps.to(self.fc.weight.dtype)))

    def forward(
        self,
        noise_embedding: torch.Tensor,
        position_ids: torch.Tensor,
        target_hidden: torch.Tensor | None = None,
        past_key_values: ContextCache | None = None,
        use_cache: bool = False,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Final-normed hidden states [B, Q, H] of the block `noise_embedding` [B, Q, H].

        position_ids [B, C + Q]: the positions of `target_hidden` [B, C, n_taps * width] (new context, may be
        C = 0 / None) then of the block. Context keys come from `past_key_values` (earlier positions) and
        `target_hidden`; with use_cache the new context is appended to `past_key_values` (the block never is)."""
        dtype = self.fc.weight.dtype
        x = noise_embedding.to(dtype)
        q_len = x.shape[1]
        c_len = 0 if target_hidden is None else target_hidden.shape[1]
        if position_ids.dim() == 1:
            position_ids = position_ids[None]
        block_pos = position_ids[:, c_len:]
        new_kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        if c_len:
            ctx = self.context(target_hidden)
            cos_c, sin_c = self._rope(position_ids[:, :c_len], dtype)
            new_kv = [layer.self_attn.kv(ctx, cos_c, sin_c) for layer in self.layers]
        cache = past_key_values if past_key_values is not None else ContextCache()
        old = cache.kv
        ctx_pos = position_ids[:, :c_len] if old is None else torch.cat([cache.positions, position_ids[:, :c_len]], -1)
        keys_pos = torch.cat([ctx_pos, block_pos], -1)  # [B, S + Q]
        cos, sin = self._rope(block_pos, dtype)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            parts = ([old[i]] if old is not None else []) + ([new_kv[i]] if new_kv else [])
            if parts:
                k_ctx, v_ctx = torch.cat([p[0] for p in parts], 2), torch.cat([p[1] for p in parts], 2)
            else:
                k_ctx = x.new_zeros(x.shape[0], attn.kv_heads, 0, attn.head_dim)
                v_ctx = k_ctx
            mask = None
            if attn.window is not None:
                mask = ((block_pos[:, :, None] - keys_pos[:, None, :]).abs() < attn.window)[:, None]
            hq = layer.input_layernorm(x)
            x = x + attn(hq, cos, sin, k_ctx, v_ctx, mask)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        if use_cache and past_key_values is not None and new_kv:
            past_key_values.append(new_kv, position_ids[:, :c_len])
        return self.norm(x)

    def logits(self, hidden: torch.Tensor, target: nn.Module) -> torch.Tensor:
        """Draft logits over the draft vocabulary (the target's whole vocabulary without a reduced one)."""
        if self.lm_head is not None:
            return self.lm_head(hidden)
        head = target.get_output_embeddings()
        return F.linear(hidden.to(head.weight.dtype), head.weight)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.lm_head is None else draft_ids + self.d2t[draft_ids]

    # --- decoding with a target ------------------------------------------------------------------------
    def _tap_modules(self, target: nn.Module) -> list[nn.Module]:
        decoder = target.get_decoder() if hasattr(target, "get_decoder") else target.model
        n = int(getattr(self.config, "num_target_layers", None) or len(decoder.layers))
        if len(decoder.layers) != n:
            raise ValueError(f"This draft was trained for a target with {n} decoder layers; the given target has {len(decoder.layers)}.")
        return [target.get_input_embeddings() if k < 0 else decoder.layers[k] for k in self.target_layer_ids]

    def _run_target(self, target, ids, positions, cache, modules):
        """One target forward over `ids`; returns (logits [1, T, V], taps [1, T, n_taps * width])."""
        got: dict[int, torch.Tensor] = {}

        def hook(i):
            def fn(_module, _inputs, output):
                got[i] = output[0] if isinstance(output, (tuple, list)) else output
            return fn

        handles = [m.register_forward_hook(hook(i)) for i, m in enumerate(modules)]
        try:
            out = target(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True)
        finally:
            for handle in handles:
                handle.remove()
        return out.logits, torch.cat([got[i] for i in range(len(modules))], -1)

    @torch.no_grad()
    def spec_generate(
        self,
        target: nn.Module,
        input_ids: torch.LongTensor,
        max_new_tokens: int,
        stop_token_ids: list[int] | None = None,
        temperature: float = 0.0,
        return_stats: bool = False,
        **kwargs: Any,
    ):
        """Greedy speculative decoding of one prompt: [1, P] -> [1, P + new tokens] (the prompt included), equal to
        the target's greedy decoding. Each round drafts block_size - 1 tokens from one block forward; the target
        verifies them in one forward and keeps the longest agreeing prefix plus its own next token.
        return_stats=True returns (ids, tokens accepted + 1 per round)."""
        from transformers import DynamicCache

        if temperature and temperature > 0:
            raise ValueError("This loader decodes greedily (temperature=0.0); sample with an engine (vLLM, SGLang) instead.")
        if int(getattr(self.config, "target_hc_mult", 1) or 1) > 1:
            raise ValueError("This draft reads a multi-stream target's residual streams, which a transformers target does not "
                             "expose; serve it with vLLM.")
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"spec_generate decodes one prompt: input_ids must be [1, length], got {tuple(input_ids.shape)}.")
        self.eval()
        dev = self.fc.weight.device
        ids = input_ids.to(dev)
        stops = set(int(t) for t in (stop_token_ids or []))
        modules = self._tap_modules(target)
        embed = target.get_input_embeddings()
        tcache = DynamicCache()
        dcache = ContextCache()
        prompt = ids.shape[1]
        logits, taps = self._run_target(target, ids, torch.arange(prompt, device=dev)[None], tcache, modules)
        out = [int(logits[0, -1].argmax())]
        pending, pending_pos = taps, torch.arange(prompt, device=dev)[None]
        rounds: list[int] = []
        k = self.block_size
        while len(out) < max_new_tokens and out[-1] not in stops:
            anchor = prompt + len(out) - 1  # the position of the last committed token (no target state yet)
            block = torch.full((1, k), self.mask_token_id, dtype=torch.long, device=dev)
            block[0, 0] = out[-1]
            bpos = torch.arange(anchor, anchor + k, device=dev)[None]
            h = self(noise_embedding=embed(block), position_ids=torch.cat([pending_pos, bpos], -1), target_hidden=pending,
                     past_key_values=dcache, use_cache=True)
            drafts = self.to_target_ids(self.logits(h[:, 1:], target).argmax(-1))  # [1, K-1]
            block[0, 1:] = drafts[0]
            logits, taps = self._run_target(target, block, bpos, tcache, modules)
            verified = logits[0].argmax(-1)  # the target's token after each block slot
            n = 0
            while n < k - 1 and int(block[0, n + 1]) == int(verified[n]):
                n += 1
            new = [int(t) for t in block[0, 1 : n + 1]] + [int(verified[n])]
            rounds.append(len(new))
            for t in new:
                out.append(t)
                if t in stops or len(out) >= max_new_tokens:
                    break
            keep = anchor + n + 1  # the anchor and the accepted drafts now have target states
            drop = tcache.get_seq_length() - keep
            if drop > 0:
                tcache.crop(-drop)
            pending, pending_pos = taps[:, : n + 1], bpos[:, : n + 1]
        result = torch.cat([ids, torch.tensor([out], dtype=ids.dtype, device=dev)], dim=1)
        return (result, rounds) if return_stats else result
