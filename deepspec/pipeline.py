"""`deepspec run CONFIG [CONFIG ...]`: every stage of one or more recipes, skipping finished work.

prompts -> regenerate -> cache -> train -> eval (ours) -> export + serve in vLLM (engine acceptance).
Each stage checks its own artifact first, so a second run costs seconds and a crashed run resumes
where it stopped. Several recipes that share a project (e.g. config/quickstart/{eagle3,dflash,dspark})
share the data stages and end in one comparison table.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from deepspec.config.args import config_from_args
from deepspec.errors import ConfigError
from deepspec.log import get_logger
from deepspec.results import length_rows, length_table, results_protocol, served_verdict, split_table

log = get_logger(__name__)

STAGES = ("prompts", "regenerate", "cache", "train", "eval", "engine")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="+", help="one or more YAML recipes (recipes after the first reuse its data)")
    parser.add_argument(
        "--opts", nargs="+", default=[], metavar="KEY=VALUE", help="overrides applied to every recipe, e.g. train.max_steps=100"
    )
    parser.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES), help="run only these stages")
    parser.add_argument("--no-engine", action="store_true", help="skip serving the export in vLLM")
    parser.add_argument("--nproc", type=int, default=1, help="training workers (>1 launches them with torchrun)")


@dataclass
class StageRecord:
    name: str
    seconds: float = 0.0
    skipped: bool = False
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class RecipeResult:
    config_path: str
    cfg: Any
    stages: list[StageRecord] = field(default_factory=list)
    checkpoint: Path | None = None
    eval_dir: Path | None = None
    results: dict[str, Any] | None = None


def _timed(records: list[StageRecord], name: str, fn: Callable[[], tuple[bool, dict[str, Any]]]) -> StageRecord:
    """Run a stage function returning (skipped, detail) and record its wall time."""
    log.info("=== stage %s ===", name)
    t0 = time.monotonic()
    skipped, detail = fn()
    rec = StageRecord(name, round(time.monotonic() - t0, 1), skipped, detail)
    records.append(rec)
    log.info("=== stage %s %s in %.1f s ===", name, "reused (already complete)" if skipped else "done", rec.seconds)
    return rec


# ----------------------------------------------------------------------------- stages


def stage_prompts(cfg) -> tuple[bool, dict[str, Any]]:
    from deepspec.data import prompts

    if prompts.is_complete(cfg):
        return True, {"output": str(cfg.conversations_path)}
    prompts.build_prompts(cfg)
    return False, {"output": str(cfg.conversations_path)}


def stage_regenerate(cfg) -> tuple[bool, dict[str, Any]]:
    from deepspec.data import regenerate

    if regenerate.is_complete(cfg):
        return True, {"output": str(cfg.regenerated_path)}
    summary = regenerate.regenerate(cfg)
    keep = ("engine", "done", "skipped", "failed", "output_tokens")
    detail = {k: summary.get(k) for k in keep}
    train_split = summary.get("splits", {}).get("train", {})
    if "tokens_per_s" in train_split:
        detail["tokens_per_s"] = train_split["tokens_per_s"]
    return False, detail


def stage_cache(cfg) -> tuple[bool, dict[str, Any]]:
    from deepspec.data.cache.format import check_manifest, is_complete, load_manifest
    from deepspec.data.cache.reader import expected_provenance
    from deepspec.data.cache.writer import build_caches

    splits = [("train", cfg.cache_train_dir)] if cfg.cache.mode == "offline" else []  # streamed runs cache no training data
    if cfg.regenerated_heldout_path.is_file():
        splits.append(("heldout", cfg.cache_heldout_dir))
    if not splits:
        return True, {"mode": cfg.cache.mode, "held-out": "none"}
    skipped = all(is_complete(d) for _, d in splits)
    build_caches(cfg, [split for split, d in splits if not is_complete(d)], nproc=cfg.cache.num_workers)
    for split, d in splits:
        if is_complete(d) and split == "train":
            # A finished cache of the project is reused only if this recipe could train on it (two recipes of one
            # project with other taps or stream reduction need their own cache.dir): refuse now, not after training starts.
            check_manifest(load_manifest(d), expected_provenance(cfg))
    manifest = load_manifest(splits[0][1])
    counts = manifest.get("counts", {})
    return skipped, {"dir": str(cfg.cache_dir), "dtype": cfg.cache.dtype, "mode": cfg.cache.mode, "split": splits[0][0],
                     **{k: v for k, v in counts.items() if isinstance(v, (int, float))}}


def stage_train(cfg, nproc: int) -> tuple[bool, dict[str, Any]]:
    from deepspec.train.checkpoint import latest_step_dir, read_best

    before = latest_step_dir(cfg.run_dir)
    if nproc > 1:
        from deepspec.train import launch

        final = launch(cfg, nproc)
    else:
        from deepspec.train import train

        final = train(cfg)
    final = Path(final)
    skipped = before is not None and before.resolve() == final.resolve()
    detail: dict[str, Any] = {"checkpoint": str(final)}
    best = read_best(cfg.run_dir)
    if best:
        detail["best"] = best
    return skipped, detail


def _eval_is_current(out_dir: Path, cfg) -> bool:
    """Reuse results.json when it was made for the same eval settings."""
    import yaml

    from deepspec.config import config_to_dict

    results, saved = out_dir / "results.json", out_dir / "config.yaml"
    if not (results.is_file() and saved.is_file()):
        return False
    old = yaml.safe_load(saved.read_text()) or {}
    old_eval, new_eval = dict(old.get("eval") or {}), dict(config_to_dict(cfg)["eval"])
    old_eval.pop("output_dir", None), new_eval.pop("output_dir", None)  # same folder, spelled relative or absolute
    return old_eval == new_eval and old.get("target", {}).get("name") == cfg.target.name


def stage_eval(cfg, checkpoint: Path, out_dir: Path, engine: bool) -> tuple[bool, dict[str, Any]]:
    from deepspec.eval.runner import evaluate

    if engine and cfg.model.algorithm not in ("eagle3", "dflash"):
        log.warning("vLLM serves %s drafts only on its GPU model runner; engine-backed eval skipped on this machine", cfg.model.algorithm)
        engine = False
    cfg.eval.engine = "vllm" if engine else "none"
    cfg.eval.output_dir = str(out_dir)
    if _eval_is_current(out_dir, cfg):
        results = json.loads((out_dir / "results.json").read_text())
        return True, {"results": results}
    results = evaluate(cfg, checkpoint, output_dir=out_dir, run_dir=cfg.run_dir)
    return False, {"results": results}


# ----------------------------------------------------------------------------- summary


def _fmt(x: Any, nd: int = 2) -> str:
    return f"{x:.{nd}f}" if isinstance(x, (int, float)) and x == x else "–"  # x != x: NaN (no data at that depth)


def summary_markdown(recipes: list[RecipeResult]) -> str:
    lines = ["# deepspec run summary", ""]
    tasks: list[str] = []
    for r in recipes:
        for t, v in ((r.results or {}).get("tasks") or {}).items():
            if "skipped" not in v and t not in tasks:
                tasks.append(t)
    lines += [
        "## tau per benchmark (ours; tau counts the bonus token; overall pooled over every round / mean of the benchmarks)",
        "",
        "| algorithm | protocol | " + " | ".join(tasks) + " | overall (pooled) | overall (benchmark mean) | speedup | vLLM tau (S spec tokens, pooled) | ours tau@S (pooled) | vLLM per-position acceptance | vLLM speedup (1 / 16 requests) |",
        "|---" * (len(tasks) + 9) + "|",
    ]
    for r in recipes:
        res = r.results or {}
        row = [_fmt(((res.get("tasks") or {}).get(t) or {}).get("tau")) for t in tasks]
        overall = res.get("overall") or {}
        eng = (res.get("engine") or {}).get("overall") or {}
        s = (res.get("engine") or {}).get("num_speculative_tokens")
        eng_tau = f"{_fmt(eng.get('engine_tau'))} (S={s})" if eng.get("engine_tau") is not None else "–"
        per_pos = eng.get("engine_survival") or []
        speedup = f"{_fmt(overall['speedup'])}x" if overall.get("speedup") is not None else "not timed"
        pos = " / ".join(f"{p:.0%}" for p in per_pos) if per_pos else "–"
        mean = res.get("overall_benchmark_mean") or {}
        lines.append(
            f"| {r.cfg.model.algorithm} | {_protocol(res)} | " + " | ".join(row) + f" | **{_fmt(overall.get('tau'))}** | {_fmt(mean.get('tau'))} | {speedup} | "
            f"{eng_tau} | {_fmt(eng.get('ours_tau_at_S'))} | {pos} | " + _served_speedup((res.get("engine") or {}).get("speedup")) + " |"
        )
    lines += served_by_engine_markdown(recipes, tasks)
    lines += split_summary_markdown(recipes, tasks)
    lines += by_length_summary_markdown(recipes, tasks)
    lines += ["", "## per-depth conditional acceptance acc_cond@k (overall, pooled)", ""]
    depth = max((len(((r.results or {}).get("overall") or {}).get("acc_cond") or []) for r in recipes), default=0)
    if depth:
        lines += ["| algorithm | " + " | ".join(f"k={k}" for k in range(1, depth + 1)) + " |", "|---" * (depth + 1) + "|"]
        for r in recipes:
            vals = (((r.results or {}).get("overall") or {}).get("acc_cond") or []) + [None] * depth
            lines.append(f"| {r.cfg.model.algorithm} | " + " | ".join(_fmt(v) for v in vals[:depth]) + " |")
    lines += ["", "## artifacts and stage times", ""]
    for r in recipes:
        lines.append(f"- **{r.cfg.model.algorithm}** (`{r.config_path}`): checkpoint `{r.checkpoint}`, eval `{r.eval_dir}` "
                     f"(results.md, acceptance.png)")
        for st in r.stages:
            lines.append(f"  - {st.name}: {st.seconds:.0f} s" + (" (reused)" if st.skipped else ""))
    return "\n".join(lines) + "\n"


def _protocol(res: dict[str, Any]) -> str:
    """The draft-sampling protocol an eval's figures were measured under (the engine's too: it is started with it)."""
    return results_protocol(res.get("meta") or {})


def split_summary_markdown(recipes: list[RecipeResult], tasks: list[str]) -> list[str]:
    """acc0, acceptance per depth, E[A]@S3, E[A]@S7 and tau@3 per split and algorithm, as one table."""
    rows = [(f"{r.cfg.model.algorithm} / {t}", ((r.results or {}).get("tasks") or {}).get(t) or {}) for r in recipes for t in tasks]
    if not any(row for _, row in rows):
        return []
    budget = recipes[0].cfg.eval.max_new_tokens
    protos = sorted({_protocol(r.results or {}) for r in recipes})
    return ["", f"## per split (answers up to {budget} tokens): acc0, acceptance per depth, E[A]@S3, E[A]@S7, tau@3 ({', '.join(protos)})", "",
            *split_table(rows, budget, label="algorithm / split")]


def by_length_summary_markdown(recipes: list[RecipeResult], tasks: list[str]) -> list[str]:
    """acc0, E[A]@S3, tau@3 and tau by prompt-length bucket on the headline split (the first evaluated one), per
    algorithm, with each bucket's answer and round counts."""
    if not tasks:
        return []
    rows = [(r.cfg.model.algorithm, bucket, fig) for r in recipes
            for _, bucket, fig in length_rows((r.results or {}).get("by_context_length"), [tasks[0]], overall=False)]
    if not rows:
        return []
    return ["", f"## {tasks[0]} by context length (prompt tokens of each answer's rendered prompt)", "",
            *length_table(rows, depth=1, label="algorithm")]


def _served_speedup(speedup: dict[str, Any] | None) -> str:
    """vLLM's output tokens/s with the draft over without it (one request / 16 concurrent), overall."""
    o = (speedup or {}).get("overall") or {}
    vals = [(o.get(m) or {}).get("speedup") for m in ("single", "concurrent")]
    return " / ".join(f"{v:.2f}x" if isinstance(v, (int, float)) else "–" for v in vals) if o else "not timed"


def served_by_engine_markdown(recipes: list[RecipeResult], tasks: list[str]) -> list[str]:
    """Per-benchmark table of the engine's mean acceptance length (ours at the same S beside it): the overall
    figure mixes benchmarks of very different difficulty, and the held-out prompts are the ones a goal names."""
    served = [r for r in recipes if ((r.results or {}).get("engine") or {}).get("tasks")]
    if not served:
        return []
    s = (served[0].results["engine"]).get("num_speculative_tokens")
    lines = [
        "",
        f"## served by vLLM: mean acceptance length per benchmark, {s} speculative tokens (ours tau@{s} in brackets, same protocol)",
        "",
        "| algorithm | protocol | " + " | ".join(tasks) + " | overall (pooled) | overall (benchmark mean) | served as trained |",
        "|---" * (len(tasks) + 5) + "|",
    ]
    for r in served:
        eng = r.results["engine"]
        cells = [eng["tasks"].get(t) or {} for t in tasks] + [eng.get("overall") or {}, eng.get("overall_benchmark_mean") or {}]
        lines.append(
            f"| {r.cfg.model.algorithm} | {eng.get('protocol') or _protocol(r.results)} | "
            + " | ".join(f"{_fmt(c.get('engine_tau'))} ({_fmt(c.get('ours_tau_at_S'))})" for c in cells)
            + f" | {served_verdict((eng.get('overall') or {}).get('served_as_trained'))} |"
        )
    return lines


def _headline_by_length(res: dict[str, Any]) -> dict[str, Any] | None:
    """The headline split's (first evaluated split's) figures per prompt-length bucket."""
    block = res.get("by_context_length") or {}
    first = next((t for t, v in (res.get("tasks") or {}).items() if "skipped" not in v), None)
    if first is None or first not in (block.get("tasks") or {}):
        return None
    return {"split": first, "buckets": block["tasks"][first]}


def summary_json(recipes: list[RecipeResult]) -> dict[str, Any]:
    out = []
    for r in recipes:
        res = r.results or {}
        out.append({
            "config": r.config_path,
            "algorithm": r.cfg.model.algorithm,
            "checkpoint": str(r.checkpoint) if r.checkpoint else None,
            "eval_dir": str(r.eval_dir) if r.eval_dir else None,
            "plot": str(r.eval_dir / "acceptance.png") if r.eval_dir else None,
            "protocol": _protocol(res),
            "serving_mode": (res.get("meta") or {}).get("serving_mode"),
            "overall": res.get("overall"),
            "overall_benchmark_mean": res.get("overall_benchmark_mean"),
            "tasks": {t: {k: v.get(k) for k in ("tau", "acc_cond", "survival", "samples", "speedup", "acc0", "E[A]@S3", "E[A]@S7", "tau@3", "protocol")}
                      for t, v in (res.get("tasks") or {}).items() if "skipped" not in v},
            "by_context_length": _headline_by_length(res),
            "engine": (res.get("engine") or {}).get("overall"),
            "engine_tasks": (res.get("engine") or {}).get("tasks"),
            "engine_num_speculative_tokens": (res.get("engine") or {}).get("num_speculative_tokens"),
            "engine_protocol": (res.get("engine") or {}).get("protocol"),
            "engine_seeded": (res.get("engine") or {}).get("seeded"),
            "engine_speedup": (res.get("engine") or {}).get("speedup"),
            "stages": [{"name": s.name, "seconds": s.seconds, "reused": s.skipped} for s in r.stages],
        })
    return {"recipes": out}


# ----------------------------------------------------------------------------- entry point


def run(config_paths: list[str], opts: list[str] | None = None, *, stages: tuple[str, ...] = STAGES, engine: bool = True,
        nproc: int = 1) -> list[RecipeResult]:
    from deepspec.config import load_config, save_config

    t_start = time.monotonic()
    cfgs = [load_config(p, opts) for p in config_paths]
    data_keys = {(str(c.data_dir), str(c.cache_dir)) for c in cfgs}
    if len(data_keys) > 1:
        log.info("recipes use %d different data/cache folders; data stages run for each", len(data_keys))
    done_data: set[tuple[str, str]] = set()
    recipes: list[RecipeResult] = []
    for path, cfg in zip(config_paths, cfgs):
        rec = RecipeResult(path, cfg)
        recipes.append(rec)
        key = (str(cfg.data_dir), str(cfg.cache_dir))
        if key not in done_data:
            save_config(cfg, cfg.project_dir, "run_config.yaml")
            if "prompts" in stages:
                _timed(rec.stages, "prompts", lambda: stage_prompts(cfg))
            if "regenerate" in stages:
                _timed(rec.stages, "regenerate", lambda: stage_regenerate(cfg))
            if "cache" in stages and cfg.cache.mode != "online":
                _timed(rec.stages, "cache", lambda: stage_cache(cfg))
            done_data.add(key)
        if "train" in stages:
            st = _timed(rec.stages, "train", lambda: stage_train(cfg, nproc))
            rec.checkpoint = Path(st.detail["checkpoint"])
        else:
            from deepspec.train.checkpoint import latest_step_dir

            rec.checkpoint = latest_step_dir(cfg.run_dir)
        if rec.checkpoint is None:
            continue
        rec.eval_dir = rec.checkpoint / "eval"
        if "eval" in stages:
            use_engine = engine and "engine" in stages
            st = _timed(rec.stages, "eval" + ("+engine" if use_engine else ""), lambda: stage_eval(cfg, rec.checkpoint, rec.eval_dir, use_engine))
            rec.results = st.detail.pop("results")
    if not recipes:
        raise ConfigError("deepspec run needs at least one recipe.")
    total = time.monotonic() - t_start
    md = summary_markdown(recipes) + f"\nTotal wall time of this run: {total:.0f} s.\n"
    project_dir = cfgs[0].project_dir
    project_dir.mkdir(parents=True, exist_ok=True)
    data = summary_json(recipes)
    data["total_seconds"] = round(total, 1)
    (project_dir / "summary.json").write_text(json.dumps(data, indent=2, default=str) + "\n")
    (project_dir / "summary.md").write_text(md)
    print(md)
    log.info("summary written to %s and %s", project_dir / "summary.md", project_dir / "summary.json")
    return recipes


def main(args: argparse.Namespace) -> int:
    # Validate every recipe (and the overrides) before any stage starts.
    for path in args.config:
        config_from_args(argparse.Namespace(config=path, opts=args.opts))
    run(args.config, args.opts, stages=tuple(args.stages), engine=not args.no_engine, nproc=args.nproc)
    return 0
