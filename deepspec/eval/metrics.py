"""Acceptance metrics of speculative decoding, with the project's names (docs/evaluation.md).

One verify round = the draft proposes k tokens, the target checks them in one forward and
accepts a prefix of A of them, then emits one token of its own (correction or bonus).

  * τ (``tau``)               = mean over rounds of (A + 1): includes the bonus token, as vLLM and
                                 SGLang report "mean acceptance length".
  * α_k (``acc_cond@k``)      = P(draft k accepted | drafts 1..k-1 accepted and draft k proposed).
  * s_k (``survival@k``)      = P(A >= k) over all rounds (prefix survival).
  * E[A]@S (``expected_accepted@S``) = Σ_{k<=S} s_k = mean min(A, S); for a chain that always
                                 proposes S tokens τ = 1 + E[A]@S, so it compares runs at a
                                 different number of speculative tokens.

The headline names users compare across papers and engines (``HEADLINE``): ``acc0`` = acc_cond@1
(the first draft's acceptance), ``acc_cond@k`` per depth, ``E[A]@S3`` / ``E[A]@S7`` and
``tau@3`` = 1 + E[A]@S3 (what a 3-token chain would reach). A name whose depth was never drafted is NaN.

Stats are integer counters, so workers merge by adding them (never by averaging ratios).
There is deliberately no bare "accept_rate": it means α, s or a token ratio depending on who prints it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


HEADLINE_S = (3, 7)
HEADLINE = ("acc0", "E[A]@S3", "E[A]@S7", "tau@3")


@dataclass
class AcceptanceStats:
    """Integer counters of verify rounds; ratios are derived, so merging is exact."""

    rounds: int = 0
    proposed: int = 0  # draft tokens the draft proposed (all rounds)
    accepted: int = 0  # draft tokens the target accepted
    generated: int = 0  # tokens emitted (accepted + corrections/bonus, after EOS / length truncation)
    # reached[k-1]: rounds where draft k was proposed and drafts 1..k-1 were accepted (denominator of α_k)
    reached: list[int] = field(default_factory=list)
    # accepted_at[k-1]: rounds with at least k drafts accepted (numerator of α_k and s_k)
    accepted_at: list[int] = field(default_factory=list)

    def _grow(self, n: int) -> None:
        while len(self.reached) < n:
            self.reached.append(0)
            self.accepted_at.append(0)

    def add_round(self, num_proposed: int, num_accepted: int, num_generated: int | None = None) -> None:
        """Record one verify round: `num_proposed` drafts were checked, the first `num_accepted` passed."""
        if not 0 <= num_accepted <= num_proposed:
            raise ValueError(f"accepted ({num_accepted}) must be between 0 and proposed ({num_proposed})")
        self._grow(num_proposed)
        self.rounds += 1
        self.proposed += num_proposed
        self.accepted += num_accepted
        self.generated += num_accepted + 1 if num_generated is None else num_generated
        # draft k is reached when k <= proposed and the k-1 before it passed: k <= min(proposed, accepted + 1)
        for k in range(1, min(num_proposed, num_accepted + 1) + 1):
            self.reached[k - 1] += 1
        for k in range(1, num_accepted + 1):
            self.accepted_at[k - 1] += 1

    def merge(self, other: "AcceptanceStats") -> "AcceptanceStats":
        """Add another worker's / benchmark's counters into this one (in place) and return self."""
        self._grow(len(other.reached))
        self.rounds += other.rounds
        self.proposed += other.proposed
        self.accepted += other.accepted
        self.generated += other.generated
        for i, (r, a) in enumerate(zip(other.reached, other.accepted_at)):
            self.reached[i] += r
            self.accepted_at[i] += a
        return self

    # ------------------------------------------------------------------ derived metrics

    @property
    def depth(self) -> int:
        return len(self.reached)

    @property
    def tau(self) -> float:
        """Mean (accepted + 1) per verify round, bonus included."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else float("nan")

    def acc_cond(self, k: int) -> float:
        """α_k = P(draft k accepted | drafts 1..k-1 accepted, draft k proposed); NaN if never reached."""
        if k < 1 or k > self.depth or self.reached[k - 1] == 0:
            return float("nan")
        return self.accepted_at[k - 1] / self.reached[k - 1]

    def survival(self, k: int) -> float:
        """s_k = P(at least k drafts accepted), over all rounds."""
        if not self.rounds:
            return float("nan")
        if k < 1:
            return 1.0
        return (self.accepted_at[k - 1] if k <= self.depth else 0) / self.rounds

    def expected_accepted(self, s: int) -> float:
        """E[A]@S = Σ_{k<=S} s_k = mean min(A, S)."""
        if not self.rounds:
            return float("nan")
        return sum(self.survival(k) for k in range(1, s + 1))

    def headline(self) -> dict[str, float]:
        """acc0, acc_cond@k (k = 1..depth), E[A]@S3, E[A]@S7, tau@3 — NaN where the depth was not drafted."""
        nan = float("nan")
        out: dict[str, float] = {"acc0": self.acc_cond(1)}
        out.update({f"acc_cond@{k}": self.acc_cond(k) for k in range(1, self.depth + 1)})
        for s in HEADLINE_S:
            out[f"E[A]@S{s}"] = self.expected_accepted(s) if s <= self.depth else nan
        out["tau@3"] = 1 + out["E[A]@S3"]
        return out

    def summary(self) -> dict[str, Any]:
        """The metrics as a JSON-ready dict (per-depth lists are indexed k-1, headline names flat)."""
        d = self.depth
        return {
            **self.headline(),
            "tau": self.tau,
            "rounds": self.rounds,
            "proposed_tokens": self.proposed,
            "accepted_tokens": self.accepted,
            "generated_tokens": self.generated,
            "mean_proposed_per_round": self.proposed / self.rounds if self.rounds else float("nan"),
            "acc_cond": [self.acc_cond(k) for k in range(1, d + 1)],
            "survival": [self.survival(k) for k in range(1, d + 1)],
            "expected_accepted": [self.expected_accepted(k) for k in range(1, d + 1)],
        }

    def to_dict(self) -> dict[str, Any]:
        """Raw counters (what workers exchange)."""
        return {
            "rounds": self.rounds, "proposed": self.proposed, "accepted": self.accepted, "generated": self.generated,
            "reached": list(self.reached), "accepted_at": list(self.accepted_at),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "AcceptanceStats":
        return cls(
            rounds=int(d["rounds"]), proposed=int(d["proposed"]), accepted=int(d["accepted"]),
            generated=int(d["generated"]), reached=[int(x) for x in d["reached"]],
            accepted_at=[int(x) for x in d["accepted_at"]],
        )


@dataclass
class TimingStats:
    """Wall-clock seconds and generated tokens of target-only and speculative decoding on the same prompts."""

    target_tokens: int = 0
    target_seconds: float = 0.0
    spec_tokens: int = 0
    spec_seconds: float = 0.0

    def merge(self, other: "TimingStats") -> "TimingStats":
        self.target_tokens += other.target_tokens
        self.target_seconds += other.target_seconds
        self.spec_tokens += other.spec_tokens
        self.spec_seconds += other.spec_seconds
        return self

    @property
    def target_tokens_per_s(self) -> float:
        return self.target_tokens / self.target_seconds if self.target_seconds > 0 else float("nan")

    @property
    def spec_tokens_per_s(self) -> float:
        return self.spec_tokens / self.spec_seconds if self.spec_seconds > 0 else float("nan")

    @property
    def speedup(self) -> float:
        """Speculative tokens/s over target-only tokens/s (same process, same prompts)."""
        t, s = self.target_tokens_per_s, self.spec_tokens_per_s
        return s / t if t == t and s == s and t > 0 else float("nan")

    def summary(self) -> dict[str, Any]:
        return {
            "target_tokens_per_s": self.target_tokens_per_s,
            "spec_tokens_per_s": self.spec_tokens_per_s,
            "speedup": self.speedup,
            "target_tokens": self.target_tokens,
            "target_seconds": self.target_seconds,
            "spec_tokens": self.spec_tokens,
            "spec_seconds": self.spec_seconds,
        }

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("target_tokens", "target_seconds", "spec_tokens", "spec_seconds")}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TimingStats":
        return cls(int(d["target_tokens"]), float(d["target_seconds"]), int(d["spec_tokens"]), float(d["spec_seconds"]))
