"""Acceptance by context length: the same counters as AcceptanceStats, split by the rendered prompt's token count.

A draft is often accepted differently on long prompts than on short ones (its attention saw short contexts in
training, a sliding window cuts in, tool schemas fill the prompt), and a pooled tau hides that. Each answer's verify
rounds go into the bucket of its prompt length: the tokens of the rendered prompt (chat template applied, generation
prompt included) — the context the draft sees at the answer's first round. Counters stay integers, so workers merge by
adding and the buckets of a split add up to the split exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deepspec.eval.metrics import AcceptanceStats

DEFAULT_EDGES = (256, 1024, 4096, 16384)  # buckets <256, 256-1k, 1k-4k, 4k-16k, >=16k prompt tokens
MEASURE = "prompt tokens of each answer's rendered prompt (chat template and generation prompt included)"


def _tokens(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def bucket_labels(edges: list[int] | tuple[int, ...]) -> list[str]:
    """Names of the buckets the edges cut: '<256', '256-1k', ..., '>=16k' (lower bound inclusive, upper exclusive)."""
    edges = list(edges)
    if not edges:
        return ["all"]
    return ([f"<{_tokens(edges[0])}"] + [f"{_tokens(a)}-{_tokens(b)}" for a, b in zip(edges, edges[1:])]
            + [f">={_tokens(edges[-1])}"])


def bucket_of(prompt_tokens: int, edges: list[int] | tuple[int, ...]) -> str:
    """The label of the bucket holding a prompt of `prompt_tokens` tokens."""
    labels = bucket_labels(edges)
    for i, edge in enumerate(edges):
        if prompt_tokens < edge:
            return labels[i]
    return labels[-1]


@dataclass
class Bucket:
    """One bucket's counters: the rounds of its answers, how many answers (prompts), and their length range."""

    stats: AcceptanceStats = field(default_factory=AcceptanceStats)
    prompts: int = 0
    min_tokens: int | None = None
    max_tokens: int | None = None

    def add(self, prompt_tokens: int, stats: AcceptanceStats) -> None:
        self.stats.merge(stats)
        self.prompts += 1
        self.min_tokens = prompt_tokens if self.min_tokens is None else min(self.min_tokens, prompt_tokens)
        self.max_tokens = prompt_tokens if self.max_tokens is None else max(self.max_tokens, prompt_tokens)

    def merge(self, other: "Bucket") -> "Bucket":
        self.stats.merge(other.stats)
        self.prompts += other.prompts
        for lo_hi in ("min_tokens", "max_tokens"):
            a, b = getattr(self, lo_hi), getattr(other, lo_hi)
            pick = min if lo_hi == "min_tokens" else max
            setattr(self, lo_hi, b if a is None else a if b is None else pick(a, b))
        return self

    def to_dict(self) -> dict[str, Any]:
        return {"stats": self.stats.to_dict(), "prompts": self.prompts, "min_tokens": self.min_tokens, "max_tokens": self.max_tokens}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Bucket":
        return cls(AcceptanceStats.from_dict(d["stats"]), int(d["prompts"]), d.get("min_tokens"), d.get("max_tokens"))

    def summary(self) -> dict[str, Any]:
        """AcceptanceStats' figures, with the answer count and the prompt-length range they came from."""
        return {"prompts": self.prompts, "prompt_tokens_min": self.min_tokens, "prompt_tokens_max": self.max_tokens,
                **self.stats.summary()}


@dataclass
class ContextLengthStats:
    """Per-bucket counters of one split (or of every split pooled)."""

    edges: tuple[int, ...] = DEFAULT_EDGES
    buckets: dict[str, Bucket] = field(default_factory=dict)

    def add(self, prompt_tokens: int, stats: AcceptanceStats) -> None:
        """Record one answer: its prompt length and the counters of its verify rounds."""
        self.buckets.setdefault(bucket_of(prompt_tokens, self.edges), Bucket()).add(prompt_tokens, stats)

    def merge(self, other: "ContextLengthStats") -> "ContextLengthStats":
        if tuple(other.edges) != tuple(self.edges):
            raise ValueError(f"cannot merge context-length buckets cut at {list(other.edges)} into {list(self.edges)}")
        for label, b in other.buckets.items():
            self.buckets.setdefault(label, Bucket()).merge(b)
        return self

    def pooled(self) -> AcceptanceStats:
        """Every bucket's rounds together: equals the split's own counters."""
        out = AcceptanceStats()
        for b in self.buckets.values():
            out.merge(b.stats)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"edges": list(self.edges), "buckets": {k: b.to_dict() for k, b in self.buckets.items()}}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ContextLengthStats":
        return cls(tuple(int(e) for e in d["edges"]), {k: Bucket.from_dict(b) for k, b in d["buckets"].items()})

    def summary(self) -> dict[str, dict[str, Any]]:
        """label -> figures, in ladder order; empty buckets are left out."""
        return {label: self.buckets[label].summary() for label in bucket_labels(self.edges) if label in self.buckets}


def report(per_task: dict[str, ContextLengthStats], order: list[str], edges: tuple[int, ...]) -> dict[str, Any]:
    """The results.json block: the ladder, then per split and every split pooled (`overall`), each label -> figures."""
    overall = ContextLengthStats(tuple(edges))
    tasks: dict[str, Any] = {}
    for task in order:
        if task in per_task:
            overall.merge(per_task[task])
            tasks[task] = per_task[task].summary()
    return {"measure": MEASURE, "edges": list(edges), "buckets": bucket_labels(edges), "tasks": tasks, "overall": overall.summary()}
