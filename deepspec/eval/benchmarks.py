"""Evaluation benchmarks: `{"turns": [...]}` JSONL files, DeepSpec's prompt formats, sample caps.

Every row is one conversation; each turn is a user message (an optional "system" message comes
first). Multi-turn rows (MT-Bench) are asked turn by turn, each later turn after the model's own
previous answer. Besides the nine benchmarks, a task can be the recipe's held-out split (`heldout`,
`heldout:<name>`) or the user's own JSONL / JSON file, named after its stem.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from deepspec.errors import DataError
from deepspec.log import get_logger

log = get_logger(__name__)

# name -> DeepSpec's default number of samples (files with more rows are shuffled with the seed, then cut)
DEFAULT_CAPS: dict[str, int] = {
    "gsm8k": 500, "math500": 500, "aime25": 30, "humaneval": 164, "mbpp": 256, "livecodebench": 500,
    "mt-bench": 80, "alpaca": 500, "arena-hard-v2": 500,
}
ALL_TASKS = list(DEFAULT_CAPS)
DOMAINS = {
    "gsm8k": "math", "math500": "math", "aime25": "math", "humaneval": "code", "mbpp": "code",
    "livecodebench": "code", "mt-bench": "chat", "alpaca": "chat", "arena-hard-v2": "chat",
}

MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL_TEMPLATE = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{prompt}\n```"


def format_math(problem: str) -> str:
    return problem.strip() + MATH_SUFFIX


def format_humaneval(prompt: str) -> str:
    return HUMANEVAL_TEMPLATE.format(prompt=prompt.strip())


def format_alpaca(instruction: str, inp: str = "") -> str:
    return instruction + ("\n\nInput:\n" + inp if inp and inp.strip() else "")


def format_mbpp(text: str, tests: list[str]) -> str:
    return text.strip() + "\nYour code should pass these tests:\n\n" + "\n".join(tests)


def format_livecodebench(question: str, starter_code: str = "") -> str:
    body = f"### Question:\n{question.strip()}\n\n"
    if starter_code and starter_code.strip():
        body += f"### Format: Use the following starter code and write the complete solution.\n```python\n{starter_code.rstrip()}\n```\n\n"
    else:
        body += "### Format: Read the inputs from stdin, solve the problem and write the answer to stdout.\n```python\n# YOUR CODE HERE\n```\n\n"
    return "You are an expert Python programmer. Solve the problem below with a correct program that passes all tests.\n\n" + body + "### Answer: (use the provided format with backticks)\n"


@dataclass
class Benchmark:
    name: str
    path: Path
    samples: list[dict]  # each {"turns": [str, ...], ...}
    total_rows: int


def resolve_datasets_dir(datasets_dir: str | Path) -> Path:
    """A relative `eval.datasets_dir` is looked up in the working directory, then in the repository."""
    p = Path(datasets_dir).expanduser()
    if p.is_absolute() or p.is_dir():
        return p
    repo = Path(__file__).resolve().parents[2] / p
    return repo if repo.is_dir() else p


def _json_lines(path: Path, bad_json: Callable[[int, ValueError], str]) -> Iterator[tuple[int, object]]:
    """(1-based line number, parsed value) of every non-blank line of a prompt file; a line that is not JSON is a
    DataError worded by bad_json(line number, error). Unlike deepspec.data.jsonl.iter_lines (our own files, torn
    tails skipped) a last line without a newline is read: these are the user's files."""
    with open(path, encoding="utf-8") as fh:
        for i, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise DataError(bad_json(i, e)) from None
            yield i, row


def read_turns_jsonl(path: Path) -> list[dict]:
    """Read and validate a benchmark file; a bad row is a DataError naming the file and line."""
    rows = []
    for i, row in _json_lines(path, lambda i, e: f"{path}:{i} is not valid JSON ({e}); rebuild it with `python eval_datasets/build.py`."):
        turns = row.get("turns") if isinstance(row, dict) else None
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
            raise DataError(f"{path}:{i} needs a non-empty list of strings under 'turns'; fix or rebuild the file.")
        rows.append(row)
    return rows


def load_benchmark(name: str, datasets_dir: str | Path, max_samples: int | None = None, seed: int = 0) -> Benchmark | None:
    """Load one benchmark, or None (with a warning) when its file was not built."""
    d = resolve_datasets_dir(datasets_dir)
    path = d / f"{name}.jsonl"
    if not path.is_file():
        log.warning(
            "benchmark %s skipped: %s does not exist (it is built only when the Hugging Face hub is reachable: "
            "run `python eval_datasets/build.py --online`).", name, path,
        )
        return None
    rows = read_turns_jsonl(path)
    total = len(rows)
    cap = max_samples if max_samples is not None else DEFAULT_CAPS.get(name)
    if cap is not None and len(rows) > cap:
        rows = list(rows)
        random.Random(seed).shuffle(rows)
        rows = rows[:cap]
    return Benchmark(name, path, rows, total_rows=total)


HELDOUT_TASK = "heldout"
HELDOUT_PREFIX = "heldout:"  # heldout:<name> = a held-out split of data.prompts.sources (heldout.<name>.jsonl)
CUSTOM_SUFFIXES = (".jsonl", ".json")


def is_custom_task(task: str) -> bool:
    """A task given as a path to the user's own prompt file (named after the file stem)."""
    return task.lower().endswith(CUSTOM_SUFFIXES) or "/" in task


def custom_task_name(task: str) -> str:
    return Path(task).name.split(".")[0]


def _custom_row(row, where: str) -> dict:
    """A custom-task row as {"turns", "id"[, "system"]}."""
    turns = _row_turns(row, where)
    out = {"turns": turns, "id": str(row.get("id", where.rsplit(":", 1)[-1].rsplit("#", 1)[-1]))}
    system = row.get("system")
    msgs = next((row[k] for k in ("conversations", "messages") if k in row), None) if "turns" not in row else None
    if system is None and msgs:
        system = next((m.get("content", m.get("value")) for m in msgs if str(m.get("role", m.get("from"))).lower() == "system"), None)
    if system is not None:
        if not isinstance(system, str):
            raise DataError(f"{where}: 'system' must be a string.")
        out["system"] = system
    return out


def _row_turns(row, where: str) -> list[str]:
    """User turns of one custom-task row: {"turns": [...]}, {"conversations"|"messages": [...]}, {"prompt": ...}."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}; "
                        'write {"turns": [...]}, {"conversations": [{"role", "content"}, ...]} or {"prompt": "..."}.')
    if "turns" in row:
        turns = row["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise DataError(f"{where}: 'turns' must be a non-empty list of non-empty strings.")
        return list(turns)
    msgs = next((row[k] for k in ("conversations", "messages") if k in row), None)
    if msgs is not None:
        if not isinstance(msgs, list) or not msgs:
            raise DataError(f"{where}: 'conversations' must be a non-empty list of {{\"role\", \"content\"}} messages.")
        turns = []
        for j, m in enumerate(msgs):
            role = m.get("role", m.get("from")) if isinstance(m, dict) else None
            content = m.get("content", m.get("value")) if isinstance(m, dict) else None
            if role is None or not isinstance(content, str):
                raise DataError(f"{where}: message {j} needs a 'role' and a string 'content'.")
            if str(role).lower() in ("user", "human"):
                if not content.strip():
                    raise DataError(f"{where}: message {j} (user) has empty content.")
                turns.append(content)
        if not turns:
            raise DataError(f"{where}: the conversation has no user message.")
        return turns
    if "prompt" in row:
        if not isinstance(row["prompt"], str) or not row["prompt"].strip():
            raise DataError(f"{where}: 'prompt' must be a non-empty string.")
        return [row["prompt"]]
    raise DataError(f"{where}: no prompt found; give 'turns', 'conversations' (or 'messages') or 'prompt' (keys: {sorted(row)[:8]}).")


def load_custom_task(path: str | Path, max_samples: int | None = None, seed: int = 0) -> Benchmark:
    """The user's own prompts (JSONL, or a JSON list) as a benchmark named after the file stem.

    Each row's user turns are asked in order after the model's own answers, as for MT-Bench; a
    malformed file is a DataError naming the line (or list index) and what is wrong.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise DataError(f"Custom eval task {path} does not exist; eval.tasks takes a benchmark name or a path to a .jsonl / .json file.")
    rows: list[dict] = []
    if path.name.lower().endswith(".json"):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as e:
            raise DataError(f"{path}:{getattr(e, 'lineno', '?')}: invalid JSON ({getattr(e, 'msg', e)}); "
                            "a .json task is a list of rows (or write JSONL, one row per line).") from None
        if isinstance(data, dict):
            data = next((data[k] for k in ("data", "rows", "prompts") if isinstance(data.get(k), list)), None)
        if not isinstance(data, list):
            raise DataError(f"{path}: a .json task must hold a list of rows (or {{\"data\": [...]}}).")
        for i, row in enumerate(data):
            rows.append(_custom_row(row, f"{path}#{i}"))
    else:
        bad = lambda i, e: f"{path}:{i}: invalid JSON ({getattr(e, 'msg', e)} at column {getattr(e, 'colno', '?')})."  # noqa: E731
        for i, row in _json_lines(path, bad):
            rows.append(_custom_row(row, f"{path}:{i}"))
    if not rows:
        raise DataError(f"{path} holds no prompts; add one row per line.")
    total = len(rows)
    if max_samples is not None and len(rows) > max_samples:
        random.Random(seed).shuffle(rows)
        rows = rows[:max_samples]
    return Benchmark(custom_task_name(str(path)), path, rows, total_rows=total)


def load_heldout(path: str | Path, max_samples: int | None = None, seed: int = 0, name: str = HELDOUT_TASK) -> Benchmark | None:
    """The recipe's own held-out prompts (never trained on) as a benchmark: each conversation's
    user turns, asked in order after the model's own answers, under its system message (a tool-use
    prompt's tools live there). `name`: heldout or heldout:<split>."""
    path = Path(path)
    if not path.is_file():
        log.warning("benchmark %s skipped: %s does not exist (run `deepspec data prompts` first).", name, path)
        return None
    rows = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                rec = json.loads(line)
                conv = rec.get("conversations", [])
                turns = [m["content"] for m in conv if m.get("role") == "user" and m.get("content")]
                system = [m["content"] for m in conv if m.get("role") == "system" and m.get("content")]
                if turns:
                    rows.append({"turns": turns, "id": rec.get("id"), **({"system": system[0]} if system else {})})
    total = len(rows)
    if max_samples is not None and len(rows) > max_samples:
        random.Random(seed).shuffle(rows)
        rows = rows[:max_samples]
    return Benchmark(name, path, rows, total_rows=total)
