"""`deepspec check EXPORT --served URL`: does a running server accept the draft as often as its contract says?

The export's `served_contract.json` (export/contract.py) holds what the draft was measured at: per split, the share of
verify rounds with at least k drafts accepted (prefix survival s_k, k = 1..S) over R rounds, the protocol, S, the
answer budget, the chat-template kwargs and a deterministic sample of the eval's prompts. The check sends those
prompts to the server (an OpenAI-compatible vLLM server running the target with this draft) under the same
settings, split by split, reads vLLM's Prometheus counters before and after each split (settled: read until two
reads agree) and compares, per position k, vLLM's rate accepted_at_position[k-1] / drafts over the N served rounds
with the contract's s_k.

The band. Under "the served draft is the contract's draft", the served rate and the contract's are two binomial
estimates of one acceptance probability p, from N and R rounds: their difference has standard deviation
sqrt(p (1 - p) (1/N + 1/R)). p is taken as the contract's rate with one accepted and one rejected round added
(p~ = (s_k R + 1) / (R + 2), so a contract rate of 0 or 1 still gets a band), and the half-width is z times that, z
from the normal quantile with a Bonferroni split of a 1% false-alarm chance over every (split, position) compared.
Rounds within one answer are not independent, so at T > 0 the band is narrower than the true spread; at T = 0 the
check sends the eval's own prompts, whose greedy answers the served target reproduces, so the two samples overlap and
the band is wider than their spread.

Exit codes: 0 every position of every split within its band; 1 a position outside (the sentence names the split
and the first such position); 2 the check cannot be made (no contract or no figures in it, server unreachable, no
speculative-decoding counters, another S served): one sentence says what to do.
"""

from __future__ import annotations

import json
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import NormalDist
from typing import Any

from deepspec.errors import DeepSpecError

FALSE_ALARM = 0.01  # the chance, over all positions of all splits together, that a matching draft is called a mismatch
REQUEST_TIMEOUT_S = 900.0
# plain softmax(z / T) sampling, sent explicitly (vLLM otherwise applies the target's generation_config defaults): the
# same settings the engine-backed eval sends (deepspec/eval/engine.py PLAIN_SAMPLING; a test keeps them equal)
PLAIN_SAMPLING = {"top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
                  "frequency_penalty": 0.0}


class UnusableInput(DeepSpecError):
    """The served check cannot be made; the message says what to do (exit 2)."""


# ------------------------------------------------------------------------------------------------------------ band


def band_z(comparisons: int, false_alarm: float = FALSE_ALARM) -> float:
    """Two-sided normal quantile with the false-alarm chance split evenly over `comparisons` (Bonferroni)."""
    return NormalDist().inv_cdf(1.0 - false_alarm / (2.0 * max(int(comparisons), 1)))


def half_width(contract_rate: float, contract_rounds: float, served_rounds: float, z: float) -> float:
    """z x the standard deviation of (served rate - contract rate) when both estimate one probability, from
    `served_rounds` and `contract_rounds` independent rounds; the probability is the contract's rate with one
    accepted and one rejected round added."""
    r, n = max(float(contract_rounds), 1.0), max(float(served_rounds), 1.0)
    p = (contract_rate * r + 1.0) / (r + 2.0)
    return z * math.sqrt(p * (1.0 - p) * (1.0 / n + 1.0 / r))


@dataclass
class PositionCheck:
    split: str
    position: int  # 1 = the first drafted token (vLLM's label position="0")
    contract: float
    served: float
    lo: float
    hi: float

    @property
    def ok(self) -> bool:
        return self.lo <= self.served <= self.hi

    @property
    def direction(self) -> str:
        return "ok" if self.ok else "drops" if self.served < self.lo else "rises"


def compare_split(name: str, contract_survival: list[float | None], contract_rounds: float, served_accepted_per_pos: list[float],
                  served_drafts: float, z: float) -> list[PositionCheck]:
    """Per position: the served rate, the contract's, and the band around the contract's (positions without a
    contract figure are left out)."""
    out = []
    for k, (c, acc) in enumerate(zip(contract_survival, served_accepted_per_pos), start=1):
        if c is None:
            continue
        served = acc / served_drafts if served_drafts else 0.0
        h = half_width(c, contract_rounds, served_drafts, z)
        out.append(PositionCheck(name, k, c, served, max(0.0, c - h), min(1.0, c + h)))
    return out


def first_outside(rows: list[PositionCheck]) -> PositionCheck | None:
    return next((r for r in rows if not r.ok), None)


# ---------------------------------------------------------------------------------------------------------- server


def server_root(url: str) -> str:
    """http://host:port from a URL given with or without /v1 (and a trailing slash)."""
    root = url.strip().rstrip("/")
    if root.endswith("/v1"):
        root = root[: -len("/v1")]
    if "://" not in root:
        root = "http://" + root
    return root


class Server:
    """The served endpoint: its model id, its spec-decode counters (settled), chats."""

    def __init__(self, url: str, timeout_s: float = REQUEST_TIMEOUT_S):
        import httpx

        self.root = server_root(url)
        self.http = httpx.Client(base_url=self.root, timeout=httpx.Timeout(timeout_s, connect=10.0))
        try:
            r = self.http.get("/v1/models")
            r.raise_for_status()
            self.model = r.json()["data"][0]["id"]
        except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
            raise UnusableInput(f"Nothing usable answers at {self.root}/v1/models ({type(e).__name__}: {e}); start the server "
                                "with the draft (README.md of the export has the command) or fix the URL.") from None

    def counters(self) -> dict[str, Any]:
        import httpx

        from deepspec.data.engines.server import parse_prometheus, spec_decode_counters

        try:
            r = self.http.get("/metrics")
            r.raise_for_status()
        except httpx.HTTPError as e:
            raise UnusableInput(f"{self.root}/metrics does not answer ({type(e).__name__}: {e}); the served check reads vLLM's "
                                "Prometheus counters there: start the server without disabling its metrics.") from None
        metrics = parse_prometheus(r.text)
        if not any(k.startswith("vllm:spec_decode_num_drafts") for k in metrics):
            sglang = any(k.startswith("sglang:") for k in metrics)
            raise UnusableInput(
                f"{self.root}/metrics has no vllm:spec_decode_* counters: "
                + ("this is an SGLang server, which reports only a mean acceptance length gauge, not per-position counters; "
                   "serve the export with vLLM for the served check." if sglang else
                   "it is not a vLLM server running a draft; start vLLM with --speculative-config naming this export."))
        return spec_decode_counters(metrics)

    def settled(self, settle_s: float = 1.0, settle_max_s: float = 30.0) -> dict[str, Any]:
        """Counters read until two reads agree (vLLM records a request's stats after it sends the answer)."""
        last = self.counters()
        deadline = time.monotonic() + settle_max_s
        while time.monotonic() < deadline:
            time.sleep(settle_s)
            now = self.counters()
            if now == last:
                return now
            last = now
        return last

    def conversation(self, prompt: dict[str, Any], contract: dict[str, Any]) -> tuple[int, int]:
        """Every turn of one stored prompt, each after the server's own answer; returns (requests answered, skipped)."""
        messages: list[dict] = [{"role": "system", "content": prompt["system"]}] if prompt.get("system") else []
        done = 0
        for turn in prompt["turns"]:
            messages.append({"role": "user", "content": turn})
            body = {"model": self.model, "messages": messages, "max_tokens": int(contract["answer_budget"]),
                    **PLAIN_SAMPLING, "temperature": float(contract.get("temperature") or 0.0),
                    "chat_template_kwargs": dict(contract.get("chat_template_kwargs") or {})}
            r = self.http.post("/v1/chat/completions", json=body)
            if r.status_code == 400:  # the prompt plus the answer budget do not fit the server's max_model_len
                return done, len(prompt["turns"]) - done
            if r.status_code != 200:
                raise UnusableInput(f"{self.root} answered {r.status_code} to a chat request ({r.text[:200]}); check that it "
                                    "serves the contract's target.")
            messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"] or ""})
            done += 1
        return done, 0


# ------------------------------------------------------------------------------------------------------------ check


@dataclass
class ServedReport:
    export: str
    server: str
    model: str
    contract: dict[str, Any]
    z: float
    requests: int = 0
    skipped: int = 0
    per_split: dict[str, dict[str, Any]] = field(default_factory=dict)
    rows: list[PositionCheck] = field(default_factory=list)

    @property
    def first(self) -> PositionCheck | None:
        return first_outside(self.rows)

    @property
    def matches(self) -> bool:
        return self.first is None

    def band_text(self) -> str:
        m = len(self.rows)
        return (f"band per position: the contract's rate ± z·√(p̃(1−p̃)(1/N + 1/R)), N served rounds, R contract rounds, "
                f"p̃ the contract's rate with one accepted and one rejected round added; z = {self.z:.2f} keeps the chance "
                f"of calling a matching draft a mismatch at {100 * FALSE_ALARM:g}% over all {m} positions compared")

    def verdict(self) -> str:
        c = self.contract
        setting = f"{c['protocol']}, S = {c['num_speculative_tokens']}, answers up to {c['answer_budget']} tokens"
        n = sum(int(v["drafts"]) for v in self.per_split.values())
        if self.matches:
            return (f"The served draft matches its contract: at every position of every split ({len(self.rows)} in all, "
                    f"{n} served rounds) the server's acceptance lies within the band ({setting}).")
        f = self.first
        sp = self.per_split[f.split]
        cause = ("the server accepts fewer of the draft's tokens than it was measured at: a tap, norm or vocabulary map "
                 "that differs in the served export (`deepspec check EXPORT` finds it), or another serving setup than the "
                 "contract's" if f.direction == "drops" else
                 "the server accepts more drafts than the contract: it serves another draft or another setup")
        return (f"The served draft does NOT match its contract: on split '{f.split}' position {f.position} first {f.direction} "
                f"(served {f.served:.3f} over {int(sp['drafts'])} rounds, contract {f.contract:.3f} over {sp['contract_rounds']} "
                f"rounds, band {f.lo:.3f}–{f.hi:.3f}; {setting}): {cause}.")

    def notes(self) -> list[str]:
        c, out = self.contract, []
        if not c.get("aligned", True):
            out.append(f"the contract's figures come from rounds of {c.get('eval_num_draft_tokens')} drafts, the server drafts "
                       f"{c['num_speculative_tokens']}: the rounds differ, so the comparison is approximate (evaluate with "
                       f"eval.num_draft_tokens = {c['num_speculative_tokens']} and export again for a like-for-like contract)")
        if float(c.get("temperature") or 0.0) > 0:
            out.append(f"T = {c.get('temperature')}: the server is assumed to draft with draft_sample_method = "
                       f"{c.get('draft_sample_method')} (vLLM's default is greedy); both sides are samples")
        if self.skipped:
            out.append(f"{self.skipped} request(s) did not fit the server's max_model_len and were skipped")
        out.append("the server's counters count every client's requests: run the check while nothing else uses the server")
        return out

    def table(self) -> str:
        c = self.contract
        lines = [f"deepspec check {self.export} --served {self.server}",
                 f"contract: {c['algorithm']} draft for {c.get('target')}; {c['protocol']}, S = {c['num_speculative_tokens']}, "
                 f"answers up to {c['answer_budget']} tokens, chat template {json.dumps(c.get('chat_template_kwargs') or {})} "
                 f"(thinking: {c.get('thinking')})",
                 f"sent {self.requests} request(s) of {len(c.get('prompts') or [])} stored prompt(s) to model '{self.model}'",
                 self.band_text(), "",
                 f"{'split':<24} {'position':>8} {'contract':>9} {'served':>8} {'band':>13}  verdict"]
        for r in self.rows:
            lines.append(f"{r.split:<24} {r.position:>8} {r.contract:>9.3f} {r.served:>8.3f} {r.lo:>6.3f}–{r.hi:<6.3f}  {r.direction}")
        lines += [""] + [f"note: {n}" for n in self.notes()] + ["", self.verdict()]
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {"export": self.export, "server": self.server, "model": self.model, "matches": self.matches, "z": self.z,
                "false_alarm": FALSE_ALARM, "requests": self.requests, "skipped": self.skipped, "per_split": self.per_split,
                "positions": [asdict(r) | {"ok": r.ok, "direction": r.direction} for r in self.rows],
                "first_outside": asdict(self.first) if self.first else None, "verdict": self.verdict(), "notes": self.notes()}


def usable_contract(export: str | Path) -> dict[str, Any]:
    """The export's contract with figures and prompts; UnusableInput (with what to do) otherwise."""
    from deepspec.export.contract import CONTRACT_FILE, read_contract

    export = Path(export)
    if not (export / "config.json").is_file():
        raise UnusableInput(f"{export} is not an export folder (no config.json); pass the folder `deepspec export` wrote.")
    c = read_contract(export)
    if c is None:
        raise UnusableInput(f"{export} has no {CONTRACT_FILE} (exports before the served contract have none): export the "
                            "checkpoint again with `deepspec export CKPT` after its eval.")
    if not c.get("measured"):
        raise UnusableInput(f"{export}/{CONTRACT_FILE} holds no measured acceptance ({c.get('why')}).")
    if not c.get("prompts"):
        raise UnusableInput(f"{export}/{CONTRACT_FILE} stores no prompts to send ({c.get('prompts_sampling')}); export again "
                            "where the eval's prompt files are readable.")
    return c


def check_served(export: str | Path, url: str, concurrency: int = 8) -> ServedReport:
    """Send the contract's prompts to the server at `url`, split by split, and compare per-position acceptance."""
    from deepspec.data.engines.server import counters_delta

    contract = usable_contract(export)
    s = int(contract["num_speculative_tokens"])
    server = Server(url)
    before = server.settled()
    served_s = len(before["accepted_per_pos"])
    if served_s != s:
        raise UnusableInput(f"The server at {server.root} drafts {served_s} tokens per round but the contract was measured at "
                            f"S = {s}: restart it with \"num_speculative_tokens\": {s} in --speculative-config.")
    by_split: dict[str, list[dict]] = {}
    for p in contract["prompts"]:
        if p["split"] in contract["splits"]:
            by_split.setdefault(p["split"], []).append(p)
    if not by_split:
        raise UnusableInput(f"{export}'s contract stores no prompt of a measured split; export the checkpoint again after its eval.")
    m = sum(len([v for v in contract["splits"][name]["survival"][:s] if v is not None]) for name in by_split)
    report = ServedReport(str(export), server.root, server.model, contract, band_z(m))
    for name, prompts in by_split.items():
        with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
            results = list(pool.map(lambda p: server.conversation(p, contract), prompts))
        after = server.settled()
        delta = counters_delta(before, after)
        before = after
        report.requests += sum(d for d, _ in results)
        report.skipped += sum(k for _, k in results)
        sp = contract["splits"][name]
        report.per_split[name] = {"prompts": len(prompts), "drafts": delta["drafts"], "accepted_per_pos": delta["accepted_per_pos"],
                                  "mean_acceptance_length": delta["mean_acceptance_length"], "contract_rounds": sp["rounds"],
                                  "contract_tau_at_S": sp.get("tau_at_S")}
        if delta["drafts"] <= 0:
            raise UnusableInput(f"The server drafted nothing for split '{name}' ({len(prompts)} prompt(s), "
                                f"{sum(d for d, _ in results)} answered): check that it runs with this export as its draft "
                                "and that its answers are longer than one token.")
        report.rows += compare_split(name, sp["survival"][:s], sp["rounds"], delta["accepted_per_pos"][:s], delta["drafts"], report.z)
    return report


def main(args) -> int:
    try:
        report = check_served(args.export, args.served, concurrency=getattr(args, "served_concurrency", 8))
    except UnusableInput as e:
        if getattr(args, "json", False):
            print(json.dumps({"export": str(args.export), "server": args.served, "usable": False, "why": str(e)}, indent=2))
        else:
            print(f"deepspec check --served: {e}")
        return 2
    print(json.dumps(report.to_json(), indent=2) if getattr(args, "json", False) else report.table())
    return 0 if report.matches else 1
