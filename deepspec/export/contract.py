"""The served-acceptance contract an export carries (`served_contract.json` beside the weights): what the draft was
measured at, so that a server running it can be checked against those figures (`deepspec check EXPORT --served URL`,
export/served.py).

It holds, from the eval's results.json (deepspec/results.py finds it): per split, the per-position acceptance at the
S speculative tokens the export is served with (prefix survival s_k = P(at least k drafts accepted), which is what
vLLM counts per position, with the conditional α_k beside it) and the rounds it was measured over; the protocol
(greedy / temperature and draft sampling method), S, the eval's own draft tokens per round, the answer budget and the
chat-template mode (thinking on / off where the template has one); for DSpark the confidence calibration baked into
the weights, if any; and a deterministic sample of the eval's own prompts (the first `prompts_per_split` of each
split in the order the eval sampled them, eval.seed) for the check to send. Without eval results the contract says
so (`measured: false`) and holds no figure.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from deepspec.errors import ConfigError
from deepspec.results import find_eval_results, results_protocol

CONTRACT_FILE = "served_contract.json"
CONTRACT_FORMAT = "deepspec-served-contract"
CONTRACT_VERSION = 1
PROMPTS_PER_SPLIT = 16
NOT_MEASURED_WHY = ("no eval results.json for this checkpoint: run `deepspec eval CKPT` (at the S the export is served "
                    "with, eval.num_draft_tokens = S) and export again, or pass --eval-results")


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not (isinstance(x, float) and math.isnan(x)) else None


def _thinking(kwargs: dict[str, Any]) -> str:
    """'on' / 'off' when the chat-template kwargs set thinking, else the template's default."""
    for key in ("enable_thinking", "thinking"):
        if key in kwargs:
            return "on" if kwargs[key] else "off"
    return "template default (not set)"


def _results_dir(checkpoint: Path, explicit: str | Path | None) -> Path | None:
    """The folder of the results.json that find_eval_results reads (same order: explicit first)."""
    for cand in ([Path(explicit)] if explicit else []) + [Path(checkpoint) / "eval" / "results.json"]:
        if cand.is_file():
            return cand.parent
    return None


def _prompt_rows(path: Path) -> list[dict]:
    """The rows of an eval prompt file in file order, as {"turns", "id", "system"}: benchmark rows ({"turns": [...]}),
    held-out splits and custom files (any record shape deepspec.data.sources.normalize reads: conversations / messages
    / prompt / instruction). A held-out record without a user turn is left out, as the eval leaves it out."""
    from deepspec.data.sources import InvalidRecord, normalize

    text = path.read_text(encoding="utf-8")
    if path.name.lower().endswith(".json"):
        records = json.loads(text)
        if isinstance(records, dict):
            records = next((records[k] for k in ("data", "rows", "prompts") if isinstance(records.get(k), list)), [])
        numbered = list(enumerate(records))
    else:  # a row without an id is known by its 1-based line number, as the eval names a custom task's rows
        numbered = [(i, json.loads(line)) for i, line in enumerate(text.splitlines(), 1) if line.strip()]
    rows = []
    for where, rec in numbered:
        rid = str(rec["id"]) if isinstance(rec, dict) and rec.get("id") is not None else str(where)
        if isinstance(rec, dict) and isinstance(rec.get("turns"), list):
            rows.append({"turns": list(rec["turns"]), "id": rid, "system": rec.get("system")})
            continue
        try:
            _, conv, _ = normalize(rec)
        except InvalidRecord:
            continue
        turns = [m["content"] for m in conv if m["role"] == "user"]
        system = next((m["content"] for m in conv if m["role"] == "system"), None)
        rows.append({"turns": turns, "id": rid, "system": system})
    return rows


def _sampled_ids(results_dir: Path | None) -> dict[tuple[str, int], Any]:
    """(split, index) -> the row id the eval recorded in samples.jsonl, where it recorded one."""
    path = results_dir / "samples.jsonl" if results_dir else None
    out: dict[tuple[str, int], Any] = {}
    if path is None or not path.is_file():
        return out
    for line in path.read_text(encoding="utf-8").splitlines():
        rec = json.loads(line) if line.strip() else {}
        if "thinking" not in rec and rec.get("id") is not None and "task" in rec:
            out[(rec["task"], int(rec["index"]))] = rec["id"]
    return out


def eval_prompts(results: dict[str, Any], results_dir: Path | None, per_split: int) -> tuple[list[dict] | None, str | None]:
    """The first `per_split` prompts of each split in the order the eval decoded them: (prompts, None), or (None, why).

    Each split's prompt file and its row count are in results.json (`file`, `rows_in_file`, `samples`); the eval
    decoded every row in file order, or, when the file held more rows than it sampled, the rows shuffled with
    eval.seed and cut to that many. The same rule is applied here to the same file; the ids the eval recorded
    (samples.jsonl) must agree, so a file changed since the eval stores no prompts rather than other ones."""
    import random

    seed = int((results.get("meta") or {}).get("seed") or 0)
    recorded = _sampled_ids(results_dir)
    out: list[dict] = []
    for name, t in (results.get("tasks") or {}).items():
        if not isinstance(t, dict) or "skipped" in t or not t.get("survival"):
            continue
        path = Path(str(t.get("file") or ""))
        if not t.get("file") or not path.is_file():
            return None, f"split '{name}''s prompt file {t.get('file')} is not readable here"
        try:
            rows = _prompt_rows(path)
        except (OSError, ValueError) as e:
            return None, f"split '{name}''s prompt file {path} could not be read ({e})"
        total, n = t.get("rows_in_file"), int(t.get("samples") or 0)
        if total is not None and len(rows) != int(total):
            return None, f"{path} holds {len(rows)} prompts but held {total} when the eval read it"
        if len(rows) > n:
            random.Random(seed).shuffle(rows)
            rows = rows[:n]
        for i, row in enumerate(rows[:per_split]):
            want = recorded.get((name, i))
            if want is not None and str(want) != row["id"]:
                return None, f"{path} has changed since the eval (row {i} is id {row['id']}, the eval decoded id {want})"
            out.append({"split": name, "index": i, "id": row["id"], "system": row["system"], "turns": row["turns"]})
    return out, None


def _split_figures(t: dict[str, Any], s: int) -> dict[str, Any]:
    surv = [_num(x) for x in (t.get("survival") or [])][:s]
    acc = [_num(x) for x in (t.get("acc_cond") or [])][:s]
    ea = t.get("expected_accepted") or []
    return {"samples": t.get("samples"), "rounds": t.get("rounds"), "survival": surv, "acc_cond": acc,
            "tau_at_S": 1 + ea[s - 1] if len(ea) >= s and _num(ea[s - 1]) is not None else None}


def build_contract(cfg: dict[str, Any], checkpoint: str | Path, eval_results: str | Path | None = None,
                   prompts_per_split: int = PROMPTS_PER_SPLIT) -> dict[str, Any]:
    """The contract of an export whose config.json is `cfg` (its `deepspec` block written), from the checkpoint's
    eval results (explicit path first, then `<checkpoint>/eval/results.json`)."""
    if prompts_per_split < 1:
        raise ConfigError(f"--contract-prompts {prompts_per_split}: the contract needs at least 1 prompt per split for the served check.")
    ds = cfg["deepspec"]
    s = int(ds["num_speculative_tokens"])
    calib = ds.get("confidence_calibration")
    out: dict[str, Any] = {
        "format": CONTRACT_FORMAT, "version": CONTRACT_VERSION, "algorithm": ds["algorithm"], "export_format": ds["format"],
        "target": (ds.get("provenance") or {}).get("target"), "num_speculative_tokens": s,
        "calibration": dict(calib["baked"]) if calib else None,
    }
    results = find_eval_results(Path(checkpoint), eval_results)
    if not results:
        return {**out, "measured": False, "why": NOT_MEASURED_WHY}
    meta = results.get("meta") or {}
    rdir = _results_dir(Path(checkpoint), eval_results)
    kwargs = dict((meta.get("serving_mode") or {}).get("chat_template_kwargs") or {})
    splits = {name: _split_figures(t, s) for name, t in (results.get("tasks") or {}).items()
              if isinstance(t, dict) and "skipped" not in t and t.get("survival")}
    prompts, why = eval_prompts(results, rdir, prompts_per_split)
    eval_s = meta.get("num_draft_tokens")
    out.update({
        "measured": bool(splits),
        **({} if splits else {"why": "the eval's results.json holds no split with per-position figures"}),
        "source": {"results": str(rdir / "results.json") if rdir else None, "checkpoint": meta.get("checkpoint")},
        "protocol": results_protocol(meta), "temperature": meta.get("temperature"),
        "draft_sample_method": meta.get("draft_sample_method"),
        "eval_num_draft_tokens": eval_s,
        # the eval's rounds drafted exactly the served S: both sides count the same kind of round
        "aligned": eval_s == s,
        "answer_budget": meta.get("max_new_tokens"),
        "chat_template_kwargs": kwargs, "thinking": _thinking(kwargs),
        "splits": splits,
        "prompts": prompts,
        "prompts_sampling": (f"the first {prompts_per_split} prompts of each split in the eval's sampled order "
                             f"(eval.seed {meta.get('seed')})") if prompts is not None else why,
    })
    return out


def write_contract(folder: Path, contract: dict[str, Any]) -> Path:
    path = Path(folder) / CONTRACT_FILE
    path.write_text(json.dumps(contract, indent=2, ensure_ascii=False) + "\n")
    return path


def read_contract(folder: str | Path) -> dict[str, Any] | None:
    """The export's contract, or None when it has none (an export written before contracts, or a plain folder)."""
    path = Path(folder) / CONTRACT_FILE
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    if data.get("format") != CONTRACT_FORMAT:
        return None
    return data


def _f(x: Any) -> str:
    return f"{x:.3f}" if isinstance(x, (int, float)) else "–"


def contract_card(contract: dict[str, Any]) -> str:
    """The model card's section on the contract: a short table of per-position acceptance per split."""
    s = contract["num_speculative_tokens"]
    lines = ["", "## Served-acceptance contract", ""]
    if not contract.get("measured"):
        return "\n".join(lines + [f"`{CONTRACT_FILE}` holds no figures: {contract.get('why')}.", ""])
    calib = contract.get("calibration")
    lines += [
        f"`{CONTRACT_FILE}` records what this draft was measured at, so a server running it can be checked with "
        f"`deepspec check DRAFT_DIR --served URL`: {contract['protocol']}, S = {s} speculative tokens "
        f"(the eval drafted {contract.get('eval_num_draft_tokens')} per round), answers up to {contract.get('answer_budget')} "
        f"tokens, chat template {json.dumps(contract.get('chat_template_kwargs') or {})} (thinking: {contract.get('thinking')})"
        + (f", confidence calibration a = {calib['a']:.4f}, b = {calib['b']:+.4f} baked at T = {calib['temperature']:g}" if calib else "")
        + f"; {len(contract.get('prompts') or [])} of the eval's prompts are stored for the check. Position k is the "
        "share of rounds with at least k drafts accepted (what vLLM counts per position).", "",
        "| split | rounds | " + " | ".join(f"position {k}" for k in range(1, s + 1)) + " | τ@S |",
        "|---" * (s + 3) + "|",
    ]
    for name, sp in contract["splits"].items():
        surv = list(sp.get("survival") or []) + [None] * s
        lines.append(f"| {name} | {sp.get('rounds')} | " + " | ".join(_f(v) for v in surv[:s]) + f" | {_f(sp.get('tau_at_S'))} |")
    return "\n".join(lines + [""])
