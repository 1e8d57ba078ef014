"""Cache size and capture speed on the embedded SmolLM2 target, bf16 vs fp8. Prints one JSON object.

    .venv/bin/python benchmarks/bench_cache.py [--samples 24] [--max-length 512]
    .venv/bin/python benchmarks/bench_cache.py --smoke        # 4 short samples: a check of the code path

Conversations: user turns are prompts of the embedded prompt set; assistant turns are the text
of *other* prompts (stand-ins: bytes and capture speed depend on lengths, not on who wrote the
text). tokens_per_s times the capture (target forward + encode + write), not model loading.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def write_conversations(path: Path, n: int, max_chars: int | None = None) -> None:
    import deepspec.data

    src = Path(deepspec.data.__file__).parent / "embedded" / "prompts.jsonl.gz"
    texts = []
    if src.is_file():
        with gzip.open(src, "rt") as f:
            for line in f:
                texts.append(json.loads(line)["conversations"][0]["content"])
                if len(texts) >= 2 * n:
                    break
    while len(texts) < 2 * n:  # fallback: deterministic filler
        texts.append(" ".join(f"word{i % 97}" for i in range(len(texts) * 7, len(texts) * 7 + 200)))
    if max_chars:  # --smoke: short turns, so that the assistant's tokens fit the short --max-length
        texts = [t[:max_chars] for t in texts]
    with open(path, "w") as f:
        for i in range(n):
            conv = [{"role": "user", "content": texts[2 * i]}, {"role": "assistant", "content": texts[2 * i + 1] * 3}]
            f.write(json.dumps({"id": f"bench-{i}", "conversations": conv}) + "\n")


def relative_error(approx, exact) -> float:
    """||approx - exact|| / ||exact||, computed in fp32 (torch does not promote float8 against other types)."""
    import torch

    a, e = approx.float(), exact.float()
    return float(torch.linalg.vector_norm(a - e) / torch.linalg.vector_norm(e))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=24)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--smoke", action="store_true", help="4 short samples of at most 96 tokens: a check of the code path")
    args = ap.parse_args()
    if args.smoke:
        args.samples, args.max_length = 4, 96
    os.environ.setdefault("DEEPSPEC_NO_PROGRESS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch

    from deepspec.config import config_from_dict
    from deepspec.data.cache.reader import CacheDataset, widen
    from deepspec.data.cache.plan import load_plan_inputs, make_plan
    from deepspec.data.cache.shards import finalize, write_shards
    from deepspec.targets import load_target

    target = load_target("smollm2-135m-instruct", device="cpu")
    out: dict = {"target": "smollm2-135m-instruct", "device": "cpu", "threads": torch.get_num_threads()}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "data").mkdir()
        write_conversations(root / "data" / "regenerated.jsonl", args.samples, 40 if args.smoke else None)
        dirs = {}
        for dtype in ("bf16", "fp8"):
            cfg = config_from_dict({
                "data": {"dir": str(root / "data")},
                "cache": {"dir": str(root / dtype), "dtype": dtype, "max_length": args.max_length, "batch_tokens": 4096},
            })
            tokenizer, tconf = load_plan_inputs(cfg)
            plan = make_plan(cfg, "train", tokenizer, tconf)
            d = cfg.cache_train_dir
            d.mkdir(parents=True)
            t0 = time.perf_counter()
            write_shards(d, plan, 0, 1, cfg, model=target.model)
            dt = time.perf_counter() - t0
            manifest = finalize(d, plan, {})
            tokens = manifest["counts"]["tokens"]
            out[dtype] = {"bytes": manifest["bytes"], "bytes_per_token": manifest["bytes"] / tokens,
                          "tokens_per_s": tokens / dt, "capture_s": round(dt, 2)}
            out.update(samples=manifest["counts"]["samples"], tokens=tokens, taps=manifest["taps"],
                       hidden_size=manifest["hidden_size"])
            dirs[dtype] = d
        a, b = CacheDataset(dirs["bf16"]), CacheDataset(dirs["fp8"])
        err_t, err_f = [], []
        for i in range(len(a)):
            # the reader returns features in their stored dtype (fp8 with per-row scales): widen applies the scales
            x, y = widen(a[i]), widen(b[i])
            err_t.append(relative_error(y["taps"], x["taps"]))
            err_f.append(relative_error(y["final_hidden"], x["final_hidden"]))
    out["bytes_per_token"] = {"bf16": out["bf16"]["bytes_per_token"], "fp8": out["fp8"]["bytes_per_token"]}
    out["fp8_over_bf16_bytes"] = out["fp8"]["bytes_per_token"] / out["bf16"]["bytes_per_token"]
    out["tokens_per_s"] = {"bf16": out["bf16"]["tokens_per_s"], "fp8": out["fp8"]["tokens_per_s"]}
    out["fp8_rel_error_vs_bf16"] = {"taps_mean": sum(err_t) / len(err_t), "taps_max": max(err_t),
                                    "final_mean": sum(err_f) / len(err_f), "final_max": max(err_f)}
    print(json.dumps(out, indent=2))
    return 0 if out["fp8_over_bf16_bytes"] <= 0.55 else 1


if __name__ == "__main__":
    sys.exit(main())
