"""SGLang layouts: the vLLM export of a draft, rewritten into what SGLang's own model classes load.

Read from SGLang 0.5.23's source (sglang/srt/models/llama_eagle3.py, dflash.py, dspark.py,
speculative/dflash_utils.py, speculative/dspark_components/dspark_config.py and
model_executor/model_runner_components/spec_aux_hidden_state.py) and checked by
tests/test_export_sglang.py, which builds those classes on CPU and loads our files into them:

  * EAGLE-3 / 3.1 -> `LlamaForCausalLMEagle3`, SGLang's only EAGLE-3 draft class (for Llama and Qwen3
    targets alike). The target captures the layers listed in `eagle_config.eagle_aux_hidden_state_layer_ids`
    and adds 1 itself, so that list holds our taps unchanged; fc is sized by `num_aux_hidden_states`;
    `fc_norm`, `norm_before_fc` and `norm_output` are read. Layer 0 is `layers.0`; a deeper layer normalises
    its input with `hidden_norm` (vLLM and we call that norm `input_layernorm`).
  * DFlash -> `DFlashDraftModel` with `dflash_config.target_layer_ids` = our taps (the target adds 1) and
    `block_size`; SGLang drafts block_size - 1 tokens per round.
  * DSpark -> SGLang's own format, not speculators: `Qwen3DSparkModel`, the DFlash fields plus `markov_rank`,
    `markov_head_type` (vanilla, gated and rnn all run), `enable_confidence_head`,
    `confidence_head_with_markov`, `sample_from_anchor`; its `block_size` is SGLang's gamma (the drafted tokens:
    our block_size with an anchor that predicts, block_size - 1 without). SGLang builds the confidence head only in its
    confidence-driven verify modes (SGLANG_RAGGED_VERIFY_MODE=cap-accept|compact; the default `static` skips
    those weights), and there it refuses a checkpoint without them, whatever `enable_confidence_head` says. The gated head's `gate` is SGLang's `gate_proj`;
    the rnn head's `cell` is SGLang's `joint_proj`, whose input is [state, prev, hidden] where ours is
    [hidden, prev, state].

What SGLang cannot run as trained is refused with the reason (see `_refuse`), among it a DFlash / DSpark draft
with a draft vocabulary: SGLang's block drafts have no LM head of their own (they score with the target's head,
DSpark's markov_w2 is sized by the target vocabulary) and skip lm_head / d2t.
"""

from __future__ import annotations

from typing import Any

import torch

from deepspec.errors import ConfigError
from deepspec.targets.taps import to_dflash_layer_ids

SGLANG_RELEASE = "0.5.23"


def _refuse(what: str, why: str, fix: str) -> ConfigError:
    return ConfigError(f"--format sglang cannot export this draft: {what}. {why} {fix}")


def _check_common(meta: dict[str, Any]) -> None:
    arch = meta["arch"]
    if int(arch.get("target_hc_mult", 1) or 1) > 1:
        raise _refuse(
            f"it reads taps of a {arch['target_hc_mult']}-stream (hyper-connection) target",
            "SGLang's draft classes size fc for one hidden-size state per tap and its targets capture no stream reduction.",
            "Export it with --format vllm.",
        )
    if "sliding_attention" in (arch.get("layer_types") or []):
        raise _refuse(
            "it has sliding-window draft layers (model.layer_types)",
            "SGLang's EAGLE-3 class ignores per-layer windows (it has only the server-wide --speculative-draft-window-size), "
            "and its DFlash/DSpark sliding layers switch to causal attention with a window convention of their own.",
            "Export it with --format vllm, or train with full-attention draft layers.",
        )
    if arch.get("hidden_act", "silu") != "silu":
        raise _refuse(f"its MLP uses {arch['hidden_act']}", "SGLang's draft MLPs (LlamaMLP, DFlashMLP) are SiLU-gated only.",
                      "Export it with --format vllm.")


def _check_block_vocab(draft) -> None:
    if draft.draft_vocab_size < draft.arch.vocab_size:
        raise _refuse(
            f"it drafts over a {draft.draft_vocab_size}-token draft vocabulary (model.draft_vocab_size)",
            "SGLang's DFlash and DSpark drafts score with the target's whole LM head and do not read lm_head or d2t.",
            "Export it with --format vllm, or train with model.draft_vocab_size=null for SGLang.",
        )


def sglang_eagle3(cfg: dict[str, Any], weights: dict[str, torch.Tensor], draft, meta: dict[str, Any]):
    """vLLM EAGLE-3 export (config, weights) -> SGLang's LlamaForCausalLMEagle3 layout."""
    _check_common(meta)
    arch, mcfg = meta["arch"], meta["model"]
    if arch.get("qk_norm"):
        raise _refuse(
            "its attention has q/k RMSNorms (a Qwen3-style draft layer)",
            "SGLang's only EAGLE-3 draft class, LlamaForCausalLMEagle3, has no q_norm/k_norm and its loader skips unknown "
            "weights, so the draft would silently run without them.",
            "Train it with Llama-style draft layers (model.qk_norm=false) or export it with --format vllm (Eagle3Qwen3ForCausalLM).",
        )
    if mcfg.get("norm_before_residual"):
        raise _refuse(
            "it was trained with model.norm_before_residual=true",
            "SGLang's first draft layer always carries the un-normed fused hidden state as the residual.",
            "Retrain with norm_before_residual=false or export it with --format vllm.",
        )
    if arch.get("attention_bias"):
        raise _refuse("its attention projections have biases", "SGLang's EAGLE-3 layer builds q/k/v without bias.",
                      "Export it with --format vllm.")
    out = {k: v for k, v in cfg.items() if k not in ("eagle_aux_hidden_state_layer_ids", "architectures")}
    out.update(
        architectures=["LlamaForCausalLMEagle3"],
        model_type="llama",
        # SGLang's target adds 1 to these ids itself (set_eagle3_layers_to_capture): they are our taps.
        eagle_config={"eagle_aux_hidden_state_layer_ids": to_dflash_layer_ids(draft.taps), "use_aux_hidden_state": True},
    )
    renamed: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        if name.startswith("midlayer."):
            name = "layers.0." + name[len("midlayer.") :]
        elif name.startswith("layers.") and name.endswith(".input_layernorm.weight"):
            name = name.replace(".input_layernorm.weight", ".hidden_norm.weight")  # a deeper layer's input norm
        renamed[name] = t
    return out, renamed


def sglang_dflash(cfg: dict[str, Any], weights: dict[str, torch.Tensor], draft, meta: dict[str, Any]):
    """vLLM DFlash export -> SGLang's DFlashDraftModel (same weight names; config fields SGLang parses)."""
    _check_common(meta)
    _check_block_vocab(draft)
    out = dict(cfg)
    out["dflash_config"] = {
        "mask_token_id": draft.mask_token_id,
        "target_layer_ids": to_dflash_layer_ids(draft.taps),
        "num_target_layers": meta["arch"]["target_num_layers"],
        "block_size": draft.block_size,
    }
    return out, dict(weights)


def sglang_dspark(cfg: dict[str, Any], weights: dict[str, torch.Tensor], draft, meta: dict[str, Any]):
    """vLLM speculators DSpark export -> SGLang's own Qwen3DSparkModel format (SGLang does not read speculators)."""
    _check_common(meta)
    _check_block_vocab(draft)
    mcfg = meta["model"]
    out = dict(cfg["transformer_layer_config"])
    # SGLang's DSpark reads block_size as gamma, the drafted tokens: it queries gamma slots when the anchor slot
    # predicts (sample_from_anchor) and gamma + 1 otherwise. Ours queries block_size slots either way.
    gamma = draft.num_predictions
    out.update(
        architectures=["Qwen3DSparkModel"],
        model_type="qwen3",
        block_size=gamma,
        dflash_config={
            "mask_token_id": draft.mask_token_id,
            "target_layer_ids": to_dflash_layer_ids(draft.taps),
            "num_target_layers": meta["arch"]["target_num_layers"],
            "block_size": gamma,
        },
        mask_token_id=draft.mask_token_id,
        markov_rank=mcfg["markov_rank"],
        markov_head_type=mcfg["markov_head_type"],
        enable_confidence_head=draft.confidence_head is not None,
        confidence_head_with_markov=bool(draft.confidence_head is not None and draft.confidence_head.with_markov),
        sample_from_anchor=bool(draft.sample_from_anchor),
        draft_vocab_size=cfg["draft_vocab_size"],
        target_hidden_size=cfg["target_hidden_size"],
    )
    h, r = meta["arch"]["hidden_size"], mcfg["markov_rank"]
    renamed: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        if name.startswith("markov_head.gate."):
            name = name.replace("markov_head.gate.", "markov_head.gate_proj.")
        elif name.startswith("markov_head.cell."):
            name = name.replace("markov_head.cell.", "markov_head.joint_proj.")
            if name.endswith(".weight"):  # our input [hidden, prev, state] -> SGLang's [state, prev, hidden]
                t = torch.cat([t[:, h + r :], t[:, h : h + r], t[:, :h]], dim=1)
        renamed[name] = t
    return out, renamed


BUILDERS = {"eagle3": sglang_eagle3, "dflash": sglang_dflash, "dspark": sglang_dspark}
