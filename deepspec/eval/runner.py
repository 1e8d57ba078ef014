"""The eval stage: speculative decoding of a draft checkpoint on benchmarks, one or many workers.

`evaluate(cfg, checkpoint_dir)` loads the target named by the checkpoint's provenance (unless the
config overrides it), runs every benchmark sample through the speculative loop and — on the same
prompts in the same process — through target-only decoding for the speed baseline, merges the
workers' integer counters and writes results.json / results.md / acceptance.png.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepspec.errors import CheckpointError, ConfigError
from deepspec.data.chat import render_prompt
from deepspec.log import get_logger, progress
from deepspec.results import protocol_name

log = get_logger(__name__)


@dataclass
class WorkItem:
    task: str
    index: int  # position in the task's sample list (seeds the sample)
    row: dict
    # eval.thinking_modes: the mode ("on" / "off") this item decodes in and its chat-template kwargs; None = the main run
    mode: str | None = None
    template_kwargs: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------------------- provenance


def checkpoint_provenance(checkpoint_dir: str | Path) -> dict[str, Any]:
    """The `deepspec` block of a draft checkpoint's config.json (algorithm, taps, provenance)."""
    from deepspec.drafts.checkpoint import read_draft_config

    return read_draft_config(checkpoint_dir)["deepspec"]


def target_overridden(cfg) -> bool:
    return any(o.startswith("target.name=") for o in cfg.overrides)


def _local_or_embedded(name: str) -> bool:
    from deepspec.targets import is_embedded

    return is_embedded(name) or Path(name).expanduser().joinpath("config.json").is_file()


def _same_target(a: str, b: str) -> bool:
    from deepspec.targets import resolve_target_path

    try:
        return resolve_target_path(a) == resolve_target_path(b)
    except Exception:  # noqa: BLE001 - an unresolvable name is simply "not the same"
        return False


def resolve_target_name(cfg, meta: dict[str, Any]) -> str:
    """Target of the eval: an explicit override wins, then the checkpoint's provenance, then the config.

    The config's own spelling is kept when it names the same model as the provenance (so a recipe's
    `smollm2-135m-instruct` is not replaced by its folder path and reruns see the same config).
    """
    if target_overridden(cfg):
        return cfg.target.name
    prov = meta.get("provenance") or {}
    for name in (prov.get("target"), prov.get("target_path")):
        if name and _local_or_embedded(str(name)):
            return cfg.target.name if _same_target(cfg.target.name, str(name)) else str(name)
    return prov.get("target") or cfg.target.name


def check_target_matches(draft_meta: dict[str, Any], target) -> None:
    """Refuse a target whose vocabulary / width differ from what the draft was trained for."""
    arch = draft_meta.get("arch") or {}
    tv = draft_meta.get("target_vocab_size")
    if tv is not None and tv != target.config.vocab_size:
        raise CheckpointError(
            f"The draft was trained for a target with vocab {tv}, but {target.name} has {target.config.vocab_size}; "
            "evaluate it with the target it was trained on (--target / --opts target.name=...)."
        )
    th = arch.get("target_hidden_size")
    if th is not None and arch.get("tap_reduction") == "concat":  # S streams of H concatenated per tap
        th //= int(arch.get("target_hc_mult") or 1)
    if th is not None and th != target.config.hidden_size:
        raise CheckpointError(
            f"The draft reads target features of width {th}, but {target.name} has hidden size {target.config.hidden_size}; "
            "use the target it was trained on."
        )


# ----------------------------------------------------------------------------------------- work list


def task_name(task: str) -> str:
    """The name a task is reported under: itself, or a custom file's stem."""
    from deepspec.eval.benchmarks import custom_task_name, is_custom_task

    return custom_task_name(task) if is_custom_task(task) else task


def task_names(cfg) -> list[str]:
    return [task_name(t) for t in cfg.eval.tasks]


def check_tasks(cfg) -> None:
    """Refuse unknown names and custom files whose stem collides with another task."""
    from deepspec.eval.benchmarks import ALL_TASKS, HELDOUT_PREFIX, HELDOUT_TASK, is_custom_task

    def known(t: str) -> bool:
        return t in ALL_TASKS or t == HELDOUT_TASK or (t.startswith(HELDOUT_PREFIX) and len(t) > len(HELDOUT_PREFIX))

    unknown = [t for t in cfg.eval.tasks if not is_custom_task(t) and not known(t)]
    names = task_names(cfg)
    unknown += [t for t in cfg.eval.task_max_samples if t not in names and not known(t)]
    if unknown:
        raise ConfigError(
            f"Unknown eval task(s) {unknown}; choose from {', '.join(ALL_TASKS)}, {HELDOUT_TASK}, {HELDOUT_PREFIX}<split> "
            "(a held-out split of data.prompts.sources), or a path to your own .jsonl / .json prompts."
        )
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"eval.tasks names {dup} more than once (a custom file is named after its stem); rename the file.")


def build_work(cfg) -> tuple[list[WorkItem], dict[str, dict]]:
    """All samples of all requested benchmarks, and per-task info (file, rows, skipped reason)."""
    from deepspec.data.prompts import heldout_split_path
    from deepspec.eval.benchmarks import HELDOUT_PREFIX, HELDOUT_TASK, is_custom_task, load_benchmark, load_custom_task, load_heldout

    check_tasks(cfg)
    items: list[WorkItem] = []
    info: dict[str, dict] = {}
    for task in cfg.eval.tasks:
        name = task_name(task)
        cap = cfg.eval.task_max_samples.get(name, cfg.eval.task_max_samples.get(task, cfg.eval.max_samples))
        if is_custom_task(task):
            bench = load_custom_task(task, cap, cfg.eval.seed)
        elif task == HELDOUT_TASK:
            bench = load_heldout(cfg.heldout_path, cap, cfg.eval.seed)
        elif task.startswith(HELDOUT_PREFIX):
            bench = load_heldout(heldout_split_path(cfg, task[len(HELDOUT_PREFIX):]), cap, cfg.eval.seed, name=task)
        else:
            bench = load_benchmark(task, cfg.eval.datasets_dir, cap, cfg.eval.seed)
        if bench is None:
            how = ("run `deepspec data prompts` with that split in data.prompts.sources" if task.startswith(HELDOUT_PREFIX)
                   else "build it with `python eval_datasets/build.py --online`")
            info[name] = {"skipped": f"{task} not found; {how}"}
            continue
        info[name] = {"file": str(bench.path), "rows_in_file": bench.total_rows, "samples": len(bench.samples)}
        items.extend(WorkItem(name, i, row) for i, row in enumerate(bench.samples))
    if not items:
        raise ConfigError(f"No benchmark samples to evaluate (tasks {cfg.eval.tasks} in {cfg.eval.datasets_dir}); build them with `python eval_datasets/build.py`.")
    return items, info


# ----------------------------------------------------------------------------------------- one worker


def first_messages(row: dict) -> list[dict]:
    """The row's system message (held-out tool-use prompts carry their tools there), if any."""
    return [{"role": "system", "content": row["system"]}] if row.get("system") else []


def run_worker(cfg, checkpoint_dir: str, target_name: str, items: list[WorkItem], rank: int = 0, world: int = 1,
               device: str | None = None) -> dict[str, Any]:
    """Evaluate items[rank::world]; returns per-task raw counters + per-sample records."""
    import torch

    from deepspec.drafts.checkpoint import load_draft
    from deepspec.eval.context_length import ContextLengthStats
    from deepspec.eval.decode import eos_token_ids, generate_speculative, generate_target_only
    from deepspec.eval.metrics import AcceptanceStats, TimingStats
    from deepspec.targets import load_target

    if device is None:
        device = f"cuda:{rank % torch.cuda.device_count()}" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    ecfg = cfg.eval
    target = load_target(target_name, revision=cfg.target.revision, dtype=cfg.target.dtype, device=device,
                         attn_implementation=cfg.target.attn_implementation, trust_remote_code=cfg.target.trust_remote_code)
    meta = checkpoint_provenance(checkpoint_dir)
    check_target_matches(meta, target)
    draft = load_draft(checkpoint_dir, target.model, device=device)
    draft = draft.to(dtype=next(target.model.parameters()).dtype).eval()
    # decoding-time knobs of the recipe apply to the loaded draft (e.g. DSpark's confidence-threshold truncation)
    if any(o.startswith("model.confidence_threshold=") for o in cfg.overrides) and hasattr(draft, "model_cfg"):
        draft.model_cfg.confidence_threshold = cfg.model.confidence_threshold
    taps = list(draft.taps)
    proposer = draft.proposer()
    eos = eos_token_ids(target.model, target.tokenizer)
    tmpl_kwargs = dict(cfg.target.chat_template_kwargs or {})
    mine = items[rank::world]

    def gen(seed: int) -> "torch.Generator":
        return torch.Generator(device=device).manual_seed(seed)

    # warm-up (one-time kernel / allocator costs must not land in the first timed sample)
    if mine and not ecfg.greedy_replay:
        warm = render_prompt(target.tokenizer, first_messages(mine[0].row) + [{"role": "user", "content": mine[0].row["turns"][0]}],
                             tmpl_kwargs)
        generate_speculative(target.model, proposer, taps, warm, max_new_tokens=8, num_draft_tokens=ecfg.num_draft_tokens,
                             temperature=ecfg.temperature, eos_ids=eos, generator=gen(0),
                             draft_sample_method=ecfg.draft_sample_method)
        if ecfg.measure_speedup:
            generate_target_only(target.model, warm, max_new_tokens=8, temperature=ecfg.temperature, eos_ids=eos, generator=gen(0))

    stats: dict[str, AcceptanceStats] = {}
    timing: dict[str, TimingStats] = {}
    by_length: dict[str, ContextLengthStats] = {}
    modes: dict[str, dict[str, AcceptanceStats]] = {}  # eval.thinking_modes passes: mode -> task -> counters

    def count(item: WorkItem, spec, prompt: list[int]) -> dict:
        """Add one answer's counters to its task (and its prompt-length bucket, or its thinking mode); the turn's record."""
        task = item.task
        if item.mode is not None:
            modes.setdefault(item.mode, {}).setdefault(task, AcceptanceStats()).merge(spec.stats)
            return {"prompt_tokens": len(prompt), "new_tokens": len(spec.tokens), "rounds": spec.stats.rounds, "tau": spec.stats.tau}
        stats.setdefault(task, AcceptanceStats()).merge(spec.stats)
        by_length.setdefault(task, ContextLengthStats(tuple(ecfg.context_length_buckets))).add(len(prompt), spec.stats)
        tm = timing.setdefault(task, TimingStats())
        tm.spec_tokens += len(spec.tokens)
        tm.spec_seconds += 0.0 if ecfg.greedy_replay else spec.seconds  # a replay is no decoding speed
        rec = {"prompt_tokens": len(prompt), "new_tokens": len(spec.tokens), "rounds": spec.stats.rounds, "tau": spec.stats.tau}
        if not ecfg.greedy_replay:
            rec["spec_seconds"] = spec.seconds
        return rec

    if ecfg.greedy_replay:
        samples = _replay_worker(cfg, target, proposer, taps, eos, tmpl_kwargs, mine, count, rank)
    else:
        samples = []
        bar = progress(mine, desc=f"eval (worker {rank})", unit="sample")
        for item in bar:
            tm = timing.setdefault(item.task, TimingStats()) if item.mode is None else TimingStats()
            messages: list[dict] = first_messages(item.row)
            record = {"task": item.task, "index": item.index, "id": item.row.get("id"), "turns": [],
                      **({"thinking": item.mode} if item.mode is not None else {})}
            for t, turn in enumerate(item.row["turns"]):
                messages.append({"role": "user", "content": turn})
                prompt = render_prompt(target.tokenizer, messages, item.template_kwargs if item.mode is not None else tmpl_kwargs)
                seed = ecfg.seed + item.index * 16 + t
                spec = generate_speculative(target.model, proposer, taps, prompt, max_new_tokens=ecfg.max_new_tokens,
                                            num_draft_tokens=ecfg.num_draft_tokens, temperature=ecfg.temperature,
                                            eos_ids=eos, generator=gen(seed), draft_sample_method=ecfg.draft_sample_method)
                turn_rec = count(item, spec, prompt)
                if ecfg.measure_speedup and item.mode is None:
                    base = generate_target_only(target.model, prompt, max_new_tokens=ecfg.max_new_tokens,
                                                temperature=ecfg.temperature, eos_ids=eos, generator=gen(seed))
                    tm.target_tokens += len(base.tokens)
                    tm.target_seconds += base.seconds
                    turn_rec.update(target_new_tokens=len(base.tokens), target_seconds=base.seconds)
                    if ecfg.temperature == 0:
                        # a free losslessness check on real prompts (fp32 should match; bf16 may drift on near-ties)
                        turn_rec["matches_target"] = base.tokens == spec.tokens
                answer = target.tokenizer.decode(spec.tokens, skip_special_tokens=True)
                turn_rec["answer"] = answer
                record["turns"].append(turn_rec)
                # the next turn is asked after the model's own answer (MT-Bench turn 2)
                messages.append({"role": "assistant", "content": answer})
            samples.append(record)
            if hasattr(bar, "set_postfix"):
                total = AcceptanceStats()
                for st in stats.values():
                    total.merge(st)
                bar.set_postfix(tau=f"{total.tau:.2f}")
    return {
        "rank": rank,
        "device": device,
        "target": target.provenance(),
        "stats": {k: v.to_dict() for k, v in stats.items()},
        "timing": {k: v.to_dict() for k, v in timing.items()},
        "by_length": {k: v.to_dict() for k, v in by_length.items()},
        "thinking": {m: {k: v.to_dict() for k, v in per.items()} for m, per in modes.items()},
        "samples": samples,
    }


def _replay_worker(cfg, target, proposer, taps, eos, tmpl_kwargs, mine: list[WorkItem], count, rank: int) -> list[dict]:
    """eval.greedy_replay: the target answers every prompt of a turn in batches, then each answer's verify rounds
    are replayed (`replay_speculative`): the counters of the speculative loop at T=0. Meant for GPUs, where batched generation
    is cheap next to one target forward per round (not timed there yet); on 2 CPU cores it was slower than decoding (docs/evaluation.md)."""
    from deepspec.eval.decode import greedy_answers, replay_speculative

    ecfg = cfg.eval
    tok = target.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else (min(eos) if eos else 0)
    messages = [first_messages(it.row) for it in mine]
    records = [{"task": it.task, "index": it.index, "id": it.row.get("id"), "turns": [],
                **({"thinking": it.mode} if it.mode is not None else {})} for it in mine]
    for t in range(max((len(it.row["turns"]) for it in mine), default=0)):
        active = [i for i, it in enumerate(mine) if t < len(it.row["turns"])]
        prompts = []
        for i in active:
            messages[i].append({"role": "user", "content": mine[i].row["turns"][t]})
            prompts.append(render_prompt(tok, messages[i], mine[i].template_kwargs if mine[i].mode is not None else tmpl_kwargs))
        log.info("worker %d, turn %d: the target answers %d prompts (batches of %d)", rank, t + 1, len(active), ecfg.replay_batch_size)
        greedy = greedy_answers(target.model, prompts, max_new_tokens=ecfg.max_new_tokens + ecfg.num_draft_tokens + 1,
                                eos_ids=eos, pad_id=pad, batch_size=ecfg.replay_batch_size)
        for i, prompt, answer_ids in zip(active, prompts, progress(greedy, desc=f"replay (worker {rank})", unit="sample")):
            spec = replay_speculative(target.model, proposer, taps, prompt, answer_ids, max_new_tokens=ecfg.max_new_tokens,
                                      num_draft_tokens=ecfg.num_draft_tokens, eos_ids=eos)
            turn_rec = count(mine[i], spec, prompt)
            answer = tok.decode(spec.tokens, skip_special_tokens=True)
            turn_rec["answer"] = answer
            records[i]["turns"].append(turn_rec)
            messages[i].append({"role": "assistant", "content": answer})
    return records


def _spawned_worker(rank: int, world: int, cfg, checkpoint_dir: str, target_name: str, items: list[WorkItem], parts_dir: str) -> None:
    import torch

    from deepspec.log import setup_logging

    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world)
    setup_logging()
    if not torch.cuda.is_available():
        from deepspec.cpus import threads_per_worker

        torch.set_num_threads(threads_per_worker(world))
    out = run_worker(cfg, checkpoint_dir, target_name, items, rank, world)
    path = Path(parts_dir) / f"rank{rank}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(out))
    tmp.replace(path)


def num_workers(cfg) -> int:
    import torch

    if cfg.eval.num_workers > 0:
        return cfg.eval.num_workers
    return max(1, torch.cuda.device_count()) if torch.cuda.is_available() else 1


# ----------------------------------------------------------------------------------------- merge


def merge_parts(parts: list[dict], info: dict[str, dict], cfg) -> tuple[dict[str, Any], list[dict]]:
    """Add the workers' counters per task and overall, then derive the metrics."""
    from deepspec.eval.metrics import AcceptanceStats, TimingStats

    stats: dict[str, AcceptanceStats] = {}
    timing: dict[str, TimingStats] = {}
    for part in parts:
        for task, d in part["stats"].items():
            stats.setdefault(task, AcceptanceStats()).merge(AcceptanceStats.from_dict(d))
        for task, d in part["timing"].items():
            timing.setdefault(task, TimingStats()).merge(TimingStats.from_dict(d))
    tasks: dict[str, Any] = {}
    overall, overall_t = AcceptanceStats(), TimingStats()
    proto = protocol(cfg)
    for task in task_names(cfg):
        if task not in stats:
            if task in info and "skipped" in info[task]:
                tasks[task] = {"skipped": info[task]["skipped"]}
            continue
        overall.merge(stats[task])
        overall_t.merge(timing[task])
        tasks[task] = {**info.get(task, {}), **stats[task].summary(), **_timing_summary(timing[task], cfg), "protocol": proto}
    order = task_names(cfg)
    samples = sorted((s for p in parts for s in p["samples"]),
                     key=lambda s: ("thinking" in s, s.get("thinking", ""), order.index(s["task"]), s["index"]))
    matches = [t["matches_target"] for s in samples for t in s["turns"] if "matches_target" in t]
    result = {
        # every verify round of every benchmark pooled: long-answer benchmarks weigh more
        "overall": {**overall.summary(), **_timing_summary(overall_t, cfg), "protocol": proto, "aggregation": POOLED},
        # each benchmark counts once, as the papers average
        "overall_benchmark_mean": benchmark_mean(tasks, proto),
        "tasks": tasks,
        "greedy_outputs_match_target": {"matched_turns": sum(matches), "turns": len(matches)} if matches else None,
        "by_context_length": merge_by_length(parts, cfg),
    }
    return result, samples


def merge_by_length(parts: list[dict], cfg) -> dict[str, Any]:
    """The workers' per-prompt-length counters added per task, then the results.json block (deepspec/eval/context_length.py)."""
    from deepspec.eval.context_length import ContextLengthStats, report

    edges = tuple(cfg.eval.context_length_buckets)
    per_task: dict[str, ContextLengthStats] = {}
    for part in parts:
        for task, d in (part.get("by_length") or {}).items():
            per_task.setdefault(task, ContextLengthStats(edges)).merge(ContextLengthStats.from_dict(d))
    return report(per_task, task_names(cfg), edges)


def thinking_items(cfg, target_name: str, items: list[WorkItem]):
    """eval.thinking_modes: probe the template, and the extra work items of each mode the main run is not already."""
    from deepspec.eval.benchmarks import HELDOUT_PREFIX, HELDOUT_TASK
    from deepspec.eval.thinking import plan
    from deepspec.targets import load_tokenizer

    heldout = [task_name(t) for t in cfg.eval.tasks if t == HELDOUT_TASK or t.startswith(HELDOUT_PREFIX)]
    tasks = [t for t in (heldout or task_names(cfg)) if any(it.task == t for it in items)]
    tok = load_tokenizer(target_name, revision=cfg.target.revision, trust_remote_code=cfg.target.trust_remote_code)
    p = plan(tok, cfg.target.chat_template_kwargs, list(cfg.eval.thinking_modes), tasks, target_name)
    extra = [WorkItem(it.task, it.index, it.row, mode, kw) for mode, kw in p.to_decode().items() for it in items if it.task in tasks]
    return p, extra


def merge_thinking(p, parts: list[dict], info: dict[str, dict]) -> dict[str, Any]:
    """The workers' per-mode counters (and the main run's, for a mode it already is) as the results.json block."""
    from deepspec.eval.metrics import AcceptanceStats
    from deepspec.eval.thinking import report

    main: dict[str, AcceptanceStats] = {}
    modes: dict[str, dict[str, AcceptanceStats]] = {}
    for part in parts:
        for task, d in part["stats"].items():
            main.setdefault(task, AcceptanceStats()).merge(AcceptanceStats.from_dict(d))
        for mode, per in (part.get("thinking") or {}).items():
            for task, d in per.items():
                modes.setdefault(mode, {}).setdefault(task, AcceptanceStats()).merge(AcceptanceStats.from_dict(d))
    return report(p, modes, main, info)


POOLED = "pooled: every verify round of every benchmark together"
BENCHMARK_MEAN = "mean of the per-benchmark values (each benchmark counts once)"
MEAN_KEYS = ("tau", "acc0", "E[A]@S3", "E[A]@S7", "tau@3", "speedup")


def protocol(cfg) -> str:
    """The draft-sampling protocol every figure of this eval was measured under (deepspec/results.py)."""
    return protocol_name(cfg.eval.temperature, cfg.eval.draft_sample_method)


def benchmark_mean(tasks: dict[str, Any], proto: str) -> dict[str, Any]:
    """The unweighted mean over benchmarks of tau and the headline figures (NaN / missing values left out)."""
    import math

    rows = {name: r for name, r in tasks.items() if "skipped" not in r}
    out: dict[str, Any] = {"protocol": proto, "aggregation": BENCHMARK_MEAN, "benchmarks": list(rows)}
    for key in MEAN_KEYS:
        vals = [float(r[key]) for r in rows.values() if isinstance(r.get(key), (int, float)) and not math.isnan(r[key])]
        if vals:
            out[key] = sum(vals) / len(vals)
    return out


def _timing_summary(t, cfg) -> dict[str, Any]:
    out = t.summary()
    if not cfg.eval.measure_speedup:
        for k in ("target_tokens_per_s", "speedup", "target_tokens", "target_seconds"):
            out.pop(k, None)
    return out


# ----------------------------------------------------------------------------------------- entry point


def evaluate(cfg, checkpoint_dir: str | Path, *, output_dir: str | Path | None = None, run_dir: str | Path | None = None,
             step: int | None = None) -> dict[str, Any]:
    """Evaluate a draft checkpoint; write results.json, results.md, acceptance.png; return the results dict.

    `run_dir` (optional): a training run folder whose tensorboard / wandb receive `eval/...` scalars at `step`.
    """
    checkpoint_dir = Path(checkpoint_dir)
    meta = checkpoint_provenance(checkpoint_dir)
    target_name = resolve_target_name(cfg, meta)
    if not target_overridden(cfg):
        cfg.target.name = target_name
    prov = meta.get("provenance") or {}
    if "chat_template_kwargs" in prov and not any(o.startswith("target.chat_template_kwargs") for o in cfg.overrides):
        cfg.target.chat_template_kwargs = dict(prov["chat_template_kwargs"])
    serving = serving_mode(cfg, prov)
    out_dir = Path(output_dir or cfg.eval.output_dir or checkpoint_dir / "eval")
    out_dir.mkdir(parents=True, exist_ok=True)
    from deepspec.locks import folder_lock

    with folder_lock(out_dir, "evaluation"):  # two evals into one folder would delete each other's worker parts
        return _evaluate_into(cfg, checkpoint_dir, meta, target_name, serving, out_dir, run_dir, step)


def _evaluate_into(cfg, checkpoint_dir: Path, meta: dict[str, Any], target_name: str, serving: dict[str, Any], out_dir: Path,
                   run_dir: str | Path | None, step: int | None) -> dict[str, Any]:
    from deepspec.config import config_to_dict, save_config
    from deepspec.eval.report import log_to_run, write_reports

    items, info = build_work(cfg)
    thinking, extra = thinking_items(cfg, target_name, items) if cfg.eval.thinking_modes else (None, [])
    world = num_workers(cfg)
    log.info("evaluating %s (%s) against %s: %d samples of %d tasks on %d worker(s), %s, %d draft tokens, chat template %s",
             checkpoint_dir, meta.get("algorithm"), target_name, len(items), len([t for t in info if "skipped" not in info[t]]),
             world, protocol(cfg), cfg.eval.num_draft_tokens, serving["chat_template_kwargs"])
    t0 = time.time()
    if world == 1:
        parts = [run_worker(cfg, str(checkpoint_dir), target_name, items + extra)]
    else:
        import torch.multiprocessing as mp

        parts_dir = out_dir / ".parts"
        parts_dir.mkdir(exist_ok=True)
        for old in parts_dir.glob("rank*.json"):
            old.unlink()
        mp.spawn(_spawned_worker, args=(world, cfg, str(checkpoint_dir), target_name, items + extra, str(parts_dir)), nprocs=world, join=True)
        parts = [json.loads((parts_dir / f"rank{r}.json").read_text()) for r in range(world)]
    results, samples = merge_parts(parts, info, cfg)
    if thinking is not None:
        results["by_thinking_mode"] = merge_thinking(thinking, parts, info)
    results["meta"] = {
        "checkpoint": str(checkpoint_dir.resolve()),
        "algorithm": meta.get("algorithm"),
        "taps": meta.get("taps"),
        "target": parts[0]["target"],
        "temperature": cfg.eval.temperature,
        "draft_sample_method": cfg.eval.draft_sample_method,
        "protocol": protocol(cfg),
        "serving_mode": serving,
        "num_draft_tokens": cfg.eval.num_draft_tokens,
        "max_new_tokens": cfg.eval.max_new_tokens,
        "seed": cfg.eval.seed,
        "num_workers": world,
        "devices": [p["device"] for p in parts],
        "wall_seconds": time.time() - t0,
        "config": config_to_dict(cfg.eval),
    }
    if cfg.eval.engine == "vllm":
        from deepspec.eval.engine import engine_eval

        write_reports(results, out_dir)  # ours is kept if the engine part fails (a server dying, a bad URL)
        results["engine"] = engine_eval(cfg, checkpoint_dir, meta, target_name, items, results, out_dir)
    with open(out_dir / "samples.jsonl", "w", encoding="utf-8") as fh:
        for s in samples:
            fh.write(json.dumps(s, ensure_ascii=False) + "\n")
    write_reports(results, out_dir)
    save_config(cfg, out_dir)
    if run_dir is not None:
        log_to_run(cfg, results, Path(run_dir), step or 0)
    o, m = results["overall"], results["overall_benchmark_mean"]
    log.info("%s: tau %.3f pooled over %d rounds, %s mean of %d benchmark(s); speedup %s; results in %s", protocol(cfg), o["tau"],
             o["rounds"], f"{m['tau']:.3f}" if "tau" in m else "n/a", len(m["benchmarks"]),
             f"{o['speedup']:.2f}x" if "speedup" in o else "n/a", out_dir)
    return results


# ----------------------------------------------------------------------------------------- serving mode


def _regenerate_kwargs(path: Path) -> dict[str, Any] | None:
    """chat_template_kwargs the regenerate stage answered with (the first record's meta), or None."""
    try:
        with open(path, encoding="utf-8") as fh:
            meta = json.loads(fh.readline() or "{}").get("meta") or {}
    except (OSError, ValueError, AttributeError):
        return None
    kw = meta.get("chat_template_kwargs")
    return dict(kw) if isinstance(kw, dict) else None


def _same_data(path: Path, data_hash: str) -> bool:
    """Whether `path` is the data file the checkpoint's cache was built from (its provenance data_hash)."""
    from deepspec.data.cache.plan import file_hash

    try:
        return file_hash(path) == data_hash
    except OSError:
        return False


def serving_mode(cfg, prov: dict[str, Any]) -> dict[str, Any]:
    """The chat-template settings this eval decodes with, beside the training data's: the checkpoint's provenance
    (what its cache was rendered with) and, where the config's regenerated.jsonl exists, what the target answered with.
    One warning when they differ — a draft evaluated (or served) in another mode than it was trained in (e.g. thinking
    on vs off) is accepted less, with no error anywhere."""
    used = dict(cfg.target.chat_template_kwargs or {})
    out: dict[str, Any] = {"chat_template_kwargs": used}
    trained = prov.get("chat_template_kwargs")
    if isinstance(trained, dict):
        out["training_chat_template_kwargs"] = dict(trained)
    try:
        regen_path = Path(cfg.regenerated_path)
    except Exception:  # noqa: BLE001 - a config without a data dir has no regenerated file
        regen_path = None
    regen = _regenerate_kwargs(regen_path) if regen_path is not None and regen_path.is_file() else None
    if regen is not None and prov.get("data_hash") and not _same_data(regen_path, str(prov["data_hash"])):
        regen = None  # the config's regenerated.jsonl is not the file this draft was trained on
    if regen is not None:
        out["regenerate_chat_template_kwargs"] = regen
        out["regenerate_file"] = str(regen_path)
    differs = [f"{name} {kw}" for name, kw in (("the training cache's", out.get("training_chat_template_kwargs")),
                                              (f"the regenerated data's ({regen_path})", regen)) if kw is not None and kw != used]
    out["matches_training"] = not differs if ("training_chat_template_kwargs" in out or regen is not None) else None
    if differs:
        log.warning("eval decodes with chat_template_kwargs %s but %s differ: acceptance measured here is not the trained "
                    "mode's (set target.chat_template_kwargs to the training data's to measure that)", used, " and ".join(differs))
    return out
