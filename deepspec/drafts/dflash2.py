"""DFlash2: the DFlash block drafter (deepspec/drafts/block.py) with two additions, as vLLM's DFlash2DraftModel
(model_executor/models/qwen3_dflash2.py) runs them.

* Grouped block convolutions. Each layer's attention and MLP are wrapped in an input-conditioned causal convolution
  over the block's slots: `prepare` turns the normed input u [Q, H] into coefficients c = kernel_projection(u)
  [Q, 2, taps, G] (G = H / conv_group_size groups) and returns conv(u, c[:, 0], base_kernel[0]); the attention (or
  MLP) runs on that, and the module's forward (vLLM's `finish`) applies conv(y, c[:, 1], base_kernel[1]) to its output, so
      conv(x, d, b)[s] = sum_{t < taps, t <= s} (b[t] + d[s, t, group]) * x[s - t]          (s = slot in its block).
  A block never reads another block's slots; the context keys/values (target features) are not convolved. Started
  at base_kernel[:, 0] = 1, the rest 0 and kernel_projection = 0, each conv is the identity: the draft starts as DFlash.
* A candidate selector. Slot p's distribution is rescored by the token drafted before it (the anchor for p = 0):
      logits_p(c) = lm_head(h_p)[c] + <predecessor_codebook[prev] * hidden_projection(h_p), successor_codebook[c]>.
  Decoding (vLLM's DFlash2Speculator) scores only the top `selector_top_k` tokens of lm_head(h_p) and walks the slots
  left to right, each step drawing among its candidates given the token drawn before; the proposer here does exactly
  that, and reports the drawn token's distribution (the softmax over the candidates) to the rejection sampler.
  Training uses the same bilinear term over the whole vocabulary, teacher-forced (prev = the data's token), with
  DFlash's position-decayed CE; the successor codebook starts at 0, so the term starts at 0.

Module names match vLLM's (layers.i.attention_conv / mlp_conv .base_kernel / .kernel_projection, candidate_selector
.predecessor_codebook / .successor_codebook / .hidden_projection), so the export is a rename-free copy.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from deepspec.drafts.block import BlockDraft
from deepspec.drafts.layers import DraftArch
from deepspec.drafts.registry import register
from deepspec.drafts.vocab import sample_token
from deepspec.errors import ConfigError


def block_conv(x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block_size: int) -> torch.Tensor:
    """x [B, Q, H] (Q = blocks x block_size, a block's slots contiguous), delta [B, Q, taps, G], base [taps, H] ->
    [B, Q, H] in x's dtype: slot s of each block gets sum_t (base[t] + delta[s, t]) * x[s - t] over t <= s, the
    products and sums in fp32 (as vLLM's kernel accumulates)."""
    b, q, h = x.shape
    taps, groups = base.shape[0], delta.shape[-1]
    xs = x.float().reshape(b, q // block_size, block_size, h)
    d = delta.float().reshape(b, q // block_size, block_size, taps, groups)
    out = xs.new_zeros(xs.shape)
    for t in range(min(taps, block_size)):
        coef = base[t].float() + d[..., t, :].repeat_interleave(h // groups, dim=-1)
        shifted = xs if t == 0 else F.pad(xs[:, :, :-t], (0, 0, t, 0))
        out = out + coef * shifted
    return out.view(b, q, h).to(x.dtype)


class GroupedConv(nn.Module):
    """One conv pair (before and after a sublayer); its dynamic coefficients come from the sublayer's input."""

    def __init__(self, hidden: int, taps: int, group_size: int, block_size: int):
        super().__init__()
        if taps < 1 or group_size < 1 or hidden % group_size:
            raise ConfigError(
                f"model.conv_group_size={group_size} must divide the draft's hidden size {hidden} (and "
                f"model.conv_kernel_size={taps} be >= 1); pick a divisor such as 64."
            )
        self.taps, self.groups, self.block_size = taps, hidden // group_size, block_size
        base = torch.zeros(2, taps, hidden)
        base[:, 0] = 1.0
        self.base_kernel = nn.Parameter(base)
        self.kernel_projection = nn.Linear(hidden, 2 * taps * self.groups, bias=False)
        nn.init.zeros_(self.kernel_projection.weight)

    def prepare(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """u [B, Q, H] -> (the sublayer's input, the coefficients forward uses)."""
        c = self.kernel_projection(u).unflatten(-1, (2, self.taps, self.groups))
        return block_conv(u, c[..., 0, :, :], self.base_kernel[0], self.block_size), c[..., 1, :, :]

    def forward(self, y: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
        """vLLM's `finish`: the sublayer's output y convolved with the second coefficients (a module call, so hooks
        see each layer's output: `deepspec check` records the residual stream there)."""
        return block_conv(y, coef, self.base_kernel[1], self.block_size)


class CandidateSelector(nn.Module):
    """The first-order pair term: z = predecessor_codebook[prev] * hidden_projection(h); bias = z @ successor_codebook^T."""

    def __init__(self, hidden: int, vocab: int, rank: int, top_k: int):
        super().__init__()
        if rank < 1 or top_k < 1:
            raise ConfigError(f"model.selector_rank ({rank}) and model.selector_top_k ({top_k}) must be >= 1 for DFlash2.")
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.randn(vocab, rank) * 0.02)
        self.successor_codebook = nn.Parameter(torch.zeros(vocab, rank))
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)

    def features(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """h [..., H], prev [...] target ids -> z [..., r]."""
        return self.predecessor_codebook[prev].to(h.dtype) * self.hidden_projection(h)

    def bias(self, z: torch.Tensor, candidates: torch.Tensor | None = None) -> torch.Tensor:
        """z [..., r] -> the pair term over the vocabulary [..., V], or over `candidates` [..., k] only."""
        if candidates is None:
            return z @ self.successor_codebook.to(z.dtype).T
        return (self.successor_codebook[candidates].to(z.dtype) * z.unsqueeze(-2)).sum(-1)


@register("dflash2")
class DFlash2Draft(BlockDraft):
    default_sample_from_anchor = False
    muon_exclude = ("candidate_selector.",)  # token tables and their head: AdamW, as the other heads (train/optim.py)

    def __init__(self, arch: DraftArch, model_cfg: Any, taps: list[int]):
        super().__init__(arch, model_cfg, taps)
        if self.reduced_vocab:
            raise ConfigError(
                "DFlash2 drafts over the target's whole vocabulary (vLLM's candidate walk has no draft-vocabulary map); "
                "set model.draft_vocab_size to null."
            )
        h = arch.hidden_size
        for layer in self.layers:
            layer.attention_conv = GroupedConv(h, model_cfg.conv_kernel_size, model_cfg.conv_group_size, self.block_size)
            layer.mlp_conv = GroupedConv(h, model_cfg.conv_kernel_size, model_cfg.conv_group_size, self.block_size)
        self.candidate_selector = CandidateSelector(h, arch.vocab_size, model_cfg.selector_rank, model_cfg.selector_top_k)

    @staticmethod
    def _layer(i, layer, mask, attn, x, kc, vc, cos, sin):
        """DFlash's layer with each sublayer between its conv pair (vLLM's DFlash2Qwen3DecoderLayer.forward)."""
        u, coef = layer.attention_conv.prepare(layer.input_layernorm(x))
        x = x + layer.attention_conv(BlockDraft._attention(i, layer, mask, attn, u, kc, vc, cos, sin), coef)
        u, coef = layer.mlp_conv.prepare(layer.post_attention_layernorm(x))
        return x + layer.mlp_conv(layer.mlp(u), coef)

    def _head_features(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        return self.candidate_selector.features(h, prev)

    def _head_bias(self, z: torch.Tensor) -> torch.Tensor:
        return self.candidate_selector.bias(z)

    def draft_block(self, h, anchor_token, num_tokens, temperature, generator):
        """vLLM's candidate walk: slot p draws among the top-k tokens of its LM-head logits, scored with the pair term
        of the token drawn before it (greedy: the best score)."""
        sel = self.candidate_selector
        unary = self.base_logits(h).float()
        values, cands = unary.topk(min(sel.top_k, unary.shape[-1]), dim=-1)
        prev = torch.tensor([anchor_token], device=h.device)
        toks, probs = [], []
        self.last_scores = []  # what `deepspec check` compares with vLLM's walk
        for p in range(min(num_tokens, h.shape[0])):
            scores = values[p] + sel.bias(sel.features(h[p : p + 1], prev), cands[p : p + 1]).float()[0]
            self.last_scores.append(scores)
            tok, pr = sample_token(scores, cands[p], self.arch.vocab_size, temperature, generator)
            toks.append(tok)
            probs.append(pr)
            prev = torch.tensor([tok], device=h.device)
        return toks, probs
