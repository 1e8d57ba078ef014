#!/usr/bin/env python
"""Does an EAGLE-3 draft copy the target's loops? Prints one JSON object.

    python benchmarks/bench_copy.py CKPT [--cache outputs/quickstart-blend/cache/heldout] [--max-samples N]
                                         [--reinit-copy-heads]

For every supervised answer position of the held-out cache we ask two predictors for the token the draft's
first step must guess (the target's argmax after the next token):
  * a trigram lookup: the token that followed the last earlier occurrence of the same three tokens
    (what prompt-lookup / n-gram drafting would propose), and
  * the draft's step-0 top-1 (teacher-forced, as validation runs it).
Positions where the lookup reproduces the data's next token are "loop" positions, the rest "fresh". A draft
that copies is far better on loop positions than on fresh ones; one that does not is about equal.

--reinit-copy-heads re-initialises the draft's weights and writes the copy heads in (model.init_copy_heads),
so the figures are those of the untrained circuit alone (needs a checkpoint trained with tap -1).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _draft_on_cache import input_error, load_draft_and_cache, smoke_inputs  # noqa: E402


def trigram_lookup(ids: list[int], t: int) -> int | None:
    """The token after the last earlier occurrence of ids[t-1 : t+2] (None if there is none)."""
    key = tuple(ids[t - 1 : t + 2])
    for j in range(t - 1, 1, -1):
        if tuple(ids[j - 2 : j + 1]) == key:
            return ids[j + 1]
    return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("checkpoint", nargs="?", help="an EAGLE-3 draft checkpoint (step_N folder)")
    p.add_argument("--cache", default=str(ROOT / "outputs" / "quickstart-blend" / "cache" / "heldout"))
    p.add_argument("--max-samples", type=int, default=None)
    p.add_argument("--smoke", action="store_true",
                   help="an untrained draft on a tiny random target's held-out cache, built here: a check of the code path")
    p.add_argument("--reinit-copy-heads", action="store_true", help="measure the untrained copy heads instead of the trained draft")
    args = p.parse_args()
    with smoke_inputs(args):
        return measure(args)


def measure(args) -> int:
    ckpt, cache_dir = Path(args.checkpoint), Path(args.cache)
    if (error := input_error(ckpt, cache_dir)) is not None:
        print(json.dumps({"error": error}))
        return 2
    import torch

    from deepspec.data.batches import collate_features

    t0 = time.perf_counter()
    data, _, draft = load_draft_and_cache(ckpt, cache_dir, target_dtype="float32")
    if not hasattr(draft, "ttt_steps"):
        print(json.dumps({"error": f"{ckpt} is not an EAGLE-3 draft"}))
        return 2
    if args.reinit_copy_heads:
        torch.manual_seed(0)
        with torch.no_grad():
            for name, module in draft.named_modules():
                if isinstance(module, torch.nn.Linear) and module is not draft.lm_head:
                    module.reset_parameters()
                elif name and hasattr(module, "weight") and module.weight is not None and module.weight.dim() == 1:
                    module.weight.fill_(1.0)  # RMSNorm weights
        draft.init_copy_heads()
    tids = draft.draft_target_ids()
    n = len(data) if args.max_samples is None else min(len(data), args.max_samples)
    counts = {"loop": [0, 0, 0], "fresh": [0, 0, 0]}  # [draft right, lookup right, positions]
    with torch.no_grad():
        for i in range(n):
            batch = collate_features([data[i]])
            ids = batch.input_ids[0].tolist()
            supervised = batch.loss_mask[0].bool().tolist()
            target_next = draft.target_logits(batch.final_hidden[0].float()).argmax(-1).tolist()
            _, logits = next(iter(draft.ttt_steps(batch.input_ids, batch.taps)))
            guess = tids[logits[0].argmax(-1)].tolist()
            for t in range(2, len(ids) - 2):
                if not supervised[t + 2]:
                    continue
                want = target_next[t + 1]  # row t reads token t+1 and predicts the target's token after it
                lookup = trigram_lookup(ids, t)
                kind = "loop" if lookup is not None and lookup == ids[t + 2] else "fresh"
                c = counts[kind]
                c[0] += guess[t] == want
                c[1] += lookup == want
                c[2] += 1
    total = sum(c[2] for c in counts.values())
    out = {
        **({"smoke": True} if args.smoke else {}),
        "checkpoint": str(ckpt),
        "cache": str(cache_dir),
        "samples": n,
        "untrained_copy_heads": args.reinit_copy_heads,
        "positions": total,
        "loop_share": round(counts["loop"][2] / total, 4) if total else None,
        **{
            f"{kind}_{name}": round(c[j] / c[2], 4) if c[2] else None
            for kind, c in counts.items()
            for j, name in ((0, "draft_top1"), (1, "lookup_top1"))
        },
        "seconds": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
