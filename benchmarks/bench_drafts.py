"""Draft sizes and CPU speed for each algorithm, sized for the embedded SmolLM2 target. Prints one JSON object.

    .venv/bin/python benchmarks/bench_drafts.py [--seq-len 256] [--repeats 3]

Random draft and random frozen target weights (speed does not depend on values): trainable
parameters, one training step (loss + backward) on one sequence, and one `propose` call
(3 tokens for EAGLE-3; one block for DFlash/DSpark) after a prompt of seq-len tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="32-token sequences, one repeat, one thread: a check of the code path")
    args = ap.parse_args()
    if args.smoke:
        args.seq_len, args.repeats, args.threads = 32, 1, 1

    import torch
    from transformers import AutoConfig

    from deepspec.config.model import ModelConfig
    from deepspec.drafts import DraftBatch, get_algorithm
    from deepspec.targets import embedded_target_dir

    torch.set_num_threads(args.threads)
    tc = AutoConfig.from_pretrained(embedded_target_dir())
    t = args.seq_len
    results = {**({"smoke": True} if args.smoke else {}), "target": "smollm2-135m-instruct", "seq_len": t, "threads": args.threads, "dtype": "float32", "torch": torch.__version__, "algorithms": {}}
    recipes = {
        "eagle3": dict(draft_vocab_size=8192, ttt_length=7),
        "dflash": dict(block_size=7, num_anchors=64, num_draft_layers=2),
        "dspark": dict(block_size=7, num_anchors=64, num_draft_layers=2, markov_rank=256),
    }
    for algo, fields in recipes.items():
        torch.manual_seed(0)
        cfg = ModelConfig(algorithm=algo, **fields)
        draft = get_algorithm(algo).from_target_config(tc, cfg)
        emb = torch.randn(tc.vocab_size, tc.hidden_size) * 0.05
        draft.load_target_weights(emb, emb)
        if algo == "eagle3":
            draft.set_token_frequencies(torch.rand(tc.vocab_size))
        n_taps = len(draft.taps)
        ids = torch.randint(0, tc.vocab_size, (1, t))
        ones = torch.ones_like(ids, dtype=torch.bool)
        batch = DraftBatch(ids, ones, ones, torch.randn(1, t, n_taps, tc.hidden_size), torch.randn(1, t, tc.hidden_size))
        step_s = []
        for _ in range(args.repeats):
            draft.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            loss, _ = draft.loss(batch)
            loss.backward()
            step_s.append(time.perf_counter() - t0)
        prop_s = []
        for _ in range(args.repeats):
            p = draft.proposer()
            p.propose(ids[0], batch.taps[0, : t - 1], 0, 3)  # prefill the context
            t0 = time.perf_counter()
            toks, _ = p.propose(ids[0], batch.taps[0, 0:0], t - 1, 6 if algo != "eagle3" else 3)
            prop_s.append(time.perf_counter() - t0)
        results["algorithms"][algo] = {
            "trainable_params": sum(p.numel() for p in draft.parameters() if p.requires_grad),
            "train_step_s": round(min(step_s), 4),
            "propose_s": round(min(prop_s), 5),
            "proposed_tokens": int(toks.numel()),
            "model": {k: v for k, v in fields.items()},
        }
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
