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
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
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
    args = p.parse_args()
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
    """`args.repeats` evals of the checkpoint at T against one vLLM server serving its export (what the conformance
    test runs once), with each repeat's depth-1 ratio vLLM / ours and tau on both sides."""
    import time

    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WANDB_MODE="offline", DEEPSPEC_NO_PROGRESS="1")
    from deepspec.config import load_config
    from deepspec.eval.engine import VLLM_METHODS
    from deepspec.eval.runner import checkpoint_provenance, evaluate, resolve_target_name
    from deepspec.export.writers import export_draft
    from deepspec.data.engines.server import VLLMServer
    from deepspec.targets import resolve_target_path

    ckpt = Path(args.checkpoint)
    cfg = load_config(str(ckpt / "config.yaml"), [])
    meta = checkpoint_provenance(ckpt)
    target = resolve_target_path(resolve_target_name(cfg, meta))
    t0, rows = time.monotonic(), []
    with tempfile.TemporaryDirectory() as tmp:
        export = export_draft(ckpt, Path(tmp) / "export", "vllm", target=str(target))
        spec = {"method": VLLM_METHODS[meta["algorithm"]], "model": str(export), "num_speculative_tokens": args.spec_tokens,
                "draft_sample_method": args.method}
        with VLLMServer(target, speculative_config=spec, dtype=cfg.target.dtype, max_model_len=cfg.eval.engine_max_model_len,
                        log_path=Path(tmp) / "vllm.log") as server:
            for r in range(args.repeats):
                opts = ["eval.engine=vllm", f"eval.engine_url={server.url}", f"eval.temperature={args.temperature}",
                        f"eval.draft_sample_method={args.method}", f"eval.max_new_tokens={args.max_tokens}", f"eval.seed={r}",
                        f"eval.num_draft_tokens={args.spec_tokens}", f"eval.engine_num_speculative_tokens={args.spec_tokens}"]
                res = evaluate(load_config(str(ckpt / "config.yaml"), opts), ckpt, output_dir=Path(tmp) / f"r{r}")
                (cell,) = res["engine"]["tasks"].values()
                e1, o1 = cell["engine_survival"][0], cell["ours_survival"][0]
                rows.append({"seed": r, "vllm_s1": e1, "ours_s1": o1, "ratio_s1": e1 / o1 if o1 else None,
                             "vllm_tau": cell["engine_tau"], "ours_tau_at_S": cell["ours_tau_at_S"], "relative_diff": cell["relative_diff"],
                             "vllm_drafts": cell["engine_drafts"], "rounds_ours": res["overall"]["rounds"]})
                print(json.dumps(rows[-1]), flush=True, file=__import__("sys").stderr)
    ratios = [x["ratio_s1"] for x in rows if x["ratio_s1"] is not None]
    return {"checkpoint": str(ckpt), "prompts": list(cfg.eval.tasks), "samples_per_repeat": cfg.eval.max_samples,
            "max_tokens": args.max_tokens, "spec_tokens": args.spec_tokens, "temperature": args.temperature, "protocol": args.method,
            "repeats": rows, "ratio_s1_min": min(ratios), "ratio_s1_max": max(ratios), "ratio_s1_mean": statistics.mean(ratios),
            "ratio_s1_sd": statistics.stdev(ratios) if len(ratios) > 1 else None,
            "vllm_s1_range": [min(x["vllm_s1"] for x in rows), max(x["vllm_s1"] for x in rows)],
            "ours_s1_range": [min(x["ours_s1"] for x in rows), max(x["ours_s1"] for x in rows)],
            "wall_s": round(time.monotonic() - t0)}


if __name__ == "__main__":
    raise SystemExit(main())
