#!/usr/bin/env python
"""How does vLLM's served acceptance depend on how long the answers run? Prints one JSON object.

    python benchmarks/bench_served_length.py CKPT [--prompts outputs/quickstart-blend/data/heldout.general.jsonl]
                                                  [--max-tokens 128 256 512 1024] [--spec-tokens 3]

One vLLM server with the exported draft (`--speculative-config`, greedy) answers the same prompts once
per answer budget; for each budget we read vLLM's spec-decode counters before and after, so every
figure is vLLM's own mean acceptance length (1 + accepted / drafts) and per-position acceptance.

Why: acceptance is not uniform along an answer. A small greedy target often ends in a repetition
loop, which any draft that copies predicts well, so a served figure taken with long (or uncapped)
answers can be far above one taken on the first 128 tokens. Quote served figures with their budget;
this script shows how much the budget alone moves them. `repeated_4gram_share` is the share of
answer tokens that close a 4-gram already seen earlier in the same answer (a loop detector);
`trigram_lookup_share` the share of answer positions whose token a trigram lookup over the answer so far
predicts (bench_copy.py's lookup: what n-gram drafting would accept without any trained draft).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_copy import trigram_lookup  # noqa: E402


def repeated_ngram_share(ids: list[int], n: int = 4) -> tuple[int, int]:
    """(tokens closing an n-gram seen before in the same sequence, tokens)."""
    seen: set[tuple[int, ...]] = set()
    rep = 0
    for i in range(n - 1, len(ids)):
        g = tuple(ids[i - n + 1 : i + 1])
        rep += g in seen
        seen.add(g)
    return rep, len(ids)


def trigram_hits(ids: list[int]) -> tuple[int, int]:
    """(answer tokens a trigram lookup over the answer so far predicts, tokens it was asked for): the share of
    positions that prompt-lookup / n-gram drafting would get for free, i.e. what a loop contributes."""
    hits = sum(trigram_lookup(ids, t) == ids[t + 2] for t in range(1, len(ids) - 2))
    return hits, max(0, len(ids) - 3)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("checkpoint", nargs="?", help="trained EAGLE-3 or DFlash draft (e.g. checkpoints/quickstart-blend/eagle3/step_latest)")
    p.add_argument("--prompts", default=str(ROOT / "outputs" / "quickstart-blend" / "data" / "heldout.general.jsonl"),
                   help="conversations JSONL whose first user turns are asked (default: the quickstart's general held-out split)")
    p.add_argument("--max-tokens", type=int, nargs="+", default=[128, 256, 512, 1024])
    p.add_argument("--spec-tokens", type=int, default=3)
    p.add_argument("--max-samples", type=int, default=None)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--smoke", action="store_true", help="an untrained draft of a tiny random target and its held-out prompts, "
                   "exported for vLLM; the server is not started: a check of the code path up to it")
    args = p.parse_args()
    if args.smoke:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from _smoke import smoke_env, tiny_recipe, untrained_checkpoint

        smoke_env()
        with tempfile.TemporaryDirectory(prefix="smoke_") as tmp:
            recipe = tiny_recipe(Path(tmp))
            args.checkpoint = str(untrained_checkpoint(recipe, Path(tmp) / "ckpt"))
            args.prompts = str(Path(tmp) / "data" / "regenerated.heldout.jsonl")
            args.max_tokens, args.max_model_len = [16, 32], 256
            return measure(args)
    if args.checkpoint is None:
        p.error("give a draft checkpoint (or --smoke)")
    return measure(args)


def measure(args) -> int:
    ckpt, prompts_path = Path(args.checkpoint), Path(args.prompts)
    for path, what in ((ckpt / "model.safetensors", "a draft checkpoint (step_N folder)"), (prompts_path, "a conversations JSONL")):
        if not path.exists():
            print(json.dumps({"error": f"{path} is not {what}: run the quickstart first or pass the path"}))
            return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import httpx

    from deepspec.drafts.checkpoint import read_draft_config
    from deepspec.eval.engine import VLLM_METHODS
    from deepspec.data.chat import render_prompt
    from deepspec.export.writers import export_draft
    from deepspec.data.engines.server import VLLMServer, counters_delta
    from deepspec.targets import load_tokenizer, resolve_target_path

    meta = read_draft_config(ckpt)["deepspec"]
    algo = meta.get("algorithm")
    if algo not in VLLM_METHODS:
        print(json.dumps({"error": f"vLLM on CPU serves {sorted(VLLM_METHODS)} drafts, not {algo!r}"}))
        return 2
    target_name = meta.get("provenance", {}).get("target", "smollm2-135m-instruct")
    target_path = resolve_target_path(target_name)
    tok = load_tokenizer(target_name)
    prompts = []
    with open(prompts_path, encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                turns = [m["content"] for m in json.loads(line)["conversations"] if m.get("role") == "user"]
                if turns:
                    prompts.append(turns[0])
    prompts = prompts[: args.max_samples] if args.max_samples else prompts
    # the same prompts at every budget: drop those whose chat prompt + the largest budget exceeds the context
    fits = [p for p in prompts
            if len(render_prompt(tok, [{"role": "user", "content": p}], {})) + max(args.max_tokens) < args.max_model_len]
    skipped, prompts = len(prompts) - len(fits), fits

    t0 = time.perf_counter()
    export_dir = ckpt / "eval" / "export-vllm"
    export_draft(ckpt, export_dir, "vllm", target=target_path)
    spec = {"method": VLLM_METHODS[algo], "model": str(export_dir), "num_speculative_tokens": args.spec_tokens}
    out: dict = {**({"smoke": True} if args.smoke else {}), "checkpoint": str(ckpt), "algorithm": algo, "prompts": str(prompts_path), "samples": len(prompts),
                 "skipped_too_long": skipped, "max_model_len": args.max_model_len, "num_speculative_tokens": args.spec_tokens, "by_max_tokens": {}}
    if args.smoke:  # everything up to the server: ~90 s to start on 2 cores, too long for a check of the code path
        out.update(not_run="the vLLM server and all it measures (by_max_tokens)",
                   export_files=sorted(f.name for f in export_dir.iterdir()), spec_config=spec)
        print(json.dumps(out))
        return 0
    with VLLMServer(target_path, speculative_config=spec, max_model_len=args.max_model_len) as server:
        http = httpx.Client(base_url=server.url, timeout=httpx.Timeout(1800.0))

        def ask(prompt: str) -> list[int]:
            body = {"model": server.served_model_name, "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": budget, "temperature": 0.0}
            r = http.post("/chat/completions", json=body)
            r.raise_for_status()
            text = r.json()["choices"][0]["message"]["content"] or ""
            return tok(text, add_special_tokens=False)["input_ids"]

        for budget in args.max_tokens:
            before = server.spec_decode_counters()
            with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
                answers = list(pool.map(ask, prompts))
            d = counters_delta(before, server.spec_decode_counters())
            rep = [repeated_ngram_share(a) for a in answers]
            tri = [trigram_hits(a) for a in answers]
            out["by_max_tokens"][str(budget)] = {
                "mean_acceptance_length": round(d["mean_acceptance_length"], 4) if d.get("mean_acceptance_length") else None,
                "acceptance_rate_per_pos": [round(x, 4) for x in (d.get("acceptance_rate_per_pos") or [])],
                "drafts": d.get("drafts"),
                "mean_answer_tokens": round(sum(len(a) for a in answers) / max(1, len(answers)), 1),
                "repeated_4gram_share": round(sum(r for r, _ in rep) / max(1, sum(n for _, n in rep)), 4),
                "trigram_lookup_share": round(sum(h for h, _ in tri) / max(1, sum(n for _, n in tri)), 4),
            }
            print(json.dumps({budget: out["by_max_tokens"][str(budget)]}), file=sys.stderr)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
