"""The regenerate stage: the target re-answers every prompt, exactly once per id.

Why exactly once: the draft is trained on these answers, and a crash that silently drops or
duplicates samples skews the data. Finished conversations are appended as whole lines with
flush + fsync; on start a torn last line is cut off and ids already present are skipped, so
a SIGKILL at any moment followed by the same command yields every input id once. Ids that
failed after retries are listed (with the reason) in `<output>.errors.jsonl`; a rerun retries
them. A sidecar state file pins the settings the output was made with, so a resumed run can
never mix answers sampled with different parameters.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from deepspec.data.engines import Engine, Job, JobResult, create_engine, resolve_engine_name
from deepspec.atomic import write_json_atomic
from deepspec.data.jsonl import JsonlAppender, iter_lines, parse_line, read_jsonl, repair_tail, write_jsonl_atomic
from deepspec.errors import DataError
from deepspec.hashing import file_sha256
from deepspec.log import get_logger, progress
from deepspec.preemption import fault_point, stop_on_signals

log = get_logger(__name__)

SUMMARY_NAME = "regenerate_summary.json"


def errors_path(output: Path) -> Path:
    return output.with_name(output.name.removesuffix(".jsonl") + ".errors.jsonl")


def state_path(output: Path) -> Path:
    return output.with_name(output.name + ".state.json")


def splits(cfg, which: str = "all") -> list[tuple[str, Path, Path]]:
    """(name, input, output) of the splits to regenerate."""
    out = []
    if which in ("all", "train"):
        out.append(("train", cfg.conversations_path, cfg.regenerated_path))
    if which == "heldout" or (which == "all" and cfg.data.regenerate.heldout):
        out.append(("heldout", cfg.heldout_path, cfg.regenerated_heldout_path))
    return out


def settings(cfg) -> dict[str, Any]:
    """What the answers depend on (the engine may change between resumes; these may not)."""
    return {
        "target": cfg.target.name,
        "target_revision": cfg.target.revision,
        "chat_template_kwargs": cfg.target.chat_template_kwargs,
        "sampling": dataclasses.asdict(cfg.data.regenerate.sampling),
    }


def load_jobs(path: Path) -> list[Job]:
    if not path.is_file():
        raise DataError(f"Input {path} does not exist; run `deepspec data prompts CONFIG` first.")
    jobs, seen = [], set()
    for lineno, text in iter_lines(path):
        try:
            rec = json.loads(text)
            jid, conv = str(rec["id"]), rec["conversations"]
        except (ValueError, KeyError, TypeError):
            raise DataError(f"{path}:{lineno}: not a conversation record; rebuild it with `deepspec data prompts CONFIG --overwrite`.") from None
        if jid in seen:
            raise DataError(f"{path}:{lineno}: duplicate id {jid!r}; ids must be unique (rebuild the prompts).")
        seen.add(jid)
        jobs.append(Job(jid, conv, rec.get("meta") or {}))
    return jobs


def done_ids(output: Path, wanted: set[str]) -> set[str]:
    """Ids already in the output (after cutting a torn tail). Rewrites the file atomically if it
    holds duplicates or ids that are not inputs any more, so the output is always exact."""
    if not output.exists():
        return set()
    cut = repair_tail(output)
    if cut:
        log.warning("%s: removed a torn last line (%d bytes) left by an interrupted run", output, cut)
    ids: list[str] = []
    for lineno, text in iter_lines(output):
        ids.append(str(parse_line(output, lineno, text)["id"]))
    unique = set(ids)
    if len(unique) != len(ids) or not unique <= wanted:
        kept, seen = [], set()
        for rec in read_jsonl(output):
            if rec["id"] in wanted and rec["id"] not in seen:
                seen.add(rec["id"])
                kept.append(rec)
        log.warning("%s: dropped %d duplicate/unknown records", output, len(ids) - len(kept))
        write_jsonl_atomic(output, kept)
        unique = seen
    return unique


def permanent_failures(output: Path) -> set[str]:
    p = errors_path(output)
    if not p.exists():
        return set()
    return {str(r["id"]) for r in read_jsonl(p) if r.get("permanent")}


def split_status(cfg, inp: Path, out: Path) -> dict[str, int]:
    jobs = load_jobs(inp)
    wanted = {j.id for j in jobs}
    done = done_ids(out, wanted) if out.exists() else set()
    perm = permanent_failures(out) & (wanted - done)
    return {"inputs": len(wanted), "done": len(done), "permanent_failures": len(perm), "todo": len(wanted) - len(done) - len(perm)}


def _check_state(cfg, inp: Path, out: Path, overwrite: bool) -> dict[str, Any]:
    state = {"input": str(inp), "input_sha256": file_sha256(inp), **settings(cfg)}
    sp = state_path(out)
    if overwrite:
        for p in (out, errors_path(out), sp):
            p.unlink(missing_ok=True)
    elif out.exists() and sp.exists():
        old = json.loads(sp.read_text())
        diff = [k for k in state if old.get(k) != state[k]]
        if diff:
            raise DataError(
                f"{out} was made with different {', '.join(diff)}; pass --overwrite to regenerate it, "
                "or use another data.dir."
            )
    elif out.exists() and out.stat().st_size:
        raise DataError(f"{out} exists but has no state file {sp.name}; pass --overwrite to regenerate it.")
    write_json_atomic(sp, state)
    return state


def is_complete(cfg, which: str = "all") -> bool:
    """True when every input id of every split is in the output (or failed permanently)."""
    for _, inp, out in splits(cfg, which):
        if not (inp.exists() and out.exists() and state_path(out).exists()):
            return False
        if split_status(cfg, inp, out)["todo"]:
            return False
        old = json.loads(state_path(out).read_text())
        if any(old.get(k) != v for k, v in settings(cfg).items()):
            return False
    return True


class _Sink:
    """Persists results as they arrive and keeps the progress bar + counters."""

    def __init__(self, cfg, out: Path, engine: Engine, state: dict[str, Any], meta_by_id: dict[str, dict], bar):
        self.out = JsonlAppender(out)
        self.errors = JsonlAppender(errors_path(out))
        self.base_meta = {
            "engine": engine.name, "engine_version": engine.version, "target": cfg.target.name,
            "template_hash": engine.template_hash, "chat_template_kwargs": state["chat_template_kwargs"],
            "sampling": state["sampling"],
        }
        self.meta_by_id = meta_by_id
        self.bar = bar
        self.done = self.failed = self.permanent = self.tokens = 0
        self.t0 = time.monotonic()

    def __call__(self, r: JobResult) -> None:
        if r.error is None:
            meta = {**self.meta_by_id.get(r.id, {}), **self.base_meta, "output_tokens": r.output_tokens,
                    "finish_reasons": r.finish_reasons}
            self.out.write({"id": r.id, "conversations": r.conversation, "meta": meta})
            self.done += 1
            fault_point("regenerate-result")
        else:
            self.errors.write({"id": r.id, "error": r.error, "permanent": r.permanent, "time": time.time()})
            self.failed += 1
            self.permanent += int(r.permanent)
        self.tokens += r.output_tokens
        dt = max(time.monotonic() - self.t0, 1e-9)
        self.bar.update(1)
        self.bar.set_postfix({"tok/s": f"{self.tokens / dt:.1f}", "failed": self.failed}, refresh=False)

    def close(self) -> None:
        self.out.close()
        self.errors.close()


def regenerate(cfg, engine: str | None = None, urls: list[str] | None = None, overwrite: bool = False,
               which: str = "all", engine_obj: Engine | None = None) -> dict[str, Any]:
    """Regenerate the train (and held-out) split; returns a summary. Complete splits cost only a scan.
    One regeneration per data folder at a time (deepspec/locks.py)."""
    from deepspec.locks import folder_lock

    with folder_lock(cfg.data_dir, "regeneration"):
        return _regenerate(cfg, engine, urls, overwrite, which, engine_obj)


def _regenerate(cfg, engine: str | None, urls: list[str] | None, overwrite: bool, which: str,
                engine_obj: Engine | None) -> dict[str, Any]:
    from deepspec.config import save_config
    from deepspec.data.engines.openai_engine import read_urls

    rc = cfg.data.regenerate
    url_list = read_urls(list(urls or []) or rc.urls, rc.urls_file)
    name = resolve_engine_name(engine or rc.engine, url_list)
    plan = []
    for split, inp, out in splits(cfg, which):
        jobs = load_jobs(inp)
        state = _check_state(cfg, inp, out, overwrite)
        wanted = {j.id for j in jobs}
        done = done_ids(out, wanted)
        todo = [j for j in jobs if j.id not in done]
        errors_path(out).unlink(missing_ok=True)  # rebuilt by this run; ids not done are retried anyway
        plan.append((split, out, jobs, done, todo, state))
    summary: dict[str, Any] = {"engine": name, "splits": {}}
    total_todo = sum(len(p[4]) for p in plan)
    own_engine = engine_obj is None and total_todo > 0
    eng = None

    def saved() -> str:  # what a preempted run keeps: every answer written so far (whole, fsynced lines)
        return "; ".join(f"{sum(1 for _ in iter_lines(p[1])) if p[1].exists() else 0} of {len(p[2])} answers are saved in {p[1]}"
                         for p in plan)

    with stop_on_signals("regenerate", saved):
        eng = engine_obj if engine_obj is not None else (create_engine(cfg, name, url_list) if total_todo else None)
        _run_splits(cfg, plan, eng, own_engine, summary)
    for key in ("done", "skipped", "failed", "permanent_failures", "output_tokens"):
        summary[key] = sum(s[key] for s in summary["splits"].values())
    if total_todo:
        summary["engine_version"] = eng.version
        save_config(cfg, cfg.data_dir, name="regenerate.config.yaml")
        write_json_atomic(cfg.data_dir / SUMMARY_NAME, summary)
    return summary


def _run_splits(cfg, plan: list, eng: Engine | None, own_engine: bool, summary: dict[str, Any]) -> None:
    """Answer each split's remaining jobs, appending results as they arrive; closes the engine if it is ours."""
    try:
        for split, out, jobs, done, todo, state in plan:
            t0 = time.monotonic()
            entry = {"inputs": len(jobs), "skipped": len(done), "done": 0, "failed": 0, "permanent_failures": 0,
                     "output_tokens": 0, "seconds": 0.0, "output": str(out)}
            if todo:
                bar = progress(total=len(todo), desc=f"regenerate {split}", unit="conv")
                sink = _Sink(cfg, out, eng, state, {j.id: j.meta for j in todo}, bar)
                try:
                    eng.run(todo, sink)
                finally:
                    sink.close()
                    bar.close()
                dt = time.monotonic() - t0
                entry.update(done=sink.done, failed=sink.failed, permanent_failures=sink.permanent,
                             output_tokens=sink.tokens, seconds=round(dt, 3),
                             conversations_per_s=round(sink.done / dt, 3), tokens_per_s=round(sink.tokens / dt, 2))
            log.info("regenerate %s: %d done, %d already there, %d failed%s, %d tokens",
                     split, entry["done"], entry["skipped"], entry["failed"],
                     f" (see {errors_path(out)})" if entry["failed"] else "", entry["output_tokens"])
            summary["splits"][split] = entry
    finally:
        if own_engine and eng is not None:
            eng.close()
