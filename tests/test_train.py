"""Trainer: worker-count invariance (DDP, FSDP2), exact resume after SIGKILL, resume on another
worker count, wandb/tensorboard series — all on a real cache of a tiny random Llama target and the
real EAGLE-3 draft, with real torchrun + gloo workers."""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_recipe import max_weight_diff, step_weights

REPO = Path(__file__).resolve().parents[1]
STEPS = 6


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def recipe(tmp_path_factory, tiny_llama_dir) -> Path:
    """A recipe on the tiny target with a built train + held-out cache; runs write under train.output_root.
    adamw: the quickstart's Muon needs whole matrices and these tests cover FSDP too; fp32: the equalities below are
    fp32-exact (pinned, not the quickstart's bf16_if_native, bf16 on some CPUs); one sample per micro-batch: the same
    micro-batches on 1 or 2 workers (exact equality below)."""
    from tiny_recipe import cached_recipe

    return cached_recipe(tmp_path_factory.mktemp("train"), tiny_llama_dir, samples=32, heldout=8, max_length=128, logging="",
                         train=f"optimizer: adamw, precision: fp32, global_batch_size: 8, micro_batch_size: 1, "
                               f"max_steps: {STEPS}, save_every: 2, val_every: 3, log_every: 1, keep_last: 2")


def _cfg(recipe: Path, *opts: str):
    from deepspec.config import load_config

    return load_config(recipe, list(opts))


@contextlib.contextmanager
def _on_cpu():
    """In-process runs that a test compares with gloo CPU workers stay on the CPU on a GPU machine too (one GPU
    cannot host two NCCL ranks, and bf16 autocast there is not comparable bit for bit); GPU training is exercised
    by benchmarks/bench_gpu.py and by the single-process tests here, which use the GPU when there is one."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: False)
        yield


def _env(**extra: str) -> dict[str, str]:
    # CUDA_VISIBLE_DEVICES="": the workers are the gloo CPU workers these tests are about, on any machine
    env = dict(os.environ, OMP_NUM_THREADS="1", DEEPSPEC_NO_PROGRESS="1", WANDB_MODE="offline", PYTHONPATH=str(REPO),
               CUDA_VISIBLE_DEVICES="")
    env.pop("DEEPSPEC_TRAIN_KILL_AFTER_STEP", None)
    env.pop("WANDB_SERVICE", None)  # set by the in-process reference run's wandb; workers need their own
    env.update(extra)
    return env


def _train_sh(recipe: Path, nproc: int, *opts: str, **env: str) -> subprocess.CompletedProcess:
    cmd = ["bash", str(REPO / "scripts/train/train.sh"), str(recipe), "--nproc", str(nproc)]
    if opts:
        cmd += ["--opts", *opts]
    return subprocess.run(cmd, env=_env(PYTHON=sys.executable, **env), capture_output=True, text=True, timeout=240)


def _losses(run_dir: Path) -> dict[int, float]:
    """train/loss per step; a step logged twice (before a crash and after resume) keeps the later value."""
    out = {}
    for line in (run_dir / "train_log.jsonl").read_text().splitlines():
        row = json.loads(line)
        out[row["step"]] = row["train/loss"]
    return out


@pytest.fixture(scope="module")
def reference(recipe) -> Path:
    """An uninterrupted single-worker run, in this process (`deepspec train`'s path)."""
    from deepspec.train import train

    cfg = _cfg(recipe)
    with _on_cpu():
        out = train(cfg)
    assert out.name == f"step_{STEPS}"
    return cfg.run_dir


# ----------------------------------------------------------------------------- fast unit tests


def test_the_trainer_and_a_streamed_plan_count_steps_by_one_rule():
    """train.max_steps when set, else epochs x the full global batches of an epoch (the last partial one dropped), at
    least one: the loop asks its BatchPlan, a streamed run's plan document asks data/batches.py total_steps."""
    from deepspec.data.batches import BatchPlan, total_steps

    plan = BatchPlan(43, 8, 2, 2, seed=0)  # 5 full global batches an epoch
    assert plan.total_steps(None, 2.5) == total_steps(43, 8, None, 2.5) == 12
    assert plan.total_steps(7, 2.5) == 7 and plan.total_steps(None, 0.01) == 1


def test_global_batch_is_independent_of_worker_count():
    from deepspec.data.batches import BatchPlan

    lengths = [random.Random(i).randint(5, 50) for i in range(40)]
    one = BatchPlan(40, 8, 2, 1, seed=3)
    two = BatchPlan(40, 8, 2, 2, seed=3)
    assert (one.accum_steps, two.accum_steps, one.steps_per_epoch) == (4, 2, 5)
    for step in (0, 4, 5, 11):  # across an epoch boundary too
        a = one.micro_batches(step, 0, lengths)
        b = [two.micro_batches(step, r, lengths) for r in range(2)]
        # the same samples, whatever the worker count
        assert sorted(i for mb in a for i in mb) == sorted(i for part in b for mb in part for i in mb) == sorted(one.global_indices(step))
        # length bucketing: one worker's micro-batches are consecutive runs of the length-sorted global batch
        flat = [i for mb in a for i in mb]
        assert [lengths[i] for i in flat] == sorted(lengths[i] for i in flat)
        # two workers: at every accumulation step both hold equally many samples of similar lengths
        # (dealt out alternately from the sorted batch), not the short half vs the long half
        for m in range(two.accum_steps):
            l0, l1 = ([lengths[i] for i in b[r][m]] for r in range(2))
            assert len(l0) == len(l1) and all(x <= y for x, y in zip(l0, l1))
            assert sum(l1) - sum(l0) <= max(l1) - min(l0)
    assert one.global_indices(5) != one.global_indices(0)  # a new epoch reshuffles


def test_global_batch_must_divide():
    from deepspec.errors import ConfigError
    from deepspec.data.batches import BatchPlan

    with pytest.raises(ConfigError, match="not divisible by workers x micro batch = 3 x 2 = 6"):
        BatchPlan(40, 8, 2, 3, seed=0)
    with pytest.raises(ConfigError, match="fewer than train.global_batch_size"):
        BatchPlan(4, 8, 2, 1, seed=0)


def test_warmup_cosine_schedule():
    from deepspec.train.optim import warmup_cosine

    f = warmup_cosine(100, 0.04, 0.1)
    assert [round(f(s), 4) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == pytest.approx(1.0)
    assert f(52) == pytest.approx(0.1 + 0.9 * 0.5)
    assert f(99) == pytest.approx(0.1, abs=1e-3)
    vals = [f(s) for s in range(4, 100)]
    assert all(x >= y for x, y in zip(vals, vals[1:]))


def test_muon_takes_matrices_adamw_the_rest():
    from torch import nn

    from deepspec.config.train import TrainConfig
    from deepspec.train.muon import Muon
    from deepspec.train.optim import MultiOptimizer, build_optimizer, build_scheduler

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.lin = nn.Linear(4, 4)
            self.norm = nn.LayerNorm(4)
            self.register_buffer("target_lm_head", torch.randn(10, 4))

    m = Tiny()
    opt = build_optimizer(m, TrainConfig(optimizer="muon", lr=1e-2))
    assert isinstance(opt, MultiOptimizer)
    muon, adam = opt.optimizers
    assert isinstance(muon, Muon) and isinstance(adam, torch.optim.AdamW)
    muon_ids = {id(p) for g in muon.param_groups for p in g["params"]}
    adam_ids = {id(p) for g in adam.param_groups for p in g["params"]}
    assert muon_ids == {id(m.lin.weight)}
    assert adam_ids == {id(m.emb.weight), id(m.lin.bias), id(m.norm.weight), id(m.norm.bias)}
    sched = build_scheduler(opt, TrainConfig(warmup_ratio=0.5), total_steps=4)
    before = m.lin.weight.detach().clone()
    (m.lin(m.emb(torch.tensor([1, 2]))).sum() + m.norm(torch.ones(4)).sum()).backward()
    opt.step()
    sched.step()
    assert not torch.equal(before, m.lin.weight)
    assert all(g["lr"] == pytest.approx(g["initial_lr"]) for g in opt.param_groups)  # warmup step 2 of 2
    state = opt.state_dict()
    opt.load_state_dict(state)


@pytest.mark.parametrize("shape", [(6, 10), (10, 6)])
def test_muon_matches_torch_muon_and_iterates_in_fp32_without_native_bf16(shape):
    """Our Muon is torch.optim.Muon's update (bit for bit with a bf16 iteration, the recipes were tuned on it);
    in fp32 — what a CPU without native bf16 gets — it stays within bf16 rounding of it."""
    from deepspec.train.muon import Muon, default_ns_dtype

    def run(make):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(*shape))
        opt = make([w])
        for i in range(4):
            torch.manual_seed(100 + i)
            w.grad = torch.randn(*shape)
            opt.step()
        state = opt.state_dict()
        return w.detach().clone(), state

    kw = dict(lr=2e-3, weight_decay=0.01, momentum=0.95, adjust_lr_fn="match_rms_adamw")
    ref, ref_state = run(lambda ps: torch.optim.Muon(ps, **kw))
    ours, ours_state = run(lambda ps: Muon(ps, ns_dtype=torch.bfloat16, **kw))
    assert torch.equal(ours, ref)
    assert torch.equal(ours_state["state"][0]["momentum_buffer"], ref_state["state"][0]["momentum_buffer"])
    fp32, _ = run(lambda ps: Muon(ps, ns_dtype=torch.float32, **kw))
    torch.manual_seed(0)
    start = torch.randn(*shape)
    assert not torch.equal(fp32, ref)
    assert (fp32 - ref).abs().max() < 0.02 * (ref - start).abs().max()
    assert default_ns_dtype("cuda") == torch.bfloat16
    with pytest.raises(ValueError, match="2-D"):
        Muon([torch.nn.Parameter(torch.ones(3))])


def test_loss_tokens_all_supervises_prompt_tokens_but_not_padding():
    from deepspec.data.batches import collate_features, supervise_all_tokens

    def item(n: int, answer_from: int) -> dict:
        return {
            "input_ids": torch.arange(n), "loss_mask": torch.arange(n) >= answer_from,
            "taps": torch.zeros(n, 2, 4), "final_hidden": torch.zeros(n, 4),
        }

    items = [item(6, 3), item(4, 1)]
    assistant = collate_features(items)
    everything = supervise_all_tokens(collate_features)(items)
    assert assistant.loss_mask.tolist() == [[False, False, False, True, True, True], [False, True, True, True, False, False]]
    assert everything.loss_mask.tolist() == [[True] * 6, [True] * 4 + [False] * 2]
    assert torch.equal(everything.input_ids, assistant.input_ids)


def test_pointer_file_fallback(tmp_path):
    from deepspec.train import checkpoint as ckpt

    step = tmp_path / "step_4"
    step.mkdir()
    (step / "config.json").write_text("{}")
    (tmp_path / "step_latest").write_text("step_4\n")  # what filesystems without symlinks get
    assert ckpt.resolve_step_dir(tmp_path / "step_latest") == step.resolve()
    assert ckpt.resolve_step_dir(tmp_path) == step.resolve()
    ckpt.write_pointer(tmp_path, "step_latest", "step_4")  # replaces the file atomically
    assert ckpt.resolve_step_dir(tmp_path / "step_latest") == step.resolve()


def test_prune_keeps_last_k_and_best(tmp_path):
    from deepspec.train import checkpoint as ckpt

    from safetensors.torch import save_file

    for s in (2, 4, 6, 8):
        (tmp_path / f"step_{s}").mkdir()
        torch.save({"step": s}, tmp_path / f"step_{s}" / ckpt.TRAINER_STATE)
        save_file({"w": torch.zeros(1)}, str(tmp_path / f"step_{s}" / ckpt.WEIGHTS))
    (tmp_path / "step_10.tmp").mkdir()  # half-written: never a resume candidate
    ckpt.record_best(tmp_path, 2, "expected_tau", 3.0)
    ckpt.prune(tmp_path, keep_last=2)
    assert ckpt.list_steps(tmp_path) == [2, 6, 8]
    assert ckpt.latest_step_dir(tmp_path) == tmp_path / "step_8"


# ----------------------------------------------------------------------------- real training


@pytest.mark.slow
def test_two_workers_match_one_worker_ddp_and_fsdp(recipe, reference):
    """2 gloo workers x 4 accumulation == 1 worker x 8 accumulation, same global batch, after 6 steps."""
    from deepspec.train import launch

    ref = step_weights(reference / f"step_{STEPS}")
    ref_losses = _losses(reference)
    for parallel in ("ddp", "fsdp"):
        cfg = _cfg(recipe, f"train.parallel={parallel}", f"run.name={parallel}")
        out = launch(cfg, 2, env=_env())
        assert out == cfg.run_dir / f"step_{STEPS}"
        diff = max_weight_diff(ref, step_weights(out))
        assert diff < 1e-5, f"{parallel}: parameters differ by {diff}"
        assert max_weight_diff(ref, step_weights(reference / "step_4")) > 1e-5  # training still moves the weights
        losses = _losses(cfg.run_dir)
        assert all(abs(losses[s] - ref_losses[s]) < 1e-5 for s in range(1, STEPS + 1)), (parallel, losses, ref_losses)
        if parallel == "fsdp":
            assert (out / "optimizer_dcp").is_dir() and not (out / "optimizer.pt").exists()
        else:
            assert (out / "optimizer.pt").is_file()


def _train_recording_the_loader(cfg):
    """Train `cfg` in this process on the CPU; returns (final checkpoint dir, the loader the loop built)."""
    from deepspec.train import train
    from deepspec.train.loader import build_loader

    built: list = []

    def spy(*args, **kwargs):
        built.append(build_loader(*args, **kwargs))
        return built[-1]

    with _on_cpu(), pytest.MonkeyPatch.context() as mp:
        mp.setattr("deepspec.train.loop.build_loader", spy)
        out = train(cfg)
    return out, built[0]


def test_loader_processes_train_exactly_like_the_thread(recipe, reference):
    """train.loader_processes=2: DataLoader worker processes read the cache (zero-copy views, shared-memory
    batches) in the plan's order, so losses and weights equal the single-thread reference exactly."""
    from deepspec.train.loader import ProcessLoader

    cfg = _cfg(recipe, "exp=procs", "train.loader_processes=2")
    out, loader = _train_recording_the_loader(cfg)
    assert isinstance(loader, ProcessLoader) and loader.loader.num_workers == 2
    assert out.name == f"step_{STEPS}"
    assert _losses(cfg.run_dir) == _losses(reference)
    assert max_weight_diff(step_weights(reference / f"step_{STEPS}"), step_weights(out)) == 0.0


def test_val_every_zero_validates_at_the_end_only(recipe):
    """train.val_every=0 with a held-out cache: no validation mid-run (it divided by zero), one at the last step."""
    from deepspec.train import train

    cfg = _cfg(recipe, "exp=val0", "train.val_every=0", "train.max_steps=2", "train.save_every=1")
    with _on_cpu():
        out = train(cfg)
    assert out.name == "step_2"
    assert json.loads((cfg.run_dir / "best.json").read_text())["step"] == 2


def test_the_data_thread_trains_exactly_like_inline_loading(recipe, reference):
    """The reference read its cache inline (the default on a CPU, where a loader thread has nothing to overlap);
    train.prefetch_depth=2 reads two micro-batches ahead in the background thread: same batches, same losses, same
    weights. With nothing set, the thread is used on a GPU and for a streamed spool only."""
    from deepspec.data.batches import Prefetcher
    from deepspec.train.loader import resolve_depth

    cfg = _cfg(recipe, "exp=thread", "train.prefetch_depth=2")
    out, loader = _train_recording_the_loader(cfg)
    assert isinstance(loader, Prefetcher) and loader.depth == 2  # a thread two micro-batches ahead
    assert _losses(cfg.run_dir) == _losses(reference)
    assert max_weight_diff(step_weights(reference / f"step_{STEPS}"), step_weights(out)) == 0.0

    class Spool:
        def follow(self, schedule):
            return schedule

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert (resolve_depth(None, cpu, object()), resolve_depth(None, gpu, object()), resolve_depth(None, cpu, Spool())) == (0, 2, 2)
    assert resolve_depth(3, cpu, object()) == 3 and resolve_depth(0, gpu, Spool()) == 0


@pytest.mark.slow
def test_sigkill_then_rerun_resumes_exactly(recipe, reference):
    """train.sh with 2 workers, rank 0 SIGKILLed after step 5 (last checkpoint: step 4); rerun the same command."""
    opts = ("exp=kill",)
    run_dir = _cfg(recipe, *opts).run_dir
    crashed = _train_sh(recipe, 2, *opts, DEEPSPEC_TRAIN_KILL_AFTER_STEP="5")
    assert crashed.returncode != 0, crashed.stderr[-2000:]
    assert os.path.realpath(run_dir / "step_latest").endswith("step_4")
    assert not (run_dir / f"step_{STEPS}").exists()
    rerun = _train_sh(recipe, 2, *opts)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "resuming from" in rerun.stderr and "step 4" in rerun.stderr
    ref, got = _losses(reference), _losses(run_dir)
    for s in (5, 6):
        assert got[s] == pytest.approx(ref[s], abs=1e-6), (s, got, ref)
    # step 5 ran twice (killed after it, resumed from step 4) but is logged once: the log was cut back to step 4
    logged = [json.loads(line)["step"] for line in (run_dir / "train_log.jsonl").read_text().splitlines()]
    assert logged == list(range(1, STEPS + 1)), logged
    val_steps = [json.loads(line)["step"] for line in (run_dir / "val_log.jsonl").read_text().splitlines()]
    assert val_steps == [3, 6], val_steps
    assert max_weight_diff(step_weights(reference / f"step_{STEPS}"), step_weights(run_dir / f"step_{STEPS}")) < 1e-5
    # keep_last=2 plus the best checkpoint; only complete step dirs remain
    from deepspec.train.checkpoint import list_steps, read_best

    steps = list_steps(run_dir)
    assert steps[-2:] == [4, 6] and set(steps) <= {read_best(run_dir)["step"], 4, 6}
    assert not list(run_dir.glob("*.tmp"))


@pytest.mark.slow
def test_resume_on_another_worker_count_keeps_global_batch(recipe, reference):
    """Crash a 2-worker FSDP2 run after step 3, resume it with 1 worker: accumulation doubles, the sharded
    optimizer state is resharded, and the losses still match the uninterrupted run."""
    from deepspec.train import train
    from deepspec.train.checkpoint import load_trainer_state

    opts = ("exp=rescale", "train.parallel=fsdp")
    cfg = _cfg(recipe, *opts)
    crashed = _train_sh(recipe, 2, *opts, DEEPSPEC_TRAIN_KILL_AFTER_STEP="3")
    assert crashed.returncode != 0
    assert load_trainer_state(cfg.run_dir / "step_3")["world_size"] == 2
    assert (cfg.run_dir / "step_3" / "optimizer_dcp").is_dir()
    with _on_cpu():
        out = train(cfg)  # one worker now, same global batch (8 = 1 x 1 micro x 8 accumulation)
    state = load_trainer_state(out)
    assert state["world_size"] == 1 and state["global_batch_size"] == 8 and state["step"] == STEPS
    ref, got = _losses(reference), _losses(cfg.run_dir)
    assert all(got[s] == pytest.approx(ref[s], abs=1e-5) for s in range(3, STEPS + 1)), (got, ref)

    from deepspec.errors import CheckpointError

    with pytest.raises(CheckpointError, match="global_batch_size"), _on_cpu():
        bad = _cfg(recipe, *opts)
        bad.train.global_batch_size = 4
        bad.train.max_steps = STEPS + 2
        train(bad)


def _wandb_history(run_dir: Path) -> dict[str, dict[int, float]]:
    """Read the offline wandb run files back (their leveldb-style record log of protobuf Records)."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    series: dict[str, dict[int, float]] = {}
    files = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert files, f"no offline wandb run under {run_dir}/wandb"
    for f in files:
        data = f.read_bytes()
        assert data[:4] == b":W&B"
        pos, buf, block = 7, b"", 32768
        while pos + 7 <= len(data):
            if block - pos % block < 7:
                pos += block - pos % block
                continue
            _, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
            chunk, pos = data[pos + 7 : pos + 7 + n], pos + 7 + n
            if kind in (1, 4):
                raw, buf = buf + chunk, b""
                rec = pb.Record()
                rec.ParseFromString(raw)
                if rec.WhichOneof("record_type") == "history":
                    row = {(it.key or "/".join(it.nested_key)): json.loads(it.value_json) for it in rec.history.item}
                    for k, v in row.items():
                        if isinstance(v, (int, float)):
                            series.setdefault(k, {})[int(row["_step"])] = float(v)
            elif kind in (2, 3):
                buf += chunk
    return series


@pytest.mark.slow
def test_wandb_and_tensorboard_series(reference):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ref_losses = _losses(reference)
    wb = _wandb_history(reference)
    assert sorted(wb["train/loss"]) == list(range(1, STEPS + 1))
    assert all(wb["train/loss"][s] == pytest.approx(ref_losses[s]) for s in ref_losses)
    assert sorted(wb["val/expected_tau"]) == [3, 6] and all(1.0 <= v <= 8.0 for v in wb["val/expected_tau"].values())
    assert "val/greedy_tau" in wb and "val/alpha_tf@1" in wb

    ev = EventAccumulator(str(reference / "tensorboard"))
    ev.Reload()
    tags = set(ev.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/tokens_per_s", "val/expected_tau", "val/greedy_tau"} <= tags
    assert [e.step for e in ev.Scalars("train/loss")] == list(range(1, STEPS + 1))
    assert [e.value for e in ev.Scalars("train/loss")] == pytest.approx([ref_losses[s] for s in range(1, STEPS + 1)], rel=1e-6)
    tb_tau = {e.step: e.value for e in ev.Scalars("val/expected_tau")}
    assert tb_tau == pytest.approx(wb["val/expected_tau"], rel=1e-6)
    # the best checkpoint by expected tau is recorded and points at a saved step
    best = json.loads((reference / "best.json").read_text())
    assert best["metric"] == "expected_tau" and best["value"] == pytest.approx(max(wb["val/expected_tau"].values()))
    assert (reference / "step_best" / "model.safetensors").is_file()


# the GPU recipes for Qwen3 targets: config/<algorithm>/<name>.yaml -> the target they name
QWEN3_RECIPES = {"qwen3-4b": "Qwen/Qwen3-4B", "qwen3-8b": "Qwen/Qwen3-8B", "qwen3-14b": "Qwen/Qwen3-14B",
                 "qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B"}


def test_every_recipe_loads_and_its_global_batch_fits_eight_gpus():
    """config/<algorithm>/<target>.yaml for each algorithm x {smollm2, qwen3-4b, qwen3-8b, qwen3-14b, qwen3-30b-a3b}."""
    from deepspec.config import load_config
    from deepspec.data.batches import BatchPlan

    for algorithm in ("eagle3", "dflash", "dspark", "dflash2"):
        for target in ("smollm2", *QWEN3_RECIPES):
            cfg = load_config(REPO / "config" / algorithm / f"{target}.yaml")
            assert cfg.model.algorithm == algorithm
            if target.startswith("qwen3"):
                t = cfg.train
                assert (t.lr, t.warmup_ratio, t.global_batch_size, t.epochs, cfg.model.block_size) == (6e-4, 0.04, 512, 10, 7)
                assert len(cfg.model.target_layer_ids) == 5
                # 8 GPUs x micro batch 4 x 16 accumulation steps, each micro-batch packed into rows of >= 8,192 tokens
                assert BatchPlan(10**6, t.global_batch_size, t.micro_batch_size, 8, 0).accum_steps == 64 // t.micro_batch_size
                assert t.micro_batch_size == 4 and t.pack_tokens >= 8192
                if t.optimizer == "muon":
                    assert t.parallel == "ddp"


@pytest.mark.parametrize("target", sorted(QWEN3_RECIPES))
def test_qwen3_recipes_build_their_draft_on_the_published_target_config(target):
    """Each Qwen3 recipe names its target and builds its draft (on the meta device: sizes only) from that target's
    published config (bench_draft_memory's table, no download): the taps are DeepSpec's spacing for the target's depth
    (layer 1 to L - 3; [1, 12, 23, 34, 45] for the 48 layers of Qwen3-30B-A3B, a Qwen3-MoE) and the draft is as wide
    as the target, whose hidden states it reads."""
    from script_loader import load_script

    from deepspec.config import load_config
    from deepspec.targets.taps import default_taps

    bench = load_script("benchmarks/bench_draft_memory.py")
    for algorithm in ("eagle3", "dflash", "dspark", "dflash2"):
        cfg = load_config(REPO / "config" / algorithm / f"{target}.yaml")
        assert cfg.target.name == QWEN3_RECIPES[target]
        draft, tconf = bench.build_recipe_draft(cfg, 1.0, "meta")
        assert list(cfg.model.target_layer_ids) == default_taps(tconf.num_hidden_layers, 5)
        assert draft.arch.hidden_size == tconf.hidden_size and {p.device.type for p in draft.parameters()} == {"meta"}
        if target == "qwen3-30b-a3b":
            assert tconf.model_type == "qwen3_moe" and tconf.num_hidden_layers == 48
            assert draft.arch.intermediate_size == 6144  # the dense MLP width, not an expert's (768)


@pytest.mark.slow
def test_online_mode_trains_from_the_colocated_target(recipe):
    """cache.mode=online: same loop, features computed by the target per micro-batch (no cache on disk)."""
    from deepspec.train import train
    from deepspec.train.checkpoint import load_trainer_state

    cfg = _cfg(recipe, "run.name=online", "cache.mode=online", "train.max_steps=2", "logging.wandb=false", f"cache.dir={recipe.parent / 'nothing'}")
    out = train(cfg)
    assert out.name == "step_2" and load_trainer_state(out)["step"] == 2
    losses = _losses(cfg.run_dir)
    assert set(losses) == {1, 2} and all(10 < v < 40 for v in losses.values())
    meta = json.loads((out / "config.json").read_text())
    assert meta["deepspec"]["provenance"]["taps"] == [0, 2, 4]


@pytest.mark.slow
def test_dflash_random_anchors_do_not_depend_on_worker_count(recipe):
    """DFlash samples anchors at random; seeds follow the micro-batch's place in the global batch, not the rank."""
    from deepspec.train import launch, train

    opts = ("exp=dflash", "model.algorithm=dflash", "model.num_anchors=16", "train.max_steps=2", "logging.wandb=false")
    with _on_cpu():
        one = train(_cfg(recipe, *opts, f"train.output_root={recipe.parent / 'one'}"))
    two = launch(_cfg(recipe, *opts), 2, env=_env())
    assert max_weight_diff(step_weights(one), step_weights(two)) < 1e-5
    assert _losses(one.parent) == pytest.approx(_losses(two.parent), abs=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm, extra", [("dflash", ("model.num_anchors=16",)), ("dspark", ("model.num_anchors=16",)),
                                              ("eagle3", ("model.num_draft_layers=2",))])
def test_fsdp_trains_drafts_whose_layers_are_driven_by_methods(recipe, algorithm, extra):
    """FSDP2 gathers a unit's weights only around its forward(); the drafts drive their decoder layers' attention through
    projection methods, so `train.parallel=fsdp` crashed for DFlash / DSpark and EAGLE-3 with 2+ layers ("mixed
    torch.Tensor and DTensor", found by benchmarks/bench_gpu.py). One FSDP worker now trains exactly like the plain draft."""
    from deepspec.train import train
    from deepspec.train.parallel import fsdp_units

    opts = (f"exp=fsdp-{algorithm}", f"model.algorithm={algorithm}", *extra, "train.max_steps=2", "logging.wandb=false",
            "logging.tensorboard=false")
    with _on_cpu():
        plain = train(_cfg(recipe, *opts))
        sharded = train(_cfg(recipe, *opts, "train.parallel=fsdp", f"run.name=fsdp-{algorithm}-sharded"))
    assert _losses(plain.parent) == pytest.approx(_losses(sharded.parent), abs=1e-6)
    assert max_weight_diff(step_weights(plain), step_weights(sharded)) < 1e-5

    from deepspec.config import load_config
    from deepspec.drafts.layers import MLP
    from deepspec.drafts.registry import get_algorithm
    from deepspec.targets.tiny import tiny_config

    cfg = load_config(recipe, [f"model.algorithm={algorithm}", *extra])
    draft = get_algorithm(algorithm).from_target_config(tiny_config("llama"), cfg.model)
    assert any(isinstance(u, MLP) for u in fsdp_units(draft)) or algorithm == "eagle3" and not draft.layers


@pytest.mark.slow
def test_fsdp_trains_like_the_plain_draft_in_bf16(recipe):
    """The tests above pin fp32, where FSDP2 and the plain draft agree to 1e-5. In bf16 (every GPU, and CPUs whose
    bf16_if_native resolves to bf16) they round in different places — FSDP2 casts every parameter to bf16 once, autocast
    only the matrix products' inputs — so they agree to what the arithmetic allows: the first step's loss (same weights)
    to 1% (a bf16 rounding is 2^-9 relative, a few dozen in sequence), and the weights after AdamW steps to 2 x lr per
    step (an AdamW update moves a weight by at most ~lr, so a gradient whose sign rounding flips moves it 2 x lr)."""
    from deepspec.train import train

    steps, lr = 2, _cfg(recipe).train.lr
    opts = ("exp=bf16", "model.num_draft_layers=2", f"train.max_steps={steps}", "train.precision=bf16", "logging.wandb=false",
            "logging.tensorboard=false")
    with _on_cpu():
        plain = train(_cfg(recipe, *opts))
        sharded = train(_cfg(recipe, *opts, "train.parallel=fsdp", "run.name=bf16-sharded"))
    assert _losses(sharded.parent)[1] == pytest.approx(_losses(plain.parent)[1], rel=1e-2)
    assert max_weight_diff(step_weights(plain), step_weights(sharded)) <= 2 * lr * steps


def test_more_workers_than_gpus_is_a_clear_error(monkeypatch):
    """torchrun with 2 workers on a 1-GPU machine died in torch.cuda.set_device ("invalid device ordinal", seen on an H100)."""
    from deepspec.errors import DeepSpecError
    from deepspec.train.dist import init_distributed

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(DeepSpecError, match="LOCAL_RANK 1 but only 1 GPU"):
        init_distributed()


def test_cpu_workers_share_the_usable_cores(monkeypatch):
    """torchrun would give every CPU worker one thread; launch/train.sh split the usable cores instead."""
    import deepspec.train.launcher as launcher

    monkeypatch.setattr(launcher.os, "sched_getaffinity", lambda pid: set(range(6)), raising=False)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert [launcher.cpu_threads_per_worker(n) for n in (1, 2, 4, 8)] == [6, 3, 1, 1]


# ----------------------------------------------------------------------------- optimizer groups, loss weights, logs


@pytest.mark.parametrize("algorithm", ["eagle3", "dspark"])
def test_muon_takes_body_matrices_and_adamw_heads_embeddings_and_vectors(algorithm):
    """Muon only on the draft body's attention / MLP / fc matrices; a trainable lm_head, DSpark's Markov head (its
    embedding table and markov_w2) and confidence head, norms and biases go to AdamW. muon_lr 0.02 + lr 6e-4 means
    what the DFlash recipe means: the matrices at 0.02 (Muon's original shape scaling), everything else at 6e-4."""
    import re

    from deepspec.config.model import ModelConfig
    from deepspec.config.train import TrainConfig
    from deepspec.drafts import get_algorithm
    from deepspec.targets.tiny import tiny_config
    from deepspec.train.muon import Muon
    from deepspec.train.optim import build_optimizer, describe_param_groups, split_muon_params
    from deepspec.train.parallel import LossModule

    mcfg = ModelConfig(algorithm=algorithm, target_layer_ids=[0, 2, 4], block_size=4, num_anchors=3, markov_rank=8,
                       enable_confidence_head=True)
    draft = get_algorithm(algorithm).from_target_config(tiny_config("qwen3"), mcfg)
    wrapped = LossModule(draft)
    muon, adam = split_muon_params(wrapped)
    muon_names, adam_names = {n for n, _ in muon}, {n for n, _ in adam}
    body = re.compile(r"^(fc|(midlayer|layers\.\d+)\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj))\.weight$")
    assert muon_names and all(body.match(n) for n in muon_names), muon_names
    assert "fc.weight" in muon_names
    assert all(p.ndim < 2 for n, p in adam if not re.search(r"lm_head|markov_head|confidence_head", n)), adam_names
    if algorithm == "eagle3":
        assert "lm_head.weight" in adam_names
    else:
        assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight"} <= adam_names
        assert any(n.startswith("confidence_head.") and p.ndim == 2 for n, p in adam)
    trainable = {n for n, p in draft.named_parameters() if p.requires_grad}
    assert muon_names | adam_names == trainable and not muon_names & adam_names

    opt = build_optimizer(wrapped, TrainConfig(optimizer="muon", lr=6e-4, muon_lr=0.02))
    muon_opt, adam_opt = opt.optimizers
    assert isinstance(muon_opt, Muon) and isinstance(adam_opt, torch.optim.AdamW)
    assert [(g["lr"], g["adjust_lr_fn"]) for g in muon_opt.param_groups] == [(0.02, "original")]
    assert all(g["lr"] == 6e-4 for g in adam_opt.param_groups)
    assert sum(len(g["params"]) for g in muon_opt.param_groups) == len(muon)
    # no muon_lr: one lr for both, Muon's update matched to AdamW's RMS
    same = build_optimizer(wrapped, TrainConfig(optimizer="muon", lr=2e-3)).optimizers[0]
    assert [(g["lr"], g["adjust_lr_fn"]) for g in same.param_groups] == [(2e-3, "match_rms_adamw")]
    line = describe_param_groups(wrapped, TrainConfig(optimizer="muon", lr=6e-4, muon_lr=0.02))
    assert "Muon lr 0.02" in line and "AdamW lr 0.0006" in line and "fc.weight" in line
    assert ("lm_head.weight" if algorithm == "eagle3" else "markov_head.markov_w2.weight") in line.split("AdamW")[1]


class _Scalar(torch.nn.Module):
    """loss = (a * c)^2 for a micro-batch whose taps are all c; optionally weighted by the draft itself (c)."""

    def __init__(self, own_weight: bool):
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor(1.0))
        self.own_weight = own_weight

    def loss(self, batch):
        c = batch.taps[0, 0, 0, 0]
        loss = (self.a * c) ** 2
        metrics = {"c": (c.detach(), torch.tensor(1.0))}
        if self.own_weight:
            metrics["_loss_weight"] = (c.detach(), torch.tensor(1.0))
        return loss, metrics


def _scalar_run(tmp_path: Path, own_weight: bool, mode: str = "tokens", supervised: int = 6) -> dict:
    from deepspec.config import load_config
    from deepspec.train import train
    from deepspec.train.parts import TrainParts

    # two samples: c = 1 with 6 tokens (the first `supervised` of them supervised), c = 3 with 2 supervised tokens
    data = [
        {"input_ids": torch.arange(n), "loss_mask": torch.arange(n) < k, "taps": torch.full((n, 1, 1), c),
         "final_hidden": torch.zeros(n, 1)}
        for n, k, c in ((6, supervised, 1.0), (2, 2, 3.0))
    ]

    def write(directory: Path, weights) -> None:
        from safetensors.torch import save_file

        (directory / "config.json").write_text("{}")
        save_file(weights, str(directory / "model.safetensors"))

    cfg = load_config(REPO / "config/quickstart/eagle3.yaml", [
        f"output_root={tmp_path}", f"train.output_root={tmp_path / 'ckpt'}", f"exp=w{int(own_weight)}-{mode}-{supervised}",
        f"train.loss_normalization={mode}", "train.loss_tokens=assistant",
        "train.optimizer=adamw", "train.global_batch_size=2", "train.micro_batch_size=1", "train.max_steps=1",
        "train.log_every=1", "train.grad_clip=0", "logging.wandb=false", "logging.tensorboard=false", "logging.progress=false",
    ])
    with _on_cpu():
        train(cfg, TrainParts(model=_Scalar(own_weight), train_data=data, write_draft=write))
    return json.loads((cfg.run_dir / "train_log.jsonl").read_text().splitlines()[0])


def test_a_drafts_own_loss_weight_replaces_the_token_count(tmp_path):
    """"_loss_weight" weights each micro-batch's mean loss in backward and in the global normalisation; without it
    the weight is the micro-batch's supervised-token count. The reserved key is not logged."""
    own = _scalar_run(tmp_path, True)  # weights c: (1*1 + 3*9) / 4 = 7; grad (1*2 + 3*18) / 4 = 14
    assert own["train/loss"] == pytest.approx(7.0) and own["train/grad_norm"] == pytest.approx(14.0)
    assert "train/_loss_weight" not in own and own["train/c"] == pytest.approx(2.0)
    tokens = _scalar_run(tmp_path, False)  # weights 6 and 2: (6*1 + 2*9) / 8 = 3; grad (6*2 + 2*18) / 8 = 6
    assert tokens["train/loss"] == pytest.approx(3.0) and tokens["train/grad_norm"] == pytest.approx(6.0)


def test_positions_normalisation_divides_each_micro_batch_by_its_positions(tmp_path):
    """train.loss_normalization=positions (DeepSpec's per-B·T): each micro-batch's supervised sum over its B x T
    positions, micro-batches averaged; `tokens` pools every supervised token. Sample one has 3 of 6 tokens
    supervised (c = 1), sample two 2 of 2 (c = 3), one sample per micro-batch."""
    tokens = _scalar_run(tmp_path, False, "tokens", supervised=3)  # (3*1 + 2*9) / 5; grad (3*2 + 2*18) / 5
    assert tokens["train/loss"] == pytest.approx(4.2) and tokens["train/grad_norm"] == pytest.approx(8.4)
    per_bt = _scalar_run(tmp_path, False, "positions", supervised=3)  # (3/6*1 + 2/2*9) / 2; grad (1 + 18) / 2
    assert per_bt["train/loss"] == pytest.approx(4.75) and per_bt["train/grad_norm"] == pytest.approx(9.5)
    # a draft's own weight (c) stands for its token count: c / positions, micro-batches averaged
    own = _scalar_run(tmp_path, True, "positions", supervised=3)  # (1/6*1 + 3/2*9) / 2; grad (1/6*2 + 3/2*18) / 2
    assert own["train/loss"] == pytest.approx((1 / 6 + 13.5) / 2) and own["train/grad_norm"] == pytest.approx((1 / 3 + 27) / 2)


def test_truncate_jsonl_keeps_rows_up_to_the_checkpoint(tmp_path):
    from deepspec.train.loop import truncate_jsonl

    log = tmp_path / "train_log.jsonl"
    log.write_text("".join(json.dumps({"step": s, "train/loss": 1.0}) + "\n" for s in (1, 2, 3, 4, 3, 4)))
    truncate_jsonl(log, 2)
    assert [json.loads(x)["step"] for x in log.read_text().splitlines()] == [1, 2]
    truncate_jsonl(tmp_path / "missing.jsonl", 2)  # nothing to cut
