"""Run every benchmark script and collect their JSON into benchmarks/results/<date>.json + .md.

Each bench_*.py prints one JSON object (its last stdout line that parses as JSON). Usage:
    python benchmarks/run_all.py [--only cache train] [--checkpoint CKPT] [--quickstart-summary PATH]
The quickstart summary (outputs/quickstart-blend/summary.json, written by `deepspec run`) is folded in
when present, so one file carries tau per algorithm and benchmark as well.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHES = ["regenerate", "cache", "train", "eval"]


def last_json(text: str):
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith(("{", "[")):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def run_bench(name: str, extra: list[str]) -> dict:
    script = HERE / f"bench_{name}.py"
    if not script.is_file():
        return {"error": f"{script.name} not found"}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(script), *extra], capture_output=True, text=True, cwd=HERE.parent)
    result = last_json(proc.stdout)
    if proc.returncode != 0 or result is None:
        return {"error": f"exit {proc.returncode}", "stderr_tail": proc.stderr[-2000:]}
    return {"result": result, "seconds": round(time.monotonic() - t0, 1)}


def markdown(data: dict) -> str:
    lines = [f"# deepspec benchmarks — {data['date']}", "", f"Machine: {data['machine']}", ""]
    for name, entry in data["benchmarks"].items():
        lines.append(f"## {name}")
        lines.append("")
        if "error" in entry:
            lines.append(f"failed: {entry['error']}")
        else:
            lines.append("```json")
            lines.append(json.dumps(entry["result"], indent=2))
            lines.append("```")
        lines.append("")
    if data.get("quickstart"):
        lines += ["## quickstart (deepspec run summary)", "", "```json", json.dumps(data["quickstart"], indent=2)[:6000], "```", ""]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="+", choices=BENCHES, default=BENCHES)
    ap.add_argument("--checkpoint", default=None,
                    help="draft checkpoint for bench_eval (default: the quickstart's checkpoints/quickstart-blend/eagle3/step_latest "
                         "when it exists, else an untrained draft, which measures only the decoding loop's overhead)")
    ap.add_argument("--quickstart-summary", default="outputs/quickstart-blend/summary.json")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("DEEPSPEC_NO_PROGRESS", "1")
    data = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}",
        "benchmarks": {},
    }
    out = Path(args.out) if args.out else HERE / "results" / f"{data['date'][:10]}.json"
    if out.is_file() and set(args.only) != set(BENCHES):
        # rerunning some benchmarks keeps the others' figures from the same day's file
        data["benchmarks"].update(json.loads(out.read_text()).get("benchmarks", {}))
    checkpoint = args.checkpoint
    default_ckpt = HERE.parent / "checkpoints" / "quickstart-blend" / "eagle3" / "step_latest"
    if checkpoint is None and default_ckpt.exists():
        checkpoint = str(default_ckpt)
    for name in args.only:
        extra = []
        if name == "eval":
            extra = [checkpoint] if checkpoint else ["--random-draft", "eagle3"]
        print(f"[run_all] bench_{name} ...", file=sys.stderr, flush=True)
        data["benchmarks"][name] = run_bench(name, extra)
        print(json.dumps(data["benchmarks"][name])[:500], file=sys.stderr, flush=True)
    qs = Path(args.quickstart_summary)
    if qs.is_file():
        data["quickstart"] = json.loads(qs.read_text())
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(data))
    print(json.dumps({"results": str(out), "summary": str(out.with_suffix(".md"))}))
    return 0 if all("error" not in e for e in data["benchmarks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
