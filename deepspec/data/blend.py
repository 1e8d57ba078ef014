"""Prompt blends: several sources mixed by count or weight, and held-out splits drawn from rows
(or whole sources) that the training mix never sees.

Why: a draft trained on one kind of prompt accepts poorly on others, and an acceptance figure
measured on prompts from the training pool overstates what users see. A recipe therefore lists
its sources (`data.prompts.sources`), and names the held-out splits it reports on (`general`,
`agentic`, ...). Held-out entries draw first from their source, so training can never take their rows.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Any

from deepspec.data.sources import OFFLINE_SOURCES, iter_source, record_subset, source_provenance
from deepspec.errors import ConfigError, DataError
from deepspec.log import get_logger

log = get_logger(__name__)

TRAIN = "train"
_SPLIT_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]*$")
_KEYS = {"source", "files", "hf_split", "subset", "count", "weight", "split", "name"}


@dataclass
class SourceSpec:
    """One entry of `data.prompts.sources`, validated."""

    source: str
    files: list[str] = field(default_factory=list)
    hf_split: str = "train"
    subset: list[str] | None = None
    count: int | None = None
    weight: float | None = None
    split: str = TRAIN
    name: str = ""

    @property
    def read_key(self) -> tuple:
        """Entries with the same key read the same rows (and so must not share any)."""
        return (self.source, tuple(self.files), self.hf_split)

    @property
    def kind(self) -> str | None:
        return OFFLINE_SOURCES.get(self.source, (None,))[0]


def parse_sources(entries: list[dict[str, Any]], max_samples: int | None) -> list[SourceSpec]:
    """Validate `data.prompts.sources`; every mistake is a ConfigError naming the entry."""
    specs: list[SourceSpec] = []
    for i, e in enumerate(entries):
        where = f"data.prompts.sources[{i}]"
        if not isinstance(e, dict) or not isinstance(e.get("source"), str) or not e["source"]:
            raise ConfigError(f"{where} needs a mapping with a 'source' (e.g. {{source: sharegpt, count: 400}}), got {e!r}.")
        unknown = set(e) - _KEYS
        if unknown:
            raise ConfigError(f"{where} has unknown key(s) {sorted(unknown)}; allowed: {', '.join(sorted(_KEYS))}.")
        if "count" in e and "weight" in e:
            raise ConfigError(f"{where} sets both count and weight; give one of them.")
        count, weight = e.get("count"), e.get("weight")
        if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
            raise ConfigError(f"{where}.count must be a whole number >= 1, got {count!r}.")
        if weight is not None and (isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight <= 0):
            raise ConfigError(f"{where}.weight must be a number > 0, got {weight!r}.")
        split = str(e.get("split", TRAIN))
        if not _SPLIT_NAME.match(split):
            raise ConfigError(f"{where}.split={split!r}: use 'train' or a held-out name of lowercase letters, digits, '-' or '_'.")
        if weight is not None and split != TRAIN:
            raise ConfigError(f"{where}: a held-out entry needs an exact count, not a weight.")
        if weight is not None and not max_samples:
            raise ConfigError(f"{where}.weight shares data.prompts.max_samples, which is not set; set it or use count.")
        subset = e.get("subset")
        if isinstance(subset, str):
            subset = [subset]
        if subset is not None and (not isinstance(subset, list) or not all(isinstance(x, str) for x in subset)):
            raise ConfigError(f"{where}.subset must be a name or a list of names, got {subset!r}.")
        files = e.get("files") or []
        if isinstance(files, str):
            files = [files]
        name = str(e.get("name") or (e["source"] + (":" + ",".join(subset) if subset else "")))
        specs.append(SourceSpec(e["source"], list(files), str(e.get("hf_split", "train")), subset,
                                count, None if weight is None else float(weight), split, name))
    names = [s.name for s in specs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"data.prompts.sources has several entries named {dup}; give them distinct 'name's.")
    if not any(s.split == TRAIN for s in specs):
        raise ConfigError("data.prompts.sources has no entry with split: train; a recipe needs training prompts.")
    return specs


def _targets(specs: list[SourceSpec], max_samples: int | None) -> dict[str, int | None]:
    """Rows wanted per entry: its count, its share of max_samples (weights), or None = all that are left."""
    weighted = [s for s in specs if s.weight is not None]
    out: dict[str, int | None] = {s.name: s.count for s in specs}
    if weighted:
        fixed = sum(s.count or 0 for s in specs if s.split == TRAIN and s.count is not None)
        budget = max(0, int(max_samples or 0) - fixed)
        total = sum(s.weight for s in weighted)
        shares = [budget * s.weight / total for s in weighted]
        ns = [int(x) for x in shares]
        # largest remainders get the rows lost to rounding, so the shares add up to the budget exactly
        for j in sorted(range(len(ns)), key=lambda j: shares[j] - ns[j], reverse=True)[: budget - sum(ns)]:
            ns[j] += 1
        for s, n in zip(weighted, ns):
            out[s.name] = n
    return out


def draw(specs: list[SourceSpec], collector, seed: int, max_samples: int | None) -> tuple[dict[str, list[dict]], list[dict]]:
    """Read each source once and deal its rows to the entries: held-out entries first, then training.

    Returns ({split name: records}, per-entry report). Rows are shuffled with the seed per source, so
    the same recipe always yields the same blend.
    """
    targets = _targets(specs, max_samples)
    groups: dict[tuple, list[SourceSpec]] = {}
    for s in specs:
        groups.setdefault(s.read_key, []).append(s)
    splits: dict[str, list[dict]] = {}
    report: list[dict] = []
    for key, group in groups.items():
        first = group[0]
        rows = collector.take(iter_source(first.source, first.files, first.hf_split),
                              keep_eval_overlap=any(s.split != TRAIN for s in group))
        random.Random(f"{seed}:{first.source}:{'|'.join(first.files)}").shuffle(rows)
        used = [False] * len(rows)
        for s in sorted(group, key=lambda s: s.split == TRAIN):  # held-out entries draw first
            want = targets[s.name]
            picked = []
            for i, r in enumerate(rows):
                if want is not None and len(picked) >= want:
                    break
                if used[i] or (s.subset is not None and record_subset(r) not in s.subset):
                    continue
                if s.split == TRAIN and r["id"] in collector.eval_overlap_ids:
                    continue  # an eval benchmark's prompt may be held out, never trained on
                used[i] = True
                picked.append({**r, "meta": {**r["meta"], "blend_source": s.name}})
            if s.subset is not None and not picked:
                subsets = sorted({record_subset(r) or "-" for r in rows})
                raise DataError(f"data.prompts.sources entry {s.name!r}: no rows of subset {s.subset} in {s.source}; "
                                f"its subsets are {', '.join(subsets[:40])}.")
            if want is not None and len(picked) < want:
                log.warning("prompts: source %s has %d rows left for %s, fewer than the %d asked", s.name, len(picked), s.split, want)
            splits.setdefault(s.split, []).extend(picked)
            report.append({"name": s.name, "source": s.source, "subset": s.subset, "split": s.split, "kind": s.kind,
                           "count": s.count, "weight": s.weight, "wanted": want, "taken": len(picked),
                           "provenance": source_provenance(s.source, s.files, s.hf_split)})
    return splits, report


def per_source(records: list[dict]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in records:
        name = (r.get("meta") or {}).get("blend_source", "?")
        out[name] = out.get(name, 0) + 1
    return out
