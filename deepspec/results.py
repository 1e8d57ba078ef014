"""Reading an eval's results.json: the few rules that eval's report, the pipeline's summary and an export's model card
all render by, kept below every stage so that none of them imports another to read the same file.

A results.json (written by deepspec/eval/report.py) has `meta` (how it was measured), `tasks` (one entry per split or
benchmark), `overall` (every round pooled), optionally `overall_benchmark_mean` and `engine` (the served part).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

GREEDY_EPS = 1e-5  # temperatures below this are greedy (as DeepSpec and vLLM treat them)


def is_greedy(temperature: float) -> bool:
    return temperature < GREEDY_EPS


def protocol_name(temperature: float, method: str) -> str:
    """How a figure was measured, for reports: 'greedy (T=0)' or '<method> drafts, T=<t>'."""
    return "greedy (T=0)" if is_greedy(temperature) else f"{method} drafts, T={temperature:g}"


def fmt(x: Any, digits: int = 3, missing: str = "–") -> str:
    """A figure for a table: floats to `digits` places, absent or NaN as `missing`."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return missing
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def find_eval_results(checkpoint: Path, explicit: str | Path | None = None) -> dict[str, Any] | None:
    """A checkpoint's eval results.json (explicit path first, then `<checkpoint>/eval/results.json`)."""
    for cand in ([Path(explicit)] if explicit else []) + [Path(checkpoint) / "eval" / "results.json"]:
        if cand.is_file():
            return json.loads(cand.read_text())
    return None


def results_protocol(meta: dict[str, Any], missing: str = "–") -> str:
    """The draft-sampling protocol a results.json's figures were decoded under: its own record, or for results written
    before it was recorded, the name its temperature and draft_sample_method give."""
    if meta.get("protocol"):
        return str(meta["protocol"])
    if meta.get("temperature") is None:
        return missing
    return protocol_name(float(meta["temperature"]), str(meta.get("draft_sample_method") or "probabilistic"))


def served_verdict(v: dict[str, Any] | None) -> str:
    """The engine-vs-ours per-depth verdict (eval/engine.py served_as_trained) in a few words."""
    if not v or not v.get("decided"):
        return "not decided" + (f" ({v['why']})" if v and v.get("why") else "")
    where = f"depth {v['worst_depth']}: {100 * (v['worst_relative_diff'] or 0):+.1f}%"
    return f"yes (worst {where})" if v["ok"] else f"**NO** ({where}, tolerance {100 * v['tolerance']:.0f}%)"


def overall_rows(results: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The two labelled overall rows: every round pooled, and the mean over benchmarks (when there is one)."""
    rows = [("**overall (pooled)**", results["overall"])]
    mean = results.get("overall_benchmark_mean")
    if mean and "tau" in mean:
        rows.append(("**overall (benchmark mean)**", mean))
    return rows


def split_table(rows: list[tuple[str, dict[str, Any]]], budget: Any, depth: int | None = None, label: str = "split") -> list[str]:
    """One table of the headline names per split / benchmark: acc0, acc_cond@k, E[A]@S3, E[A]@S7, tau@3,
    with the answer budget (max new tokens) — the figures reported for every held-out split."""
    rows = [(n, r) for n, r in rows if r and "skipped" not in r]
    if depth is None:
        depth = max((len(r.get("acc_cond") or []) for _, r in rows), default=0)
    depth_cols = [f"acc_cond@{k}" for k in range(2, depth + 1)]
    head = ["acc0", *depth_cols, "E[A]@S3", "E[A]@S7", "tau@3", "tau"]
    lines = [f"| {label} | samples | answer budget | " + " | ".join(head) + " |", "|---" * (len(head) + 3) + "|"]
    for name, r in rows:
        acc = list(r.get("acc_cond") or [])
        vals = {"acc0": r.get("acc0", acc[0] if acc else None), "tau": r.get("tau")}
        vals.update({f"acc_cond@{k}": r.get(f"acc_cond@{k}", acc[k - 1] if len(acc) >= k else None) for k in range(2, depth + 1)})
        vals.update({k: r.get(k) for k in ("E[A]@S3", "E[A]@S7", "tau@3")})
        lines.append(f"| {name} | {r.get('samples', '')} | {budget} | " + " | ".join(fmt(vals[h]) for h in head) + " |")
    return lines


def length_rows(block: dict[str, Any] | None, names: list[str] | None = None, overall: bool = True) -> list[tuple[str, str, dict[str, Any]]]:
    """(split, bucket, figures) rows of a results.json `by_context_length` block, in ladder order: the splits in `names`
    (every split when None), then every split pooled."""
    if not block:
        return []
    tasks = block.get("tasks") or {}
    groups = [(n, tasks[n]) for n in (names if names is not None else list(tasks)) if n in tasks]
    if overall:
        groups.append(("**overall (pooled)**", block.get("overall") or {}))
    return [(name, label, per[label]) for name, per in groups for label in block.get("buckets") or [] if label in per]


def length_table(rows: list[tuple[str, str, dict[str, Any]]], depth: int | None = None, label: str = "split") -> list[str]:
    """One table of acceptance by prompt-length bucket: each row's answer and round counts (so thin buckets show), acc0,
    acc_cond@2..depth, E[A]@S3, E[A]@S7, tau@3, tau."""
    if not rows:
        return []
    if depth is None:
        depth = max((len(r.get("acc_cond") or []) for _, _, r in rows), default=0)
    head = ["acc0", *[f"acc_cond@{k}" for k in range(2, depth + 1)], "E[A]@S3", "E[A]@S7", "tau@3", "tau"]
    lines = [f"| {label} | prompt tokens | answers | rounds | " + " | ".join(head) + " |", "|---" * (len(head) + 4) + "|"]
    for name, bucket, r in rows:
        lines.append(f"| {name} | {bucket} | {r.get('prompts', '')} | {r.get('rounds', '')} | " + " | ".join(fmt(r.get(h)) for h in head) + " |")
    return lines
