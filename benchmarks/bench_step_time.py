"""Median EAGLE-3 training-step time (loss forward + backward) on the quickstart's shapes, for comparing two trees.

Random SmolLM2-shaped target head (hidden 576, vocab 49,152), the quickstart's EAGLE-3.1 draft (taps [-1, 1, 14, 26],
draft vocabulary 8,192, TTT 3), one micro-batch of 2 x 700 tokens, bf16 autocast on CPU, metrics off (an unlogged
step). Prints one JSON line. Compare code versions by running it with PYTHONPATH pointing at each checkout, e.g.
    git worktree add /tmp/old <commit>
    PYTHONPATH=/tmp/old python benchmarks/bench_step_time.py; python benchmarks/bench_step_time.py
and interleave the runs: on a shared 2-core machine, background load moves single figures by ~10%.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import LlamaConfig

import deepspec
from deepspec.config.model import ModelConfig
from deepspec.drafts import DraftBatch, get_algorithm


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=700)
    ap.add_argument("--smoke", action="store_true", help="2 steps of 1 x 64 tokens: a check of the code path")
    args = ap.parse_args()
    if args.smoke:
        args.steps, args.batch, args.tokens = 2, 1, 64
    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                      num_hidden_layers=30, vocab_size=49152, head_dim=64)
    mc = ModelConfig(algorithm="eagle3", target_layer_ids=[-1, 1, 14, 26], ttt_length=3, draft_vocab_size=8192)
    torch.manual_seed(0)
    draft = get_algorithm("eagle3").from_target_config(cfg, mc)
    draft.load_target_weights(torch.randn(49152, 576) * 0.02, torch.randn(49152, 576) * 0.02)
    draft.set_token_frequencies(torch.rand(49152))
    draft.train()
    draft.train_metrics = False
    b, t = args.batch, args.tokens
    ids = torch.randint(0, 49152, (b, t))
    lm = torch.ones(b, t, dtype=torch.bool)
    lm[:, :50] = False
    batch = DraftBatch(ids, lm, torch.ones_like(lm), torch.randn(b, t, 4, 576), torch.randn(b, t, 576))
    times = []
    for i in range(args.steps + 2):  # two warm-up steps
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, _ = draft.loss(batch)
        loss.backward()
        draft.zero_grad()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    times.sort()
    print(json.dumps({**({"smoke": True} if args.smoke else {}), "deepspec": deepspec.__file__, "median_step_s": round(times[len(times) // 2], 3),
                      "min_step_s": round(times[0], 3), "steps": args.steps, "batch": b, "tokens": t,
                      "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
