"""EAGLE-3 / EAGLE-3.1: an autoregressive one-layer draft over fused target taps, trained with TTT.

Alignment (pinned by tests/test_drafts_eagle3.py): row t of the draft reads token t+1 and the fused
taps of position t, runs at RoPE position t, and at TTT step k (0-based) predicts token t+2+k against
the target distribution softmax(lm_head(final_hidden[t+1+k])). Step k's queries see step-0 keys of
rows <= t (causal) plus their own row's keys from steps 1..k (the "diagonal"), exactly what the
draft cache holds at decoding time when the chain is k tokens deep. This is also what vLLM's
`LlamaForCausalLMEagle3` computes, so exported drafts behave the same in the engine.

EAGLE-3.1 options: `fc_norm` (an RMSNorm per tap before fc) and `norm_output` (the next step reads
the post-norm hidden state); legacy `norm_before_fc` (one RMSNorm over the concatenation).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from deepspec.drafts.attention import ChainParts, chain_attention, sample_ranges
from deepspec.drafts.plan import StepPlan
from deepspec.drafts.base import LOSS_WEIGHT, DraftBatch, Metrics, Proposer
from deepspec.drafts.common import TargetBackedDraft
from deepspec.drafts.layers import DecoderLayer, DraftArch, RotaryEmbedding, attend, causal_mask, softcap
from deepspec.drafts.losses import gemm_dtype, soft_ce, takes_fused_path, teacher_dist, teacher_logits
from deepspec.drafts.registry import register
from deepspec.drafts.vocab import sample_token
from deepspec.errors import ConfigError

KV = tuple[torch.Tensor, torch.Tensor]


@register("eagle3")
class Eagle3Draft(TargetBackedDraft):
    def __init__(self, arch: DraftArch, model_cfg: Any, taps: list[int]):
        super().__init__(arch, model_cfg, taps)
        n, ht, h = len(taps), arch.target_hidden_size, arch.hidden_size
        self.input_norm = arch.make_norm(n * ht) if model_cfg.norm_before_fc else None
        self.fc_norm = nn.ModuleList([arch.make_norm(ht) for _ in range(n)]) if model_cfg.fc_norm else None
        self.fc = nn.Linear(n * ht, h, bias=False)
        self.midlayer = DecoderLayer(arch, attn_in_dim=2 * h)
        self.midlayer.hidden_norm = arch.make_norm(h)
        self.layers = nn.ModuleList([DecoderLayer(arch) for _ in range(arch.num_layers - 1)])
        self.norm = arch.make_norm(h)
        self.rotary = RotaryEmbedding(arch)
        self.chain = ChainParts()  # the TTT attention's elementwise work: compiled regions under train.compile
        dv = self._draft_vocab_size(model_cfg.draft_vocab_size)
        self.draft_vocab_size = dv
        self.lm_head = nn.Linear(h, dv, bias=False)
        self.lm_head.weight.requires_grad_(not model_cfg.freeze_lm_head)
        self._register_draft_vocab(dv)  # set_token_frequencies (common.py) fills it from the training data

    def _on_target_loaded(self) -> None:
        # The draft LM head starts as the target's rows for the draft tokens (trained unless
        # model.freeze_lm_head). The final norm stays at 1: starting it at the target's (mean 1.8 on
        # SmolLM2) makes the first predictions over-confident, and the quickstart learned slower.
        with torch.no_grad():
            self.lm_head.weight.copy_(self.target_lm_head[self.draft_target_ids()].to(self.lm_head.weight.dtype))

    def init_from_target_layers(self, layers: list[dict[str, torch.Tensor]]) -> None:
        """model.init_from_target_layer: draft layer i starts as target decoder layer k+i (HF parameter names,
        without the `model.layers.N.` prefix) and fc passes the deepest tap through unchanged, so the draft
        starts as the target's next layer over that tap. The first layer's q/k/v read [emb, hidden]: the
        hidden half gets the target's weights, the token half starts at zero (it learns from there)."""
        h, n = self.arch.hidden_size, len(self.taps)
        if h != self.arch.target_hidden_size:
            raise ConfigError(
                f"model.init_from_target_layer needs the draft hidden size to equal the target's ({self.arch.target_hidden_size}), "
                f"got {h}; drop model.hidden_size or the init option."
            )
        draft_layers = [self.midlayer, *self.layers]
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.weight[:, (n - 1) * h :] = torch.eye(h, dtype=self.fc.weight.dtype)
            for i, (layer, weights) in enumerate(zip(draft_layers, layers)):
                own = dict(layer.named_parameters())
                for name, w in weights.items():
                    dest = "hidden_norm.weight" if (i == 0 and name == "input_layernorm.weight") else name
                    if dest not in own:
                        continue  # e.g. rotary buffers
                    p = own[dest]
                    w = w.to(p.dtype)
                    if i == 0 and name.startswith("self_attn.") and name.split(".")[1] in ("q_proj", "k_proj", "v_proj") and name.endswith("weight"):
                        if tuple(w.shape) != (p.shape[0], h):
                            raise ConfigError(f"Target tensor {name} has shape {tuple(w.shape)}; the draft expects ({p.shape[0]}, {h}).")
                        p.zero_()
                        p[:, h:] = w
                    elif tuple(w.shape) == tuple(p.shape):
                        p.copy_(w)
                    else:
                        raise ConfigError(
                            f"Target tensor {name} has shape {tuple(w.shape)} but draft layer {i} has {tuple(p.shape)}; "
                            "model.init_from_target_layer needs the draft sized like the target (drop the size overrides)."
                        )

    @torch.no_grad()
    def init_copy_heads(self, match_scale: float = 3.0, copy_scale: float = 8.0) -> None:
        """model.init_copy_heads: start the first layer's attention as copy (induction) heads.

        Why: greedy answers of small targets fall into loops, where the next tokens are a copy of what
        followed the same token earlier. A one-layer draft can copy in one attention hop — row s's key is
        its own token x_s (the embeddings tap, passed through fc), row t's query its input token x_{t+1},
        row s's value its input token x_{s+1} — but it learns that circuit far too slowly from a small
        cache (docs/benchmarks.md, copy-heads ablations). So we write it in: keys and queries compare the top principal components
        of the (RMS-normed, whitened) draft-vocabulary embeddings in the low-frequency RoPE dimensions,
        where rotation barely depends on distance; each KV head's value carries its own slice of
        components and its first query head writes them back into the residual, where the frozen
        (tied) LM head reads the copied token; an untied head gets a least-squares map from the components
        to its rows instead (not measured on a real untied target). The other weights keep their random init,
        scaled down so the copy dominates at first; training takes it from there. Weights only: vLLM serves it
        unchanged. Tuned on SmolLM2 (match/copy scales, the RoPE band) with a handful of probes.
        """
        if -1 not in self.taps:
            raise ConfigError("model.init_copy_heads needs the embeddings as a tap: add -1 to model.target_layer_ids (e.g. [-1, 1, 14, 26]).")
        if self.fc_norm is None:
            raise ConfigError("model.init_copy_heads needs model.fc_norm=true (each tap normed before fc).")
        h, ht = self.arch.hidden_size, self.arch.target_hidden_size
        if h != ht:
            raise ConfigError(f"model.init_copy_heads needs the draft hidden size to equal the target's ({ht}), got {h}; drop model.hidden_size.")
        att = self.midlayer.self_attn
        nh, nkv, hd = att.num_heads, att.num_kv_heads, att.head_dim
        emb = self.target_embed[self.draft_target_ids()].float()
        normed = emb * torch.rsqrt(emb.pow(2).mean(-1, keepdim=True) + 1e-6)
        mean = normed.mean(0)
        unit = mean / mean.norm()
        centred = normed - mean
        centred = centred - (centred @ unit)[:, None] * unit[None]  # the shared direction tells tokens apart least
        _, sv, basis = torch.linalg.svd(centred, full_matrices=False)
        std = sv / centred.shape[0] ** 0.5
        whiten = basis / std[:, None].clamp(min=1e-6)  # [components, H]: unit-variance coordinates
        unwhiten = basis.T * std[None]  # [H, components]
        half = hd // 2
        low = [j for j in range(half) if j >= (5 * half) // 8]
        low = low + [j + half for j in low]  # rotate-half pairs (j, j + hd/2) with the lowest frequencies
        n_match = len(low)
        if nkv * hd > whiten.shape[0]:
            raise ConfigError(f"model.init_copy_heads: {nkv} KV heads x {hd} dims exceed the {whiten.shape[0]} embedding components.")
        tap = self.taps.index(-1)
        self.fc.weight.mul_(0.5)
        self.fc.weight[:, tap * ht : (tap + 1) * ht] = torch.eye(h, dtype=self.fc.weight.dtype)
        # what o_proj writes for a copied token: with tied embeddings the LM head row is the embedding itself, so the
        # components map straight back; an untied head gets the least-squares map from components to its rows
        value_basis = whiten[: nkv * hd]
        if torch.equal(self.target_embed, self.target_lm_head):
            write_back = unwhiten[:, : nkv * hd]
        else:
            head_rows = self.target_lm_head[self.draft_target_ids()].float()
            head_rows = head_rows * torch.rsqrt(head_rows.pow(2).mean(-1, keepdim=True) + 1e-6)
            write_back = torch.linalg.lstsq(centred @ value_basis.T, head_rows).solution.T
        per = nh // nkv
        for g in range(nkv):
            rows = slice(g * hd, (g + 1) * hd)
            att.k_proj.weight[rows] = 0
            att.k_proj.weight[rows][low, h:] = match_scale * whiten[:n_match].to(att.k_proj.weight.dtype)
            att.v_proj.weight[rows] = 0
            att.v_proj.weight[rows][:, :h] = value_basis[g * hd : (g + 1) * hd].to(att.v_proj.weight.dtype)
            q = g * per
            att.q_proj.weight[q * hd : (q + 1) * hd] = 0
            att.q_proj.weight[q * hd : (q + 1) * hd][low, :h] = match_scale * whiten[:n_match].to(att.q_proj.weight.dtype)
            att.o_proj.weight[:, q * hd : (q + 1) * hd] = copy_scale * write_back[:, g * hd : (g + 1) * hd].to(att.o_proj.weight.dtype)
            att.o_proj.weight[:, (q + 1) * hd : (q + per) * hd] *= 0.1
        self.midlayer.mlp.down_proj.weight.mul_(0.1)

    @property
    def num_layers_total(self) -> int:
        return 1 + len(self.layers)

    # --- forward pieces ---------------------------------------------------------------------------
    def combine_taps(self, taps: torch.Tensor) -> torch.Tensor:
        """taps [..., n_taps, H_t] -> fc input [..., H] (with the EAGLE-3.1 / legacy norms)."""
        taps = self._augment(taps)
        if self.fc_norm is not None:
            x = torch.cat([norm(taps[..., i, :]) for i, norm in enumerate(self.fc_norm)], dim=-1)
        else:
            x = taps.flatten(-2)
            if self.input_norm is not None:
                x = self.input_norm(x)
        return self.fc(x)

    def _augment(self, taps: torch.Tensor) -> torch.Tensor:
        """Training-time feature noise (model.feature_noise): a regulariser for small caches, scaled by
        each tap's per-token RMS so it means the same on every target and layer."""
        a = self.model_cfg.feature_noise
        if not (self.training and a > 0):
            return taps
        rms = taps.float().pow(2).mean(-1, keepdim=True).sqrt().to(taps.dtype)
        return taps + (torch.rand_like(taps) * 2 - 1) * (a * rms)

    def step(
        self, emb: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor, past: list[KV] | None, mask
    ) -> tuple[torch.Tensor, torch.Tensor, list[KV]]:
        """One draft forward over T query rows. Returns (logits [B,T,Dv], hidden for the next step, new K/V per layer).

        `past[i]` are layer i's keys/values the queries may attend to; `mask` (boolean, past + new keys) is one
        tensor for every layer or a list with one per layer (sliding layers see fewer keys); None = all keys."""
        return self._step(emb, hidden, position_ids, past, mask)[:3]

    def _step(self, emb, hidden, position_ids, past, mask, attn=None, head: bool = True):
        """`step` plus the final normed state (what the LM head reads), for the hidden-state loss.

        attn(i, q, k, v) -> output replaces layer i's masked attention (the training chain); head=False
        skips the LM head (the chunked loss applies it itself) and returns logits None."""
        cos, sin = self.rotary(position_ids, emb.dtype)
        new_kv: list[KV] = []
        layer = self.midlayer
        residual = layer.hidden_norm(hidden) if self.model_cfg.norm_before_residual else hidden
        x = torch.cat([layer.input_layernorm(emb), layer.hidden_norm(hidden)], dim=-1)
        mlp_out = None
        ckpt = self.model_cfg.activation_checkpointing and self.training and torch.is_grad_enabled()
        for i, layer in enumerate([self.midlayer, *self.layers]):
            if i > 0:
                residual = residual + mlp_out
                x = layer.input_layernorm(residual)
            layer_mask = mask[i] if isinstance(mask, (list, tuple)) else mask
            fn = partial(self._layer, i, layer, None if past is None else past[i], layer_mask, attn)
            if ckpt:
                residual, mlp_out, k, v = checkpoint(fn, x, residual, cos, sin, use_reentrant=False)
            else:
                residual, mlp_out, k, v = fn(x, residual, cos, sin)
            new_kv.append((k, v))
        out = residual + mlp_out
        normed = self.norm(out)
        logits = softcap(self.lm_head(normed), self.arch.logit_softcap) if head else None
        return logits, (normed if self.model_cfg.norm_output else out), new_kv, normed

    @staticmethod
    def _layer(i, layer, past, mask, attn, x, residual, cos, sin):
        a = layer.self_attn
        q = a.project_q(x, cos, sin)
        k, v = a.project_kv(x, cos, sin)
        if attn is not None:
            o = attn(i, q, k, v)
        else:
            kk, vv = (k, v) if past is None else (torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2))
            o = attend(q, kk, vv, mask)
        residual = residual + a.output(o)
        return residual, layer.mlp(layer.post_attention_layernorm(residual)), k, v

    # --- training ---------------------------------------------------------------------------------
    def ttt_steps(
        self,
        input_ids: torch.Tensor,
        taps: torch.Tensor,
        with_normed: bool = False,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        heads: bool = True,
        plan: StepPlan | None = None,
    ):
        """Yield (k, logits [B, T, Dv]) for TTT steps k = 0..ttt_length-1 (rows >= T-1-k are padding);
        with_normed: (k, logits, final normed state [B, T, H]); heads=False: logits None (the loss applies
        the LM head chunk by chunk and may `send` the draft's own next inputs [B, T-2-k] back).

        Row r at step k reads token r+1+k and the previous step's hidden state of row r, at RoPE
        position r+k (packed rows: position_ids[r] + k); it attends to step-0 keys of rows <= r of its own
        sample and to row r's keys of steps 1..k (chain_attention: no dense mask).
        """
        b, t = input_ids.shape
        dev = input_ids.device
        hidden = self.combine_taps(taps.to(self.fc.weight.dtype))
        pos = position_ids if position_ids is not None else torch.arange(t, device=dev).unsqueeze(0).expand(b, t)
        # the samples' bounds: the loader's plan (no host read in the step), else read from segment_ids here
        ranges = plan.ranges if plan is not None else sample_ranges(segment_ids, b, t)
        buckets = plan is not None and plan.buckets
        n_layers = 1 + len(self.layers)
        step0: list[KV] = []
        diags: list[list[KV]] = [[] for _ in range(n_layers)]
        own_inputs = self.training and self.model_cfg.ttt_inputs == "draft"
        draft_tids = self.draft_target_ids() if own_inputs else None
        own: torch.Tensor | None = None
        for k in range(self.model_cfg.ttt_length):
            n = t - 1 - k  # rows with a next input token r+1+k
            if n <= 0:
                return
            shifted = torch.zeros_like(input_ids)
            # step k >= 1 of row r reads token r+1+k: the data's, or (ttt_inputs=draft) the draft's own
            # step k-1 guess for that very position, as a served chain would feed it.
            shifted[:, :n] = input_ids[:, 1 + k :] if own is None else own[:, :n]
            emb = self.embed(shifted).to(hidden.dtype)

            # the keys as of this step (bound now: activation checkpointing calls this again in the backward)
            def attn(i, q, kk, vv, k=k, s0=list(step0), dg=[list(x) for x in diags]):
                w = self.arch.window(i)
                if k == 0:
                    return chain_attention(q, kk, vv, [], ranges, w, buckets)
                return chain_attention(q, s0[i][0], s0[i][1], dg[i] + [(kk, vv)], ranges, w, buckets, self.chain)

            logits, hidden, kv, normed = self._step(emb, hidden, pos + k, None, None, attn=attn, head=heads)
            if k == 0:
                step0 = kv
            else:
                for i, x in enumerate(kv):
                    diags[i].append(x)
            sent = yield (k, logits, normed) if with_normed else (k, logits)
            if own_inputs:
                with torch.no_grad():
                    own = sent if sent is not None else draft_tids[logits.argmax(-1)]

    def loss(self, batch: DraftBatch) -> tuple[torch.Tensor, Metrics]:
        ids, lm, am = batch.input_ids, batch.loss_mask.bool(), batch.attention_mask.bool()
        b, t = ids.shape
        dev = ids.device
        draft_tids = self.draft_target_ids()
        cfg = self.model_cfg
        chunk = max(1, int(cfg.vocab_chunk_rows))
        cap = self.arch.logit_softcap
        # The target's distribution on the draft vocabulary, once per micro-batch for every TTT step (step k reads the
        # rows shifted by k): [B*T, Dv] in the GEMM's dtype (bf16 under bf16 autocast), built in row chunks. The
        # full-vocabulary head (acceptance and top-1 metrics) is ~1/4 of a quickstart step, so only logged steps take
        # it, in the same pass (the labels are its draft-vocabulary columns).
        with_metrics = self.train_metrics or not self.training
        fh = batch.final_hidden
        teacher = teacher_logits(fh.reshape(b * t, -1), self.target_lm_head, chunk=chunk, draft_ids=draft_tids, cap=cap,
                                 full_stats=with_metrics)
        lse_full = t_top = None
        if with_metrics:
            lse_full, t_top = teacher.lse_full.view(b, t), teacher.top.view(b, t)
        head = self.lm_head.weight
        head_gemm = head.to(gemm_dtype(fh, head))  # cast once for every step's GEMMs (a no-op in fp32 / bf16 params)
        row_base = torch.arange(b, device=dev)[:, None] * t
        # unlogged steps that feed the data's tokens read only the loss (Liger's fused kernel on CUDA, losses.py)
        loss_only = not with_metrics and not (self.training and cfg.ttt_inputs == "draft")
        # ...whose label distribution every step reads again: made once here (fp32 [B*T, Dv])
        dist = teacher_dist(teacher.logits, cap, cfg.label_temperature, chunk) if takes_fused_path(fh, loss_only, cap) else None
        alphas, tops, valids = [], [], []
        total = torch.zeros((), device=dev)
        metrics: Metrics = {}
        hidden_w = cfg.hidden_loss_weight
        weight0 = torch.zeros((), device=dev)
        gen = self.ttt_steps(ids, batch.taps, with_normed=True, position_ids=batch.position_ids, segment_ids=batch.segment_ids, heads=False,
                             plan=batch.plan)
        item = next(gen, None)
        while item is not None:
            k, _, normed = item
            n = t - 1 - k
            # row r (< n-1) predicts token r+2+k; its target distribution is row r+1+k of the target.
            m = max(n - 1, 0)
            valid = torch.zeros(b, t, dtype=torch.bool, device=dev)
            if m > 0:
                valid[:, :m] = lm[:, 2 + k :] & am[:, 2 + k :]
                same = batch.same_segment(2 + k)
                if same is not None:
                    valid[:, :m] &= same
            v = valid[:, :m].float()
            cnt = v.sum()
            decay = cfg.step_loss_decay**k
            ce_w, ce, arg, alpha, top = soft_ce(
                normed[:, :m].reshape(b * m, -1),
                head,
                (v * (decay / cnt.clamp(min=1))).reshape(-1),
                teacher.logits[1 + k : 1 + k + m] if b == 1 else teacher.logits,  # one row: a view, no gather
                None if b == 1 else (row_base + 1 + k + torch.arange(m, device=dev)[None]).reshape(-1),
                chunk=chunk,
                label_temperature=cfg.label_temperature,
                draft_softcap=cap,
                target_softcap=cap,
                lse_full=None if lse_full is None else lse_full[:, 1 + k : 1 + k + m].reshape(-1),
                target_top=None if t_top is None else t_top[:, 1 + k : 1 + k + m].reshape(-1),
                draft_tids=draft_tids,
                head_gemm=head_gemm,
                loss_only=loss_only,
                dist=None if dist is None else dist[1 + k : 1 + k + m] if b == 1 else dist,
            )
            total = total + ce_w
            if hidden_w > 0 and m > 0:
                # EAGLE-1's feature loss: the draft's normed state should be the target's next final state
                # (the draft LM head starts as the target's rows, so matching it reproduces the target's logits).
                diff = normed[:, :m].float() - fh[:, 1 + k : 1 + k + m].float()
                h_loss = F.smooth_l1_loss(diff, torch.zeros_like(diff), reduction="none").mean(-1)
                total = total + decay * hidden_w * (h_loss * v).sum() / cnt.clamp(min=1)
            if k == 0:
                weight0 = cnt.detach()
            d = k + 1
            if ce is not None:  # None: the fused kernel returned the loss alone (an unlogged step)
                metrics[f"step_loss@{d}"] = ((ce.view(b, m) * v).sum().detach(), cnt.detach())
            if with_metrics:
                a_full = torch.zeros(b, t, device=dev)
                a_full[:, :m] = alpha.view(b, m)
                t_full = torch.zeros(b, t, device=dev)
                t_full[:, :m] = top.view(b, m)
                alphas.append(a_full)
                tops.append(t_full)
                valids.append(valid)
                metrics[f"alpha_tf@{d}"] = ((alpha.view(b, m) * v).sum(), cnt.detach())
                metrics[f"top1@{d}"] = ((top.view(b, m) * v).sum(), cnt.detach())
            try:
                item = gen.send(None if arg is None else draft_tids[arg.view(b, m)])
            except StopIteration:
                item = None
        metrics.update(self._tau_metrics(alphas, tops, valids))
        metrics[LOSS_WEIGHT] = (weight0, torch.ones((), device=dev))
        return total, metrics

    @staticmethod
    def _tau_metrics(alphas: list[torch.Tensor], tops: list[torch.Tensor], valids: list[torch.Tensor]) -> Metrics:
        """Per-row chains: expected_tau = mean_t [1 + sum_k prod_{i<=k} alpha_i(t)], the sum running over the
        contiguous valid depths of row t (teacher-forced inputs); greedy_tau the same with top-1 indicators;
        survival@k = mean prod_{i<=k} alpha_i over rows whose depth k is valid."""
        out: Metrics = {}
        if not alphas:
            return out
        v0 = valids[0].float()
        count = v0.sum()
        e_cum = torch.ones_like(v0)
        g_cum = torch.ones_like(v0)
        live = torch.ones_like(v0)
        e_tau = v0.clone()
        g_tau = v0.clone()
        for k, (a, g, v) in enumerate(zip(alphas, tops, valids)):
            live = live * v.float()
            e_cum = e_cum * a
            g_cum = g_cum * g
            e_tau = e_tau + e_cum * live
            g_tau = g_tau + g_cum * live
            out[f"survival@{k + 1}"] = ((e_cum * live).sum(), live.sum())
        out["expected_tau"] = ((e_tau * v0).sum(), count)
        out["greedy_tau"] = ((g_tau * v0).sum(), count)
        return out

    def proposer(self) -> "Eagle3Proposer":
        return Eagle3Proposer(self)


class Eagle3Proposer(Proposer):
    """Chain drafting with a cache of step-0 K/V (one row per committed position, from target taps)."""

    def __init__(self, draft: Eagle3Draft):
        self.draft = draft
        self.reset()

    def reset(self) -> None:
        self.cache: list[KV] | None = None
        self.n = 0
        self.last: tuple[torch.Tensor, torch.Tensor] | None = None  # (logits, hidden) of row n-1

    @torch.no_grad()
    def propose(self, input_ids, new_taps, start, num_tokens, temperature=0.0, generator=None):
        d = self.draft
        dev = d.fc.weight.device
        dtype = d.fc.weight.dtype
        input_ids = input_ids.to(dev)
        total = input_ids.numel()
        if start > self.n:
            raise ValueError(f"propose(start={start}) skips positions {self.n}..{start - 1} the draft never saw")
        if start < self.n and self.cache is not None:
            self.cache = [(k[:, :, :start], v[:, :, :start]) for k, v in self.cache]
            self.n = start
            self.last = None
        m = total - 1 - start
        if m > 0:
            emb = d.embed(input_ids[start + 1 : total].unsqueeze(0)).to(dtype)
            hidden = d.combine_taps(new_taps.to(device=dev, dtype=dtype).unsqueeze(0))
            pos = torch.arange(start, total - 1, device=dev)
            if self.cache is None:
                # the first prefill is the training's step 0 over the whole prompt: causal SDPA, no [L, L] mask
                ranges = [(None, 0, m)]

                def attn(i, q, k, v):
                    return chain_attention(q, k, v, [], ranges, d.arch.window(i))

                logits, hid, kv, _ = d._step(emb, hidden, pos.unsqueeze(0), None, None, attn=attn)
            else:
                keys = torch.arange(total - 1, device=dev)
                mask = [causal_mask(pos, keys, d.arch.window(i))[None, None] for i in range(d.num_layers_total)]
                logits, hid, kv = d.step(emb, hidden, pos.unsqueeze(0), self.cache, mask)
            self.cache = kv if self.cache is None else [(torch.cat([c[0], x[0]], 2), torch.cat([c[1], x[1]], 2)) for c, x in zip(self.cache, kv)]
            self.n = total - 1
            self.last = (logits[0, -1], hid[:, -1:])
        if self.last is None or num_tokens <= 0:
            return torch.empty(0, dtype=torch.long), torch.empty(0, d.arch.vocab_size)
        tids = d.draft_target_ids()
        logits, hid = self.last
        cache = self.cache
        tokens, probs = [], []
        for j in range(num_tokens):
            tok, p = sample_token(logits, tids, d.arch.vocab_size, temperature, generator)
            tokens.append(tok)
            probs.append(p)
            if j == num_tokens - 1:
                break
            emb = d.embed(torch.tensor([[tok]], device=dev)).to(dtype)
            pos = torch.tensor([[total - 1 + j]], device=dev)
            keys = torch.arange(total + j, device=dev)  # cache rows 0..total-2, then the chain at total-1..
            mask = [None if d.arch.window(i) is None else causal_mask(pos[0], keys, d.arch.window(i))[None, None] for i in range(d.num_layers_total)]
            step_logits, hid, kv = d.step(emb, hid, pos, cache, mask)
            cache = [(torch.cat([c[0], x[0]], 2), torch.cat([c[1], x[1]], 2)) for c, x in zip(cache, kv)]
            logits = step_logits[0, -1]
        return torch.tensor(tokens, dtype=torch.long), torch.stack(probs).cpu()
