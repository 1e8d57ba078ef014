"""The block drafter shared by DFlash and DSpark: one parallel forward drafts a whole block.

Context: ctx = hidden_norm(fc(taps)) of every committed position, injected as extra keys/values
(k_proj/v_proj of ctx, with k_norm and RoPE) into every draft layer. A block for anchor a is
[token a, MASK x (K-1)] at positions a..a+K-1; it attends to context positions < a (strict: the
anchor has no target hidden state yet at decoding time) and bidirectionally to its own K slots,
never to another block.

Which slots predict (`sample_from_anchor`):
  * false (DFlash, what vLLM's DFlashDraftModel runs): slot j >= 1 predicts token a+j -> K-1 drafts;
  * true (DSpark, DeepSpec's "anchor as first prediction"): slot j predicts token a+j+1 -> K drafts.
Prediction p (0-based) of anchor a is therefore always token a+1+p, and is supervised while the
labels a+1..a+1+p are all loss-masked response tokens (contiguous-prefix masking), with weight
exp(-p / loss_decay_gamma).

Losses and the full-vocabulary softmax / TV run over chunks of `model.vocab_chunk_rows` rows under
activation checkpointing, so the [rows, V] logits of a 150k vocabulary never exist all at once.

Draft vocabulary (`model.draft_vocab_size` < the target's vocabulary): the most frequent loss-masked target ids of
the training data, chosen as for EAGLE-3 (d2t / t2d, `set_token_frequencies` in common.py). The draft then scores
only those ids with `lm_head` = the target LM head's rows for them, frozen like the full head, and maps what it
samples back to target ids. Null or >= the target's vocabulary: the full frozen target head, no d2t / t2d.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from deepspec.drafts.anchors import sample_anchors as draw_anchors
from deepspec.drafts.attention import BlockBounds, block_attention, dense_block_mask
from deepspec.drafts.base import LOSS_WEIGHT, DraftBatch, Metrics, Proposer
from deepspec.drafts.common import TargetBackedDraft
from deepspec.drafts.layers import DecoderLayer, DraftArch, RotaryEmbedding, attend, softcap
from deepspec.drafts.losses import gemm_dtype
from deepspec.drafts.flex import flex_block_attention
from deepspec.drafts.plan import StepPlan, bucket, use_buckets
from deepspec.drafts.vocab import sample_token

KV = tuple[torch.Tensor, torch.Tensor]

# Mask token ids for targets whose tokenizer has no mask token. SmolLM2 (vocab 49152, every id used):
# 16 = "<empty_output>", a StarCoder notebook special that chat never produces. Qwen3: 151669, an
# unused row of the padded embedding (as DeepSpec/z-lab use).
KNOWN_MASK_TOKENS = {49152: 16, 151936: 151669}


def default_mask_token_id(vocab_size: int, tokenizer: Any = None) -> int:
    """The tokenizer's mask token, else a documented choice per vocabulary, else the last embedding row
    (unused padding in padded vocabularies such as the tiny test targets')."""
    if tokenizer is not None and getattr(tokenizer, "mask_token_id", None) is not None:
        return int(tokenizer.mask_token_id)
    return KNOWN_MASK_TOKENS.get(vocab_size, vocab_size - 1)


class BlockDraft(TargetBackedDraft):
    """DFlash backbone; subclasses add sequential heads (DSpark) through the `_head_*` hooks."""

    default_qk_norm = True  # Qwen3-style layers (what vLLM's DFlash/DSpark models build), for every target family
    default_sample_from_anchor = False

    def __init__(self, arch: DraftArch, model_cfg: Any, taps: list[int]):
        super().__init__(arch, model_cfg, taps)
        n, ht, h = len(taps), arch.target_hidden_size, arch.hidden_size
        self.draft_vocab_size = self._draft_vocab_size(model_cfg.draft_vocab_size)
        if self.reduced_vocab:
            # the target head's rows of the draft vocabulary (filled when the target and the token counts arrive), frozen
            # as the full head is; a module of its own so checkpoints and exports carry it as `lm_head.weight`
            self.lm_head = nn.Linear(h, self.draft_vocab_size, bias=False)
            self.lm_head.weight.requires_grad_(False)
            self._register_draft_vocab(self.draft_vocab_size)
        self.fc = nn.Linear(n * ht, h, bias=False)
        self.hidden_norm = arch.make_norm(h)
        self.layers = nn.ModuleList([DecoderLayer(arch) for _ in range(arch.num_layers)])
        self.norm = arch.make_norm(h)
        self.rotary = RotaryEmbedding(arch)
        self.block_size = model_cfg.block_size
        self.mask_token_id = model_cfg.mask_token_id if model_cfg.mask_token_id is not None else default_mask_token_id(arch.vocab_size)
        if not 0 <= self.mask_token_id < arch.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the target vocabulary (0..{arch.vocab_size - 1})")
        sfa = model_cfg.sample_from_anchor
        self.sample_from_anchor = self.default_sample_from_anchor if sfa is None else bool(sfa)

    @property
    def reduced_vocab(self) -> bool:
        """True when the draft scores a draft vocabulary smaller than the target's."""
        return self.draft_vocab_size < self.arch.vocab_size

    def _on_target_loaded(self) -> None:
        if self.reduced_vocab:
            with torch.no_grad():
                self.lm_head.weight.copy_(self.target_lm_head[self.draft_target_ids()].to(self.lm_head.weight.dtype))

    def head_weight(self) -> torch.Tensor:
        """The LM head the draft scores with: the target's whole head, or its rows of the draft vocabulary [Dv, H]."""
        return self.lm_head.weight if self.reduced_vocab else self.target_lm_head

    def vocab_target_ids(self) -> torch.Tensor:
        """[Dv] the target id of every column of the draft's logits."""
        if self.reduced_vocab:
            return self.draft_target_ids()
        return torch.arange(self.arch.vocab_size, device=self.target_lm_head.device)

    @property
    def num_predictions(self) -> int:
        return self.block_size - 1 + int(self.sample_from_anchor)

    @property
    def first_slot(self) -> int:
        return 0 if self.sample_from_anchor else 1

    def export_config(self) -> dict[str, Any]:
        out = super().export_config()
        out.update(mask_token_id=self.mask_token_id, sample_from_anchor=self.sample_from_anchor, block_size=self.block_size)
        return out

    # --- backbone ---------------------------------------------------------------------------------
    def context(self, taps: torch.Tensor) -> torch.Tensor:
        return self.hidden_norm(self.fc(taps.flatten(-2).to(self.fc.weight.dtype)))

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> list[KV]:
        """Per-layer keys/values of the context features (the same ctx feeds every layer)."""
        cos, sin = self.rotary(positions, ctx.dtype)
        return [layer.self_attn.project_kv(ctx, cos, sin) for layer in self.layers]

    def backbone(self, x: torch.Tensor, positions: torch.Tensor, ctx_kv: list[KV], mask, attn=None) -> torch.Tensor:
        """x [B, Q, H] block embeddings at `positions` -> final-normed hidden [B, Q, H].
        mask [B, 1, Q, S+Q] covers the context keys then the block keys (one tensor, or a list with one per
        layer; None = every key); attn(i, q, k_block, v_block, k_ctx, v_ctx) replaces it (training)."""
        cos, sin = self.rotary(positions, x.dtype)
        ckpt = self.model_cfg.activation_checkpointing and self.training and torch.is_grad_enabled()
        for i, (layer, (kc, vc)) in enumerate(zip(self.layers, ctx_kv)):
            layer_mask = mask[i] if isinstance(mask, (list, tuple)) else mask
            fn = partial(self._layer, i, layer, layer_mask, attn)
            x = checkpoint(fn, x, kc, vc, cos, sin, use_reentrant=False) if ckpt else fn(x, kc, vc, cos, sin)
        return self.norm(x)

    @staticmethod
    def _layer(i, layer, mask, attn, x, kc, vc, cos, sin):
        x = x + BlockDraft._attention(i, layer, mask, attn, layer.input_layernorm(x), kc, vc, cos, sin)
        return x + layer.mlp(layer.post_attention_layernorm(x))

    @staticmethod
    def _attention(i, layer, mask, attn, hq, kc, vc, cos, sin):
        """The layer's attention output (o_proj applied) for normed block states hq over the context keys and the block's."""
        a = layer.self_attn
        q = a.project_q(hq, cos, sin)
        k, v = a.project_kv(hq, cos, sin)
        if attn is not None:
            o = attn(i, q, k, v, kc, vc)
        else:
            o = attend(q, torch.cat([kc, k], dim=2), torch.cat([vc, v], dim=2), mask)
        return a.output(o)

    def base_logits(self, h: torch.Tensor) -> torch.Tensor:
        return softcap(h @ self.head_weight().to(h.dtype).T, self.arch.logit_softcap)

    # --- sequential head hooks (DSpark overrides) ---------------------------------------------------
    def _head_features(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor | None:
        """h [N, P, H], prev [N, P] (token before each prediction) -> per-prediction head features or None."""
        return None

    def _head_bias(self, z: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _confidence_logit(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor | None:
        return None

    def _loss_weights(self) -> tuple[float, float, float]:
        """(ce, l1, confidence) loss weights; DFlash trains with CE only (DeepSpec's DFlash recipe)."""
        return 1.0, 0.0, 0.0

    # --- training ---------------------------------------------------------------------------------
    def sample_anchors(
        self,
        loss_mask: torch.Tensor,
        attention_mask: torch.Tensor,
        segment_ids: torch.Tensor | None = None,
        input_ids: torch.Tensor | None = None,
        key: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """min(num_anchors, valid_i) anchors per sample i, packed or padded, among a with loss_mask[a] & loss_mask[a+1]
        (same sample); returns (anchors [B, A] sorted, keep [B, A]); missing anchors are dummies (position 0, keep
        False). With input_ids a sample draws the same anchors in a packed row as in a padded one (drafts/anchors.py).
        key: the draw's key (a training micro-batch's seed, from the loader); without it, outside training the draw
        comes from a fixed seed, so validation metrics are reproducible, and in training from torch's generator."""
        seed = None if key is not None or self.training else self.VALIDATION_ANCHOR_SEED
        return draw_anchors(loss_mask, attention_mask, self.model_cfg.num_anchors, segment_ids, input_ids, seed, key)

    VALIDATION_ANCHOR_SEED = 1234

    def _block_ids_pos(self, input_ids: torch.Tensor, anchors: torch.Tensor, positions: torch.Tensor | None = None):
        """Block token ids [B, A*K] ([token a, MASK x (K-1)]) and their RoPE positions (anchor's + slot)."""
        b, _ = input_ids.shape
        k = self.block_size
        na = anchors.shape[1]
        slot = torch.arange(k, device=input_ids.device)
        ids = torch.full((b, na, k), self.mask_token_id, dtype=input_ids.dtype, device=input_ids.device)
        ids[:, :, 0] = input_ids.gather(1, anchors)
        base = anchors if positions is None else positions.gather(1, anchors)
        return ids.reshape(b, na * k), (base.unsqueeze(-1) + slot).reshape(b, na * k)

    def block_inputs(self, input_ids: torch.Tensor, anchors: torch.Tensor, keep: torch.Tensor, attention_mask: torch.Tensor):
        """Block token ids / positions [B, A*K] and the dense attention mask [B, 1, A*K, T + A*K] (the reference
        the masked-free training attention is tested against)."""
        ids, pos = self._block_ids_pos(input_ids, anchors)
        mask = dense_block_mask(anchors, torch.zeros_like(anchors), keep, attention_mask, self.block_size)
        return ids, pos, mask

    def block_labels(self, input_ids, loss_mask, attention_mask, anchors, keep, segment_ids=None):
        """Prediction p of anchor a targets token a+1+p. Returns (labels [B, A, P], eval_mask [B, A, P]:
        the contiguous supervised prefix within the anchor's sample, label positions clamped to T-1 [B, A, P])."""
        b, t = input_ids.shape
        na, p_n = anchors.shape[1], self.num_predictions
        label_pos = anchors.unsqueeze(-1) + 1 + torch.arange(p_n, device=anchors.device)
        lp = label_pos.clamp(max=t - 1)
        flat = lp.view(b, -1)
        labels = input_ids.gather(1, flat).view(b, na, p_n)
        ok = (label_pos < t) & loss_mask.bool().gather(1, flat).view(b, na, p_n) & attention_mask.bool().gather(1, flat).view(b, na, p_n)
        if segment_ids is not None:
            ok = ok & (segment_ids.gather(1, flat).view(b, na, p_n) == segment_ids.gather(1, anchors).unsqueeze(-1))
        ok = ok & keep.unsqueeze(-1)
        return labels, ok.long().cumprod(dim=-1).bool(), lp

    def plan_batch(self, batch: DraftBatch, key: int | None = None, buckets: bool | None = None) -> StepPlan:
        """The anchors of `batch` and their chunk plans (deepspec/drafts/plan.py). The loader calls this on the CPU
        batch with the micro-batch's seed as `key`; without a key the draw is a training one from torch's generator, or
        the fixed validation draw when the draft is in eval mode."""
        anchors, keep = self.sample_anchors(batch.loss_mask, batch.attention_mask, batch.segment_ids, batch.input_ids, key)
        return self.plan_anchors(batch, anchors, keep, use_buckets(anchors.device) if buckets is None else buckets)

    def plan_anchors(self, batch: DraftBatch, anchors: torch.Tensor, keep: torch.Tensor, buckets: bool = False) -> StepPlan:
        """The plan for given anchors [B, A] / keep [B, A] (reads them on the host). With buckets a data-dependent anchor
        count (packed rows) is padded with dummy anchors to a `bucket` count, so chunk shapes come from the ladder."""
        a_n = anchors.shape[1]
        if buckets and a_n != self.model_cfg.num_anchors and bucket(a_n) > a_n:
            extra = bucket(a_n) - a_n
            anchors, keep = F.pad(anchors, (0, extra)), F.pad(keep, (0, extra))
        # a packed sample starts where its positions restart: anchor row - anchor position
        ctx_start = torch.zeros_like(anchors) if batch.position_ids is None else anchors - batch.position_ids.gather(1, anchors)
        bounds = BlockBounds.of(anchors, ctx_start, keep, batch.input_ids.shape[1], buckets)
        return StepPlan([], buckets, anchors, keep, ctx_start, bounds)

    def block_hidden(self, batch: DraftBatch, plan: StepPlan | torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states of every block slot: [B, A, K, H]. Blocks see context rows of their own sample
        before the anchor (block_attention: no dense mask; key ranges from the plan's host copies). plan: a StepPlan,
        or anchors [B, A] (with keep [B, A], default all) to plan here."""
        if isinstance(plan, torch.Tensor):
            plan = self.plan_anchors(batch, plan, torch.ones_like(plan, dtype=torch.bool) if keep is None else keep)
        b, t = batch.input_ids.shape
        anchors, keep, ctx_start = plan.anchors, plan.keep, plan.ctx_start
        positions = batch.positions()
        ids, pos = self._block_ids_pos(batch.input_ids, anchors, positions)
        ctx = self.context(batch.taps)
        x = self.embed(ids).to(ctx.dtype)
        am = batch.attention_mask.bool()
        recompute = bool(self.model_cfg.activation_checkpointing)  # trading compute for memory: the chunks' masks too

        def attn(i, q, kb, vb, kc, vc):
            if plan.kernel == "flex":
                return flex_block_attention(q, kb, vb, kc, vc, anchors, ctx_start, keep, am, self.arch.window(i), plan.bounds)
            return block_attention(q, kb, vb, kc, vc, anchors, ctx_start, keep, am, self.arch.window(i), plan.bounds, recompute)

        h = self.backbone(x, pos, self.context_kv(ctx, positions), None, attn=attn)
        return h.view(b, anchors.shape[1], self.block_size, -1)

    def loss(self, batch: DraftBatch, anchors: torch.Tensor | None = None, keep: torch.Tensor | None = None) -> tuple[torch.Tensor, Metrics]:
        """Position-decayed CE on the data's next tokens (+ DSpark's L1 to the target and confidence BCE) and metrics.

        With a draft vocabulary the loss is computed over it, as EAGLE-3 does: EAGLE-3 trains on the target's
        distribution renormalised over the draft vocabulary, so target mass outside it adds nothing to its loss.
        Here the label is one token, so a prediction whose label lies outside the draft vocabulary adds nothing
        to the CE (ce_loss is the mean over the other supervised predictions). L1 / alpha / top-1 / tau compare the
        draft (zero outside its vocabulary) with the target's full distribution, as EAGLE-3's alpha does, so mass
        outside the draft vocabulary counts as rejected there."""
        ids, lm, am = batch.input_ids, batch.loss_mask.bool(), batch.attention_mask.bool()
        b, t = ids.shape
        dev = ids.device
        if anchors is not None:  # given anchors (tests, benchmarks): planned here
            plan = self.plan_anchors(batch, anchors, torch.ones_like(anchors, dtype=torch.bool) if keep is None else keep)
        else:  # the loader's plan, else drawn and planned here (one host read)
            plan = batch.plan if batch.plan is not None and batch.plan.anchors is not None else self.plan_batch(batch)
        anchors, keep = plan.anchors, plan.keep
        na, p_n = anchors.shape[1], self.num_predictions
        h = self.block_hidden(batch, plan)[:, :, self.first_slot :]  # [B, A, P, H]
        p_idx = torch.arange(p_n, device=dev)
        labels, eval_mask, lp = self.block_labels(ids, lm, am, anchors, keep, batch.segment_ids)
        prev = ids.gather(1, (lp - 1).view(b, -1)).view(b, na, p_n)  # token a+p, the one before each label
        z = self._head_features(h.reshape(b * na, p_n, -1), prev.reshape(b * na, p_n))
        conf = self._confidence_logit(h.reshape(b * na, p_n, -1), prev.reshape(b * na, p_n))
        weights = torch.exp(-p_idx.float() / self.model_cfg.loss_decay_gamma).expand(b, na, p_n)
        # every prediction row, unsupervised ones at weight 0 (selecting rows would read their count on the host)
        sel = eval_mask.reshape(-1)
        rows_h = h.reshape(-1, h.shape[-1])
        rows_z = None if z is None else z.reshape(-1, z.shape[-1])
        rows_conf = None if conf is None else conf.reshape(-1)
        rows_label = labels.reshape(-1)
        ce_alpha, l1_alpha, conf_alpha = self._loss_weights()
        # a loss of CE alone (DFlash) on a step whose metrics nobody reads: the target's distribution, the L1 and the
        # acceptance terms are metrics only — skip its [rows, V] head product and the terms (the loss is the same)
        with_metrics = self.train_metrics or not self.training
        ce_only = not with_metrics and l1_alpha == 0 and conf is None
        rows_fh = None if ce_only else batch.final_hidden.gather(
            1, (lp - 1).view(b, -1, 1).expand(-1, -1, batch.final_hidden.shape[-1])).reshape(-1, batch.final_hidden.shape[-1])
        rows_w = weights.reshape(-1) * sel
        ce_w = rows_w
        if self.reduced_vocab:
            ce_w = rows_w * self.t2d[rows_label]  # labels outside the draft vocabulary: no CE (see the docstring)
            rows_label = (torch.cumsum(self.t2d, 0) - 1).clamp(min=0)[rows_label]  # target id -> draft id
        ce, l1, alpha, top = self._row_terms(rows_h, rows_z, rows_fh, rows_label, with_metrics)
        w_sum = rows_w.sum().clamp(min=1e-9)
        ce_loss = (ce_w * ce).sum() / ce_w.sum().clamp(min=1e-9)
        metrics: Metrics = {"ce_loss": ((ce_w * ce).sum().detach(), ce_w.sum())}
        samples = ((batch.positions() == 0) & am).sum().float()  # packed rows hold several samples
        metrics["anchors"] = (keep.sum().float(), samples)  # anchors per sample
        metrics[LOSS_WEIGHT] = (rows_w.sum().detach(), torch.ones((), device=dev))
        if ce_only:
            return ce_alpha * ce_loss, metrics
        l1_loss = (rows_w * l1).sum() / w_sum
        total = ce_alpha * ce_loss + l1_alpha * l1_loss
        metrics["l1_loss"] = ((rows_w * l1).sum().detach(), rows_w.sum())
        if rows_conf is not None:
            target_acc = (1.0 - 0.5 * l1).detach().clamp(0.0, 1.0)
            bce = F.binary_cross_entropy_with_logits(rows_conf.float(), target_acc, reduction="none")
            conf_loss = (rows_w * bce).sum() / w_sum
            total = total + conf_alpha * conf_loss
            metrics["confidence_loss"] = ((rows_w * bce).sum().detach(), rows_w.sum())
            if with_metrics:
                err = (torch.sigmoid(rows_conf.detach().float()) - target_acc).abs() * sel
                metrics["confidence_abs_error"] = (err.sum(), sel.sum().float())
        if with_metrics:
            metrics.update(self._depth_metrics(alpha, top, eval_mask))
        return total, metrics

    def _row_terms(self, h, z, fh, labels, with_metrics: bool = True):
        """Per supervised row: (CE, L1 = ||p_d - p_t||_1, alpha = sum min(p_d, p_t), top-1 match), chunked.
        labels are draft ids (= target ids without a draft vocabulary). fh None: CE alone (the others None);
        with_metrics False: alpha and top-1 (metrics only) None."""
        n = h.shape[0]
        if n == 0:
            zero = h.sum() * 0.0
            e = torch.zeros(0, device=h.device)
            return zero.expand(0), zero.expand(0), e, e
        chunk = max(1, int(self.model_cfg.vocab_chunk_rows))
        head = self.head_weight()
        head = head.to(gemm_dtype(h, head))  # cast once per loss, not per chunk (no-op: frozen head in the training dtype)
        terms = partial(self._chunk_terms, head=head, tids=self.draft_target_ids() if self.reduced_vocab else None,
                        with_metrics=with_metrics)
        ces, l1s, alphas, tops = [], [], [], []
        for i in range(0, n, chunk):
            args = (h[i : i + chunk], None if fh is None else fh[i : i + chunk], labels[i : i + chunk]) + (() if z is None else (z[i : i + chunk],))
            if torch.is_grad_enabled() and h.requires_grad and n > chunk:
                ce, l1, alpha, top = checkpoint(terms, *args, use_reentrant=False)
            else:
                ce, l1, alpha, top = terms(*args)
            ces.append(ce), l1s.append(l1), alphas.append(alpha), tops.append(top)
        if fh is None:
            return torch.cat(ces), None, None, None
        if not with_metrics:
            return torch.cat(ces), torch.cat(l1s), None, None
        return torch.cat(ces), torch.cat(l1s), torch.cat(alphas), torch.cat(tops)

    def _chunk_terms(self, h, fh, labels, z=None, tids=None, head=None, with_metrics=True):
        """tids [Dv]: the target ids of the draft vocabulary's columns (None = the full vocabulary). head: the LM head in
        the GEMM dtype (bf16 under bf16 autocast); softmax, log-normalisers and the terms are fp32. with_metrics False:
        alpha and top-1 are None."""
        head = self.head_weight() if head is None else head
        dt = gemm_dtype(h, head)
        logits = softcap(F.linear(h.to(dt), head.to(dt)).float(), self.arch.logit_softcap)
        if z is not None:
            logits = logits + self._head_bias(z).float()
        logp = torch.log_softmax(logits, dim=-1)
        ce = -logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        if fh is None:
            return ce, None, None, None
        with torch.no_grad():
            p_t = torch.softmax(self.target_logits(fh), dim=-1)
        p_d = logp.exp()
        if tids is None:
            l1 = (p_d - p_t).abs().sum(-1)
            if not with_metrics:
                return ce, l1, None, None
            alpha = torch.minimum(p_d.detach(), p_t).sum(-1)
            top = (logits.detach().argmax(-1) == p_t.argmax(-1)).float()
            return ce, l1, alpha, top
        p_in = p_t[:, tids]  # the target's probabilities of the draft vocabulary; the draft puts 0 on the rest
        l1 = (p_d - p_in).abs().sum(-1) + (1.0 - p_in.sum(-1)).clamp(min=0.0)
        if not with_metrics:
            return ce, l1, None, None
        alpha = torch.minimum(p_d.detach(), p_in).sum(-1)
        top = (tids[logits.detach().argmax(-1)] == p_t.argmax(-1)).float()
        return ce, l1, alpha, top

    def _depth_metrics(self, alpha, top, eval_mask) -> Metrics:
        """alpha_tf@k / top1@k per prediction depth over supervised predictions (teacher-forced prefix);
        expected_tau / greedy_tau per block = 1 + sum_k prod_{i<=k} alpha_i over its supervised prefix
        (blocks with at least one supervised prediction); survival@k = mean prod_{i<=k} alpha_i.
        alpha / top: one value per prediction row (every row; the mask picks the supervised ones)."""
        out: Metrics = {}
        p_n = self.num_predictions
        a_full = alpha.detach().float().view(-1, p_n)
        t_full = top.float().view(-1, p_n)
        m = eval_mask.reshape(-1, p_n).float()
        for k in range(p_n):
            cnt = m[:, k].sum()
            out[f"alpha_tf@{k + 1}"] = ((a_full[:, k] * m[:, k]).sum(), cnt)
            out[f"top1@{k + 1}"] = ((t_full[:, k] * m[:, k]).sum(), cnt)
        e_cum = torch.cumprod(torch.where(m.bool(), a_full, torch.zeros_like(a_full)), dim=1) * m
        g_cum = torch.cumprod(torch.where(m.bool(), t_full, torch.zeros_like(t_full)), dim=1) * m
        blocks = m[:, 0]
        for k in range(p_n):
            out[f"survival@{k + 1}"] = (e_cum[:, k].sum(), m[:, k].sum())
        out["expected_tau"] = (((1 + e_cum.sum(1)) * blocks).sum(), blocks.sum())
        out["greedy_tau"] = (((1 + g_cum.sum(1)) * blocks).sum(), blocks.sum())
        return out

    # --- decoding ---------------------------------------------------------------------------------
    def proposer(self) -> "BlockProposer":
        return BlockProposer(self)

    def draft_block(self, h: torch.Tensor, anchor_token: int, num_tokens: int, temperature: float, generator):
        """h [P, H] prediction-slot hidden states -> (tokens, probs); DFlash samples slots independently."""
        logits = self.base_logits(h)
        tids = self.vocab_target_ids()
        toks, probs = [], []
        for p in range(min(num_tokens, h.shape[0])):
            tok, pr = sample_token(logits[p], tids, self.arch.vocab_size, temperature, generator)
            toks.append(tok)
            probs.append(pr)
        return toks, probs


class BlockProposer(Proposer):
    """Caches the context K/V of committed positions; each call runs one block forward."""

    def __init__(self, draft: BlockDraft):
        self.draft = draft
        self.reset()

    def reset(self) -> None:
        self.ctx_kv: list[KV] | None = None
        self.n = 0
        self.last_hidden: torch.Tensor | None = None

    @torch.no_grad()
    def propose(self, input_ids, new_taps, start, num_tokens, temperature=0.0, generator=None):
        d = self.draft
        dev, dtype = d.fc.weight.device, d.fc.weight.dtype
        total = input_ids.numel()
        if start > self.n:
            raise ValueError(f"propose(start={start}) skips positions {self.n}..{start - 1} the draft never saw")
        if self.ctx_kv is not None and start < self.n:
            self.ctx_kv = [(k[:, :, :start], v[:, :, :start]) for k, v in self.ctx_kv]
        self.n = start
        m = total - 1 - start
        if m > 0:
            ctx = d.context(new_taps.to(device=dev, dtype=dtype).unsqueeze(0))
            kv = d.context_kv(ctx, torch.arange(start, total - 1, device=dev).unsqueeze(0))
            self.ctx_kv = kv if self.ctx_kv is None else [(torch.cat([c[0], x[0]], 2), torch.cat([c[1], x[1]], 2)) for c, x in zip(self.ctx_kv, kv)]
            self.n = total - 1
        if self.ctx_kv is None or num_tokens <= 0:
            return torch.empty(0, dtype=torch.long), torch.empty(0, d.arch.vocab_size)
        anchor = total - 1
        k = d.block_size
        ids = torch.full((1, k), d.mask_token_id, dtype=torch.long, device=dev)
        ids[0, 0] = int(input_ids[-1])
        pos = torch.arange(anchor, anchor + k, device=dev).unsqueeze(0)
        keys = torch.cat([torch.arange(anchor, device=dev), pos[0]])
        mask = [None if d.arch.window(i) is None else (pos[0, :, None] - keys[None, :] < d.arch.window(i))[None, None] for i in range(len(d.layers))]
        h = d.backbone(d.embed(ids).to(dtype), pos, self.ctx_kv, mask)[0, d.first_slot :]
        self.last_hidden = h
        toks, probs = d.draft_block(h, int(input_ids[-1]), num_tokens, temperature, generator)
        if not toks:
            return torch.empty(0, dtype=torch.long), torch.empty(0, d.arch.vocab_size)
        return torch.tensor(toks, dtype=torch.long), torch.stack(probs).cpu()

