"""Peak memory of one EAGLE-3 / DFlash training step (forward + backward) against the sample length.

A SmolLM2-shaped target config (hidden 576, 9 heads / 3 KV heads, 30 layers, vocabulary 49,152) with random
weights; one sample of T tokens per step; each length runs in a fresh child process and reports its peak RSS
(ru_maxrss) and step time. Memory linear in T means peak(4T) / peak(T) <= 4 (plus the fixed part).

    python benchmarks/bench_draft_memory.py --lengths 4096 16384 --ttt 7
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def _rss_kib() -> int:
    """Resident memory now (the high-water mark ru_maxrss may still hold start-up peaks)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def child(algorithm: str, t: int, ttt: int, draft_vocab: int | None, ckpt: bool) -> dict:
    import torch
    from transformers import LlamaConfig

    from deepspec.config.model import ModelConfig
    from deepspec.drafts import DraftBatch, get_algorithm

    torch.manual_seed(0)
    torch.set_num_threads(2)
    tc = LlamaConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=30,
                     vocab_size=49152, max_position_embeddings=max(8192, 2 * t))
    kw = dict(activation_checkpointing=ckpt) if ckpt else {}
    cfg = ModelConfig(algorithm=algorithm, target_layer_ids=[1, 14, 26], ttt_length=ttt, draft_vocab_size=draft_vocab, num_anchors=512, **kw)
    draft = get_algorithm(algorithm).from_target_config(tc, cfg)
    draft.load_target_weights(torch.randn(49152, 576) * 0.02, torch.randn(49152, 576) * 0.02)
    draft.train()
    draft.train_metrics = False
    ids = torch.randint(0, 49152, (1, t))
    ones = torch.ones(1, t, dtype=torch.bool)
    batch = DraftBatch(ids, ones, ones, torch.randn(1, t, 3, 576), torch.randn(1, t, 576))
    base = _rss_kib()
    t0 = time.perf_counter()
    loss, _ = draft.loss(batch)
    loss.backward()
    dt = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"tokens": t, "peak_rss_mib": round(peak / 1024, 1), "step_peak_over_start_mib": round((peak - base) / 1024, 1), "step_s": round(dt, 2),
            "loss": round(float(loss), 4)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--algorithm", default="eagle3")
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--draft-vocab", type=int, default=0, help="0 = the full 49,152-token vocabulary")
    ap.add_argument("--activation-checkpointing", action="store_true")
    ap.add_argument("--child", type=int, default=0)
    a = ap.parse_args()
    dv = a.draft_vocab or None
    if a.child:
        print(json.dumps(child(a.algorithm, a.child, a.ttt, dv, a.activation_checkpointing)))
        return
    rows = []
    for t in a.lengths:
        cmd = [sys.executable, __file__, "--algorithm", a.algorithm, "--ttt", str(a.ttt), "--draft-vocab", str(a.draft_vocab), "--child", str(t)]
        if a.activation_checkpointing:
            cmd.append("--activation-checkpointing")
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode:
            rows.append({"tokens": t, "error": out.stderr.strip().splitlines()[-1:]})
        else:
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    res = {"algorithm": a.algorithm, "ttt_length": a.ttt, "draft_vocab": dv or 49152, "activation_checkpointing": a.activation_checkpointing, "runs": rows}
    ok = [r for r in rows if "peak_rss_mib" in r]
    if len(ok) >= 2:
        res["peak_ratio_last_over_first"] = round(ok[-1]["peak_rss_mib"] / ok[0]["peak_rss_mib"], 2)
        res["step_ratio_last_over_first"] = round(ok[-1]["step_peak_over_start_mib"] / max(ok[0]["step_peak_over_start_mib"], 1e-9), 2)
        res["length_ratio"] = ok[-1]["tokens"] / ok[0]["tokens"]
    print(json.dumps(res))


if __name__ == "__main__":
    main()
