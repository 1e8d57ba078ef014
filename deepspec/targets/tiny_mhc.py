"""`tiny-mhc`: a tiny multi-stream (hyper-connection) MoE target, built in-process from a seed.

DeepSeek-V4 carries its residual as `hc_mult` = S parallel streams; a decoder layer's output, and so a
tap, is [T, S, H]. This model reproduces that shape with a small Llama-like stack so the multi-stream
path (tap reduction, cache, draft width, export) is tested end to end without downloads:
  * the embeddings are copied into S streams;
  * layer l reads u = sum_s read[s] * x_s (learned weights), runs attention + an MoE MLP on it
    (pre-norm, GQA, RoPE; top-k routed experts), and writes back x'_r = sum_s mix[r, s] * x_s +
    write[r] * (attn + mlp): a learned S x S stream mixing plus learned write weights;
  * the final state is norm(sum_s head[s] * x_s), then the LM head.
`output_hidden_states` returns the streams [B, T, S, H] (embeddings first), so hook-captured taps can be
golden-tested against the model's own forward. Registered with the transformers Auto classes on import,
so the saved folder loads by path like any HF model (vLLM does not know it: regenerate with the HF engine).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

MODEL_TYPE = "deepspec_tiny_mhc"
NAME = "tiny-mhc"
_FORMAT_VERSION = 1


class TinyMHCConfig(PretrainedConfig):
    model_type = MODEL_TYPE

    def __init__(self, vocab_size: int = 320, hidden_size: int = 64, intermediate_size: int = 64, num_hidden_layers: int = 6,
                 num_attention_heads: int = 4, num_key_value_heads: int = 2, head_dim: int = 16, hc_mult: int = 4,
                 num_experts: int = 4, num_experts_per_tok: int = 2, rms_norm_eps: float = 1e-6, rope_theta: float = 10000.0,
                 max_position_embeddings: int = 1024, hidden_act: str = "silu", pad_token_id: int | None = 256,
                 eos_token_id: int | None = 258, bos_token_id: int | None = None, tie_word_embeddings: bool = False, **kwargs: Any):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.hc_mult = hc_mult
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.max_position_embeddings = max_position_embeddings
        self.hidden_act = hidden_act
        super().__init__(pad_token_id=pad_token_id, eos_token_id=eos_token_id, bos_token_id=bos_token_id,
                         tie_word_embeddings=tie_word_embeddings, **kwargs)


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class _Attention(nn.Module):
    def __init__(self, cfg: TinyMHCConfig, layer_idx: int):
        super().__init__()
        self.layer_idx, self.nh, self.nkv, self.hd = layer_idx, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, mask, cache):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        rep = self.nh // self.nkv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.nh * self.hd))


class _MoE(nn.Module):
    """Top-k routed experts (softmax router, renormalised top-k weights); computed densely (tiny)."""

    def __init__(self, cfg: TinyMHCConfig):
        super().__init__()
        E, H, I = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
        self.top_k = cfg.num_experts_per_tok
        self.router = nn.Linear(H, E, bias=False)
        self.gate_up = nn.Parameter(torch.empty(E, 2 * I, H))
        self.down = nn.Parameter(torch.empty(E, H, I))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = self.router(x).float().softmax(-1)
        w, idx = probs.topk(self.top_k, dim=-1)
        dense = torch.zeros_like(probs).scatter(-1, idx, w / w.sum(-1, keepdim=True)).to(x.dtype)
        g, u = torch.einsum("bth,eih->btei", x, self.gate_up).chunk(2, dim=-1)
        y = torch.einsum("btei,ehi->bteh", F.silu(g) * u, self.down)
        return (y * dense.unsqueeze(-1)).sum(2)


class _Layer(nn.Module):
    def __init__(self, cfg: TinyMHCConfig, layer_idx: int):
        super().__init__()
        S = cfg.hc_mult
        self.input_layernorm = _RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = _Attention(cfg, layer_idx)
        self.post_attention_layernorm = _RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = _MoE(cfg)
        self.hc_read = nn.Parameter(torch.empty(S))
        self.hc_write = nn.Parameter(torch.empty(S))
        self.hc_mix = nn.Parameter(torch.empty(S, S))

    def forward(self, streams, cos, sin, mask, cache):
        u = torch.einsum("s,btsh->bth", self.hc_read, streams)
        a = self.self_attn(self.input_layernorm(u), cos, sin, mask, cache)
        m = self.mlp(self.post_attention_layernorm(u + a))
        mixed = torch.einsum("rs,btsh->btrh", self.hc_mix, streams)
        return mixed + self.hc_write[:, None] * (a + m).unsqueeze(2)


class TinyMHCPreTrainedModel(PreTrainedModel):
    config_class = TinyMHCConfig
    base_model_prefix = "model"
    _no_split_modules = ["_Layer"]

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = 0.02
        if isinstance(module, nn.Linear):
            module.weight.normal_(0.0, std)
        elif isinstance(module, nn.Embedding):
            module.weight.normal_(0.0, std)
        elif isinstance(module, _RMSNorm):
            module.weight.fill_(1.0)
        elif isinstance(module, _MoE):
            module.gate_up.normal_(0.0, std)
            module.down.normal_(0.0, std)
        elif isinstance(module, _Layer):
            S = module.hc_read.numel()
            module.hc_read.copy_(1.0 / S + 0.2 * torch.randn(S))
            module.hc_write.copy_(1.0 + 0.3 * torch.randn(S))
            module.hc_mix.copy_(torch.eye(S) + 0.1 * torch.randn(S, S))
        elif isinstance(module, TinyMHCModel):
            S = module.hc_head.numel()
            module.hc_head.copy_(1.0 / S + 0.2 * torch.randn(S))


class TinyMHCModel(TinyMHCPreTrainedModel):
    def __init__(self, config: TinyMHCConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(_Layer(config, i) for i in range(config.num_hidden_layers))
        self.hc_head = nn.Parameter(torch.empty(config.hc_mult))
        self.norm = _RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, inputs_embeds=None,
                use_cache=None, output_hidden_states=None, **kwargs) -> BaseModelOutputWithPast:
        from transformers import DynamicCache

        cfg = self.config
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        B, T, H = x.shape
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=cfg)
        cache = past_key_values if use_cache else None
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + T, device=x.device).unsqueeze(0)
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, device=x.device, dtype=torch.float32) / cfg.head_dim))
        freqs = position_ids.float().unsqueeze(-1) * inv
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype)[:, None], emb.sin().to(x.dtype)[:, None]
        keys = torch.arange(past + T, device=x.device)
        mask = keys[None, :] <= position_ids[0, :, None]  # [T, past + T] causal
        mask = mask[None, None].expand(B, 1, T, past + T)
        if attention_mask is not None:
            mask = mask & attention_mask[:, None, None, : past + T].bool()
        streams = x.unsqueeze(2).expand(B, T, cfg.hc_mult, H).contiguous()
        hidden = [streams] if output_hidden_states else None
        for layer in self.layers:
            streams = layer(streams, cos, sin, mask, cache)
            if hidden is not None:
                hidden.append(streams)
        out = self.norm(torch.einsum("s,btsh->bth", self.hc_head, streams))
        return BaseModelOutputWithPast(last_hidden_state=out, past_key_values=cache, hidden_states=tuple(hidden) if hidden else None)


class TinyMHCForCausalLM(TinyMHCPreTrainedModel, GenerationMixin):
    def __init__(self, config: TinyMHCConfig):
        super().__init__(config)
        self.model = TinyMHCModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, inputs_embeds=None,
                use_cache=None, output_hidden_states=None, logits_to_keep: int = 0, labels=None, **kwargs) -> CausalLMOutputWithPast:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, past_key_values=past_key_values,
                         inputs_embeds=inputs_embeds, use_cache=use_cache, output_hidden_states=output_hidden_states)
        h = out.last_hidden_state
        logits = self.lm_head(h[:, -logits_to_keep:] if logits_to_keep else h)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=out.past_key_values, hidden_states=out.hidden_states)


AutoConfig.register(MODEL_TYPE, TinyMHCConfig, exist_ok=True)
AutoModelForCausalLM.register(TinyMHCConfig, TinyMHCForCausalLM, exist_ok=True)


def tiny_mhc_target(seed: int = 0, **overrides: Any):
    """(model, tokenizer): the tiny multi-stream target in fp32, eval mode, frozen; the same weights for a seed."""
    from deepspec.targets.tiny_tokenizer import tiny_tokenizer

    torch.manual_seed(seed)
    model = TinyMHCForCausalLM(TinyMHCConfig(**overrides)).float()
    model.eval().requires_grad_(False)
    return model, tiny_tokenizer()


def save_tiny_mhc(path: str | Path, seed: int = 0, **overrides: Any) -> Path:
    path = Path(path)
    model, tok = tiny_mhc_target(seed, **overrides)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


def tiny_mhc_dir() -> Path:
    """The `tiny-mhc` folder under the deepspec cache dir (built once, atomically, under one lock for every process
    asking at once; seed 0)."""
    from deepspec.targets.embedded import build_lock, cache_root

    out = cache_root() / "targets" / NAME
    marker = out / "deepspec_target.json"

    def built() -> bool:
        return marker.is_file() and json.loads(marker.read_text()).get("format_version") == _FORMAT_VERSION

    if built():
        return out
    with build_lock(out):
        if built():  # another process built it while we waited
            return out
        tmp = Path(tempfile.mkdtemp(prefix=f".{NAME}-", dir=out.parent))
        try:
            save_tiny_mhc(tmp)
            (tmp / "deepspec_target.json").write_text(json.dumps({"format_version": _FORMAT_VERSION, "name": NAME, "seed": 0}))
            if out.exists():
                shutil.rmtree(out, ignore_errors=True)
            tmp.rename(out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out
