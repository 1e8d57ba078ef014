"""Planning a split: tokenizing every conversation vs loading the plan another process stored.

    .venv/bin/python benchmarks/bench_plan.py [--conversations 20000] [--turns 2] [--words 180] [--dir DIR]

Writes `--conversations` synthetic chats (`--turns` user/assistant pairs of about `--words` words per answer) as a
regenerated.jsonl for the embedded SmolLM2 target, then times make_plan three ways, in one process, one after another:

  tokenize_s     the first plan: render every chat through the template and tokenize it (what every trainer rank,
                 producer and restarted process did before plans were shared), then store it
  load_s         the same plan again: loaded from <data>/.plans (what every later process does)
  plan_file_mb   the stored plan's size

and prints one JSON object with those, the sample / token counts, conversations per second and the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORDS = ("the model drafts tokens that the target verifies in one forward pass and accepts the longest prefix "
         "which matches its own choice so decoding costs fewer target steps per token").split()


def write_chats(path: Path, n: int, turns: int, words: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            conv = []
            for _ in range(turns):
                conv.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(8, 40))) + "?"})
                conv.append({"role": "assistant", "content": " ".join(rng.choices(WORDS, k=rng.randint(words // 2, words * 3 // 2)))})
            f.write(json.dumps({"id": f"c{i}", "conversations": conv}) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=20000)
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--words", type=int, default=180)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--smoke", action="store_true", help="50 short conversations: a check of the code path")
    args = ap.parse_args()
    os.environ.setdefault("DEEPSPEC_NO_PROGRESS", "1")
    if args.smoke:
        args.conversations, args.words = 50, 20
    work = Path(args.dir or tempfile.mkdtemp(prefix="bench_plan_"))
    try:
        measure(args, work)
    finally:
        if not args.dir:  # a temporary folder of ours
            shutil.rmtree(work, ignore_errors=True)


def measure(args, work: Path) -> None:

    from deepspec.config import load_config
    from deepspec.data.cache.plan import load_plan_inputs, make_plan
    from deepspec.eval.engine import machine_description
    from deepspec.targets.embedded import embedded_target_dir

    cfg = load_config(None, [f"target.name={embedded_target_dir()}", f"data.dir={work / 'data'}", "cache.max_length=2048"])
    cfg.data_dir.mkdir(parents=True, exist_ok=True)
    write_chats(cfg.regenerated_path, args.conversations, args.turns, args.words)
    tok, tconf = load_plan_inputs(cfg)
    t0 = time.perf_counter()
    first = make_plan(cfg, "train", tok, tconf, count_tokens=True)
    tokenize_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    second = make_plan(cfg, "train", tok, tconf, count_tokens=True)
    load_s = time.perf_counter() - t0
    assert [(s.id, s.length) for s in second.samples] == [(s.id, s.length) for s in first.samples]
    stored = sorted((cfg.data_dir / ".plans").glob("train-*.npz"))
    print(json.dumps({
        **({"smoke": True} if args.smoke else {}),
        "conversations": args.conversations, "samples": len(first.samples), "tokens": first.counts["tokens"],
        "tokenize_s": round(tokenize_s, 2), "load_s": round(load_s, 3),
        "conversations_per_s_tokenizing": round(args.conversations / tokenize_s, 1),
        "speedup": round(tokenize_s / load_s, 1), "plan_file_mb": round(stored[-1].stat().st_size / 1e6, 2),
        "note": "load_s includes hashing the data file (sha256) and the tokenizer's vocabulary, which any plan needs",
        "machine": machine_description(), "python": platform.python_version(),
    }, indent=2))


if __name__ == "__main__":
    main()
