"""Regeneration throughput: our stage (chunking, length guard, JSONL fsync, resume bookkeeping)
versus the raw engine on the same prompts with the same sampling. Prints one JSON object.

    python benchmarks/bench_regenerate.py --prompts 64 --max-tokens 64            # in-process vLLM
    python benchmarks/bench_regenerate.py --engine openai --url http://127.0.0.1:8000
    python benchmarks/bench_regenerate.py --smoke      # transformers on a tiny random target: a check of the code path

The raw figure is `vllm.LLM.chat` on all prompts at once (vllm) or the same number of
concurrent /v1/chat/completions requests with no retries or bookkeeping (openai). Runs
alternate raw/ours `--repeats` times and keep each side's best, so machine noise hurts both.
Goal: tokens_per_s / raw_tokens_per_s >= 0.9.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("DEEPSPEC_NO_PROGRESS", "1")


def build_cfg(workdir: Path, args):
    from deepspec.config import load_config
    from deepspec.data.prompts import build_prompts

    cfg = load_config(None, [
        *([f"target.name={args.target}", "target.dtype=float32"] if args.target else []),
        f"data.dir={workdir}", f"data.prompts.max_samples={args.prompts + 1}", "data.prompts.heldout=1",
        "data.prompts.first_turn_only=true", f"data.prompts.max_prompt_chars={args.max_prompt_chars}",
        f"eval.datasets_dir={workdir / 'none'}", "data.regenerate.heldout=false",
        f"data.regenerate.sampling.max_tokens={args.max_tokens}", f"data.regenerate.batch_size={args.batch_size}",
        f"data.regenerate.concurrency_per_server={args.concurrency}", f"data.regenerate.max_model_len={args.max_model_len}",
    ])
    build_prompts(cfg)
    return cfg


def raw_vllm(engine, messages: list, max_tokens: int) -> tuple[int, float]:
    from deepspec.data.engines.vllm_engine import vllm_sampling_params

    params = vllm_sampling_params(engine.sampling, max_tokens, None)
    t0 = time.perf_counter()
    outs = engine.llm.chat(messages, params, use_tqdm=False, chat_template_kwargs=engine.chat_template_kwargs or None)
    dt = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs), dt


def raw_batch(engine, messages: list, max_tokens: int) -> tuple[int, float]:
    """The engine's own batched call on every prompt at once (the transformers engine): no chunking or bookkeeping."""
    t0 = time.perf_counter()
    outs = engine.chat_batch([(m, max_tokens, engine.seed) for m in messages])
    return sum(o.tokens for o in outs), time.perf_counter() - t0


async def _raw_openai(url: str, model: str, messages: list, max_tokens: int, concurrency: int, kwargs: dict) -> int:
    import httpx

    sem = asyncio.Semaphore(concurrency)

    async def one(client, m):
        async with sem:
            r = await client.post(url + "/v1/chat/completions", json={
                "model": model, "messages": m, "max_tokens": max_tokens, "temperature": 0.0, "chat_template_kwargs": kwargs})
            return r.json()["usage"]["completion_tokens"]

    async with httpx.AsyncClient(timeout=600) as client:
        return sum(await asyncio.gather(*(one(client, m) for m in messages)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=["vllm", "openai", "hf"], default="vllm")
    p.add_argument("--url", default=None, help="server base URL for --engine openai")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-prompt-chars", type=int, default=1200)
    p.add_argument("--batch-size", type=int, default=64, help="data.regenerate.batch_size (conversations per engine call)")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight (openai)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--smoke", action="store_true", help="the transformers engine on a tiny random target, 4 prompts of 8 "
                   "tokens, one repeat: a check of the code path (vLLM is not started)")
    args = p.parse_args()
    args.target = None
    if args.smoke:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from _smoke import smoke_env, tiny_target

        smoke_env()
        args.engine, args.prompts, args.max_tokens, args.repeats, args.batch_size = "hf", 4, 8, 1, 4
        with tempfile.TemporaryDirectory(prefix="smoke_") as tmp:
            args.target = str(tiny_target(Path(tmp)))
            return measure(args)
    return measure(args)


def measure(args) -> int:

    from deepspec.data.engines import create_engine
    from deepspec.data.jsonl import read_jsonl
    from deepspec.data.regenerate import regenerate

    with tempfile.TemporaryDirectory() as tmp:
        cfg = build_cfg(Path(tmp), args)
        jobs = read_jsonl(cfg.conversations_path)
        messages = [r["conversations"] for r in jobs]
        engine = create_engine(cfg, args.engine, [args.url] if args.url else [])
        try:
            # Warm-up over every prompt: first-call allocations, and vLLM's prefix cache is then
            # equally hot for the raw and our runs.
            if args.engine == "vllm":
                raw_vllm(engine, messages, 4)
            elif args.engine == "hf":
                raw_batch(engine, messages, 4)
            else:
                asyncio.run(_raw_openai(engine.urls[0], engine.model, messages, 4, args.concurrency,
                                        cfg.target.chat_template_kwargs))
            best_raw, best_ours = (0, float("inf")), (0, float("inf"))
            for _ in range(args.repeats):
                if args.engine == "vllm":
                    raw = raw_vllm(engine, messages, args.max_tokens)
                elif args.engine == "hf":
                    raw = raw_batch(engine, messages, args.max_tokens)
                else:
                    t0 = time.perf_counter()
                    n = asyncio.run(_raw_openai(engine.urls[0], engine.model, messages, args.max_tokens,
                                                args.concurrency, cfg.target.chat_template_kwargs))
                    raw = (n, time.perf_counter() - t0)
                best_raw = max(best_raw, raw, key=lambda x: x[0] / x[1])
                t0 = time.perf_counter()
                summary = regenerate(cfg, engine=args.engine, overwrite=True, which="train", engine_obj=engine)
                ours = (summary["output_tokens"], time.perf_counter() - t0)
                assert summary["done"] == len(jobs), summary
                best_ours = max(best_ours, ours, key=lambda x: x[0] / x[1])
        finally:
            engine.close()
    result = {
        **({"smoke": True, "not_run": "vLLM (in-process or served): the smoke regenerates with the transformers engine"}
           if args.smoke else {}),
        "engine": args.engine, "engine_version": engine.version, "prompts": len(messages), "max_tokens": args.max_tokens,
        "batch_size": args.batch_size if args.engine in ("vllm", "hf") else None,
        "concurrency": args.concurrency if args.engine == "openai" else None,
        "output_tokens": best_ours[0], "seconds": round(best_ours[1], 3), "tokens_per_s": round(best_ours[0] / best_ours[1], 2),
        "raw_output_tokens": best_raw[0], "raw_seconds": round(best_raw[1], 3),
        "raw_tokens_per_s": round(best_raw[0] / best_raw[1], 2),
    }
    result["ratio"] = round(result["tokens_per_s"] / result["raw_tokens_per_s"], 3)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
