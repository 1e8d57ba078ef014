"""README.md for an export, in the style of published draft-model cards.

Only figures measured for this checkpoint appear: held-out acceptance comes from the checkpoint's eval
results.json (`<checkpoint>/eval/results.json` unless given), served figures from its engine-backed part;
a field without a measurement says "not measured". Nothing here is estimated.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from deepspec.targets.taps import to_dflash_layer_ids, to_vllm_aux_ids

NOT_MEASURED = "not measured"
NOT_RECORDED = "not recorded"
ALGORITHM_NAMES = {"eagle3": "EAGLE-3", "dflash": "DFlash", "dspark": "DSpark"}


def _fmt(x: Any, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return NOT_MEASURED
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def _algorithm_name(algo: str, model: dict[str, Any]) -> str:
    if algo == "eagle3" and (model.get("fc_norm") or model.get("norm_output")):
        return "EAGLE-3.1"
    return ALGORITHM_NAMES.get(algo, algo)


def find_eval_results(checkpoint: Path, explicit: str | Path | None = None) -> dict[str, Any] | None:
    """The checkpoint's eval results.json (explicit path first, then `<checkpoint>/eval/results.json`)."""
    for cand in ([Path(explicit)] if explicit else []) + [Path(checkpoint) / "eval" / "results.json"]:
        if cand.is_file():
            return json.loads(cand.read_text())
    return None


def _resolved_config(checkpoint: Path) -> dict[str, Any]:
    import yaml

    f = Path(checkpoint) / "config.yaml"
    return (yaml.safe_load(f.read_text()) or {}) if f.is_file() else {}


def _cache_counts(rcfg: dict[str, Any]) -> dict[str, Any] | None:
    """Sample / token counts from the training cache's manifest, when the cache is still where the recipe put it."""
    cache_dir = (rcfg.get("cache") or {}).get("dir") or ""
    if not cache_dir:
        root, project = rcfg.get("output_root") or "outputs", rcfg.get("project") or ""
        cache_dir = str(Path(root) / project / "cache") if project else ""
    for cand in ([Path(cache_dir) / "manifest.json", Path(cache_dir) / "train" / "manifest.json"] if cache_dir else []):
        if cand.is_file():
            return json.loads(cand.read_text()).get("counts")
    return None


def _architecture(cfg: dict[str, Any], ds: dict[str, Any], n_params: int) -> list[str]:
    algo, model, taps = ds["algorithm"], ds.get("model", {}), ds["taps"]
    prov = ds.get("provenance", {})
    body = f"{cfg.get('num_hidden_layers', '?')} decoder layer(s), hidden {cfg.get('hidden_size', cfg.get('transformer_layer_config', {}).get('hidden_size'))}"
    rows = [
        ("Draft", f"{_algorithm_name(algo, model)}: {body}; {n_params / 1e6:.2f} M parameters in this export"),
        ("Target", f"{prov.get('target', NOT_RECORDED)} ({prov.get('target_architecture') or 'architecture not recorded'})"),
        ("Taps (output of decoder layer k; -1 = embeddings)", str(list(taps))),
        ("vLLM capture ids (`eagle_aux_hidden_state_layer_ids`, k + 1)", str(to_vllm_aux_ids(taps))),
        ("SGLang ids (`eagle_config` / `dflash_config`, the target adds 1)", str(to_dflash_layer_ids(taps))),
        ("Stream reduction", f"{cfg.get('tap_reduction', model.get('tap_reduction', 'mean'))} over "
                             f"{cfg.get('target_hc_mult', cfg.get('hc_mult', 1))} residual stream(s)"),
        ("Draft vocabulary", f"{cfg.get('draft_vocab_size', NOT_MEASURED)} of {cfg.get('vocab_size', cfg.get('transformer_layer_config', {}).get('vocab_size'))} target tokens"),
    ]
    if algo == "eagle3":
        rows.append(("TTT depth (training)", str(model.get("ttt_length"))))
        rows.append(("EAGLE-3.1 options", f"fc_norm={model.get('fc_norm')}, norm_output={model.get('norm_output')}, norm_before_fc={model.get('norm_before_fc')}"))
    else:
        mask = (cfg.get("dflash_config") or {}).get("mask_token_id", cfg.get("mask_token_id"))
        anchor = cfg.get("sample_from_anchor", False)  # absent = DFlash (a sampling anchor is refused at export)
        rows.append(("Block size", f"{model.get('block_size')} (mask token id {mask}, the anchor slot predicts: {anchor})"))
    if algo == "dspark":
        rows.append(("Markov head", f"{model.get('markov_head_type')}, rank {model.get('markov_rank')}"))
        rows.append(("Confidence head", f"{model.get('enable_confidence_head')} (with Markov features: {model.get('confidence_head_with_markov')}); "
                                        f"threshold {model.get('confidence_threshold', 0)}"))
    return ["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]


def _training(rcfg: dict[str, Any], ds: dict[str, Any]) -> list[str]:
    if not rcfg:
        return ["The resolved training recipe was not stored with the checkpoint: " + NOT_MEASURED + "."]
    data, train = rcfg.get("data") or {}, rcfg.get("train") or {}
    prompts = data.get("prompts") or {}
    sources = prompts.get("sources") or ([{"source": prompts.get("source"), "files": prompts.get("files") or None}] if prompts else [])
    counts = _cache_counts(rcfg)
    prov = ds.get("provenance", {})
    rows = [
        ("Data sources", "; ".join(json.dumps({k: v for k, v in s.items() if v not in (None, [], "")}, sort_keys=True) for s in sources) or NOT_MEASURED),
        ("Answers", f"regenerated by the target (temperature {((data.get('regenerate') or {}).get('sampling') or {}).get('temperature', NOT_MEASURED)})"),
        ("Training samples / loss tokens (cache manifest)",
         f"{counts.get('samples')} / {counts.get('loss_tokens', NOT_MEASURED)}" if counts else NOT_MEASURED),
        ("Data hash / template hash", f"{prov.get('data_hash', NOT_RECORDED)} / {prov.get('template_hash', NOT_RECORDED)}"),
        ("Optimizer", f"{train.get('optimizer')} lr {train.get('lr')}" + (f" (muon lr {train['muon_lr']})" if train.get("muon_lr") else "")
                      + f", betas {train.get('betas')}, "
                      f"weight decay {train.get('weight_decay')}, grad clip {train.get('grad_clip')}"),
        ("Schedule", f"{train.get('epochs')} epochs (max_steps {train.get('max_steps')}), warmup {train.get('warmup_ratio')}, "
                     f"min lr ratio {train.get('min_lr_ratio')}"),
        ("Batch", f"global {train.get('global_batch_size')}, micro {train.get('micro_batch_size')}, max length {(rcfg.get('cache') or {}).get('max_length')}"),
        ("Precision / parallelism", f"{train.get('precision')} / {train.get('parallel')}"),
        ("Seed", str(train.get("seed"))),
    ]
    return ["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]


def _acceptance(results: dict[str, Any] | None) -> list[str]:
    if not results:
        return [f"Held-out acceptance: {NOT_MEASURED} (no eval results.json for this checkpoint; run `deepspec eval` first)."]
    meta = results.get("meta", {})
    from deepspec.eval.report import results_protocol

    depth = max((len(t.get("acc_cond") or []) for t in results.get("tasks", {}).values()), default=0)
    head = "| split | samples | acc0 | " + " | ".join(f"α{k}" for k in range(1, depth + 1)) + " | E[A]@S3 | E[A]@S7 | τ@3 | τ (chain of S) | speedup (HF loop) |"
    lines = [
        f"Speculative decoding with our own loop at temperature {meta.get('temperature')} ({results_protocol(meta, NOT_MEASURED)}), "
        f"{meta.get('num_draft_tokens')} draft tokens per round, answers up to {meta.get('max_new_tokens')} tokens. αk is the "
        "conditional acceptance at depth k; τ includes the bonus token.",
        "", head, "|" + "---|" * (head.count("|") - 1),
    ]
    rows = [(name, t) for name, t in results.get("tasks", {}).items() if "tau" in t] + [("overall", results.get("overall", {}))]
    for name, t in rows:
        acc = list(t.get("acc_cond") or []) + [None] * depth
        sp = t.get("speedup")
        lines.append(f"| {name} | {t.get('samples', '')} | {_fmt(t.get('acc0'))} | " + " | ".join(_fmt(a) for a in acc[:depth])
                     + f" | {_fmt(t.get('E[A]@S3'))} | {_fmt(t.get('E[A]@S7'))} | {_fmt(t.get('tau@3'))} | {_fmt(t.get('tau'))} | "
                     + (f"{sp:.2f}x" if isinstance(sp, (int, float)) else NOT_MEASURED) + " |")
    return lines


def _served(results: dict[str, Any] | None) -> list[str]:
    eng = (results or {}).get("engine")
    if not eng:
        return [f"vLLM mean acceptance length and served speedup: {NOT_MEASURED} (run the eval with eval.engine=vllm)."]
    s = eng.get("num_speculative_tokens")
    machine = eng.get("machine") or ", ".join(sorted(set(map(str, (results.get("meta") or {}).get("devices") or [])))) or NOT_MEASURED
    version = f" {eng['engine_version']}" if eng.get("engine_version") else ""
    from deepspec.eval.report import results_protocol, served_verdict

    proto = eng.get("protocol") or results_protocol((results or {}).get("meta") or {}, NOT_MEASURED)
    lines = [f"vLLM{version} with {s} speculative tokens per round on {machine}, {proto} on both sides.", "",
             "| split | vLLM mean acceptance length | ours τ@S | served as trained (per depth, T = 0) | tok/s alone (1 request) | "
             "speedup (1 request) | speedup (16 concurrent) |",
             "|---|---|---|---|---|---|---|"]
    speed = eng.get("speedup") or {}
    for name, c in list((eng.get("tasks") or {}).items()) + [("overall", eng.get("overall") or {})]:
        sp = speed.get(name) or {}
        one, batch = sp.get("single") or {}, sp.get("concurrent") or {}
        lines.append(f"| {name} | {_fmt(c.get('engine_tau'))} | {_fmt(c.get('ours_tau_at_S'))} | {served_verdict(c.get('served_as_trained'))} | "
                     f"{_fmt(one.get('baseline_tokens_per_s'), 1)} | "
                     f"{_x(one.get('speedup'))} | {_x(batch.get('speedup'))} |")
    return lines


def _x(v: Any) -> str:
    return f"{v:.2f}x" if isinstance(v, (int, float)) else NOT_MEASURED


def transformers_loaders(cfg: dict[str, Any]) -> dict[str, str | None]:
    """For a DFlash export: loader -> None when it runs the draft as trained, else why not. `deepspec`: the modeling file
    shipped in the export (AutoModel + trust_remote_code); `dflash`: the published DFlash reference code
    (`DFlashDraftModel` of the `dflash` package / the public checkpoints' modeling file)."""
    ds = cfg.get("deepspec", {})
    taps = list(ds.get("taps") or [])
    n_target = cfg.get("num_target_layers")
    streams = int(cfg.get("target_hc_mult") or 1)
    multi = (f"it reads {streams} residual streams of a hyper-connection target per tap, which a transformers target does not "
             "expose" if streams > 1 else None)
    reasons = []
    if multi:
        reasons.append(multi)
    if (cfg.get("draft_vocab_size") or cfg.get("vocab_size")) < cfg.get("vocab_size", 0):
        reasons.append(f"it drafts over a {cfg['draft_vocab_size']}-token draft vocabulary, but that code scores with the target's "
                       "whole LM head and ignores lm_head / d2t")
    if n_target is not None and (n_target - 1) in taps:
        reasons.append(f"it taps the target's last layer ({n_target - 1}), which that code reads from output_hidden_states after "
                       "the target's final norm (deepspec taps it before)")
    if cfg.get("attention_bias"):
        reasons.append("its q/k/v projections have biases, and that code also builds an o_proj bias the draft does not have")
    return {"deepspec": multi, "dflash": "; ".join(reasons) or None}


def _transformers(cfg: dict[str, Any], ds: dict[str, Any], target: str, name: str) -> list[str]:
    """Deployment lines for transformers (trust_remote_code), ours and the published DFlash code."""
    loaders = transformers_loaders(cfg)
    lines = []
    if loaders["deepspec"]:
        lines += [f"Transformers: not run as trained — {loaders['deepspec']}; serve it with vLLM.", ""]
    else:
        lines += [
            "Transformers (the modeling file shipped here, `modeling_deepspec_dflash.py`, runs the draft as trained; greedy "
            "decoding equals the target's own):", "",
            "```python",
            "from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer",
            f'draft = AutoModel.from_pretrained("{name}", trust_remote_code=True, dtype="auto").eval()',
            f'target = AutoModelForCausalLM.from_pretrained("{target}", dtype="auto").eval()',
            f'tokenizer = AutoTokenizer.from_pretrained("{target}")',
            'text = tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], tokenize=False, add_generation_prompt=True)',
            'ids = tokenizer(text, return_tensors="pt").input_ids',
            "out = draft.spec_generate(target=target, input_ids=ids, max_new_tokens=256, stop_token_ids=[tokenizer.eos_token_id], temperature=0.0)",
            "```", "",
        ]
    if loaders["dflash"]:
        lines += [f"The published DFlash reference code (`DFlashDraftModel` of the `dflash` package) does not run this export as "
                  f"trained: {loaders['dflash']}.", ""]
    else:
        lines += ["The published DFlash reference code (`DFlashDraftModel` of the `dflash` package) also runs it as trained.", ""]
    return lines


def model_card(cfg: dict[str, Any], checkpoint: str | Path, n_params: int, engines: dict[str, str | None],
               results: dict[str, Any] | None, name: str = "DRAFT_DIR") -> str:
    """The README.md text. `engines`: engine -> None when it serves this draft as trained, else the refusal."""
    from deepspec.export.serve import served_tokens, sglang_command, vllm_command

    ds = cfg["deepspec"]
    algo, model, prov = ds["algorithm"], ds.get("model", {}), ds.get("provenance", {})
    target = prov.get("target") or "TARGET"
    rcfg = _resolved_config(Path(checkpoint))
    s = ds.get("num_speculative_tokens") or served_tokens(algo, model)
    title = f"{_algorithm_name(algo, model)} draft for {target}"
    lines = [
        "---", "library_name: deepspec", "tags: [speculative-decoding, " + algo + "]", f"base_model: {target}", "---", "",
        f"# {title}", "",
        "## Overview", "",
        f"A {_algorithm_name(algo, model)} draft model that proposes tokens for `{target}` in speculative decoding; the target "
        "verifies every token, so outputs follow the target's distribution. Trained and exported with deepspec "
        f"(export format: {ds.get('format')}).", "",
        "## Architecture", "", *_architecture(cfg, ds, n_params), "",
        "## Training", "", *_training(rcfg, ds), "",
        "## Held-out acceptance", "", *_acceptance(results), "",
        "## Served results", "", *_served(results), "",
        "## Deployment", "",
    ]
    for engine, label in (("vllm", "vLLM"), ("sglang", "SGLang")):
        if engines.get(engine):
            lines += [f"{label}: not served as trained — {engines[engine]}", ""]
            continue
        fmt = "" if engine == ds.get("format") else f" (export with `deepspec export CKPT --format {engine}` first)"
        cmd = vllm_command(target, name, algo, s) if engine == "vllm" else sglang_command(target, name, algo, s)
        lines += [f"{label}{fmt}:", "", "```bash", cmd, "```", ""]
    if algo == "dflash":
        lines += _transformers(cfg, ds, target, name)
    lines += [
        "## Limitations", "",
        f"- Acceptance depends on what is drafted: the figures above hold for the listed splits at the stated temperature "
        "and answer budget; other prompts, chat templates or sampling settings accept differently.",
        f"- The draft reads the target's hidden states at the taps above and shares its embeddings and LM head: it works "
        f"only with `{target}` (template hash {prov.get('template_hash', NOT_RECORDED)}).",
        f"- Serve it with {s} speculative tokens per round" + (" (the DFlash training block minus the anchor; vLLM ignores block_size)." if algo == "dflash" else "."),
    ]
    if algo == "dspark":
        lines.append("- Neither engine reads a confidence threshold from the checkpoint: vLLM uses the confidence head with "
                     "`\"enable_adaptive_verification\": true` in `--speculative-config`, SGLang in its confidence-driven verify modes "
                     "(SGLANG_RAGGED_VERIFY_MODE=cap-accept|compact); vLLM runs DSpark only on its GPU model runner.")
    return "\n".join(lines) + "\n"
