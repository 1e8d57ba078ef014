#!/usr/bin/env python
"""Served as trained at T > 0: vLLM's acceptance against ours under the same protocol, on enough prompts to resolve a
few percent. Prints one JSON object.

    flock /tmp/deepspec-heavy.lock python benchmarks/bench_served_t1.py CKPT \
        [--prompts outputs/quickstart-blend/data/conversations.jsonl] [--max-samples 120] [--max-tokens 96] \
        [--spec-tokens 3] [--temperature 1.0] [--method greedy]

One `deepspec eval CKPT --engine vllm`: our evaluator decodes each prompt drafting S tokens per round, then vLLM's CPU
build serves the export with S speculative tokens on the same prompts, both at the same temperature with the same
draft-sampling protocol (`greedy`: vLLM's default, argmax drafts accepted iff u < p_target(x)). At T > 0 the two are
independent samples, so the figure to quote is the relative difference of the mean acceptance lengths with its
uncertainty: ours is bootstrapped over prompts (answers are the clusters), and vLLM's, whose counters come pooled,
is taken to spread as much, so the difference's standard error is sqrt(2) x ours.

    python benchmarks/bench_served_t1.py CKPT --repeats 20 [--ours-repeats 1] [--max-tokens 96] [--temperature 1.0]

The spread at a test's scale: the same comparison on the checkpoint's own eval prompts (its recipe's eval.tasks /
max_samples, as tests/test_conformance_vllm.py evaluates it), vLLM repeated R times against one server on the export
(its CPU build takes no per-request seed, so each repeat is a fresh sample), ours K times with seeds 0..K-1. Prints
every run's depth-1 survival and the standard deviation of its logarithm: the band a served-vs-ours check at that
scale can hold without failing by chance.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def bootstrap_tau(samples: list[dict], draws: int = 2000, seed: int = 0) -> float:
    """Standard error of the pooled tau (accepted-plus-bonus tokens / rounds) over prompts drawn with replacement."""
    pairs = [(sum(t["new_tokens"] for t in s["turns"]), sum(t["rounds"] for t in s["turns"])) for s in samples]
    pairs = [p for p in pairs if p[1] > 0]
    rng = random.Random(seed)
    taus = []
    for _ in range(draws):
        pick = [pairs[rng.randrange(len(pairs))] for _ in pairs]
        taus.append(sum(a for a, _ in pick) / sum(b for _, b in pick))
    return statistics.pstdev(taus)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("checkpoint")
    p.add_argument("--prompts", default=str(ROOT / "outputs" / "quickstart-blend" / "data" / "conversations.jsonl"))
    p.add_argument("--max-samples", type=int, default=120)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--spec-tokens", type=int, default=3)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--method", default="greedy", choices=["greedy", "probabilistic"])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=0, help="> 0: the spread over this many vLLM repeats on the checkpoint's own eval prompts")
    p.add_argument("--ours-repeats", type=int, default=1, help="with --repeats: our evaluator's runs (seeds 0..)")
    p.add_argument("--ours-results", nargs="*", default=[],
                   help="with --repeats: results.json of our evaluator's earlier runs at the same settings, instead of running it")
    args = p.parse_args()
    if args.repeats > 0:
        print(json.dumps(spread(args), indent=1))
        return 0
    if not (Path(args.checkpoint) / "model.safetensors").is_file() or not Path(args.prompts).is_file():
        print(json.dumps({"error": "pass a draft checkpoint (step_N folder) and an existing prompts JSONL"}))
        return 2
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WANDB_MODE="offline", DEEPSPEC_NO_PROGRESS="1")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "eval"
        cmd = [str(ROOT / ".venv/bin/deepspec"), "eval", args.checkpoint, "--tasks", args.prompts, "--max-samples", str(args.max_samples),
               "--max-new-tokens", str(args.max_tokens), "--temperature", str(args.temperature), "--draft-sample-method", args.method,
               "--num-draft-tokens", str(args.spec_tokens), "--engine", "vllm", "--no-speedup", "--output-dir", str(out),
               "--opts", f"eval.engine_num_speculative_tokens={args.spec_tokens}", "eval.engine_speedup=false",
               f"eval.num_workers={args.workers}", "eval.task_max_samples={}"]
        run = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if run.returncode != 0:
            print(json.dumps({"error": f"deepspec eval failed (exit {run.returncode})", "stderr": run.stderr[-3000:]}))
            return 1
        results = json.loads((out / "results.json").read_text())
        samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines() if x.strip()]
    eng = results["engine"]["overall"]
    ours_tau, e_tau = eng["ours_tau_at_S"], eng["engine_tau"]
    se = bootstrap_tau(samples)
    rel = (e_tau - ours_tau) / ours_tau
    rel_se = 2 ** 0.5 * se / ours_tau
    print(json.dumps({
        "checkpoint": args.checkpoint, "prompts": args.prompts, "samples": len(samples), "max_tokens": args.max_tokens,
        "spec_tokens": args.spec_tokens, "temperature": args.temperature, "protocol": args.method,
        "engine_seeded": results["engine"].get("seeded"),
        "vllm_tau": e_tau, "ours_tau_at_S": ours_tau, "relative_diff": round(rel, 4),
        "relative_diff_95ci": [round(rel - 1.96 * rel_se, 4), round(rel + 1.96 * rel_se, 4)],
        "ours_tau_se": round(se, 4), "vllm_survival": eng.get("engine_survival"), "ours_survival": eng.get("ours_survival"),
        "rounds_ours": sum(t["rounds"] for s in samples for t in s["turns"]), "vllm_drafts": eng.get("engine_drafts"),
    }, indent=1))
    return 0


def spread(args) -> dict:
    """The spread of the depth-1 comparison at the scale of the checkpoint's own eval (what the conformance test runs
    once): our evaluator `--ours-repeats` times (seeds 0..), vLLM `--repeats` times on the same prompts against one
    server serving the export (its CPU build takes no seed: each repeat is a fresh sample). vLLM's repeats are cheap
    (seconds each) and ours cost minutes, so the spread of the ratio is taken as sqrt(2) x vLLM's (both sides sample the
    same protocol), and the measured ratios against each of our runs are listed beside it."""
    import time

    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WANDB_MODE="offline", DEEPSPEC_NO_PROGRESS="1")
    import math

    from deepspec.config import load_config
    from deepspec.eval.engine import VLLM_METHODS, engine_eval
    from deepspec.eval.runner import build_work, checkpoint_provenance, evaluate, resolve_target_name
    from deepspec.export.writers import export_draft
    from deepspec.data.engines.server import VLLMServer
    from deepspec.targets import resolve_target_path

    ckpt = Path(args.checkpoint)
    opts = [f"eval.temperature={args.temperature}", f"eval.draft_sample_method={args.method}", f"eval.max_new_tokens={args.max_tokens}",
            f"eval.num_draft_tokens={args.spec_tokens}", f"eval.engine_num_speculative_tokens={args.spec_tokens}"]
    cfg = load_config(str(ckpt / "config.yaml"), opts)
    meta = checkpoint_provenance(ckpt)
    target_name = resolve_target_name(cfg, meta)
    target = resolve_target_path(target_name)
    t0, ours, engine = time.monotonic(), [], []
    with tempfile.TemporaryDirectory() as tmp:
        runs = [json.loads(Path(f).read_text()) for f in args.ours_results] or [
            evaluate(load_config(str(ckpt / "config.yaml"), [*opts, "eval.engine=none", f"eval.seed={k}"]), ckpt,
                     output_dir=Path(tmp) / f"ours{k}") for k in range(args.ours_repeats)]
        for k, res in enumerate(runs):
            (cell,) = res["tasks"].values()
            ours.append({"seed": res["meta"]["seed"], "s1": cell["survival"][0], "tau_at_S": 1 + cell["expected_accepted"][args.spec_tokens - 1],
                         "rounds": res["overall"]["rounds"], "results": res})
            print(json.dumps({k2: v for k2, v in ours[-1].items() if k2 != "results"}), flush=True, file=sys.stderr)
        export = export_draft(ckpt, Path(tmp) / "export", "vllm", target=str(target))
        spec = {"method": VLLM_METHODS[meta["algorithm"]], "model": str(export), "num_speculative_tokens": args.spec_tokens,
                "draft_sample_method": args.method}
        with VLLMServer(target, speculative_config=spec, dtype=cfg.target.dtype, max_model_len=cfg.eval.engine_max_model_len,
                        log_path=Path(tmp) / "vllm.log") as server:
            ecfg = load_config(str(ckpt / "config.yaml"), [*opts, "eval.engine=vllm", f"eval.engine_url={server.url}"])
            items, _ = build_work(ecfg)
            for r in range(args.repeats):
                out = engine_eval(ecfg, ckpt, meta, target_name, items, ours[0]["results"], Path(tmp) / f"vllm{r}")
                (cell,) = out["tasks"].values()
                engine.append({"repeat": r, "s1": cell["engine_survival"][0], "tau": cell["engine_tau"], "drafts": cell["engine_drafts"]})
                print(json.dumps(engine[-1]), flush=True, file=sys.stderr)
    logs = [math.log(e["s1"]) for e in engine if e["s1"]]
    sd_log = statistics.stdev(logs) if len(logs) > 1 else None
    return {"checkpoint": str(ckpt), "prompts": list(cfg.eval.tasks), "samples": cfg.eval.max_samples, "max_tokens": args.max_tokens,
            "spec_tokens": args.spec_tokens, "temperature": args.temperature, "protocol": args.method,
            "ours": [{k: v for k, v in o.items() if k != "results"} for o in ours], "vllm": engine,
            "vllm_s1_range": [min(e["s1"] for e in engine), max(e["s1"] for e in engine)],
            "vllm_s1_sd_of_log": sd_log,
            "ratio_s1_sd_of_log": 2 ** 0.5 * sd_log if sd_log is not None else None,
            "ratios_s1_vs_each_ours": [[e["s1"] / o["s1"] for e in engine] for o in ours],
            "wall_s": round(time.monotonic() - t0)}


if __name__ == "__main__":
    raise SystemExit(main())
