#!/usr/bin/env python
"""Does decoding see what validation measured? Replays held-out cache samples through the draft's
Proposer (the code path our evaluator drives, with the served chain's semantics) and compares the
greedy acceptance it gets with the trainer's validation figure on the same samples. Prints one JSON object.

    python benchmarks/bench_replay.py CKPT [--cache outputs/quickstart-blend/cache/heldout] [--depth 3]

Why: validation runs the draft in its training form (all TTT depths in one pass over cached target
states); decoding runs it one committed position and one drafted token at a time. An alignment slip
between the two (a shifted position, a mask that lets a depth see too much) shows up as validation
tau above served tau, which is otherwise easy to blame on the benchmark prompts. Here both run on the
same tokens, so for EAGLE-3 the two taus must agree up to bf16 rounding. (Block drafts replay the same
way, but their validation tau counts their own block depths, so only the replay figure is comparable.)

Replay: for every answer position p whose next `depth` tokens are supervised, the committed text is
the sample up to p, the proposer drafts `depth` tokens, and they are checked greedily against the
target's argmax (from the cached final states) — continuing only while the drafts also equal the
data's tokens, beyond which the replayed context would no longer be what decoding commits.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _draft_on_cache import input_error, load_draft_and_cache, smoke_inputs  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("checkpoint", nargs="?", help="trained draft checkpoint (e.g. checkpoints/quickstart-blend/eagle3/step_latest)")
    p.add_argument("--cache", default=str(ROOT / "outputs" / "quickstart-blend" / "cache" / "heldout"),
                   help="a cache split the draft was not trained on (default: the quickstart's held-out split)")
    p.add_argument("--depth", type=int, default=None,
                   help="drafted tokens per position (default: the draft's TTT length, the depths validation counts)")
    p.add_argument("--max-samples", type=int, default=None)
    p.add_argument("--smoke", action="store_true",
                   help="an untrained draft on a tiny random target's held-out cache, built here: a check of the code path")
    args = p.parse_args()
    with smoke_inputs(args):
        return measure(args)


def measure(args) -> int:
    if args.depth is not None and args.depth < 1:
        print(json.dumps({"error": f"--depth must be >= 1, got {args.depth}"}))
        return 2
    cache_dir, ckpt = Path(args.cache), Path(args.checkpoint)
    if (error := input_error(ckpt, cache_dir)) is not None:
        print(json.dumps({"error": error}))
        return 2
    import torch

    from deepspec.data.batches import collate_features

    t0 = time.perf_counter()
    data, target, draft = load_draft_and_cache(ckpt, cache_dir)
    n = len(data) if args.max_samples is None else min(len(data), args.max_samples)

    # validation: the trainer's own metric, under the precision the run trained with (bf16 autocast
    # where train.precision resolved to bf16 on this machine)
    autocast = contextlib.nullcontext
    if (ckpt / "config.yaml").is_file():
        from deepspec.config import load_config
        from deepspec.train.loop import autocast_context

        autocast = autocast_context(load_config(ckpt / "config.yaml"), torch.device("cpu"))
    algo = type(draft).__name__
    # TTT drafts validate over ttt_length depths; block drafts (DFlash/DSpark) count their own block
    val_depths = draft.model_cfg.ttt_length if hasattr(draft, "ttt_steps") else None
    if args.depth is None:
        args.depth = val_depths or 3
    tau_sum = tau_rows = 0.0
    with torch.no_grad(), autocast():
        for i in range(n):
            _, metrics = draft.loss(collate_features([data[i]]))
            if "greedy_tau" in metrics:  # token-weighted over samples, as the trainer reduces it
                tau_sum += float(metrics["greedy_tau"][0])
                tau_rows += float(metrics["greedy_tau"][1])
    val_tau = tau_sum / tau_rows if tau_rows else None

    # replay: the proposer in the target's dtype, as the evaluator runs it
    draft = draft.to(next(target.model.parameters()).dtype)
    proposer = draft.proposer()
    rows, accepted, eq_data = 0, [0] * args.depth, 0
    with torch.no_grad():
        for i in range(n):
            s = data[i]
            ids = torch.as_tensor(s["input_ids"]).long()
            mask = torch.as_tensor(s["loss_mask"]).bool()
            taps = torch.as_tensor(s["taps"])
            argmax = draft.target_logits(torch.as_tensor(s["final_hidden"])).argmax(-1)  # [j] = target's token after j
            answer = mask.nonzero()
            if len(answer) == 0:
                continue
            proposer.reset()
            seen = 0
            for pos in range(int(answer[0]), len(ids) - args.depth - 1):
                if not bool(mask[pos + 1 : pos + 1 + args.depth].all()):
                    continue
                drafts, _ = proposer.propose(ids[: pos + 1], taps[seen:pos], seen, args.depth)
                seen = pos
                rows += 1
                eq_data += int(argmax[pos] == ids[pos + 1])
                for j in range(min(args.depth, len(drafts))):
                    if int(drafts[j]) != int(argmax[pos + j]):
                        break
                    accepted[j] += 1
                    if int(drafts[j]) != int(ids[pos + 1 + j]):
                        break
    survival = [a / rows for a in accepted] if rows else []
    out = {
        **({"smoke": True} if args.smoke else {}),
        "checkpoint": str(ckpt),
        "draft": algo,
        "cache": str(cache_dir),
        "samples": n,
        "depth": args.depth,
        "rows": rows,
        "val_greedy_tau": None if val_tau is None else round(val_tau, 4),
        "val_depths": val_depths,
        "replay_greedy_tau": round(1 + sum(survival), 4) if rows else None,
        "replay_survival": [round(x, 4) for x in survival],
        "data_equals_target_argmax": round(eq_data / rows, 4) if rows else None,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
