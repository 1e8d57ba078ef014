"""DSpark: the DFlash backbone + a sequential Markov head + a confidence head.

Logits of prediction k: base U_k = lm_head(h_k) plus a prefix-dependent bias B_k = W2 z_k where z_k
depends on the previous token (teacher-forced in training, the previously *sampled* token when
decoding), so every per-token distribution stays an exact softmax for rejection sampling:
  * vanilla: z = W1[prev]                        (first-order low-rank transition)
  * gated:   z = sigmoid(gate([h; W1[prev]])) * W1[prev]
  * rnn:     s_k = g*s_{k-1} + (1-g)*tanh(c), z = tanh(o), [g, c, o] = cell([h; W1[prev]; s_{k-1}])
Confidence c_k = sigmoid(proj([h_k; W1[prev]])) is trained towards the analytic acceptance 1 - TV.
Loss = ce_loss_alpha*CE + l1_loss_alpha*||p_d - p_t||_1 + confidence_head_alpha*BCE, decayed by
exp(-k/loss_decay_gamma). Anchor slot predicts (`sample_from_anchor: true`), as vLLM's Qwen3DSparkModel.
Module names match vLLM's (markov_head.markov_w1/markov_w2, confidence_head.proj).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from deepspec.drafts.block import BlockDraft
from deepspec.drafts.layers import DraftArch
from deepspec.drafts.registry import register
from deepspec.drafts.vocab import sample_token
from deepspec.errors import ConfigError


class MarkovHead(nn.Module):
    """markov_w1 embeds the previous token (a target id); markov_w2 writes a bias over the draft vocabulary
    (draft_vocab, = vocab without one), the sizes vLLM's DSparkMarkovHead builds."""

    def __init__(self, kind: str, vocab: int, hidden: int, rank: int, draft_vocab: int | None = None):
        super().__init__()
        if kind not in ("vanilla", "gated", "rnn"):
            raise ConfigError(f"model.markov_head_type='{kind}' is unknown; use vanilla, gated or rnn.")
        self.kind, self.rank = kind, rank
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, vocab if draft_vocab is None else draft_vocab, bias=False)
        nn.init.normal_(self.markov_w1.weight, std=0.02)
        nn.init.zeros_(self.markov_w2.weight)  # starts as plain DFlash
        if kind == "gated":
            self.gate = nn.Linear(hidden + rank, rank)
        elif kind == "rnn":
            self.cell = nn.Linear(hidden + 2 * rank, 3 * rank)

    def step(self, h: torch.Tensor, prev: torch.Tensor, state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One prediction: h [N, H], prev [N] -> (z [N, r], new state)."""
        e = self.markov_w1(prev).to(h.dtype)
        if self.kind == "vanilla":
            return e, None
        if self.kind == "gated":
            return torch.sigmoid(self.gate(torch.cat([h, e], -1))) * e, None
        s = torch.zeros_like(e) if state is None else state
        g, c, o = self.cell(torch.cat([h, e, s], -1)).chunk(3, dim=-1)
        g = torch.sigmoid(g)
        s = g * s + (1 - g) * torch.tanh(c)
        return torch.tanh(o), s

    def features(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """Teacher-forced z for a whole block: h [N, P, H], prev [N, P] -> [N, P, r]."""
        if self.kind != "rnn":
            return self.step(h.reshape(-1, h.shape[-1]), prev.reshape(-1), None)[0].view(*prev.shape, -1)
        state, out = None, []
        for k in range(prev.shape[1]):
            z, state = self.step(h[:, k], prev[:, k], state)
            out.append(z)
        return torch.stack(out, dim=1)


class ConfidenceHead(nn.Module):
    def __init__(self, hidden: int, rank: int, with_markov: bool):
        super().__init__()
        self.with_markov = with_markov
        self.proj = nn.Linear(hidden + (rank if with_markov else 0), 1, bias=True)

    def forward(self, h: torch.Tensor, markov_embed: torch.Tensor) -> torch.Tensor:
        x = torch.cat([h, markov_embed.to(h.dtype)], -1) if self.with_markov else h
        return self.proj(x.float() if self.proj.weight.dtype == torch.float32 else x).squeeze(-1)


@register("dspark")
class DSparkDraft(BlockDraft):
    default_sample_from_anchor = True

    def __init__(self, arch: DraftArch, model_cfg: Any, taps: list[int]):
        super().__init__(arch, model_cfg, taps)
        if model_cfg.markov_rank < 1:
            raise ConfigError("model.markov_rank must be >= 1 for DSpark (use model.algorithm=dflash for no Markov head).")
        self.markov_head = MarkovHead(model_cfg.markov_head_type, arch.vocab_size, arch.hidden_size, model_cfg.markov_rank, self.draft_vocab_size)
        self.confidence_head = (
            ConfidenceHead(arch.hidden_size, model_cfg.markov_rank, model_cfg.confidence_head_with_markov)
            if model_cfg.enable_confidence_head else None
        )

    def _head_features(self, h, prev):
        return self.markov_head.features(h, prev)

    def _head_bias(self, z):
        return self.markov_head.markov_w2(z)

    def _confidence_logit(self, h, prev):
        if self.confidence_head is None:
            return None
        return self.confidence_head(h, self.markov_head.markov_w1(prev))

    def _loss_weights(self):
        c = self.model_cfg
        return c.ce_loss_alpha, c.l1_loss_alpha, (c.confidence_head_alpha if self.confidence_head is not None else 0.0)

    def draft_block(self, h, anchor_token, num_tokens, temperature, generator):
        """Left-to-right sampling: each slot's bias uses the token sampled just before it; stops at the
        first slot whose confidence is below model.confidence_threshold (0 = off)."""
        base = self.base_logits(h)
        tids = self.vocab_target_ids()
        threshold = self.model_cfg.confidence_threshold
        prev = torch.tensor([anchor_token], device=h.device)
        state = None
        toks, probs = [], []
        self.last_confidence = []
        self.last_confidence_logits = []  # the head's raw logits, per slot (what eval/calibration.py fits)
        for p in range(min(num_tokens, h.shape[0])):
            z, state = self.markov_head.step(h[p : p + 1], prev, state)
            if self.confidence_head is not None:
                logit = self.confidence_head(h[p : p + 1], self.markov_head.markov_w1(prev))
                c = float(torch.sigmoid(logit))
                self.last_confidence.append(c)
                self.last_confidence_logits.append(float(logit))
                if threshold > 0 and c < threshold:
                    break
            logits = base[p] + self.markov_head.markov_w2(z)[0]
            tok, pr = sample_token(logits, tids, self.arch.vocab_size, temperature, generator)
            toks.append(tok)
            probs.append(pr)
            prev = torch.tensor([tok], device=h.device)
        return toks, probs
