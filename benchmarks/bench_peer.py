#!/usr/bin/env python
"""deepspec against the peer trainer (vLLM's `speculators`) on the same data, budget, machine and run.

    flock /tmp/deepspec-heavy.lock python benchmarks/bench_peer.py config/quickstart/eagle3_blend.yaml \
        [--opts k=v ...] [--split heldout:general] [--max-samples 64] [--spec-tokens 3] [--max-tokens 160]

1. ours: `deepspec run` stages prompts -> regenerate -> cache -> train of the recipe; the wall time of
   its train stage is the budget (`budget_s`);
2. peer data from the same `regenerated.jsonl`: our own token ids and loss masks (the chat template and
   assistant spans our cache used) through `speculators prepare-data`, then hidden states from vLLM's `extract_hidden_states` served with
   the CPU connector of shared/peers (aux ids 1, 14, 27 + the last layer, as the peer's recipe);
3. the peer trains EAGLE-3 with shared/peers/speculators_cpu.py for the whole number of epochs nearest the budget
   (estimated from its measured throughput, killed at 1.25 x the budget; the last saved epoch is used);
4. both drafts are served by vLLM (`--speculative-config`, greedy, the same number of speculative
   tokens) on the same held-out prompts in this same run; vLLM's own counters give each mean
   acceptance length.

Prints one JSON line: {"ours", "peer" (vLLM mean acceptance lengths), "budget_s", "prompts", ...}.
The peer runs in its own venv (benchmarks/peer_setup.sh; PEER_VENV, default .peer-venv); the helper
files it needs are in shared/peers (PEER_DIR). Data preparation and hidden-state extraction of either
side are outside the budget; only training time is matched.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PEER_AUX_IDS = [1, 14, 27]  # vLLM ids (id k = the input of layer k) of the peer's own default recipe
# The peer on 2 CPU cores, measured in this benchmark (2026-11-25: 200 s per epoch of the blended quickstart's 110,750
# tokens, validation included; shared/peers/README.md quotes 830-950 at 2048-token packing): sizes its epochs to the budget
PEER_TOKENS_PER_S = 550.0


def peer_epochs(budget_s: float, tokens: int, requested: int | None = None) -> tuple[int, float]:
    """(the peer's epochs, its time limit in s): `requested`, else the whole number of epochs nearest our training time
    at PEER_TOKENS_PER_S; the limit is 1.25x the time those epochs should take at that rate's sizing, plus a minute."""
    sized = max(1, round(budget_s / (tokens / PEER_TOKENS_PER_S)))
    epochs = requested or sized
    return epochs, 1.25 * budget_s * epochs / sized + 60


def _fail(msg: str) -> int:
    print(json.dumps({"error": msg}))
    return 2


def held_out_prompts(cfg, split: str, max_samples: int | None) -> tuple[Path, list[dict]]:
    """(file, rows {turns, system}) of a held-out split, as our evaluator reads it."""
    from deepspec.data.prompts import heldout_split_path
    from deepspec.eval.benchmarks import HELDOUT_PREFIX, HELDOUT_TASK, load_heldout

    path = cfg.heldout_path if split == HELDOUT_TASK else heldout_split_path(cfg, split.removeprefix(HELDOUT_PREFIX))
    bench = load_heldout(path, max_samples, cfg.eval.seed, name=split)
    if bench is None:
        raise SystemExit(_fail(f"{path} does not exist: the recipe has no held-out split {split!r}"))
    return path, bench.samples


def run_peer(cmd: list[str], log: Path, timeout: float | None = None, env: dict | None = None) -> tuple[int, float]:
    t0 = time.monotonic()
    with open(log, "ab") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 15)
            code = proc.wait()
    return code, time.monotonic() - t0


def peer_hidden_states(cfg, target_path: str, peer_bin: Path, data_dir: Path, peer_dir: Path, log: Path) -> None:
    """vLLM extract_hidden_states with the CPU connector; `speculators generate-offline-data` drives it."""
    from deepspec.data.engines.server import VLLMServer

    hs_dir = data_dir.parent / "hidden_states_raw"  # the server's per-request files; generate-offline-data writes
    hs_dir.mkdir(parents=True, exist_ok=True)       # the trainer's hs_<i>.safetensors into data_dir/hidden_states
    num_layers = json.loads((Path(target_path) / "config.json").read_text())["num_hidden_layers"]
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": PEER_AUX_IDS + [num_layers]}}}
    kv = {"kv_connector": "CPUHiddenStatesConnector", "kv_connector_module_path": "cpu_hidden_states_connector",
          "kv_role": "kv_producer", "kv_connector_extra_config": {"shared_storage_path": str(hs_dir)}}
    env = {"PYTHONPATH": os.pathsep.join([str(peer_dir), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    with VLLMServer(target_path, speculative_config=spec, dtype=cfg.target.dtype, max_model_len=cfg.cache.max_length + 16,
                    extra_args=["--no-enable-chunked-prefill", "--kv-transfer-config", json.dumps(kv)], env=env,
                    log_path=log.with_name("vllm_hidden_states.log")) as server:
        code, _ = run_peer([str(peer_bin / "speculators"), "generate-offline-data", "--model", target_path, "--endpoint", server.url,
                            "--preprocessed-data", str(data_dir), "--concurrency", "8", "--validate-outputs"], log)
    if code != 0:
        raise SystemExit(_fail(f"speculators generate-offline-data failed (exit {code}); see {log}"))


def served_length(cfg, target_path: str, draft_dir: Path, rows: list[dict], spec_tokens: int, max_tokens: int, log: Path) -> dict:
    """vLLM's mean acceptance length of one draft on the held-out rows (every user turn, its own answers)."""
    import httpx

    from deepspec.data.engines.server import VLLMServer, counters_delta

    spec = {"method": "eagle3", "model": str(draft_dir), "num_speculative_tokens": spec_tokens}
    with VLLMServer(target_path, speculative_config=spec, dtype=cfg.target.dtype, max_model_len=cfg.eval.engine_max_model_len,
                    log_path=log) as server:
        http = httpx.Client(base_url=server.url, timeout=httpx.Timeout(1800.0))

        def conversation(row: dict) -> None:
            messages = [{"role": "system", "content": row["system"]}] if row.get("system") else []
            for turn in row["turns"]:
                messages.append({"role": "user", "content": turn})
                body = {"model": server.served_model_name, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
                        "chat_template_kwargs": dict(cfg.target.chat_template_kwargs or {})}
                r = http.post("/chat/completions", json=body)
                r.raise_for_status()
                messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"] or ""})

        before = server.spec_decode_counters()
        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(conversation, rows))
        d = counters_delta(before, server.spec_decode_counters())
    mal = d.get("mean_acceptance_length")
    return {"mean_acceptance_length": round(mal, 4) if mal else None, "drafts": d.get("drafts"),
            "acceptance_rate_per_pos": [round(x, 4) for x in (d.get("acceptance_rate_per_pos") or [])]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("config", nargs="?", help="an EAGLE-3 recipe (e.g. config/quickstart/eagle3_blend.yaml)")
    p.add_argument("--opts", nargs="+", default=[])
    p.add_argument("--split", default="heldout:general", help="held-out split asked of both drafts: heldout or heldout:<name>")
    p.add_argument("--max-samples", type=int, default=64)
    p.add_argument("--spec-tokens", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=None, help="answer budget (default: the recipe's eval.max_new_tokens)")
    p.add_argument("--peer-epochs", type=int, default=None,
                   help="the peer's epochs (default: the whole number nearest our training time); a bracket around the "
                        "budget when no whole number of epochs matches it (its time is in peer_detail.train_s)")
    p.add_argument("--peer-venv", default=os.environ.get("PEER_VENV", str(ROOT / ".peer-venv")))
    p.add_argument("--peer-dir", default=os.environ.get("PEER_DIR", str(ROOT.parent / "shared" / "peers")),
                   help="folder with speculators_cpu.py and cpu_hidden_states_connector.py")
    p.add_argument("--work", default=None, help="peer work folder (default: <project>/bench_peer)")
    p.add_argument("--smoke", action="store_true", help="our side on a tiny random target (cache, 2 training steps, the peer's "
                   "input rows, our export, the held-out prompts); the peer and vLLM are not run: a check of the code path")
    args = p.parse_args()
    if args.smoke:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from _smoke import smoke_env, tiny_recipe

        smoke_env()
        with tempfile.TemporaryDirectory(prefix="smoke_") as tmp:
            args.config, args.split, args.work = str(tiny_recipe(Path(tmp))), "heldout", str(Path(tmp) / "bench_peer")
            return compare(args)
    if args.config is None:
        p.error("give an EAGLE-3 recipe (or --smoke)")
    return compare(args)


def compare(args) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("WANDB_MODE", "offline")

    peer_bin, peer_dir = Path(args.peer_venv) / "bin", Path(args.peer_dir)
    if args.smoke:
        pass  # the peer is not run
    elif not (peer_bin / "speculators").exists():
        return _fail(f"no speculators in {args.peer_venv}: run `bash benchmarks/peer_setup.sh` first (or set PEER_VENV)")
    elif not (peer_dir / "speculators_cpu.py").is_file():
        return _fail(f"{peer_dir} has no speculators_cpu.py: set PEER_DIR to the shared peers folder")

    from deepspec.config import load_config
    from deepspec.export.writers import export_draft
    from deepspec.pipeline import run
    from deepspec.targets import resolve_target_path

    cfg = load_config(args.config, args.opts)
    if cfg.model.algorithm != "eagle3":
        return _fail(f"the peer comparison trains EAGLE-3; {args.config} trains {cfg.model.algorithm}")
    max_tokens = args.max_tokens or cfg.eval.max_new_tokens
    t_all = time.monotonic()

    # 1. ours, timed by the pipeline's own train stage
    with contextlib.redirect_stdout(sys.stderr):  # the run's summary table must not mix with the JSON line
        # a smoke's recipe comes with its conversations regenerated
        stages = ("cache", "train") if args.smoke else ("prompts", "regenerate", "cache", "train")
        (rec,) = run([args.config], args.opts, stages=stages, engine=False)
    train_stage = next(s for s in rec.stages if s.name == "train")
    if train_stage.skipped:
        return _fail(f"the train stage was reused ({rec.checkpoint}): delete {cfg.run_dir} so that its time is measured")
    budget_s = train_stage.seconds
    target_path = resolve_target_path(cfg.target.name)
    work = Path(args.work) if args.work else cfg.project_dir / "bench_peer"
    work.mkdir(parents=True, exist_ok=True)
    log = work / "peer.log"

    # 2. the peer's data: our own token ids and loss masks of the same regenerated conversations (the template and
    #    assistant spans our cache used), so only the trainer differs; then hidden states through vLLM
    from deepspec.data.chat import render_conversation
    from deepspec.data.jsonl import read_jsonl, write_jsonl_atomic
    from deepspec.targets import load_tokenizer

    t0 = time.monotonic()
    tok = load_tokenizer(cfg.target.name)
    rows, tokens = [], 0
    for r in read_jsonl(cfg.regenerated_path):
        chat = render_conversation(tok, r["conversations"], cfg.target.chat_template_kwargs, max_length=cfg.cache.max_length)
        if sum(chat.loss_mask) >= cfg.cache.min_loss_tokens:
            rows.append({"id": r["id"], "input_ids": list(chat.input_ids), "loss_mask": [int(x) for x in chat.loss_mask]})
            tokens += len(chat.input_ids)
    write_jsonl_atomic(work / "peer_input.jsonl", rows)
    if args.smoke:
        prompts_path, held = held_out_prompts(cfg, args.split, args.max_samples)
        ours_export = export_draft(rec.checkpoint, work / "ours-export-vllm", "vllm", target=target_path)
        print(json.dumps({
            "smoke": True, "not_run": "the peer (speculators prepare-data, its hidden states through vLLM, its training) and "
                                      "vLLM serving both drafts (ours, peer)",
            "budget_s": round(budget_s, 1), "peer_input_rows": len(rows), "peer_input_tokens": tokens,
            "peer_epochs_for_budget": peer_epochs(budget_s, tokens, args.peer_epochs)[0],
            "prompts": {"split": args.split, "file": str(prompts_path), "samples": len(held), "max_tokens": max_tokens},
            "ours_export_files": sorted(f.name for f in Path(ours_export).iterdir()), "checkpoint": str(rec.checkpoint),
            "seconds": round(time.monotonic() - t_all, 1)}))
        return 0
    data_dir = work / "data"
    # this run's own: the peer's prepare-data refuses to overwrite a folder holding an earlier run's hidden states
    shutil.rmtree(data_dir, ignore_errors=True)
    code, _ = run_peer([str(peer_bin / "speculators"), "prepare-data", "--model", target_path, "--data", str(work / "peer_input.jsonl"),
                        "--output", str(data_dir), "--token-freq-path", str(data_dir / "token_freq.pt"), "--no-skip-token-freq",
                        "--seq-length", str(cfg.cache.max_length), "--overwrite"], log)
    if code != 0:
        return _fail(f"speculators prepare-data failed (exit {code}); see {log}")
    peer_hidden_states(cfg, target_path, peer_bin, data_dir, peer_dir, log)
    peer_data_s = time.monotonic() - t0

    # 3. the peer trains for the same time
    # whole epochs (its schedule decays over the planned epochs), the count nearest the budget; the run is still capped
    epochs, limit = peer_epochs(budget_s, tokens, args.peer_epochs)
    save = work / "peer_ckpt"
    shutil.rmtree(save, ignore_errors=True)  # a checkpoint of an earlier run is never taken for this one's
    cmd = [str(peer_bin / "python"), str(peer_dir / "speculators_cpu.py"), "--speculator-type", "eagle3",
           "--verifier-name-or-path", target_path, "--data-path", str(data_dir),
           "--target-layer-ids", *map(str, PEER_AUX_IDS), "--draft-vocab-size", str(cfg.model.draft_vocab_size or 8192),
           "--no-norm-before-fc", "--fc-norm", "--norm-output", "--draft-attn-impl", "sdpa", "--loss-implementation", "eager",
           "--num-workers", "0", "--total-seq-len", str(max(2048, cfg.cache.max_length)), "--lr", "3e-3",
           "--epochs", str(epochs), "--save-path", str(save)]
    code, peer_train_s = run_peer(cmd, log, timeout=limit)
    done = sorted((d for d in save.glob("*") if (d / "config.json").is_file()), key=lambda d: d.stat().st_mtime)
    if not done:
        return _fail(f"the peer saved no checkpoint within {limit:.0f} s (exit {code}); see {log}")
    peer_ckpt = done[-1]

    # 4. both drafts served by vLLM on the same held-out prompts
    prompts_path, rows = held_out_prompts(cfg, args.split, args.max_samples)
    ours_export = export_draft(rec.checkpoint, work / "ours-export-vllm", "vllm", target=target_path)
    ours = served_length(cfg, target_path, ours_export, rows, args.spec_tokens, max_tokens, work / "vllm_ours.log")
    peer = served_length(cfg, target_path, peer_ckpt, rows, args.spec_tokens, max_tokens, work / "vllm_peer.log")
    print(json.dumps({
        "ours": ours["mean_acceptance_length"], "peer": peer["mean_acceptance_length"], "budget_s": round(budget_s, 1),
        "prompts": {"split": args.split, "file": str(prompts_path), "samples": len(rows), "max_tokens": max_tokens},
        "num_speculative_tokens": args.spec_tokens, "config": args.config, "opts": args.opts,
        "ours_detail": {**ours, "checkpoint": str(rec.checkpoint)},
        "peer_detail": {**peer, "checkpoint": str(peer_ckpt), "epochs": epochs, "train_s": round(peer_train_s, 1),
                        "exit_code": code, "data_s": round(peer_data_s, 1), "rows": len(rows), "tokens": tokens},
        "seconds": round(time.monotonic() - t_all, 1),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
