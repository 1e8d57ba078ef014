"""The prompts stage: source -> validated, deduplicated conversations + a seeded held-out split.

Why the care: bad records must be reported where they are (file:line) instead of crashing a
multi-hour run later, duplicate prompts would over-weight some samples, and a training prompt
that is also an evaluation prompt would inflate the acceptance numbers we report.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from pathlib import Path
from typing import Any

from deepspec.atomic import write_json_atomic
from deepspec.data.jsonl import write_jsonl_atomic
from deepspec.data.sources import InvalidRecord, iter_source, normalize, source_provenance
from deepspec.errors import ConfigError, DataError
from deepspec.log import get_logger

log = get_logger(__name__)

SUMMARY_NAME = "prompts_summary.json"
_MAX_REPORTED = 50


def prompt_key(conv: list[dict[str, str]]) -> str:
    """Identity of a prompt: the system + user turns (assistant turns are regenerated anyway)."""
    return json.dumps([(m["role"], m["content"].strip()) for m in conv if m["role"] != "assistant"], ensure_ascii=False)


def _fingerprint(cfg) -> str:
    p = dataclasses.asdict(cfg.data.prompts)
    p.pop("strict", None)
    return hashlib.sha256(json.dumps(p, sort_keys=True).encode()).hexdigest()[:16]


def summary_path(cfg) -> Path:
    return cfg.data_dir / SUMMARY_NAME


def heldout_split_path(cfg, name: str) -> Path:
    """File of a named held-out split (`split: NAME` entries of data.prompts.sources)."""
    return cfg.data_dir / f"heldout.{name}.jsonl"


def is_complete(cfg) -> bool:
    """True when conversations + held-out files exist and were built from the same prompt settings."""
    sp = summary_path(cfg)
    if not (sp.is_file() and cfg.conversations_path.is_file() and cfg.heldout_path.is_file()):
        return False
    try:
        summary = json.loads(sp.read_text())
    except (OSError, ValueError):
        return False
    named = (summary.get("splits") or {}).keys()
    return summary.get("fingerprint") == _fingerprint(cfg) and all(heldout_split_path(cfg, n).is_file() for n in named)


def eval_prompt_texts(datasets_dir: str | Path) -> tuple[set[str], list[str]]:
    """Every turn text of the evaluation benchmarks (`eval_datasets/*.jsonl`, `{"turns": [...]}`)."""
    texts: set[str] = set()
    files: list[str] = []
    d = Path(datasets_dir)
    if not d.is_dir():
        return texts, files
    for f in sorted(d.glob("*.jsonl")):
        files.append(str(f))
        with open(f, encoding="utf-8") as fh:
            for line in fh:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                turns = rec.get("turns") if isinstance(rec, dict) else None
                for t in turns or []:
                    if isinstance(t, str) and t.strip():
                        texts.add(t.strip())
    return texts, files


def heldout_count(heldout: float, n: int) -> int:
    """A fraction in (0, 1) of n, or an absolute count >= 1; always leaves at least one train record."""
    if heldout < 0:
        raise ConfigError(f"data.prompts.heldout={heldout} is negative; use a fraction in (0, 1) or a count >= 1.")
    if heldout == 0:
        return 0
    if heldout < 1:
        k = max(1, round(n * heldout))
    elif float(heldout).is_integer():
        k = int(heldout)
    else:
        raise ConfigError(f"data.prompts.heldout={heldout} is neither a fraction in (0, 1) nor a whole count.")
    if k >= n:
        raise DataError(f"The held-out split ({k}) would take all {n} valid prompts; lower data.prompts.heldout or add prompts.")
    return k


class _Collector:
    """Validation, first-turn cut, length filter, dedup and eval-overlap filter shared by every source
    of one build (a prompt seen in one source is a duplicate in the next)."""

    def __init__(self, cfg, strict: bool):
        self.pc, self.strict = cfg.data.prompts, strict
        self.eval_texts, self.eval_files = eval_prompt_texts(cfg.eval.datasets_dir)
        if not self.eval_files:
            log.warning("no evaluation prompts found in %s (eval.datasets_dir); training prompts are not checked against them",
                        cfg.eval.datasets_dir)
        self.counts = {"read": 0, "invalid": 0, "duplicates": 0, "eval_overlap": 0, "too_long": 0, "valid": 0}
        self.issues: list[str] = []
        self.seen_keys: set[str] = set()
        self.seen_ids: set[str] = set()
        self.eval_overlap_ids: set[str] = set()  # kept rows that are also eval prompts (held-out use only)

    def take(self, raws, keep_eval_overlap: bool = False) -> list[dict[str, Any]]:
        """Valid, new records of `raws`; eval-benchmark prompts are dropped, or with `keep_eval_overlap`
        kept and listed in `eval_overlap_ids` (a held-out split may ask them; training never may)."""
        pc, counts = self.pc, self.counts
        records: list[dict[str, Any]] = []
        for raw in raws:
            counts["read"] += 1
            try:
                if raw.error:
                    raise InvalidRecord(raw.error)
                rid, conv, meta = normalize(raw.record)
            except InvalidRecord as e:
                counts["invalid"] += 1
                msg = f"{raw.origin}: {e}"
                if self.strict:
                    raise DataError(f"Invalid prompt record at {msg}; fix it or drop --strict to skip invalid records.") from None
                if len(self.issues) < _MAX_REPORTED:
                    self.issues.append(msg)
                continue
            if pc.first_turn_only:
                first_user = next(i for i, m in enumerate(conv) if m["role"] == "user")
                conv = conv[: first_user + 1]
            if pc.max_prompt_chars and sum(len(m["content"]) for m in conv if m["role"] != "assistant") > pc.max_prompt_chars:
                counts["too_long"] += 1
                continue
            key = prompt_key(conv)
            if key in self.seen_keys:
                counts["duplicates"] += 1
                continue
            overlap = bool(self.eval_texts) and any(m["content"].strip() in self.eval_texts for m in conv if m["role"] == "user")
            if overlap:
                counts["eval_overlap"] += 1
                if not keep_eval_overlap:
                    continue
            self.seen_keys.add(key)
            if rid is None:
                rid = "p-" + hashlib.sha1(key.encode()).hexdigest()[:16]
            base, n = rid, 1
            while rid in self.seen_ids:
                n += 1
                rid = f"{base}-{n}"
            self.seen_ids.add(rid)
            if overlap:
                self.eval_overlap_ids.add(rid)
            meta.setdefault("origin", raw.origin)
            records.append({"id": rid, "conversations": conv, "meta": meta})
        counts["valid"] += len(records)
        return records


def collect(cfg, strict: bool) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Read, validate, dedupe and filter the source; returns (records in source order, counts)."""
    pc = cfg.data.prompts
    col = _Collector(cfg, strict)
    records = col.take(iter_source(pc.source, pc.files, pc.split))
    return records, {"counts": col.counts, "issues": col.issues, "eval_files": col.eval_files}


def build_prompts(cfg, strict: bool | None = None, overwrite: bool = False) -> Path:
    """Write `conversations.jsonl` + `heldout.jsonl` (+ summary, config); skip if already complete."""
    from deepspec.config import save_config

    if strict is None:
        strict = cfg.data.prompts.strict
    if is_complete(cfg) and not overwrite:
        log.info("prompts: %s is complete (same settings); nothing to do (use --overwrite to rebuild)", cfg.conversations_path)
        return cfg.conversations_path
    pc = cfg.data.prompts
    named: dict[str, list[dict]] = {}
    blend_report: list[dict] | None = None
    if pc.sources:
        from deepspec.data.blend import TRAIN, draw, parse_sources

        specs = parse_sources(pc.sources, pc.max_samples)
        col = _Collector(cfg, strict)
        drawn, blend_report = draw(specs, col, pc.seed, pc.max_samples)
        records = drawn.pop(TRAIN, [])
        named = drawn
        report = {"counts": col.counts, "issues": col.issues, "eval_files": col.eval_files}
        random.Random(pc.seed).shuffle(records)
        if pc.max_samples and not any(s.weight for s in specs):
            records = records[: pc.max_samples]
        source_desc: dict[str, Any] = {"kind": "blend", "entries": blend_report}
    else:
        records, report = collect(cfg, strict)
        random.Random(pc.seed).shuffle(records)  # deterministic: same source + seed -> same split
        if pc.max_samples:
            records = records[: pc.max_samples]
        source_desc = source_provenance(pc.source, pc.files, pc.split)
    if not records:
        where = f"sources {[e.get('source') for e in pc.sources]}" if pc.sources else f"source '{pc.source}'"
        raise DataError(f"No valid prompts in {where} ({report['counts']}); check data.prompts.source/files/sources.")
    k = heldout_count(pc.heldout, len(records))
    heldout, train = records[:k], records[k:]
    cfg.data_dir.mkdir(parents=True, exist_ok=True)
    summary_path(cfg).unlink(missing_ok=True)  # the summary is written last: it marks completion
    write_jsonl_atomic(cfg.heldout_path, heldout)
    write_jsonl_atomic(cfg.conversations_path, train)
    for old in cfg.data_dir.glob("heldout.*.jsonl"):  # a split the recipe no longer names must not be evaluated
        if old.name.removeprefix("heldout.").removesuffix(".jsonl") not in named:
            old.unlink()
    for name, recs in named.items():
        write_jsonl_atomic(heldout_split_path(cfg, name), recs)
    c = report["counts"]
    summary = {
        "fingerprint": _fingerprint(cfg),
        "source": source_desc,
        "counts": {**c, "train": len(train), "heldout": len(heldout), **{f"heldout.{n}": len(r) for n, r in named.items()}},
        "invalid_examples": report["issues"],
        "eval_datasets_checked": report["eval_files"],
        "conversations": str(cfg.conversations_path),
        "heldout": str(cfg.heldout_path),
    }
    if blend_report is not None:
        from deepspec.data.blend import per_source

        summary["per_source"] = {"train": per_source(train), "heldout": per_source(heldout),
                                 **{f"heldout.{n}": per_source(r) for n, r in named.items()}}
        summary["splits"] = {n: {"path": str(heldout_split_path(cfg, n)), "count": len(r), "per_source": per_source(r)}
                             for n, r in named.items()}
    save_config(cfg, cfg.data_dir, name="prompts.config.yaml")
    write_json_atomic(summary_path(cfg), summary)
    for msg in report["issues"][:10]:
        log.warning("skipped invalid record %s", msg)
    for name, recs in named.items():
        log.info("prompts: held-out split %s: %d prompts -> %s", name, len(recs), heldout_split_path(cfg, name))
    log.info(
        "prompts: %d train + %d held-out -> %s (read %d, invalid %d, duplicates %d, eval overlap %d, too long %d)",
        len(train), len(heldout), cfg.data_dir, c["read"], c["invalid"], c["duplicates"], c["eval_overlap"], c["too_long"],
    )
    return cfg.conversations_path
