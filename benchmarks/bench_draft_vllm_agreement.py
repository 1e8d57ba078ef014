"""Does vLLM accept what our offline decoding accepts? Prints one JSON object.

    .venv/bin/python benchmarks/bench_draft_vllm_agreement.py --algorithm eagle3|dflash [--prompts 4] [--new-tokens 48] [--steps 40]
    .venv/bin/python benchmarks/bench_draft_vllm_agreement.py --smoke   # (a) and the export on a tiny random target, no vLLM

Briefly trains a draft for the embedded SmolLM2 on the target's own greedy answers to a few prompts
(train = test: this measures *agreement*, not quality), then decodes the same prompts greedily
(a) offline with our proposer (k = 3 drafts per round, chain stops at the first mismatch) and
(b) in real vLLM with the exported draft (temperature 0, num_speculative_tokens 3),
and reports mean acceptance length tau (incl. the bonus token) and accepted tokens per position for both.
vLLM runs bf16, our loop fp32, so small differences are expected.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPTS = ["What is the capital of France?", "Write a short poem about the sea.", "Explain photosynthesis in one paragraph.",
           "List three prime numbers and explain why they are prime.", "How do I boil an egg?", "What is machine learning?",
           "Give me a tip for learning Python.", "Why is the sky blue?"]
K = 3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--algorithm", default="eagle3", choices=["eagle3", "dflash"])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--smoke", action="store_true", help="a tiny random target, 2 prompts of 16 tokens: trains, decodes "
                    "offline and exports; vLLM is not started (a check of the code path up to it)")
    args = ap.parse_args()
    target = "smollm2-135m-instruct"
    if args.smoke:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from _smoke import smoke_env, tiny_target

        smoke_env()
        args.prompts, args.new_tokens = 2, 16
        with tempfile.TemporaryDirectory(prefix="smoke_") as tmp:
            args.workdir = tmp
            measure(args, str(tiny_target(Path(tmp))))
        return
    measure(args, target)


def measure(args, target: str) -> None:

    import torch

    from deepspec.config.model import ModelConfig
    from deepspec.drafts import DraftBatch, get_algorithm
    from deepspec.drafts.checkpoint import save_draft, target_weights
    from deepspec.export.writers import export_draft
    from deepspec.data.engines.server import VLLMServer
    from deepspec.targets import capture, load_target

    torch.manual_seed(0)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-agree-"))
    tgt = load_target(target, dtype="float32", device="cpu")
    tok = tgt.tokenizer
    prompts = PROMPTS[: args.prompts]
    seqs, plens = [], []
    t0 = time.perf_counter()
    for p in prompts:
        ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, return_tensors="pt")
        ids = ids if torch.is_tensor(ids) else ids["input_ids"]
        seqs.append(tgt.model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False)[0])
        plens.append(ids.shape[1])
    gen_s = time.perf_counter() - t0
    t = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), t), tok.pad_token_id)
    lm = torch.zeros(len(seqs), t, dtype=torch.bool)
    am = torch.zeros_like(lm)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], am[i, : len(s)], lm[i, plens[i] : len(s)] = s, True, True

    if args.algorithm == "eagle3":
        cfg = ModelConfig(algorithm="eagle3", draft_vocab_size=4096, ttt_length=2)
    else:
        cfg = ModelConfig(algorithm="dflash", block_size=K + 1, num_anchors=64)
    draft = get_algorithm(args.algorithm).from_target_config(tgt.config, cfg)
    draft.load_target_weights(*target_weights(tgt.model))
    v = tgt.config.vocab_size
    draft.set_token_frequencies(torch.bincount(ids[lm], minlength=v).float() + 1e-3 * torch.bincount(ids[am], minlength=v).float())
    taps, final = capture(tgt.model, ids, draft.taps, attention_mask=am.long())
    batch = DraftBatch(ids, lm, am, taps, final)
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=args.lr)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        loss, metrics = draft.loss(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    train_s = time.perf_counter() - t0
    train_metrics = {k: round(float(n / d), 4) for k, (n, d) in metrics.items() if k.startswith(("alpha_tf", "top1", "greedy_tau", "expected_tau")) and float(d) > 0}

    # (a) offline greedy chains with our proposer
    draft.eval()
    rounds, per_pos = 0, [0] * K
    for i, s in enumerate(seqs):
        prop, pos, seen = draft.proposer(), plens[i], 0
        while pos < len(s) - K:
            toks, _ = prop.propose(s[: pos + 1], taps[i, seen:pos], seen, K)
            seen = pos
            a = 0
            while a < min(K, toks.numel()) and int(toks[a]) == int(s[pos + 1 + a]):
                per_pos[a] += 1
                a += 1
            rounds += 1
            pos += a + 1
    offline = {"rounds": rounds, "accepted_per_pos": per_pos, "tau": round(1 + sum(per_pos) / max(rounds, 1), 4)}

    # (b) the exported draft in real vLLM
    ckpt = save_draft(draft, work / "ckpt", tgt.provenance())
    export = export_draft(ckpt, work / "export", "vllm")
    spec = {"method": args.algorithm, "model": str(export), "num_speculative_tokens": K}
    head = {"algorithm": args.algorithm, "target": target, "prompts": len(prompts), "new_tokens": args.new_tokens,
            "train_steps": args.steps, "generate_s": round(gen_s, 1), "train_s": round(train_s, 1),
            "train_metrics_last_step": train_metrics, "offline_fp32": offline}
    if args.smoke:  # the server takes ~90 s to start on 2 cores
        print(json.dumps({"smoke": True, **head, "not_run": "vLLM serving the export (vllm_bf16)",
                          "export_files": sorted(f.name for f in Path(export).iterdir())}, indent=2))
        return
    with VLLMServer(tgt.path, speculative_config=spec, log_path=work / "vllm.log", max_model_len=1024) as srv:
        before = srv.spec_decode_counters()
        for p in prompts:
            body = json.dumps({"model": srv.served_model_name, "messages": [{"role": "user", "content": p}],
                               "max_tokens": args.new_tokens, "temperature": 0}).encode()
            req = urllib.request.Request(srv.url + "/chat/completions", data=body, headers={"Content-Type": "application/json"})
            urllib.request.urlopen(req, timeout=600).read()
        after = srv.spec_decode_counters()
    drafts = after["drafts"] - before["drafts"]
    acc_pos = [a - b for a, b in zip(after["accepted_per_pos"], before["accepted_per_pos"] + [0.0] * K)]
    vllm = {"drafts": drafts, "accepted_per_pos": acc_pos,
            "tau": round(1 + (after["accepted_tokens"] - before["accepted_tokens"]) / max(drafts, 1), 4)}
    print(json.dumps({**head, "vllm_bf16": vllm}, indent=2))


if __name__ == "__main__":
    main()
