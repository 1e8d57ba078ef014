"""Load a deepspec export into SGLang's own draft model classes on CPU and compare a forward with ours.

Run as a subprocess by tests/test_export_sglang.py (SGLang's import chain and its torch.distributed
init must not leak into the test process):

    python tests/sglang_probe.py SIDE_DIR CHECKPOINT::EXPORT::VERIFY_MODE ...   -> one JSON line (a list) on stdout

SIDE_DIR holds SGLang's sources (scripts/sglang_side.sh). SGLang's attention kernel (RadixAttention) needs
its GPU/CPU attention backends and a KV pool, so each layer's `attn` is replaced by plain softmax attention
over the same q/k/v SGLang's own code computes (projections, q/k norms, RoPE, MLP, norms and fc are SGLang's).
For DFlash/DSpark the context keys/values are made with SGLang's own `kv_proj_only` / `apply_k_norm` /
`apply_k_rope`, as its DFlash worker does.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import types
from pathlib import Path

import torch
from torch import nn

from deepspec.export.sglang_side import import_sglang


class PlainAttention(nn.Module):
    """Softmax attention over [context K/V ; own K/V] in place of SGLang's RadixAttention."""

    def __init__(self, radix, causal: bool):
        super().__init__()
        self.nh, self.nkv, self.hd = radix.tp_q_head_num, radix.tp_k_head_num, radix.qk_head_dim
        self.scaling, self.causal = radix.scaling, causal
        self.ctx: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, q, k, v, forward_batch=None, **kwargs):
        t = q.shape[0]
        q = q.reshape(t, self.nh, self.hd).transpose(0, 1)
        k = k.reshape(-1, self.nkv, self.hd)
        v = v.reshape(-1, self.nkv, self.hd)
        if self.ctx is not None:
            k, v = torch.cat([self.ctx[0].reshape(-1, self.nkv, self.hd), k]), torch.cat([self.ctx[1].reshape(-1, self.nkv, self.hd), v])
        rep = self.nh // self.nkv
        k = k.transpose(0, 1).repeat_interleave(rep, 0)
        v = v.transpose(0, 1).repeat_interleave(rep, 0)
        scores = (q @ k.transpose(1, 2)) * self.scaling
        if self.causal:
            s = k.shape[1]
            mask = torch.ones(t, s, dtype=torch.bool).tril(s - t)
            scores = scores.masked_fill(~mask, float("-inf"))
        return (scores.softmax(-1) @ v).transpose(0, 1).reshape(t, self.nh * self.hd)


def _load_and_account(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict:
    """Which tensors SGLang's load_weights consumes (fed one at a time into NaN-filled parameters), then one
    real load of the whole file: which parameters it leaves unset."""
    params = dict(model.named_parameters())

    def fill_nan():
        with torch.no_grad():
            for p in params.values():
                p.fill_(float("nan"))

    fill_nan()
    unconsumed = []
    for name, tensor in tensors.items():
        before = {n: p.detach().clone() for n, p in params.items()}
        try:
            model.load_weights([(name, tensor)])
        except ValueError as e:  # DSpark checks the confidence head's completeness after each call
            if "missing" not in str(e):
                raise
        changed = [n for n, p in params.items() if not torch.equal(torch.nan_to_num(p, 7.0), torch.nan_to_num(before[n], 7.0))]
        if not changed:
            unconsumed.append(name)
    fill_nan()
    model.load_weights(list(tensors.items()))
    unset = sorted(n for n, p in params.items() if torch.isnan(p).any())
    return {"unconsumed": sorted(unconsumed), "unset": unset, "params": sorted(params)}


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def probe_eagle3(model, draft, report) -> None:
    from deepspec.drafts.layers import causal_mask

    hot = model.get_hot_token_id()
    report["hot_token_id_matches_d2t"] = bool(
        hot is not None and torch.equal(hot.long(), torch.arange(draft.d2t.numel()) + draft.d2t)
    ) if draft.draft_vocab_size < draft.arch.vocab_size else hot is None
    for layer in model.model.layers:
        layer.self_attn.attn = PlainAttention(layer.self_attn.attn, causal=True)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(draft.target_embed)
        g = torch.Generator().manual_seed(0)
        t, n, ht = 6, len(draft.taps), draft.arch.target_hidden_size
        taps = torch.randn(t, n, ht, generator=g)
        ids = torch.randint(0, draft.arch.vocab_size, (t,), generator=g)
        pos = torch.arange(t)
        emb = draft.target_embed[ids]
        logits, out_hidden, _, normed = draft._step(emb[None], draft.combine_taps(taps[None]), pos[None], None,
                                                    causal_mask(pos, pos)[None, None])
        fb = types.SimpleNamespace(spec_info=types.SimpleNamespace(hidden_states=taps.flatten(-2)))
        to_logits, aux = model.model(ids, pos, fb, input_embeds=emb)
        s_logits = to_logits @ model.lm_head.weight[: draft.draft_vocab_size].T
    report["max_abs_diff"] = {"logits": _maxdiff(s_logits, logits[0]), "normed": _maxdiff(to_logits, normed[0]),
                              "next_hidden": _maxdiff(aux[0], out_hidden[0])}
    report["logit_scale"] = float(logits.abs().max())


def probe_block(model, draft, report) -> None:
    """One block forward: ctx = fc + hidden_norm of the taps, per-layer ctx K/V, the block attends to all of it."""
    for layer in model.layers:
        layer.self_attn.attn = PlainAttention(layer.self_attn.attn, causal=False)
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        s, n, ht, b = 5, len(draft.taps), draft.arch.target_hidden_size, draft.block_size
        taps = torch.randn(s, n, ht, generator=g)
        ctx_pos, blk_pos = torch.arange(s), torch.arange(s, s + b)
        anchor = int(torch.randint(0, draft.arch.vocab_size, (1,), generator=g))
        block_ids = torch.tensor([anchor] + [draft.mask_token_id] * (b - 1))
        emb = draft.target_embed[block_ids]
        ctx = draft.context(taps[None])
        h_ours = draft.backbone(emb[None], blk_pos[None], draft.context_kv(ctx, ctx_pos[None]), None)[0]
        s_ctx = model.project_target_hidden(taps.flatten(-2))
        for layer in model.layers:
            attn = layer.self_attn
            k, v = attn.kv_proj_only(s_ctx)
            attn.attn.ctx = (attn.apply_k_rope(ctx_pos, attn.apply_k_norm(k)), v)
        out = model(block_ids, blk_pos, types.SimpleNamespace(), input_embeds=emb)
        h_sgl = out.hidden_states
        report["max_abs_diff"] = {"context": _maxdiff(s_ctx, ctx[0]), "block_hidden": _maxdiff(h_sgl, h_ours)}
        report["hidden_scale"] = float(h_ours.abs().max())
        if hasattr(model, "markov_head"):
            prev = torch.randint(0, draft.arch.vocab_size, (b,), generator=g)
            bias_s, state_s = [], model.markov_head.init_state(h_sgl[:1])
            bias_o, state_o = [], None
            for p in range(b):
                bs_, state_s = model.markov_head.step_bias(prev[p : p + 1], hidden_states=h_sgl[p : p + 1], state=state_s)
                z, state_o = draft.markov_head.step(h_ours[p : p + 1], prev[p : p + 1], state_o)
                bias_s.append(bs_)
                bias_o.append(draft.markov_head.markov_w2(z))
            report["max_abs_diff"]["markov_bias"] = _maxdiff(torch.cat(bias_s), torch.cat(bias_o))
            report["markov_head"] = type(model.markov_head).__name__
            if model.confidence_head is not None and draft.confidence_head is not None:
                c_s = model.confidence_head(h_sgl[None], model.markov_head.get_prev_embeddings(prev)[None])[0]
                c_o = draft.confidence_head(h_ours, draft.markov_head.markov_w1(prev))
                report["max_abs_diff"]["confidence_logit"] = _maxdiff(c_s, c_o)


def probe(checkpoint: str, export: str, verify_mode: str) -> dict:
    """Build SGLang's class for one export, load it, compare with our checkpoint. `verify_mode`: SGLang's
    SGLANG_RAGGED_VERIFY_MODE (DSpark builds its confidence head only in cap-accept / compact)."""
    from safetensors.torch import load_file
    from sglang.srt.utils.hf_transformers_utils import get_config

    from deepspec.drafts.checkpoint import load_draft

    os.environ["SGLANG_RAGGED_VERIFY_MODE"] = verify_mode  # read by SGLang at model construction
    torch.manual_seed(0)
    cfg = get_config(export, trust_remote_code=False)
    arch = cfg.architectures[0]
    module = {"LlamaForCausalLMEagle3": "llama_eagle3", "DFlashDraftModel": "dflash", "Qwen3DSparkModel": "dspark"}[arch]
    cls = getattr(importlib.import_module(f"sglang.srt.models.{module}"), arch)
    model = cls(cfg).float().eval()
    report = {"class": f"sglang.srt.models.{module}.{arch}", "verify_mode": verify_mode}
    report.update(_load_and_account(model, load_file(str(Path(export) / "model.safetensors"))))
    draft = load_draft(checkpoint).float().eval()
    with torch.no_grad():  # the target's embeddings are not part of a draft checkpoint: any shared values do
        draft.target_embed.normal_(generator=torch.Generator().manual_seed(1))
    if module == "llama_eagle3":
        probe_eagle3(model, draft, report)
    else:
        probe_block(model, draft, report)
    return report


def main(side: str, jobs: list[str]) -> list[dict]:
    """jobs: CHECKPOINT::EXPORT::VERIFY_MODE each (one SGLang import for all of them)."""
    import_sglang(side)
    return [probe(*job.split("::")) for job in jobs]


if __name__ == "__main__":
    print("SGLANG_PROBE " + json.dumps(main(sys.argv[1], sys.argv[2:])))
