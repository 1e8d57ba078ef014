#!/usr/bin/env python
"""Streamed vs offline training on the same data in the same run: training tokens/s, spool peak bytes, producer and
trainer idle fractions. Prints one JSON object.

    .venv/bin/python benchmarks/bench_stream.py [--samples 48] [--steps 12] [--max-length 512] [--spool-gb 0.05] \
        [--transports file mooncake]

The embedded SmolLM2 target and the quickstart's EAGLE-3 recipe (fp32 training, global batch 4, one worker).
Conversations as in bench_cache.py (prompt texts as stand-in answers: speed depends on lengths). The offline run
builds its cache first (timed apart) and trains from it; the streamed run trains while one producer
(`deepspec data stream`) captures the same samples into a spool capped at --spool-gb. A producer has a device of
its own in a real deployment, so on a CPU machine the trainer runs on the first usable core and the producer on the last
(both runs train on the first; the cache build runs on the last, as the producer does). Both runs read through the
loader thread, two micro-batches ahead (a streamed run's default; an offline run on a CPU reads inline unless told).
Needs >= 2 cores; --smoke, a check of the code path and no measurement, shares one core where it has only one.

  offline.tokens_per_s / stream.tokens_per_s   supervised + prompt tokens trained per second of training wall time
  stream.vs_offline                            their ratio (>= 0.8 is the target while producers keep up)
  stream_mooncake.*                            the same through a Mooncake store on 127.0.0.1 (--transports mooncake)
  stream.vs_offline_when_fed                   offline train time / streamed train time less its waits for the producer
  stream.end_to_end_vs_offline                 (offline cache build + offline training) / streamed training
  stream.first_loss_rel_diff / final_loss_rel_diff  streamed vs offline loss at the first and last step (the same samples;
                                               features differ by round-off where captures batch samples differently)
  stream.spool_peak_bytes / spool_cap_bytes    the most the producer held in the spool, and the cap
  stream.trainer_wait_fraction                 the trainer's reads' time spent waiting for the producer / training time
  stream.producer_busy_fraction                the producer's capture time / its lifetime after it found the trainer
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))


def _recipe(root: Path, args) -> Path:
    path = root / "recipe.yaml"
    tiny = ""
    if args.smoke:  # the tiny random target and taps of its 6 layers
        from _smoke import TAPS, tiny_target

        tiny = (f"target: {{name: {tiny_target(root)}, dtype: float32}}\n"
                f"model: {{target_layer_ids: {TAPS}, draft_vocab_size: null, init_copy_heads: false}}\n")
    path.write_text(f"""_base_: {REPO}/config/quickstart/eagle3.yaml
project: bench-stream
exp: offline
output_root: {root}/out
data: {{dir: {root / 'data'}}}
target: {{dtype: float32}}
cache: {{max_length: {args.max_length}, spool_gb: {args.spool_gb}, stream_ahead: 4, stream_producers: 0}}
train: {{output_root: {root}/ckpt, precision: fp32, max_steps: {args.steps}, global_batch_size: 4, micro_batch_size: 1,
        save_every: {args.steps}, val_every: 0, log_every: 1, prefetch_depth: 2}}
logging: {{progress: false, wandb: false, tensorboard: false}}
{tiny}""")
    return path


def _train_seconds(run_dir: Path, t_wall: float) -> dict:
    rows = [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]
    return {"steps": len(rows), "tokens_per_s": round(rows[-1]["train/tokens_per_s"], 1), "train_wall_s": round(t_wall, 1),
            "first_loss": rows[0]["train/loss"], "final_loss": rows[-1]["train/loss"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=48)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--spool-gb", type=float, default=0.05)
    ap.add_argument("--transports", nargs="+", default=["file"], choices=["file", "mooncake"],
                    help="streamed runs to make: through the spool folder and/or a Mooncake store on 127.0.0.1 (TCP)")
    ap.add_argument("--smoke", action="store_true", help="a tiny random target (byte tokens), 8 samples of at most 192 tokens, 2 steps, "
                    "the file spool: a check of the code path")
    args = ap.parse_args()
    if args.smoke:
        args.samples, args.steps, args.max_length, args.transports = 8, 2, 192, ["file"]
    os.environ.update(DEEPSPEC_NO_PROGRESS="1", HF_HUB_OFFLINE="1", WANDB_MODE="offline", DEEPSPEC_CACHE_DEVICE="cpu")
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2 and not args.smoke:
        raise SystemExit(f"bench_stream.py needs 2 cores (the producer and the trainer each get one); this process may use {cores}.")
    args.trainer_core, args.producer_core = cores[0], cores[-1]
    import torch

    from bench_cache import write_conversations
    from deepspec.config import load_config
    from deepspec.train import train

    torch.set_num_threads(1)
    out: dict = {**({"smoke": True} if args.smoke else {}), "target": "tiny random llama" if args.smoke else "smollm2-135m-instruct", "draft": "eagle3 (config/quickstart/eagle3.yaml)", "samples": args.samples,
                 "max_length": args.max_length, "steps": args.steps, "global_batch": 4, "machine": f"CPU, trainer core {args.trainer_core}, producer core {args.producer_core}"}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "data").mkdir()
        write_conversations(root / "data" / "regenerated.jsonl", args.samples, 40 if args.smoke else None)
        recipe = _recipe(root, args)
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))

        t0 = time.perf_counter()  # the offline cache, built on the producer's core
        built = subprocess.run(["taskset", "-c", str(args.producer_core), sys.executable, "-m", "deepspec.cli", "data", "cache", str(recipe), "--split",
                                "train"], env=env, capture_output=True, text=True)
        if built.returncode != 0:
            raise SystemExit(f"the offline cache build failed:\n{built.stderr[-3000:]}")
        build_s = time.perf_counter() - t0
        os.sched_setaffinity(0, {args.trainer_core})
        cfg = load_config(recipe)
        t0 = time.perf_counter()
        train(cfg)
        out["offline"] = {**_train_seconds(cfg.run_dir, time.perf_counter() - t0), "cache_build_s": round(build_s, 1)}

        for transport in args.transports:
            key = "stream" if transport == "file" else f"stream_{transport}"
            with _transport(transport, root, args.producer_core) as extra:
                out[key] = _streamed(recipe, [f"exp={key}", "cache.mode=stream", *extra], env, args, out["offline"])
    print(json.dumps(out))
    return 0


@contextlib.contextmanager
def _transport(transport: str, root: Path, core: int):
    """The --opts of a transport; for mooncake, a master with its metadata service on 127.0.0.1 while the run lasts."""
    if transport == "file":
        yield []
        return
    import socket

    ports = []
    for _ in range(3):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    with open(root / "mooncake_master.log", "w") as log:
        master = subprocess.Popen(["taskset", "-c", str(core), "bash", str(REPO / "scripts/data/mooncake_master.sh"), "--host", "127.0.0.1",
                                   "--port", str(ports[0]), "--metadata-port", str(ports[1]), "--metrics-port", str(ports[2])],
                                  stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            time.sleep(3)
            yield ["cache.spool_transport=mooncake", f"cache.mooncake_master=127.0.0.1:{ports[0]}",
                   f"cache.mooncake_metadata=http://127.0.0.1:{ports[1]}/metadata"]
        finally:
            os.killpg(master.pid, 9)
            master.wait()


def _streamed(recipe: Path, opts: list[str], env: dict, args, off: dict) -> dict:
    """One streamed run: the trainer here (its core), one producer on the producer's core."""
    from deepspec.config import load_config
    from deepspec.data.stream.spool import spool_dir
    from deepspec.train import train

    cfg = load_config(recipe, opts)
    producer = subprocess.Popen(["taskset", "-c", str(args.producer_core), sys.executable, "-m", "deepspec.cli", "data", "stream", str(recipe),
                                 "--opts", *opts], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        t0 = time.perf_counter()
        train(cfg)
        wall = time.perf_counter() - t0
        p_out, p_err = producer.communicate(timeout=120)
    finally:
        if producer.poll() is None:
            producer.kill()
    if producer.returncode != 0:
        raise SystemExit(f"the producer failed:\n{p_err[-3000:]}")
    stats = json.loads(p_out.strip().splitlines()[-1])
    done = json.loads((spool_dir(cfg) / "done.0").read_text())
    lived = stats["busy_s"] + stats["wait_trainer_s"] + stats["wait_room_s"]
    st = {**_train_seconds(cfg.run_dir, wall), "spool_peak_bytes": stats["peak_bytes"],
          "spool_cap_bytes": int(args.spool_gb * 1e9), "produced": stats["produced"],
          "trainer_wait_fraction": round(done["waited_s"] / wall, 3),
          "producer_busy_fraction": round(stats["busy_s"] / max(lived, 1e-9), 3),
          "producer_wait_room_s": round(stats["wait_room_s"], 1)}
    st["vs_offline"] = round(st["tokens_per_s"] / off["tokens_per_s"], 3)
    # the trainer's own pace: its wall time less the time its reads waited for the producer
    st["vs_offline_when_fed"] = round(off["train_wall_s"] / max(st["train_wall_s"] - done["waited_s"], 1e-9), 3)
    st["end_to_end_vs_offline"] = round((off["train_wall_s"] + off["cache_build_s"]) / st["train_wall_s"], 3)
    st["first_loss_rel_diff"] = abs(st["first_loss"] - off["first_loss"]) / off["first_loss"]
    st["final_loss_rel_diff"] = abs(st["final_loss"] - off["final_loss"]) / off["final_loss"]
    return st


if __name__ == "__main__":
    raise SystemExit(main())
