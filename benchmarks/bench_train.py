"""Training throughput per algorithm on the embedded SmolLM2 target (cached features, CPU).

    python benchmarks/bench_train.py                      # every registered algorithm
    python benchmarks/bench_train.py --algorithms eagle3 --steps 6 --samples 32 --global-batch 8

Builds a small offline cache per algorithm (its taps) from synthetic conversations through the real
cache stage, then trains `--steps` optimizer steps in a fresh subprocess (so peak RSS is per
algorithm) with the recipe config/<algorithm>/smollm2.yaml. Prints one JSON object with a row per
algorithm: `draft_tokens_per_s` = non-padding tokens through the draft per second of training wall
time (forward + backward + optimizer, no checkpoint), `peak_rss_mb` = the training process's peak RSS.

`peer_tokens_per_s` (vLLM's `speculators` training the same EAGLE-3 draft) is null with a reason:
speculators 0.9.0 cannot train on CPU (see PEER_NOTE).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("DEEPSPEC_NO_PROGRESS", "1")
REPO = Path(__file__).resolve().parents[1]

PEER_NOTE = (
    "speculators 0.9.0 (pip download, inspected in a throwaway dir) cannot train on CPU: its Trainer sets "
    "device_type = 'cuda' when torch.accelerator.current_accelerator() is None (train/trainer.py), its distributed "
    "setup raises 'No accelerator found' (train/distributed.py), the EAGLE-3 model defaults to flex-attention block "
    "masks, and it pins datasets<=5.1.0 and requires torchvision/torchaudio, which break this torch 2.13 CPU install."
)

_WORDS = (
    "the a model learns to predict next token from hidden states of target layers while training on cached features "
    "speculative decoding drafts several tokens then verifies them in one pass accepted prefix bonus token length "
    "python code function returns list of numbers sorted by value math answer is seven because two plus five"
).split()


def _conversations(n: int, seed: int, answer_words: tuple[int, int] = (20, 60)) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        q = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(6, 20)))
        a = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(*answer_words)))
        out.append({"id": f"s{seed}-{i}", "conversations": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
    return out


def _opts(work: Path, algorithm: str, args) -> list[str]:
    return [
        f"output_root={work}", f"data.dir={work / 'data'}", f"cache.dir={work / ('cache-' + algorithm)}",
        f"train.output_root={work / 'ckpt'}", f"train.global_batch_size={args.global_batch}",
        f"train.micro_batch_size={args.micro_batch}", f"train.max_steps={args.steps}", f"train.save_every={10**6}",
        f"train.val_every={10**6}", "train.log_every=1", "logging.wandb=false", "logging.tensorboard=false",
        "logging.progress=false",
    ]


def train_child(recipe: str, opts: list[str]) -> dict:
    """Train in this process (alone, or as the rank of a torchrun launch); return its figures.

    `draft_tokens_per_s` is the trainer's own figure (from the first step on, so one-time costs such as CUDA start-up
    and torch.compile are in it); `steady_tokens_per_s` leaves the first step out (time between the first and the last
    logged step, tokens of the steps in between, from the batch plan). On a GPU, `peak_gpu_mb` is the peak allocated.
    """
    import deepspec.train.loop as loop
    from deepspec.config import load_config
    from deepspec.train.batches import BatchPlan, sample_lengths
    from deepspec.train.build import build_parts
    from deepspec.train.dist import init_distributed, teardown

    cfg = load_config(recipe, opts)
    stamps: dict[int, float] = {}
    append = loop._append_jsonl

    def stamped(path, step, row):  # rank 0 writes a logged step's row right after the optimizer step
        stamps[step] = time.perf_counter()
        append(path, step, row)

    loop._append_jsonl = stamped
    info = init_distributed()
    try:
        import torch

        torch.manual_seed(cfg.train.seed)  # as train() does before building the draft
        parts = build_parts(cfg, info)
        parts.val_data = None  # throughput only
        t0 = time.perf_counter()
        loop._train(cfg, info, parts)
        wall = time.perf_counter() - t0
    finally:
        loop._append_jsonl = append
        teardown(info)
    rows = [json.loads(line) for line in (cfg.run_dir / "train_log.jsonl").read_text().splitlines()]
    last = rows[-1]
    trainable = sum(p.numel() for p in parts.model.parameters() if p.requires_grad)
    out = {
        "draft_tokens_per_s": round(last["train/tokens_per_s"], 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "steps": last["step"], "train_wall_s_incl_final_save": round(wall, 2), "trainable_params": trainable,
        "final_loss": round(last["train/loss"], 4),
    }
    logged = sorted(stamps)
    if info.world == 1 and len(logged) >= 2:
        t = cfg.train
        plan = BatchPlan(len(parts.train_data), t.global_batch_size, t.micro_batch_size, info.world, t.seed, t.bucketing)
        lengths = sample_lengths(parts.train_data)
        if lengths is not None:  # row `step` s is written after plan step s - 1
            tokens = sum(lengths[i] for s in range(logged[0], logged[-1]) for i in plan.global_indices(s))
            out["steady_tokens_per_s"] = round(tokens / (stamps[logged[-1]] - stamps[logged[0]]), 1)
    if info.device.type == "cuda":
        out["peak_gpu_mb"] = round(torch.cuda.max_memory_allocated(info.device) / 2**20, 1)
    out["device"] = str(info.device)
    out["run_dir"] = str(cfg.run_dir)
    return out


def _child(recipe: str, opts: list[str]) -> None:
    """Train in this process; print this process's figures as JSON on the last line."""
    print(json.dumps(train_child(recipe, opts)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--algorithms", nargs="*", default=None, help="default: every algorithm whose module exists")
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--global-batch", type=int, default=4)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--workdir", default=None)
    p.add_argument("--_child", nargs=2, metavar=("RECIPE", "OPTS_JSON"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._child:
        _child(args._child[0], json.loads(args._child[1]))
        return 0

    import importlib.util

    import torch

    from deepspec.config import load_config
    from deepspec.data.cache import build_cache
    from deepspec.drafts.registry import _MODULES

    algorithms = args.algorithms or [a for a, mod in _MODULES.items() if importlib.util.find_spec(mod) is not None]
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-train-"))
    (work / "data").mkdir(parents=True, exist_ok=True)
    for name, seed, n in (("regenerated.jsonl", 0, args.samples), ("regenerated.heldout.jsonl", 1, 4)):
        (work / "data" / name).write_text("".join(json.dumps(c) + "\n" for c in _conversations(n, seed)))
    rows = []
    for algorithm in algorithms:
        recipe = str(REPO / "config" / algorithm / "smollm2.yaml")
        opts = _opts(work, algorithm, args)
        row = {"algorithm": algorithm, "target": "smollm2-135m-instruct", "device": "cpu", "threads": torch.get_num_threads()}
        try:
            cfg = load_config(recipe, opts)
            t0 = time.perf_counter()
            build_cache(cfg, "train")
            row["cache_build_s"] = round(time.perf_counter() - t0, 1)
            proc = subprocess.run(
                [sys.executable, __file__, "--_child", recipe, json.dumps(opts)], capture_output=True, text=True,
                env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=1800,
            )
            if proc.returncode != 0:
                raise RuntimeError(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}")
            row.update(json.loads(proc.stdout.strip().splitlines()[-1]))
        except Exception as e:  # report and go on with the next algorithm
            row["error"] = f"{type(e).__name__}: {e}"
        row["peer_tokens_per_s"] = None
        if algorithm == "eagle3":
            row["peer_note"] = PEER_NOTE
        rows.append(row)
    print(json.dumps({
        "benchmark": "train", "samples": args.samples, "steps": args.steps, "global_batch": args.global_batch,
        "micro_batch": args.micro_batch, "precision": "fp32", "workers": 1, "results": rows,
    }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
