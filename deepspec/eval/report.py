"""Eval reports: results.json (everything), results.md (tables), acceptance.png (per-depth curves) and
acceptance_by_length.png (the same curves per prompt-length bucket).

Metric names follow docs/evaluation.md: tau (incl. bonus), acc_cond@k (conditional), survival@k
(prefix survival), E[A]@S. No bare "accept rate" anywhere.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from deepspec.log import get_logger
from deepspec.results import fmt as _f
from deepspec.results import length_rows, length_table, overall_rows, served_verdict, split_table

log = get_logger(__name__)


def json_safe(obj: Any) -> Any:
    """NaN is not JSON: write null instead."""
    if isinstance(obj, float) and (math.isnan(obj) or math.isinf(obj)):
        return None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def markdown(results: dict[str, Any]) -> str:
    """A readable summary: one row per benchmark + overall, then per-depth tables."""
    meta = results.get("meta", {})
    rows = [(name, r) for name, r in results["tasks"].items() if "skipped" not in r] + overall_rows(results)
    depth = max((len(r.get("acc_cond", [])) for _, r in rows), default=0)
    serving = meta.get("serving_mode") or {}
    lines = [
        f"# Speculative decoding eval: {meta.get('algorithm', '?')} draft",
        "",
        f"- checkpoint: `{meta.get('checkpoint', '?')}`",
        f"- target: `{(meta.get('target') or {}).get('target', '?')}`; temperature {meta.get('temperature')}, "
        f"{meta.get('num_draft_tokens')} draft tokens per round, max {meta.get('max_new_tokens')} new tokens, seed {meta.get('seed')}",
        f"- protocol of every figure below: **{meta.get('protocol', '?')}** (eval.draft_sample_method = "
        f"{meta.get('draft_sample_method', '?')}; docs/evaluation.md, \"Draft sampling at T > 0\")",
        f"- chat template: {serving.get('chat_template_kwargs', '?')}"
        + ("" if serving.get("matches_training") is not False else
           f" — **differs from the training data's** ({serving.get('training_chat_template_kwargs')}"
           + (f", regenerated with {serving['regenerate_chat_template_kwargs']}" if "regenerate_chat_template_kwargs" in serving else "") + ")"),
        "- overall (pooled) = every verify round of every benchmark together; overall (benchmark mean) = the mean of the "
        "per-benchmark values, each benchmark counting once.",
        "- tau = mean (accepted drafts + 1) per verify round (bonus token included); acc_cond@k = P(draft k accepted | 1..k-1 "
        "accepted); survival@k = P(at least k accepted); E[A]@S = sum of survival@1..S.",
        "",
        "| benchmark | samples | tau | rounds | proposed | accepted | target tok/s | spec tok/s | speedup |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows:
        lines.append(
            f"| {name} | {r.get('samples', '')} | {_f(r.get('tau'))} | {r.get('rounds', '')} | {r.get('proposed_tokens', '')} | "
            f"{r.get('accepted_tokens', '')} | {_f(r.get('target_tokens_per_s'), 1)} | {_f(r.get('spec_tokens_per_s'), 1)} | "
            f"{_f(r.get('speedup'), 2)} |"
        )
    lines += ["", "## Per split: acc0 (= acc_cond@1), acceptance per depth, E[A]@S3, E[A]@S7, tau@3", ""]
    lines += split_table(rows, meta.get("max_new_tokens"), depth)
    lines += by_length_markdown(results) + by_thinking_markdown(results)
    if depth:
        head = " | ".join(f"k={k}" for k in range(1, depth + 1))
        sep = "|---" * (depth + 1) + "|"
        for title, key in (("Conditional acceptance acc_cond@k", "acc_cond"), ("Prefix survival survival@k", "survival"),
                           ("E[A]@S (expected accepted drafts with S speculative tokens)", "expected_accepted")):
            lines += ["", f"## {title}", "", f"| benchmark | {head} |", sep]
            for name, r in rows:
                vals = list(r.get(key, [])) + [None] * (depth - len(r.get(key, [])))
                lines.append(f"| {name} | " + " | ".join(_f(v) for v in vals) + " |")
    skipped = [(n, r["skipped"]) for n, r in results["tasks"].items() if "skipped" in r]
    if skipped:
        lines += ["", "## Skipped benchmarks", ""] + [f"- {n}: {why}" for n, why in skipped]
    match = results.get("greedy_outputs_match_target")
    if match:
        lines += ["", f"Greedy outputs identical to target-only decoding: {match['matched_turns']}/{match['turns']} turns."]
    eng = results.get("engine")
    if eng and "tasks" in eng:
        proto = eng.get("protocol") or meta.get("protocol")
        seeded = "" if eng.get("seeded", True) else "; engine requests unseeded (vLLM's CPU build cannot honour a per-request seed)"
        lines += ["", f"## Engine-backed ({eng.get('engine')}, {eng.get('num_speculative_tokens')} speculative tokens, {proto} on both sides{seeded})", "",
                  "| benchmark | engine tau | ours tau@S | diff | engine survival@k | ours survival@k | served as trained | served speedup (1 request / 16 concurrent) |",
                  "|---|---|---|---|---|---|---|---|"]
        served = eng.get("speedup") or {}
        for name, r in list(eng["tasks"].items()) + [("**overall (pooled)**", eng.get("overall", {})),
                                                     ("**overall (benchmark mean)**", eng.get("overall_benchmark_mean", {}))]:
            if not r:
                continue
            sp = served.get("overall" if name == "**overall (pooled)**" else name.strip("*")) or {}
            speed = " / ".join(f"{_f((sp.get(m) or {}).get('speedup'), 2)}x" for m in ("single", "concurrent")) if sp else "not measured"
            lines.append(
                f"| {name} | {_f(r.get('engine_tau'))} | {_f(r.get('ours_tau_at_S'))} | {_f(r.get('relative_diff'), 3)} | "
                f"{', '.join(_f(v, 2) for v in r.get('engine_survival', []))} | {', '.join(_f(v, 2) for v in r.get('ours_survival', []))} | "
                f"{served_verdict(r.get('served_as_trained'))} | {speed} |"
            )
        if served:
            lines += ["", f"Served speedup: vLLM output tokens/s with the draft / without it, same prompts and server settings, on {eng.get('machine')}."]
    return "\n".join(lines) + "\n"


def by_length_markdown(results: dict[str, Any]) -> list[str]:
    """The acceptance-by-prompt-length table (per split, then pooled); empty buckets are left out."""
    block = results.get("by_context_length")
    rows = length_rows(block)
    if not rows:
        return []
    return ["", f"## By context length: buckets of {block.get('measure', 'prompt tokens')}", "", *length_table(rows)]


def by_thinking_markdown(results: dict[str, Any]) -> list[str]:
    """The thinking on / off table (eval.thinking_modes), or the one line saying the template has no switch."""
    block = results.get("by_thinking_mode")
    if not block:
        return []
    modes = block.get("modes", {})
    rows = [(f"{task} / thinking {mode}", r["tasks"][task]) for task in block.get("tasks", [])
            for mode, r in modes.items() if task in r.get("tasks", {})]
    rows += [(f"**overall (pooled)** / thinking {mode}", r.get("overall") or {}) for mode, r in modes.items()]
    lines = ["", "## By thinking mode (chat template enable_thinking)", ""]
    if not block.get("template_switch"):
        lines += [f"Not compared: {block.get('note')}.", ""]
    return lines + split_table(rows, (results.get("meta") or {}).get("max_new_tokens"), label="split / thinking")


def _depth_plot(curves: list[tuple[dict[str, Any], str, str, dict[str, Any]]], titles: tuple[str, str], suptitle: str,
                path: Path) -> Path:
    """Two panels over draft depth k: acc_cond@k left, survival@k right; one (figures, legend label, survival label,
    line style) per curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nan = float("nan")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for r, label, short, style in curves:
        ks = list(range(1, len(r["acc_cond"]) + 1))
        axes[0].plot(ks, [v if v is not None else nan for v in r["acc_cond"]], marker="o", label=label, **style)
        axes[1].plot(ks, [v if v is not None else nan for v in r["survival"]], marker="o", label=short, **style)
    for ax, title in zip(axes, titles):
        ax.set_title(title)
        ax.set_xticks(list(range(1, max(len(r["acc_cond"]) for r, *_ in curves) + 1)))
        ax.set_xlabel("draft depth k")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="best")
    fig.suptitle(suptitle, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_title(results: dict[str, Any], what: str = "") -> str:
    meta = results.get("meta", {})
    return f"{meta.get('algorithm', '')} draft, {what}{meta.get('protocol') or 'T=' + str(meta.get('temperature'))}"


def plot_by_length(results: dict[str, Any], path: Path) -> Path | None:
    """Per-depth acceptance and survival per prompt-length bucket (every split pooled), one line per non-empty bucket."""
    rows = [(label, r) for _, label, r in length_rows(results.get("by_context_length"), names=[]) if r.get("acc_cond")]
    if not rows:
        return None
    curves = [(r, f"{label} tokens: {r['prompts']} answers, {r['rounds']} rounds, tau {_f(r.get('tau'), 2)}", label, {})
              for label, r in rows]
    return _depth_plot(curves, ("conditional acceptance acc_cond@k by prompt length", "prefix survival survival@k by prompt length"),
                       _plot_title(results, "every split pooled, "), path)


def plot_acceptance(results: dict[str, Any], path: Path) -> Path | None:
    """Per-depth conditional acceptance and prefix survival, one line per benchmark."""
    rows = [(name, r) for name, r in results["tasks"].items() if "skipped" not in r] + [("overall", results["overall"])]
    if not any(r.get("acc_cond") for _, r in rows):
        return None
    curves = [(r, f"{name} (tau {r['tau']:.2f})", name,
               {"linewidth": 2.5, "color": "black"} if name == "overall" else {"linewidth": 1.2}) for name, r in rows]
    return _depth_plot(curves, ("conditional acceptance acc_cond@k", "prefix survival survival@k = P(A >= k)"), _plot_title(results), path)


def write_reports(results: dict[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """results.json, results.md and acceptance.png in `out_dir` (each written atomically)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "md": out / "results.md", "png": out / "acceptance.png"}
    for key, text in (("json", json.dumps(json_safe(results), indent=2) + "\n"), ("md", markdown(results))):
        tmp = paths[key].with_suffix(paths[key].suffix + ".tmp")
        tmp.write_text(text)
        tmp.replace(paths[key])
    tmp_png = out / "acceptance.tmp.png"
    if plot_acceptance(results, tmp_png) is not None:
        tmp_png.replace(paths["png"])
    else:
        paths.pop("png")
    tmp_png = out / "acceptance_by_length.tmp.png"
    if plot_by_length(results, tmp_png) is not None:
        paths["png_by_length"] = out / "acceptance_by_length.png"
        tmp_png.replace(paths["png_by_length"])
    return paths


def flat_scalars(results: dict[str, Any]) -> dict[str, float]:
    """`eval/<task>/tau`, `eval/<task>/acc_cond@k`, ... for tensorboard / wandb."""
    out: dict[str, float] = {}
    mean = [("overall_benchmark_mean", results["overall_benchmark_mean"])] if results.get("overall_benchmark_mean") else []
    for name, r in list(results["tasks"].items()) + [("overall", results["overall"])] + mean:
        if "skipped" in r:
            continue
        for key in ("tau", "speedup", "spec_tokens_per_s", "target_tokens_per_s", "acc0", "E[A]@S3", "E[A]@S7", "tau@3"):
            v = r.get(key)
            if isinstance(v, (int, float)) and not math.isnan(v):
                out[f"eval/{name}/{key}"] = float(v)
        for key in ("acc_cond", "survival"):
            for k, v in enumerate(r.get(key, []), 1):
                if v is not None and not math.isnan(v):
                    out[f"eval/{name}/{key}@{k}"] = float(v)
    return out


def log_to_run(cfg, results: dict[str, Any], run_dir: Path, step: int) -> None:
    """Send the scalars to the run's tensorboard / wandb (the same sinks training uses)."""
    from deepspec.train.loggers import MetricLoggers

    run_dir.mkdir(parents=True, exist_ok=True)
    sinks = MetricLoggers(cfg, run_dir, enabled=True)
    try:
        sinks.log(flat_scalars(results), step)
    finally:
        sinks.close()
    log.info("logged eval scalars to %s (step %d)", run_dir, step)
