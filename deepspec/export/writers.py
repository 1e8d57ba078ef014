"""Write a deepspec draft checkpoint in the layout vLLM / SGLang load unchanged (see docs/export.md).

  * EAGLE-3 / 3.1 -> `LlamaForCausalLMEagle3` (Llama-style layers) or `Eagle3Qwen3ForCausalLM` (q/k norms),
    aux layer ids = our taps + 1, draft vocabulary via d2t/t2d, embeddings omitted (shared with the target).
  * DFlash        -> `DFlashDraftModel` (model_type qwen3), dflash_config.target_layer_ids = our taps, every field the
                     published DFlash checkpoints carry, and our own transformers modeling file (export/hf_remote/) with
                     an `auto_map`, so `AutoModel.from_pretrained(EXPORT, trust_remote_code=True)` runs it.
  * DSpark        -> speculators format (`speculators_model_type: dspark`) that vLLM maps to Qwen3DSparkModel.
  * DFlash2       -> `DFlash2DraftModel`: DFlash's layout + dflash_config's conv / selector fields and the layers'
                     attention_conv / mlp_conv and candidate_selector weights (vLLM's qwen3_dflash2.py); vLLM only.
  DFlash / DSpark with a draft vocabulary also write `draft_vocab_size`, `lm_head.weight` (the target head's rows
  of the draft vocabulary) and d2t / t2d, which vLLM's DFlashQwen3ForCausalLM / Qwen3DSparkForCausalLM read
  (d2t as draft_id_to_target_id; t2d skipped); without one the engine shares the target's head.

These are vLLM 0.32's layouts; `--format sglang` rewrites them into SGLang's (export/sglang.py). Every export
either runs in its engine as trained or is refused with the reason (`_check_vllm`, export/sglang.py), and
writes a model card (export/card.py). Layer ids are translated only through deepspec.targets.taps. The export
refuses a checkpoint whose recorded target does not match the target it is exported for.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch

from deepspec.config.model import block_window_error
from deepspec.drafts.checkpoint import load_draft, read_draft_config
from deepspec.diskfull import room_for, tensor_bytes
from deepspec.errors import CheckpointError, ConfigError
from deepspec.targets.taps import to_dflash_layer_ids, to_vllm_aux_ids

FORMATS = ("vllm", "sglang")
# Provenance fields compared against the target's own config.json (provenance key, HF config key).
_CHECKED = (("target_vocab_size", "vocab_size"), ("target_hidden_size", "hidden_size"), ("target_num_layers", "num_hidden_layers"))


def _sizes(arch: dict[str, Any], model_type: str) -> dict[str, Any]:
    rope = dict(arch["rope_parameters"])
    return {
        "model_type": model_type,
        "hidden_size": arch["hidden_size"],
        "intermediate_size": arch["intermediate_size"],
        "num_attention_heads": arch["num_attention_heads"],
        "num_key_value_heads": arch["num_key_value_heads"],
        "head_dim": arch["head_dim"],
        "num_hidden_layers": arch["num_layers"],
        "rms_norm_eps": arch["rms_norm_eps"],
        "rope_parameters": rope,
        "rope_theta": rope.get("rope_theta", 10000.0),
        "max_position_embeddings": arch["max_position_embeddings"],
        "hidden_act": arch["hidden_act"],
        "attention_bias": arch["attention_bias"],
        "vocab_size": arch["vocab_size"],
        "tie_word_embeddings": False,
        "target_hidden_size": arch["target_hidden_size"],
        # multi-stream targets: taps of hc_mult streams, reduced by mean (width H) or concat (width hc_mult * H)
        "target_hc_mult": arch.get("target_hc_mult", 1),
        "tap_reduction": arch.get("tap_reduction", "mean"),
        # sliding-window draft layers: what vLLM's Llama/Qwen3 layers read per layer (Qwen3's config keeps
        # sliding_window only with use_sliding_window)
        **(
            {"layer_types": list(arch["layer_types"]), "sliding_window": arch["sliding_window"], "use_sliding_window": True, "max_window_layers": 0}
            if arch.get("layer_types") and "sliding_attention" in arch["layer_types"]
            else {}
        ),
    }


def target_folder(meta: dict[str, Any], target: str | None) -> Path | None:
    """The target's local folder: `target` (a folder or embedded name), else the provenance's recorded path
    when it still exists; None when there is none to read."""
    from deepspec.targets.load import resolve_target_path

    prov = meta.get("provenance", {})
    path = None
    if target is not None:
        path = Path(resolve_target_path(target))
        if not (path / "config.json").is_file():
            raise CheckpointError(f"--target {target} is not a local model folder with config.json; export needs the target's config to check it.")
    else:
        for cand in (prov.get("target_path"), prov.get("target")):
            if not cand:
                continue
            try:
                p = Path(resolve_target_path(str(cand)))
            except Exception:  # noqa: BLE001 - an unresolvable recorded name just means "cannot check"
                continue
            if (p / "config.json").is_file():
                path = p
                break
    return path


def check_target(meta: dict[str, Any], target: str | None) -> dict[str, Any] | None:
    """Compare the checkpoint's provenance and sizes with the target's config.json; raise on a mismatch.

    `target` is a folder (or embedded name); without it, the provenance's target_path is used when it
    exists. Returns the target's config dict (None when no target folder could be found)."""
    prov = meta.get("provenance", {})
    path = target_folder(meta, target)
    if path is None:
        return None
    cfg = json.loads((path / "config.json").read_text())
    cfg = cfg.get("text_config", cfg) if "hidden_size" not in cfg else cfg
    arch = meta["arch"]
    width = arch["target_hidden_size"] // (int(arch.get("target_hc_mult") or 1) if arch.get("tap_reduction") == "concat" else 1)
    expect = {"target_vocab_size": arch["vocab_size"], "target_hidden_size": width, "target_num_layers": arch["target_num_layers"]}
    for key, hf_key in _CHECKED:
        for source, value in (("provenance", prov.get(key)), ("draft", expect[key])):
            if value is not None and cfg.get(hf_key) != value:
                raise CheckpointError(
                    f"The checkpoint was trained for another target: its {source} {key}={value} but {path} has {hf_key}={cfg.get(hf_key)}; "
                    "export it for the target it was trained on (--target)."
                )
    arch_name = (cfg.get("architectures") or [None])[0]
    if prov.get("target_architecture") and arch_name and prov["target_architecture"] != arch_name:
        raise CheckpointError(
            f"The checkpoint was trained for a {prov['target_architecture']} target but {path} is a {arch_name}; use the matching --target."
        )
    if prov.get("template_hash") and (path / "tokenizer_config.json").is_file():
        from deepspec.targets.load import chat_template_hash

        got = chat_template_hash(str(path))
        if got != prov["template_hash"]:
            raise CheckpointError(
                f"The target's chat template hash {got} differs from the checkpoint's template_hash {prov['template_hash']}; "
                "the draft was trained on another template. Export it for the matching target."
            )
    return cfg


def _eagle3(draft, meta) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    arch, mcfg = meta["arch"], meta["model"]
    qwen = arch["qk_norm"]
    cfg = _sizes(arch, "qwen3" if qwen else "llama")
    full_vocab = draft.draft_vocab_size == arch["vocab_size"]
    cfg.update(
        architectures=["Eagle3Qwen3ForCausalLM" if qwen else "LlamaForCausalLMEagle3"],
        eagle_aux_hidden_state_layer_ids=to_vllm_aux_ids(draft.taps),
        # vLLM's drafter sizes fc from this (or from eagle_config), else assumes 3 taps
        num_aux_hidden_states=len(draft.taps),
        draft_vocab_size=draft.draft_vocab_size,
        fc_norm=bool(mcfg["fc_norm"]),
        norm_output=bool(mcfg["norm_output"]),
        norm_before_residual=bool(mcfg["norm_before_residual"]),
        norm_before_fc=bool(mcfg["norm_before_fc"]),
    )
    weights: dict[str, torch.Tensor] = {}
    for name, t in draft.state_dict().items():
        if name in ("target_embed", "target_lm_head"):
            continue
        if name in ("d2t", "t2d") and full_vocab:
            continue  # vLLM builds no d2t parameter for a full-vocabulary draft
        if name.startswith("layers."):  # extra layers follow midlayer (= vLLM layer 0)
            idx, rest = name[len("layers.") :].split(".", 1)
            name = f"layers.{int(idx) + 1}.{rest}"
        weights[name] = t
    return cfg, weights


def _block_weights(draft, keep_prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The named weights, plus a draft vocabulary's head rows and d2t / t2d (absent from full-vocabulary drafts)."""
    keep_prefixes = keep_prefixes + ("lm_head.", "d2t", "t2d")
    return {n: t for n, t in draft.state_dict().items() if n.startswith(keep_prefixes)}


def _dflash(draft, meta, target_cfg: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """DFlashDraftModel config + weights. Beside what vLLM reads, the config carries every field the published DFlash
    checkpoints carry (so their transformers loader and other readers find them) and maps AutoModel to our own
    modeling file (export/hf_remote/), which `export_draft` copies into the export."""
    import transformers

    if draft.sample_from_anchor:
        raise ConfigError(
            "This DFlash draft was trained with model.sample_from_anchor=true, which vLLM's DFlashDraftModel does not run; "
            "retrain with sample_from_anchor=false (the DFlash default) or train a DSpark draft."
        )
    arch = meta["arch"]
    cfg = _sizes(arch, "qwen3")
    sliding = "sliding_window" in cfg
    rope = {k: v for k, v in arch["rope_parameters"].items() if k != "rope_theta"}
    tcfg = target_cfg or {}
    cfg.update(
        architectures=["DFlashDraftModel"],
        auto_map={"AutoModel": f"{REMOTE_MODULE}.DFlashDraftModel"},
        draft_vocab_size=draft.draft_vocab_size,
        block_size=draft.block_size,
        num_target_layers=arch["target_num_layers"],
        # the block attends both ways; stated at the top level too, where loaders that otherwise make sliding
        # layers causal (the published DFlash modeling code, vLLM, SGLang) read it first
        is_causal=False,
        dflash_config={"mask_token_id": draft.mask_token_id, "target_layer_ids": to_dflash_layer_ids(draft.taps), "causal": False},
        layer_types=list(arch.get("layer_types") or ["full_attention"] * arch["num_layers"]),
        sliding_window=cfg.get("sliding_window") if sliding else None,
        use_sliding_window=sliding,
        max_window_layers=cfg.get("max_window_layers", 0) if sliding else arch["num_layers"],
        # transformers releases before rope_parameters read rope_theta + rope_scaling
        rope_scaling=rope if rope.get("rope_type", "default") != "default" else None,
        attention_dropout=0.0,
        initializer_range=0.02,
        use_cache=True,
        bos_token_id=tcfg.get("bos_token_id"),
        eos_token_id=tcfg.get("eos_token_id"),
        transformers_version=transformers.__version__,
    )
    return cfg, _block_weights(draft, ("fc.", "hidden_norm.", "norm.", "layers."))


# our transformers modeling file for DFlash exports (`AutoModel.from_pretrained(EXPORT, trust_remote_code=True)`)
REMOTE_MODULE = "modeling_deepspec_dflash"
REMOTE_FILE = Path(__file__).with_name("hf_remote") / f"{REMOTE_MODULE}.py"


def bake_confidence(weights: dict[str, torch.Tensor], a: float, b: float) -> dict[str, torch.Tensor]:
    """Fold sigmoid(a * z + b) into the confidence head z = W x + c: W' = a W, c' = a c + b (fp32, as vLLM keeps it).

    vLLM's DSparkConfidenceHead is one Linear shared by every draft position (qwen3_dspark.py: compute_confidence =
    sigmoid(proj(x))), so only a global (a, b) can live in the weights; a per-position scaling has no row to go to."""
    out = dict(weights)
    out["confidence_head.proj.weight"] = weights["confidence_head.proj.weight"].float() * a
    out["confidence_head.proj.bias"] = weights["confidence_head.proj.bias"].float() * a + b
    return out


def read_calibration(path: str | Path) -> dict[str, Any]:
    """A calibration.json written by deepspec.eval.calibration; a user error when it is not one."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
        a, b = float(data["bake"]["a"]), float(data["bake"]["b"])
        data["temperatures"][f"{data['bake']['temperature']:g}"]["scaling"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{p} is not a calibration.json from `python -m deepspec.eval.calibration` ({e}); rerun the calibration.") from e
    if not (math.isfinite(a) and math.isfinite(b)):
        raise ConfigError(f"{p} holds a non-finite calibration; rerun the calibration with more prompts.")
    return data


def calibration_record(calib: dict[str, Any]) -> dict[str, Any]:
    """What config.json keeps of a calibration.json: the baked global pair and every per-position pair (which the
    engine cannot apply), with the evaluation split's ECE, so nothing is dropped silently."""
    bake = calib["bake"]
    per = calib["temperatures"][f"{bake['temperature']:g}"]
    sc = per["scaling"]
    return {"baked": {"a": bake["a"], "b": bake["b"], "temperature": bake["temperature"]},
            "method": sc.get("method", "per_position"), "global_fit": sc.get("global_fit"),
            "per_position_not_baked": {"a": sc["a"], "b": sc["b"]},
            "ece_bins": calib["bins"], "ece_raw": per["ece_raw"], "ece_global_only": per["ece_global_only"],
            "ece_per_position_calibrated": per["ece_calibrated"]}


def calibration_card(rec: dict[str, Any]) -> str:
    """The model card's section on the confidence calibration (README.md)."""
    b = rec["baked"]
    pos = ", ".join(f"{a:.3f}·z{bb:+.3f}" for a, bb in zip(rec["per_position_not_baked"]["a"], rec["per_position_not_baked"]["b"]))
    if (b["a"], b["b"]) == (1.0, 0.0):  # cross-validation kept the raw head: say so rather than print an identity pair
        fit = rec.get("global_fit")
        head = (f"The confidence head is exported as trained: calibrated at T = {b['temperature']:g}, no global scaling beat "
                f"the raw head on held-out answers" + (f" (the fitted pair would have been sigmoid({fit[0]:.4f}·z {fit[1]:+.4f}))" if fit else "")
                + ", so vLLM's adaptive verification reads the raw values. ")
    else:
        head = (f"The confidence head's weights include a global temperature scaling sigmoid({b['a']:.4f}·z {b['b']:+.4f}) "
                f"fitted at T = {b['temperature']:g} (raw z = the trained head's logit): vLLM's adaptive verification reads "
                f"these calibrated values. ")
    return (f"\n## Confidence calibration\n\n{head}The per-position fit ({rec.get('method', 'per_position')}: {pos}, "
            f"position 1 first) cannot be carried by vLLM's shared head and is recorded in config.json (`deepspec.confidence_calibration`). "
            f"ECE ({rec['ece_bins']} equal-mass bins) per position, raw: {rec['ece_raw']}; baked global: "
            f"{rec['ece_global_only']}; per-position: {rec['ece_per_position_calibrated']}.\n")


def _dspark(draft, meta, target_name: str | None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    mcfg = meta["model"]
    layer = _sizes(meta["arch"], "qwen3")
    layer["architectures"] = ["Qwen3ForCausalLM"]
    cfg = {
        "architectures": ["Qwen3DSparkModel"],
        "speculators_model_type": "dspark",
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": "dspark",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": draft.num_predictions}],
            "verifier": {"name_or_path": target_name or meta.get("provenance", {}).get("target"), "architectures": [meta.get("provenance", {}).get("target_architecture")]},
        },
        "aux_hidden_state_layer_ids": to_vllm_aux_ids(draft.taps),
        "draft_vocab_size": draft.draft_vocab_size,
        "target_hidden_size": meta["arch"]["target_hidden_size"],
        "mask_token_id": draft.mask_token_id,
        "markov_rank": mcfg["markov_rank"],
        "markov_head_type": mcfg["markov_head_type"],
        "block_size": draft.block_size,
        "enable_confidence_head": draft.confidence_head is not None,
        "confidence_head_with_markov": bool(draft.confidence_head is not None and draft.confidence_head.with_markov),
        "sample_from_anchor": draft.sample_from_anchor,
    }
    weights = _block_weights(draft, ("fc.", "hidden_norm.", "norm.", "layers.", "markov_head.", "confidence_head."))
    if "confidence_head.proj.weight" in weights:
        weights = {k: (v.float() if k.startswith("confidence_head.") else v) for k, v in weights.items()}
    return cfg, weights


def _dflash2(draft, meta, target_cfg: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """DFlash2DraftModel: DFlash's config with DFlash2's fields in dflash_config (what qwen3_dflash2.py reads) and the
    convolution and selector weights under vLLM's names. No auto_map: our transformers modeling file runs DFlash only."""
    cfg, _ = _dflash(draft, meta, target_cfg)
    mcfg = meta["model"]
    cfg.pop("auto_map", None)
    cfg["architectures"] = ["DFlash2DraftModel"]
    cfg["dflash_config"].update(conv_kernel_size=mcfg["conv_kernel_size"], conv_group_size=mcfg["conv_group_size"],
                                selector_rank=mcfg["selector_rank"], selector_top_k=mcfg["selector_top_k"],
                                input_embedding_scale=1.0, output_multiplier=1.0, final_logit_softcapping=0.0)
    return cfg, _block_weights(draft, ("fc.", "hidden_norm.", "norm.", "layers.", "candidate_selector."))


def _check_vllm(algo: str, meta: dict[str, Any]) -> None:
    """Refuse what vLLM 0.32 would load but not run as trained."""
    mcfg = meta["model"]
    act = meta["arch"].get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"vLLM's Llama/Qwen3 draft layers use a SiLU-gated MLP; this draft's MLP uses {act}, so vLLM would not run it as trained.")
    if algo == "dspark" and mcfg["markov_head_type"] != "vanilla":
        raise ConfigError(
            f"vLLM's Qwen3DSparkModel implements only the vanilla Markov head; this draft uses '{mcfg['markov_head_type']}'. "
            "Train with model.markov_head_type=vanilla, or export it with --format sglang (SGLang runs gated and rnn heads)."
        )


def _name_mask_token(cfg: dict[str, Any], folder: Path | None) -> None:
    """SGLang's block drafts look their mask token string up in the target's tokenizer (default `<|MASK|>`) and
    refuse to start when it names another id than dflash_config.mask_token_id: name our id's own token."""
    if folder is None or not (folder / "tokenizer_config.json").is_file():
        return
    from deepspec.targets.load import load_tokenizer

    token = load_tokenizer(str(folder)).convert_ids_to_tokens(cfg["dflash_config"]["mask_token_id"])
    if token:
        cfg["dflash_config"]["mask_token"] = token


def _engine_refusals(algo, meta, cfg, weights, draft) -> dict[str, str | None]:
    """engine -> None when it runs this draft as trained, else the sentence saying why not (for the card too)."""
    from deepspec.export.sglang import BUILDERS

    out: dict[str, str | None] = {}
    def sglang() -> None:
        if algo not in BUILDERS:
            raise ConfigError(f"SGLang has no {algo} draft model; export this draft with --format vllm.")
        BUILDERS[algo](dict(cfg), dict(weights), draft, meta)

    for engine, check in (("vllm", lambda: _check_vllm(algo, meta)), ("sglang", sglang)):
        try:
            check()
            out[engine] = None
        except ConfigError as e:
            out[engine] = str(e)
    return out


def export_draft(
    checkpoint: str | Path,
    out: str | Path,
    fmt: str = "vllm",
    target: str | None = None,
    dtype: str = "bfloat16",
    num_speculative_tokens: int | None = None,
    eval_results: str | Path | None = None,
    calibration: str | Path | None = None,
    contract_prompts: int | None = None,
) -> Path:
    """Export a deepspec checkpoint folder to `out` (written atomically). Returns `out`.

    `num_speculative_tokens`: the tokens per round the export is meant to be served with (recorded in
    config.json's `deepspec.num_speculative_tokens` and the model card; a DFlash draft refuses anything but
    block_size - 1). `eval_results`: the eval results.json the model card (README.md) reports (default:
    `<checkpoint>/eval/results.json`; absent = the card says "not measured"). `calibration`: a DSpark draft's
    calibration.json (eval/calibration.py) whose global scaling is baked into the confidence head. `contract_prompts`:
    how many of each split's eval prompts the served-acceptance contract stores (export/contract.py)."""
    from deepspec.export.sglang import BUILDERS
    from deepspec.export.serve import served_tokens

    if fmt not in FORMATS:
        raise ConfigError(f"Unknown export format '{fmt}'; use one of {', '.join(FORMATS)}.")
    meta = read_draft_config(checkpoint)["deepspec"]
    target_cfg = check_target(meta, target)
    mcfg = meta["model"]
    short = block_window_error(meta["algorithm"], int(mcfg.get("block_size") or 1), mcfg.get("layer_types"), mcfg.get("sliding_window"))
    if short:  # a checkpoint trained before the config refused it
        raise ConfigError(short)
    if meta["arch"].get("norm_offset") or meta["arch"].get("embed_scale", 1.0) != 1.0 or meta["arch"].get("logit_softcap"):
        raise ConfigError(
            "This draft uses Gemma-style norms / embedding scaling / logit soft-capping, which vLLM's Llama/Qwen3 draft "
            "layouts cannot express; it can be evaluated with deepspec but not exported."
        )
    draft = load_draft(checkpoint)
    algo = meta["algorithm"]
    if algo == "eagle3":
        cfg, weights = _eagle3(draft, meta)
    elif algo == "dflash":
        cfg, weights = _dflash(draft, meta, target_cfg)
    elif algo == "dspark":
        cfg, weights = _dspark(draft, meta, target)
        if calibration is not None:
            calib = calibration_record(read_calibration(calibration))
            if "confidence_head.proj.weight" not in weights:
                raise ConfigError("--calibration needs a DSpark draft with a confidence head; this one has none.")
            weights = bake_confidence(weights, calib["baked"]["a"], calib["baked"]["b"])
    elif algo == "dflash2":
        cfg, weights = _dflash2(draft, meta, target_cfg)
    else:
        raise ConfigError(f"Export does not know algorithm '{algo}'.")
    engines = _engine_refusals(algo, meta, cfg, weights, draft)  # engine -> None (serves it as trained) or the reason
    if engines[fmt]:
        raise ConfigError(engines[fmt])
    if fmt == "sglang":  # SGLang's layouts are rewrites of the vLLM ones (fields added above reach both)
        cfg, weights = BUILDERS[algo](cfg, weights, draft, meta)
        if "dflash_config" in cfg:
            _name_mask_token(cfg, target_folder(meta, target))
    torch_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype]
    cfg["torch_dtype"] = dtype
    if algo in ("dflash", "dflash2"):
        cfg["dtype"] = dtype  # the name transformers 5 writes (published DFlash checkpoints carry it)
    cfg["deepspec"] = {"algorithm": algo, "format": fmt, "taps": list(draft.taps), "source_checkpoint": str(Path(checkpoint).resolve()),
                       "provenance": meta.get("provenance", {}), "model": meta["model"],
                       "num_speculative_tokens": served_tokens(algo, meta["model"], num_speculative_tokens)}
    if algo == "dspark" and calibration is not None:
        cfg["deepspec"]["confidence_calibration"] = calib
    tensors = {}
    for k, v in weights.items():
        v = v.detach().cpu()
        if v.is_floating_point() and not k.startswith("confidence_head."):
            v = v.to(torch_dtype)
        tensors[k] = v.contiguous()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    from deepspec.locks import folder_lock

    with folder_lock(out, "export"):
        _write_export(out, cfg, tensors, algo, engines, Path(checkpoint), eval_results, contract_prompts)
    return out


def _write_export(out: Path, cfg: dict[str, Any], tensors: dict[str, torch.Tensor], algo: str, engines: dict[str, str | None],
                  checkpoint: Path, eval_results: str | Path | None, contract_prompts: int | None = None) -> None:
    """Write the export into a hidden temporary folder and swap it in: `out` is always a whole export (the old one or
    the new one), also for a server loading it meanwhile."""
    from safetensors.torch import save_file

    from deepspec.export.card import model_card
    from deepspec.export.contract import PROMPTS_PER_SPLIT, build_contract, contract_card, write_contract
    from deepspec.results import find_eval_results

    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    keep = "The earlier export there is untouched; free" if out.exists() else "Free"
    try:
        with room_for(out, tensor_bytes(tensors), "the export", f"{keep} some space and rerun the export."):
            (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
            if algo == "dflash":
                shutil.copyfile(REMOTE_FILE, tmp / REMOTE_FILE.name)
            save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            n_params = sum(t.numel() for k, t in tensors.items() if k not in ("d2t", "t2d"))
            card = model_card(cfg, Path(checkpoint), n_params, engines, find_eval_results(Path(checkpoint), eval_results), out.name)
            if "confidence_calibration" in cfg["deepspec"]:
                card += calibration_card(cfg["deepspec"]["confidence_calibration"])
            # what the draft was measured at, for `deepspec check EXPORT --served URL`
            contract = build_contract(cfg, Path(checkpoint), eval_results, PROMPTS_PER_SPLIT if contract_prompts is None else contract_prompts)
            write_contract(tmp, contract)
            card += contract_card(contract)
            (tmp / "README.md").write_text(card)
            recipe = Path(checkpoint) / "config.yaml"
            if recipe.is_file():  # the fully resolved training recipe travels with the export
                shutil.copyfile(recipe, tmp / "deepspec_config.yaml")
        swap_in(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def swap_in(new: Path, out: Path) -> None:
    """Move the complete folder `new` to `out`, replacing what is there: the old one is renamed aside first (and put
    back if the move fails), so `out` is always a whole folder, the old one or the new one."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(out, old)
    try:
        os.replace(new, out)
    except BaseException:
        if old is not None and not out.exists():
            os.replace(old, out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
