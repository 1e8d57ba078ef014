"""Evaluation benchmarks: `{"turns": [...]}` JSONL files, DeepSpec's prompt formats, sample caps.

Every row is one conversation; each turn is a user message. Multi-turn rows (MT-Bench) are asked
turn by turn, each later turn after the model's own previous answer.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

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


def read_turns_jsonl(path: Path) -> list[dict]:
    """Read and validate a benchmark file; a bad row is a DataError naming the file and line."""
    rows = []
    with open(path, encoding="utf-8") as fh:
        for i, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise DataError(f"{path}:{i} is not valid JSON ({e}); rebuild it with `python eval_datasets/build.py`.") from None
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


def load_heldout(path: str | Path, max_samples: int | None = None, seed: int = 0) -> Benchmark | None:
    """The recipe's own held-out prompts (same pool as training, never trained on) as a benchmark:
    each conversation's user turns, asked in order after the model's own answers."""
    path = Path(path)
    if not path.is_file():
        log.warning("benchmark heldout skipped: %s does not exist (run `deepspec data prompts` first).", path)
        return None
    rows = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                rec = json.loads(line)
                turns = [m["content"] for m in rec.get("conversations", []) if m.get("role") == "user" and m.get("content")]
                if turns:
                    rows.append({"turns": turns, "id": rec.get("id")})
    total = len(rows)
    if max_samples is not None and len(rows) > max_samples:
        random.Random(seed).shuffle(rows)
        rows = rows[:max_samples]
    return Benchmark(HELDOUT_TASK, path, rows, total_rows=total)
