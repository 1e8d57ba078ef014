"""The reference side of `deepspec check`, shared by both engines' runs: the seeded samples (token ids, per-layer target
states, and the shared target embeddings / LM head regenerated from a seed on each side), our draft rebuilt from its
checkpoint and rounded to the export's dtype, its stages traced through its own proposer (`trace_ours`), the hooks that
record an engine's decoder layers (`engine_layer_streams`), and the stage-by-stage comparison (`compare`).

Imported by export/check.py and, inside the engines' own processes, by export/check_vllm.py and export/check_sglang.py:
it imports torch and nothing of an engine's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

REL_TOL = 1e-4  # fp32 on both sides with identical weights: observed differences are ~1e-6 of the scale
FP32_EPS = 2.0 ** -24  # unit roundoff of fp32


@dataclass
class Row:
    stage: str
    max_abs_diff: float
    tolerance: float
    ok: bool
    note: str = ""


class Trace(dict):
    """A side's stages in the order the engine computes them ({stage: tensor}); on our side also, for a stage whose
    tolerance is derived rather than relative to its scale, a function (ours, engine's) -> tolerance, and a note."""

    def __init__(self) -> None:
        super().__init__()
        self.tolerances: dict[str, Callable[[dict, dict], float]] = {}
        self.notes: dict[str, str] = {}


def declared_calibration(cfg: dict[str, Any]) -> tuple[float, float] | None:
    """The (a, b) an export says it baked into its confidence head (`deepspec export --calibration`), else None."""
    baked = (cfg.get("deepspec", {}).get("confidence_calibration") or {}).get("baked")
    return (float(baked["a"]), float(baked["b"])) if baked else None


def confidence_tolerance(w: torch.Tensor, c: torch.Tensor, x: torch.Tensor, hidden: int, first_slot: int):
    """The tolerance of the confidence stage, sigmoid(w . x + c) per drafted slot, by arithmetic rather than by scale.

    x = [h; e]: h the final-norm rows the head reads (the engine's may differ from ours by what block.norm shows), e
    the Markov embeddings of the previous tokens (rows of the same weights picked by the same token ids: exact). So
    |dp| <= 1/4 |dz| (sigmoid' <= 1/4) with |dz| <= sum_i |w_i| |dh_i| + the fp32 rounding of both sides' dot products
    of n terms and of the baked weight a*W (each <= n u sum_i |w_i x_i| + u |c|, u = 2^-24), plus the rounding of
    each side's p to fp32. w, c: the head as the export holds it (calibration baked in)."""
    w64, c64, x64 = w.double().flatten(), float(c.double().flatten()[0]), x.double()
    n = w64.numel()
    gamma = n * FP32_EPS / (1 - n * FP32_EPS)
    lip = float(w64[:hidden].abs().sum())
    rounding = (2 * gamma + FP32_EPS) * ((x64 * w64).abs().sum(-1) + abs(c64))

    def tol(ours: dict, theirs: dict) -> float:
        a, b = ours["block.norm"], theirs.get("block.norm")
        if b is None or b.shape != a.shape:  # the head's input already differs in shape: nothing to bound by
            return 0.0
        dh = (a[first_slot:].double() - b[first_slot:].double()).abs().amax(-1)[: x.shape[0]]
        return float((0.25 * (lip * dh + rounding)).max()) + 2 * FP32_EPS

    return tol


# --- inputs and our side --------------------------------------------------------------------------

def round_to(draft, dtype: str) -> None:
    """Round our weights through the export dtype (what the engine loads), keep computing in fp32."""
    dt = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype)
    if dt is None:
        return
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if p.is_floating_point() and not name.startswith("confidence_head."):
                p.copy_(p.to(dt).float())


def target_tables(vocab: int, hidden: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Shared target embeddings and LM head: random (the draft shares the target's, so any values serve both sides),
    regenerated from the seed on each side instead of shipped between processes."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, hidden, generator=g), torch.randn(vocab, hidden, generator=g) * hidden ** -0.5


def make_inputs(draft, num_layers: int, tokens: int = 9, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded samples: `tokens` ids and per-position target states for every layer (HF index: 0 = embeddings,
    j = output of layer j - 1, num_layers = the last layer's output before the final norm)."""
    g = torch.Generator().manual_seed(seed)
    v, ht = draft.arch.vocab_size, draft.arch.target_hidden_size
    return {
        "input_ids": torch.randint(0, v, (tokens,), generator=g),
        "states": torch.randn(tokens - 1, num_layers + 1, ht, generator=g),
        "tables": torch.tensor([v, draft.arch.hidden_size, seed + 1]),
    }


def our_taps(draft, states: torch.Tensor) -> torch.Tensor:
    return states[:, [k + 1 for k in draft.taps]]  # our tap k = output of layer k = HF index k + 1


def stream_hooks(layers, out: list) -> list:
    """Each decoder layer's residual stream: the input of post_attention_layernorm plus the MLP's output."""
    pending: list = []
    hooks = []
    for layer in layers:
        hooks.append(layer.post_attention_layernorm.register_forward_hook(lambda m, a, r: pending.append(a[0])))
        last = getattr(layer, "mlp_conv", None) or layer.mlp  # DFlash2: the MLP's output convolution ends the layer
        hooks.append(last.register_forward_hook(lambda m, a, r: out.append(pending.pop() + r)))
    return hooks


def engine_layer_streams(layers, out: list) -> list:
    """Hooks recording each engine decoder layer's residual stream: SGLang's and vLLM's layers return
    (mlp_out, residual), and the stream is their sum."""
    return [layer.register_forward_hook(lambda mod, a, r: out.append(r[0] + r[1])) for layer in layers]


def trace_ours(draft, inp: dict[str, torch.Tensor], confidence: tuple[float, float] | None = None) -> Trace:
    """Our draft's stages, through its own decoding proposer (the code our evaluator runs). `confidence`: for a DSpark
    draft with a confidence head, also trace the head as the engine computes it (sigmoid of the head, every drafted
    slot, after the tokens), scaled by the (a, b) the export declares baked (`declared_calibration`; (1, 0) for none)."""
    with torch.no_grad():
        embed, head = target_tables(*inp["tables"].tolist())
        draft.target_embed.copy_(embed)
        draft.target_lm_head.copy_(head)
        taps = our_taps(draft, inp["states"])
        ids = inp["input_ids"]
        out = Trace()
        fc_out: list = []
        streams: list = []
        hooks = [draft.fc.register_forward_hook(lambda m, a, r: fc_out.append(r[0]))]
        if draft.algorithm == "eagle3":
            layers = [draft.midlayer, *draft.layers]
            hooks += stream_hooks(layers, streams)
            steps: list = []
            inner = draft._step

            def recording(*a, **k):
                res = inner(*a, **k)
                steps.append(res)
                return res

            draft._step = recording
            try:
                toks, _ = draft.proposer().propose(ids, taps, 0, 2, temperature=0.0)
            finally:
                del draft._step
            n = len(layers)
            tids = draft.draft_target_ids()
            (l1, hid1, _, norm1), (l2, _, _, norm2) = steps[0], steps[1]
            out["step1.taps"] = taps.flatten(-2)
            out["step1.fc"] = fc_out[0]
            for i in range(n):
                out[f"step1.layer{i}"] = streams[i][0]
            out["step1.norm"], out["step1.logits"] = norm1[0], l1[0]
            out["step1.tokens"] = tids[l1[0].argmax(-1)]
            out["step1.next_hidden"] = hid1[0]
            out["step2.input_token"] = toks[:1]
            for i in range(n):
                out[f"step2.layer{i}"] = streams[n + i][0]
            out["step2.norm"], out["step2.logits"] = norm2[0], l2[0]
            out["step2.tokens"] = toks[1:2]
        else:
            ctx_out: list = []
            norm_out: list = []
            hooks.append(draft.hidden_norm.register_forward_hook(lambda m, a, r: ctx_out.append(r[0])))
            hooks.append(draft.norm.register_forward_hook(lambda m, a, r: norm_out.append(r[0])))
            hooks += stream_hooks(draft.layers, streams)
            biases: list = []  # DSpark: the Markov bias of each drafted slot, left to right
            if draft.algorithm == "dspark":
                hooks.append(draft.markov_head.markov_w2.register_forward_hook(lambda m, a, r: biases.append(r[0])))
            threshold = getattr(draft.model_cfg, "confidence_threshold", 0.0)
            if draft.algorithm == "dspark":  # the engines do not read it: every slot is drafted
                draft.model_cfg.confidence_threshold = 0.0
            try:
                toks, _ = draft.proposer().propose(ids, taps, 0, draft.num_predictions, temperature=0.0)
            finally:
                for h in hooks:
                    h.remove()
                if draft.algorithm == "dspark":
                    draft.model_cfg.confidence_threshold = threshold
            block_ids = torch.full((draft.block_size,), draft.mask_token_id, dtype=torch.long)
            block_ids[0] = ids[-1]
            out["block.taps"] = taps.flatten(-2)
            out["block.fc"], out["block.context"] = fc_out[0], ctx_out[0]
            out["block.input_ids"] = block_ids
            for i, s in enumerate(streams):
                out[f"block.layer{i}"] = s[0]
            out["block.norm"] = norm_out[0]
            logits = draft.base_logits(norm_out[0][draft.first_slot:])
            out["block.logits"] = logits
            if biases:
                out["block.markov_logits"] = logits[: len(biases)] + torch.stack(biases)
            if draft.algorithm == "dflash2":  # each slot's candidate scores given the token drafted before it
                out["block.candidate_scores"] = torch.stack(draft.last_scores)
            out["block.tokens"] = toks
            if confidence is not None and getattr(draft, "confidence_head", None) is not None:
                _trace_confidence(draft, out, ids, toks, norm_out[0], confidence)
        for h in hooks:
            h.remove()
    return out


def _trace_confidence(draft, out: Trace, ids, toks, normed, calibration: tuple[float, float]) -> None:
    """block.confidence: sigmoid(a z + b) of our head's logit z at every drafted slot (its input: the slot's final-norm
    row and the Markov embedding of the token before it, the anchor first), computed in float64 from our fp32 logits;
    and its tolerance, from the head as the export would hold it (W' = a W, c' = a c + b)."""
    a, b = calibration
    z = torch.tensor(draft.last_confidence_logits, dtype=torch.float64)
    out["block.confidence"] = torch.sigmoid(a * z + b).float()
    head = draft.confidence_head
    prev = torch.cat([ids[-1:], toks[:-1].to(ids.dtype)])[: z.numel()]
    rows = normed[draft.first_slot :][: z.numel()].float()
    x = torch.cat([rows, draft.markov_head.markov_w1(prev).float()], -1) if head.with_markov else rows
    w, c = head.proj.weight.double() * a, head.proj.bias.double() * a + b
    out.tolerances["block.confidence"] = confidence_tolerance(w, c, x, rows.shape[-1], draft.first_slot)
    if (a, b) != (1.0, 0.0):
        out.notes["block.confidence"] = f"with the baked calibration sigmoid({a:.4g} z {b:+.4g}) the export declares"


def our_side(ckpt: Path, cfg: dict[str, Any], ds: dict[str, Any]):
    """Our draft rebuilt from the checkpoint, rounded to the export's dtype, and the seeded inputs for both sides."""
    from deepspec.drafts.checkpoint import load_draft

    draft = load_draft(ckpt).float().eval()
    round_to(draft, cfg.get("torch_dtype", "float32"))
    num_layers = int(ds.get("provenance", {}).get("target_num_layers") or draft.arch.target_num_layers)
    return draft, make_inputs(draft, num_layers)


# --- comparison -----------------------------------------------------------------------------------

def compare(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> list[Row]:
    """One row per stage, in our order (the engine's order too): float tensors by max abs difference against a
    tolerance relative to the tensor's scale, integer tensors (token ids) exactly."""
    rows = []
    for stage, a in ours.items():
        b = theirs.get(stage)
        if b is None:
            rows.append(Row(stage, float("inf"), 0.0, False, "the engine produced no such tensor"))
            continue
        if tuple(a.shape) != tuple(b.shape):
            rows.append(Row(stage, float("inf"), 0.0, False, f"shape ours {tuple(a.shape)} vs engine {tuple(b.shape)}"))
            continue
        if not a.is_floating_point():
            bad = int((a.long() != b.long()).sum())
            note = "" if not bad else f"{bad} of {a.numel()} ids differ, e.g. ours {a.flatten()[(a != b).flatten()][:3].tolist()} vs engine {b.flatten()[(a != b).flatten()][:3].tolist()}"
            rows.append(Row(stage, float(bad), 0.0, bad == 0, note))
            continue
        diff = float((a.float() - b.float()).abs().max()) if a.numel() else 0.0
        derived = getattr(ours, "tolerances", {}).get(stage)
        tol = derived(ours, theirs) if derived else REL_TOL * max(1.0, float(a.abs().max()) if a.numel() else 1.0)
        rows.append(Row(stage, diff, tol, diff <= tol and diff == diff, getattr(ours, "notes", {}).get(stage, "")))
    return rows
