#!/usr/bin/env python
"""GPU figures: training at users' scale beside the peer trainer, the recipes on torchrun + NCCL (DDP / FSDP2 /
torch.compile), and speculative decoding on CUDA, on random-weight targets built from configs.

One invocation = one `--row`, each well under 10 minutes on an H100 (docs/training.md lists the commands):

    python benchmarks/bench_gpu.py --row env   --out R.jsonl     # the environment line alone
    python benchmarks/bench_gpu.py --row ours  --out R.jsonl     # Qwen3-8B-shaped EAGLE-3 + DFlash at 4,096 tokens
    python benchmarks/bench_gpu.py --row peer  --out R.jsonl --peer-wheels .peer-wheels   # EAGLE-3, ours + the peer
    python benchmarks/bench_gpu.py --row long  --out R.jsonl     # one 32,768-token EAGLE-3 sample, activation checkpointing
    python benchmarks/bench_gpu.py --row cache --out R.jsonl     # EAGLE-3 + DFlash trained from an on-disk cache
    python benchmarks/bench_gpu.py --row recipes --out R.jsonl   # the recipe / evaluator section described below
    python benchmarks/bench_gpu.py --smoke --row ours            # any row on tiny shapes: a CPU check of its code path

benchmarks/gpu_check.sh runs the rows that matter most, with the CUDA-only tests, in one command under 9 minutes.

Output: JSON lines, each written (flushed, fsynced) to `--out` and stdout as soon as it exists: first the
environment, then one line per measured row, then the invocation's summary, so a row that finished is never lost
to a later one that hangs. Every measurement runs in a process group of its own (benchmarks/_procs.py): past its
time the whole tree (torchrun and its workers, compile workers, loader processes) is killed and an error line says so.

Rows ours / peer / long / cache (benchmarks/bench_train.py, one subprocess per row; with --smoke in its process): a Qwen3-8B-shaped target
(random embedding / norm / LM head), bf16, `--scale-seq-len` (4096) tokens per sample, `--scale-accum` (8) micro-batches
of one sample per optimizer step as a recipe accumulates, with the recipe's optimizer and anchors: our tokens/s, peak
GPU memory (torch.cuda.max_memory_allocated), MFU (the model's bf16 FLOPs over the GPU's dense bf16 peak; fp32 FLOPs
are reported beside it, not counted), and from one profiled step the GPU-busy share, kernel launches and host syncs
per step. `peer`: `speculators` 0.9.0 training the same EAGLE-3 on the same samples on the
same GPU right after ours, both one sample per optimizer step (the peer has no accumulation; its wheels, made by
`bash benchmarks/peer_setup.sh --gpu-wheels`, are installed with pip --target into /tmp/peer-site and run with this
python; its unfused loss, `--loss-implementation eager`). `long`: one EAGLE-3 sample of `--scale-long-seq-len` (32768)
tokens per step with `model.activation_checkpointing=true`, which must train without running out of memory. `cache`: the
samples are written as an on-disk cache (the format's own writer functions, the shape's taps, width and bf16) and
trained through the trainer's data path: open_cache, the cache reader and the training loader, so tokens/s includes
the reader.

Section `recipes`:

Targets (random weights, so acceptance and tau mean nothing; the tokenizer is the tiny byte-level one of
deepspec.targets.tiny, so the synthetic text is ~1 token per byte):
  smollm2   a SmolLM2-135M-shaped Llama (30 layers, hidden 576, vocab 49152), recipes config/<algo>/smollm2.yaml
  qwen3-4b  a Qwen3-4B-shaped Qwen3 (36 layers, hidden 2560, vocab 151936), the GPU recipes config/<algo>/qwen3-4b.yaml

For each target and algorithm (eagle3, dflash, dspark): a synthetic training cache through the real cache stage,
then a few optimizer steps in a torchrun worker (one rank: NCCL on the one GPU, gloo on CPU) with the recipe's
precision (`auto`/`bf16` = bf16 autocast on GPU) and parallelism (variant `ddp`: DDP, FSDP for the Qwen3 EAGLE-3
recipe), then `train.parallel=fsdp` and `train.compile=true` (SmolLM2 shape). `--budget-s` stops starting runs after that
many seconds (the default fits a 10-minute call; skipped runs are listed). `steady_tokens_per_s` leaves the first step (CUDA start-up, compilation)
out; `peak_gpu_mb` is the worker's peak allocated memory. Then the trained SmolLM2-shaped drafts (and the
Qwen3-4B-shaped draft of the first algorithm) run through our speculative decoding evaluator on the GPU: in fp32, where greedy
speculative decoding must give the target-only tokens (`greedy_outputs_match_target`), and in bf16 for speed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("DEEPSPEC_NO_PROGRESS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from _procs import GroupTimeout, last_error, pythonpath_with, run_group  # noqa: E402  (a process group per measurement)
from bench_train import _conversations, _opts  # noqa: E402  (shared synthetic data and trainer overrides)

# name -> (family, config overrides of deepspec.targets.tiny.tiny_config, recipe target, extra recipe overrides)
SHAPES = {
    "smollm2": ("llama", dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                              num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                              rms_norm_eps=1e-5, tie_word_embeddings=True), "smollm2", []),
    "qwen3-4b": ("qwen3", dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                               num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                               rms_norm_eps=1e-6, tie_word_embeddings=True), "qwen3-4b", []),
    # --tiny: the same recipes on the tests' tiny targets (taps / mask token / draft vocabulary that fit them)
    "tiny-llama": ("llama", {}, "smollm2", ["model.target_layer_ids=[0,2,4]"]),
    "tiny-qwen3": ("qwen3", {}, "qwen3-4b", ["model.target_layer_ids=[0,2,4]", "model.mask_token_id=259", "model.draft_vocab_size=256"]),
}
VARIANTS = {"ddp": [], "fsdp": ["train.parallel=fsdp"], "compile": ["train.compile=true"]}


def _merge(opts: list[str], extra: list[str]) -> list[str]:
    """`opts` with the keys of `extra` replaced (one value per key, the later one)."""
    keys = {e.split("=", 1)[0] for e in extra}
    return [o for o in opts if o.split("=", 1)[0] not in keys] + extra


def save_random_target(path: Path, shape: str, device: str) -> Path:
    """A random-weight target of `shape` as an HF folder (fp32 up to ~1B parameters, else bf16), built on `device`."""
    import torch
    from transformers import AutoModelForCausalLM

    from deepspec.targets.tiny import tiny_config, tiny_tokenizer

    if (path / "config.json").is_file():
        return path
    family, overrides, _, _ = SHAPES[shape]
    config = tiny_config(family, **overrides)
    big = config.hidden_size >= 2048
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if big else torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    tiny_tokenizer().save_pretrained(path)
    del model
    return path


def _train_run(recipe: str, opts: list[str], timeout: float, log: Path) -> dict:
    """One torchrun worker running bench_train's child (NCCL on a GPU, gloo on CPU) in a process group of its own;
    its figures. Its stdout / stderr go to `log`.out / .err (files, not pipes). Past `timeout` the whole tree is killed:
    SIGTERM first (torchrun stops its worker, which runs in a session of its own), then SIGKILL to every group of it."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
           str(REPO / "benchmarks" / "bench_train.py"), "--_child", recipe, json.dumps(opts)]
    out_path, err_path = log.with_suffix(".out"), log.with_suffix(".err")
    proc = run_group(cmd, timeout, env=dict(os.environ, PYTHONPATH=pythonpath_with(REPO)), stdout_path=out_path, stderr_path=err_path)
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}: " + last_error(proc.stderr))  # the worker's own exception
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _eval_run(ckpt: Path, dtype: str, args, out_dir: Path) -> dict:
    """Our evaluator on `ckpt` with the target in `dtype`: tau, tokens/s, speedup, greedy agreement with target-only."""
    from deepspec.config import load_config
    from deepspec.eval.runner import evaluate

    opts = [
        "eval.tasks=[" + ",".join(args.eval_tasks) + "]", f"eval.max_samples={args.eval_samples}",
        f"eval.max_new_tokens={args.eval_tokens}", "eval.temperature=0", f"eval.output_dir={out_dir}",
        "eval.num_workers=1", f"target.dtype={dtype}",
    ]
    cfg = load_config(ckpt / "config.yaml", opts)
    t0 = time.perf_counter()
    res = evaluate(cfg, ckpt)
    o = res["overall"]
    return {
        "target_dtype": dtype, "device": res["meta"]["devices"][0], "tau": o["tau"], "rounds": o["rounds"],
        "spec_tokens_per_s": o.get("spec_tokens_per_s"), "target_tokens_per_s": o.get("target_tokens_per_s"),
        "speedup": o.get("speedup"), "generated_tokens": o.get("spec_tokens"),
        "greedy_outputs_match_target": res.get("greedy_outputs_match_target"),
        "num_draft_tokens": res["meta"]["num_draft_tokens"], "wall_s": round(time.perf_counter() - t0, 1),
    }


def _bench_train(argv: list[str], timeout: float, jsonl: Path | None, log: Path) -> dict:
    """benchmarks/bench_train.py with `argv` in a process group of its own; its rows go to `jsonl` as each finishes.
    Returns its summary (or an error row: the rows it finished are in `jsonl` already)."""
    cmd = [sys.executable, str(REPO / "benchmarks" / "bench_train.py"), *argv, "--row-timeout", str(int(max(60, timeout - 30)))]
    if jsonl is not None:
        cmd += ["--jsonl", str(jsonl)]
    try:
        proc = run_group(cmd, timeout, env=dict(os.environ, PYTHONPATH=pythonpath_with(REPO)), stdout_path=log.with_suffix(".out"),
                         stderr_path=log.with_suffix(".err"))
    except GroupTimeout as e:
        return {"error": f"{e} (finished rows are above; log: {log.with_suffix('.err')})"}
    if proc.returncode != 0:
        return {"error": last_error(proc.stderr)}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def scale_row(row: str, args, work: Path, jsonl: Path | None, timeout: float) -> dict:
    """One of the scale rows (ours, peer, long, cache) through bench_train.py; its summary."""
    common = ["--shape", args.scale_shape, "--steps", str(args.scale_steps), "--workdir", str(work / row),
              "--accum", str(1 if row in ("peer", "long") else args.scale_accum)]
    if args.smoke:
        common.append("--smoke")
    seq = str(args.scale_seq_len)
    if row == "ours":
        argv = [*common, "--seq-len", seq, "--algorithms", *args.scale_algorithms, "--no-peer"]
    elif row == "peer":
        peer: list[str] = []  # bench_train's default: the peer venv .peer-venv (benchmarks/peer_setup.sh)
        if args.peer_wheels:
            site = Path("/tmp/peer-site")
            wheels = sorted(str(w) for w in Path(args.peer_wheels).glob("*.whl"))
            rc = run_group([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                            "--target", str(site), *wheels], 300).returncode
            peer = ["--peer-python", sys.executable, "--peer-pythonpath", str(site)] if rc == 0 else ["--no-peer"]
        elif args.peer_venv:
            peer = ["--peer-venv", args.peer_venv]
        argv = [*common, "--seq-len", seq, "--algorithms", "eagle3", *peer, "--peer-timeout", str(int(timeout / 2))]
    elif row == "long":
        argv = [*common, "--steps", "3", "--seq-len", str(args.scale_long_seq_len), "--algorithms", "eagle3", "--no-peer",
                "--extra-opts", "model.activation_checkpointing=true"]
    else:  # cache
        argv = [*common, "--seq-len", seq, "--algorithms", *args.scale_algorithms, "--no-peer", "--from-cache"]
    return _bench_train(argv, timeout, jsonl, work / "logs" / f"bench-train-{row}")


def _liger() -> str:
    """Liger-Kernel's version and whether EAGLE-3's loss hands its unlogged steps to it here (deepspec/drafts/liger.py:
    CUDA only): the fused loss is part of what a GPU user with requirements-gpu.txt installed runs."""
    import importlib.metadata

    try:
        version = importlib.metadata.version("liger-kernel")
    except importlib.metadata.PackageNotFoundError:
        return "not installed (EAGLE-3's loss runs its eager chunks)"
    import torch

    from deepspec.drafts import liger

    used = torch.cuda.is_available() and liger.available(torch.empty(0, device="cuda"))
    return f"{version} ({'used by' if used else 'not used by'} EAGLE-3's loss)"


def _environment() -> dict:
    import importlib.metadata
    import importlib.util

    import torch

    # transformers' version from its metadata: this row trains nothing, and importing it costs ~0.7 s
    env = {"torch": torch.__version__, "transformers": importlib.metadata.version("transformers"), "cuda": torch.version.cuda,
           "flash_attn": "installed" if importlib.util.find_spec("flash_attn") else "not installed (SDPA attention)",
           "vllm": "installed" if importlib.util.find_spec("vllm") else "not installed", "liger": _liger()}
    if torch.cuda.is_available():
        env.update(device=torch.cuda.get_device_name(0), gpu_memory_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
                   nccl=".".join(map(str, torch.cuda.nccl.version())))
    else:
        env.update(device="cpu", threads=torch.get_num_threads())
    return env


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--row", choices=["env", "ours", "peer", "long", "cache", "recipes"], default=None,
                   help="what this invocation measures (default: ours; recipes with --tiny; env: the environment line only)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes, short sequences, two steps: a CPU check of the row's code path")
    p.add_argument("--timeout-s", type=float, default=540.0, help="this invocation's time; past it its process tree is killed")
    p.add_argument("--scale-shape", default="qwen3-8b")
    p.add_argument("--scale-seq-len", type=int, default=4096)
    p.add_argument("--scale-long-seq-len", type=int, default=32768)
    p.add_argument("--scale-algorithms", nargs="+", default=["eagle3", "dflash"])
    p.add_argument("--scale-steps", type=int, default=4)
    p.add_argument("--scale-accum", type=int, default=8, help="micro-batches per optimizer step (rows ours, cache)")
    p.add_argument("--peer-wheels", default=None, help="a folder of the peer's wheels (benchmarks/peer_setup.sh --gpu-wheels)")
    p.add_argument("--peer-venv", default=None, help="the peer's venv (benchmarks/peer_setup.sh), instead of --peer-wheels")
    p.add_argument("--tiny", action="store_true", help="tiny targets and short runs (a CPU check of the code paths)")
    p.add_argument("--shapes", nargs="*", default=None, help="default: smollm2 qwen3-4b (tiny-llama tiny-qwen3 with --tiny)")
    p.add_argument("--algorithms", nargs="*", default=["eagle3", "dflash", "dspark"])
    p.add_argument("--variants", nargs="*", default=list(VARIANTS), help="ddp (the recipe's parallelism), fsdp, compile")
    p.add_argument("--variant-shapes", nargs="*", default=["smollm2", "tiny-llama"], help="shapes that also run the fsdp/compile variants")
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--global-batch", type=int, default=4)
    p.add_argument("--eval-tasks", nargs="*", default=["gsm8k", "mt-bench"])
    p.add_argument("--eval-samples", type=int, default=1, help="per task (mt-bench has two turns)")
    p.add_argument("--eval-tokens", type=int, default=64)
    p.add_argument("--no-eval", action="store_true")
    p.add_argument("--budget-s", type=float, default=480.0, help="skip the runs that would start after this many seconds")
    p.add_argument("--run-timeout", type=int, default=300)
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", default=None, help="append the JSON lines here too (flushed as each row finishes)")
    args = p.parse_args()
    if args.smoke:
        args.tiny = True
        args.scale_shape = "tiny"
        args.scale_seq_len = 64 if args.scale_seq_len == 4096 else args.scale_seq_len
        args.scale_long_seq_len = 512 if args.scale_long_seq_len == 32768 else args.scale_long_seq_len
        args.scale_steps = 3
        args.scale_accum = 2
    args.row = args.row or ("recipes" if args.tiny and not args.smoke else "ours")

    import torch

    from deepspec.config import load_config
    from deepspec.data.cache import build_cache
    from deepspec.log import setup_logging

    setup_logging("WARNING")
    t_start = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = args.shapes or (["tiny-llama", "tiny-qwen3"] if args.tiny else ["smollm2", "qwen3-4b"])
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-gpu-"))
    # answer words per sample (~6 tokens per word with the byte-level tokenizer), micro batch, cache.max_length
    sizes = {"smollm2": ((150, 250), 2, 2048), "qwen3-4b": ((250, 330), 1, 4096)}
    result = {
        "benchmark": "gpu", "row": args.row, "date": time.strftime("%Y-%m-%d"), **_environment(), "workers": 1,
        "note": ("random-weight targets built from configs and the tiny byte-level tokenizer: training throughput, memory and "
                 "decoding speed are real, acceptance (tau) and therefore speedup are meaningless (an untrained draft of a "
                 "random target is almost never accepted)"),
        "train": [], "eval": [], "skipped": [],
    }

    from deepspec.eval.report import json_safe

    out = Path(args.out) if args.out else None

    def line(obj: dict) -> None:
        """One JSON line to stdout and --out, on disk before anything else runs."""
        text = json.dumps(json_safe(obj), default=str)  # NaN (never-reached depths) -> null
        print(text, flush=True)
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            with open(out, "a") as f:
                f.write(text + "\n")
                f.flush()
                os.fsync(f.fileno())

    line({k: v for k, v in result.items() if k not in ("train", "eval", "skipped")})
    if args.row == "env":
        return 0
    if args.row != "recipes":
        # bench_train.py appends its rows to --out itself, one line each as it finishes; here only its summary / error
        jsonl = out
        if jsonl is None:
            jsonl = work / "rows.jsonl"
        summary = scale_row(args.row, args, work, jsonl, args.timeout_s - (time.perf_counter() - t_start))
        if out is None:  # rows went to a scratch file: show them
            for text in jsonl.read_text().splitlines() if jsonl.is_file() else []:
                print(text, flush=True)
        line({"benchmark": "gpu", "row": args.row, "summary": True, "wall_s": round(time.perf_counter() - t_start, 1),
              **({"error": summary["error"]} if "error" in summary else {"rows": len(summary.get("rows", []))})})
        return 1 if "error" in summary else 0

    def emit(kind: str | None = None, row: dict | None = None) -> None:
        if row is not None:
            line({"benchmark": "gpu", "row": "recipes", "section": kind, **row})

    def over_budget(what: str) -> bool:
        if time.perf_counter() - t_start > args.budget_s:
            result["skipped"].append(f"{what}: over --budget-s {args.budget_s:g}")
            emit("skipped", {"skipped": what, "why": f"over --budget-s {args.budget_s:g}"})
            return True
        return False

    trained: dict[tuple[str, str], Path] = {}
    prepared: dict[str, tuple[Path, Path]] = {}

    def prepare(shape: str) -> tuple[Path, Path]:
        if shape not in prepared:
            t0 = time.perf_counter()
            target = save_random_target(work / f"target-{shape}", shape, device)
            data = work / f"data-{shape}"
            data.mkdir(parents=True, exist_ok=True)
            answer_words = sizes.get(shape, ((20, 60), 2, 1024))[0]
            (data / "regenerated.jsonl").write_text("".join(json.dumps(c) + "\n" for c in _conversations(args.samples, 0, answer_words)))
            result.setdefault("target_build_s", {})[shape] = round(time.perf_counter() - t0, 1)
            prepared[shape] = (target, data)
        return prepared[shape]

    def train_runs(shape: str, variant: str) -> None:
        _, micro, max_len = sizes.get(shape, ((20, 60), 2, 1024))
        _, _, recipe_target, extra = SHAPES[shape]
        steps = max(2, args.steps - (1 if shape.startswith("qwen3") else 0))
        targs = argparse.Namespace(global_batch=args.global_batch, micro_batch=micro, steps=steps)
        for algorithm in args.algorithms:
            name = f"{shape}/{algorithm}/{variant}"
            if over_budget(name):
                continue
            target, data = prepare(shape)
            recipe = str(REPO / "config" / algorithm / f"{recipe_target}.yaml")
            opts = _merge(_opts(work, f"{shape}-{algorithm}", targs), [
                f"target.name={target}", f"data.dir={data}", f"cache.max_length={max_len}", "train.log_every=1000",
                f"run.name={shape}-{algorithm}-{variant}",  # one run folder per variant (a rerun resumes none of them)
                *extra, *VARIANTS[variant],
            ])
            cfg = load_config(recipe, opts)
            row = {"target": shape, "algorithm": algorithm, "variant": variant, "precision": cfg.train.precision,
                   "parallel": cfg.train.parallel, "compile": cfg.train.compile, "optimizer": cfg.train.optimizer,
                   "micro_batch": micro, "global_batch": args.global_batch}
            try:
                taps = cfg.model.target_layer_ids
                opts = _merge(opts, [f"cache.dir={work / ('cache-' + shape + '-' + ('-'.join(map(str, taps)) if taps else algorithm))}"])
                cfg = load_config(recipe, opts)
                t0 = time.perf_counter()
                build_cache(cfg, "train")  # skipped when this shape's cache for these taps is complete
                row["cache_s"] = round(time.perf_counter() - t0, 1)
                if device == "cuda":
                    torch.cuda.empty_cache()  # the worker process needs the memory, not this one
                left = args.timeout_s - (time.perf_counter() - t_start) - 10
                row.update(_train_run(recipe, opts, min(args.run_timeout, max(30, left)), work / "logs" / f"{shape}-{algorithm}-{variant}"))
                if variant == "ddp":
                    trained[(shape, algorithm)] = Path(row["run_dir"]) / f"step_{steps}"
            except Exception as e:  # report and go on with the next run
                row["error"] = f"{type(e).__name__}: {e}"[-3000:]
            row.pop("run_dir", None)
            result["train"].append(row)
            emit("train", row)

    def eval_runs(shape: str) -> None:
        big = shape == "qwen3-4b"
        for algorithm, dtype in ([(args.algorithms[0], "bfloat16")] if big else [(a, d) for a in args.algorithms for d in ("float32", "bfloat16")]):
            ckpt = trained.get((shape, algorithm))
            if ckpt is None or over_budget(f"eval {shape}/{algorithm}/{dtype}"):
                continue
            row = {"target": shape, "algorithm": algorithm, "tasks": args.eval_tasks, "samples_per_task": args.eval_samples,
                   "max_new_tokens": args.eval_tokens}
            try:
                row.update(_eval_run(ckpt, dtype, args, work / "eval" / f"{shape}-{algorithm}-{dtype}"))
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"[-3000:]
            result["eval"].append(row)
            emit("eval", row)
            if device == "cuda":
                torch.cuda.empty_cache()

    # the recipes' own settings and decoding first, then the FSDP2 / torch.compile variants
    for shape in shapes:
        if "ddp" in args.variants:
            train_runs(shape, "ddp")
        if not args.no_eval:
            eval_runs(shape)
    for variant in [v for v in args.variants if v != "ddp"]:
        for shape in shapes:
            if shape in args.variant_shapes:
                train_runs(shape, variant)
    result["wall_s"] = round(time.perf_counter() - t_start, 1)
    line({"benchmark": "gpu", "row": "recipes", "summary": True, "wall_s": result["wall_s"], "train_rows": len(result["train"]),
          "eval_rows": len(result["eval"]), "skipped": result["skipped"]})
    return 0


if __name__ == "__main__":
    from deepspec.exiting import exit_process  # no final collection of the heap a measurement left

    exit_process(main())
