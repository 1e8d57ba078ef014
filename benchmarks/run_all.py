"""Run every benchmark script and collect their JSON into benchmarks/results/<date>.json + .md.

Each bench_*.py prints one JSON object (the last one on its stdout, on one line or indented). Usage:
    python benchmarks/run_all.py [--only cache train] [--checkpoint CKPT] [--quickstart-summary PATH]
    python benchmarks/run_all.py --smoke [--only copy eval] [--jobs 2] [--out DIR/smoke.json]
--smoke runs every script's own --smoke (tiny shapes, seconds each) and writes the collected JSON into a temporary
folder (or --out), never into benchmarks/results/: a check that the scripts still run, not a measurement. Each script
runs in its own process, forked (on Linux) from this one after it imported torch and transformers once, which saves
every script seconds of start-up; --fresh starts each in a new interpreter instead.
The quickstart summary (outputs/quickstart-blend/summary.json, written by `deepspec run`) is folded in
when present, so one file carries tau per algorithm and benchmark as well.
"""

from __future__ import annotations

import argparse
import datetime as dt
import tempfile
from concurrent.futures import ThreadPoolExecutor
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import _forked

HERE = Path(__file__).resolve().parent
BENCHES = ["regenerate", "cache", "train", "eval"]
# every script's smoke: bench_<name>.py and its arguments (the GPU drivers bench_gpu.py and gpu_check.sh have their own)
SMOKES = {name: ["--smoke"] for name in [
    "audit_cost", "cache", "copy", "draft_vllm_agreement", "drafts", "eval", "launches", "loader", "loss_normalization", "peer", "plan",
    "regenerate", "replay", "served_length", "step_time", "stream", "train"]}
SMOKES["draft_memory"] = ["--recipe", "config/eagle3/qwen3-8b.yaml", "--smoke"]


def last_json(text: str):
    """The last JSON value that starts a line and runs to the end of the output (one line or indented)."""
    lines = text.rstrip().splitlines(keepends=True)
    decoder = json.JSONDecoder()
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].lstrip().startswith(("{", "[")):
            rest = "".join(lines[i:]).strip()
            try:
                value, end = decoder.raw_decode(rest)
            except json.JSONDecodeError:
                continue
            if not rest[end:].strip():
                return value
    return None


def run_bench(name: str, extra: list[str], env: dict | None = None) -> dict:
    script = HERE / f"bench_{name}.py"
    if not script.is_file():
        return {"error": f"{script.name} not found"}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(script), *extra], capture_output=True, text=True, cwd=HERE.parent, env=env)
    return bench_entry(name, proc.returncode, proc.stdout, proc.stderr, time.monotonic() - t0)


def bench_entry(name: str, returncode: int, stdout: str, stderr: str, seconds: float) -> dict:
    """What a script's run gives the collected file: its last JSON object, or why there is none."""
    result = last_json(stdout)
    if returncode != 0 or result is None:
        return {"error": f"exit {returncode}", "stderr_tail": stderr[-2000:]}
    return {"result": result, "seconds": round(seconds, 1)}


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
    ap.add_argument("--only", nargs="+", choices=sorted(set(BENCHES) | set(SMOKES)), default=None,
                    help=f"default: {' '.join(BENCHES)} (with --smoke: every script)")
    ap.add_argument("--smoke", action="store_true", help="run every script's --smoke; results go to a temporary folder")
    ap.add_argument("--jobs", type=int, default=1, help="smokes run at once (--smoke only)")
    ap.add_argument("--fresh", action="store_true",
                    help="--smoke: start each script in a fresh interpreter instead of forking it from one that "
                         "imported torch and transformers once (benchmarks/_forked.py)")
    ap.add_argument("--checkpoint", default=None,
                    help="draft checkpoint for bench_eval (default: the quickstart's checkpoints/quickstart-blend/eagle3/step_latest "
                         "when it exists, else an untrained draft, which measures only the decoding loop's overhead)")
    ap.add_argument("--quickstart-summary", default="outputs/quickstart-blend/summary.json")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("DEEPSPEC_NO_PROGRESS", "1")
    if args.smoke:
        return smoke(args, ap)
    args.only = args.only or BENCHES
    if unknown := [n for n in args.only if n not in BENCHES]:
        ap.error(f"{', '.join(unknown)} run only with --smoke here; run the script itself for a measurement")
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


def smoke(args, ap) -> int:
    """Every script's --smoke (`--jobs` at a time, one thread each), collected into one JSON file outside results/."""
    names = args.only or sorted(SMOKES)
    if unknown := [n for n in names if n not in SMOKES]:
        ap.error(f"no smoke for {', '.join(unknown)}")
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="deepspec_smoke_")) / "smoke.json"
    if out.resolve().is_relative_to((HERE / "results").resolve()):
        ap.error("smoke figures are checks of the code paths, not results: give --out outside benchmarks/results")
    data = {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "smoke": True,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}", "benchmarks": {}}
    t0 = time.monotonic()
    if not args.fresh and _forked.can_fork():
        os.environ["OMP_NUM_THREADS"] = env["OMP_NUM_THREADS"]  # before torch is imported: the children's pool size
        _forked.preload()
        scripts = {n: (HERE / f"bench_{n}.py", SMOKES[n]) for n in names}
        missing = {n: {"error": f"{s.name} not found"} for n, (s, _) in scripts.items() if not s.is_file()}
        done = {**missing, **_forked.run_forked({n: v for n, v in scripts.items() if n not in missing}, env, HERE.parent,
                                                 args.jobs, bench_entry)}
    else:
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            done = dict(zip(names, pool.map(lambda n: run_bench(n, SMOKES[n], env), names)))
    data["benchmarks"] = {n: done[n] for n in names}
    data["seconds"] = round(time.monotonic() - t0, 1)
    failed = sorted(n for n, e in done.items() if "error" in e)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(data))
    print(json.dumps({"results": str(out), "summary": str(out.with_suffix(".md")), "failed": failed}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
