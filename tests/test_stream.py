"""Streamed training (cache.mode=stream): producers write the samples the trainer reads next into a bounded spool.

On the tiny random Llama target, with real producer processes (`deepspec data stream`) and real gloo workers: the
streamed run trains exactly like the offline cache run (same features, same order, same losses); the spool never
holds more than its cap; a producer killed with SIGKILL mid-epoch is restarted and every sample is still trained
exactly once per epoch (counted in the ledgers); a trainer killed mid-run resumes from its checkpoint and the
producers make again what it needs, and its ledgers still count each sample once per epoch; a trainer SIGTERMed while
it waits for a paused producer stops at once with the checkpoint of its last finished step and resumes exactly."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from gloo_ranks import outputs, start_ranks
from tiny_recipe import conversation, step_weights  # the trainer tests' conversations and saved weights

REPO = Path(__file__).resolve().parents[1]
STEPS = 12  # two epochs of 6 steps (24 samples, global batch 4)
GLOBAL = 4
CAP_GB = 0.0001  # 100 kB: a few of the tiny target's records


@pytest.fixture(scope="module")
def recipe(tmp_path_factory, tiny_llama_dir) -> Path:
    """A recipe on the tiny target; its held-out cache is built (validation reads it in both modes), and so is the
    train cache of the offline reference run. One target forward per sample (batch_tokens 1) on both paths, so the
    streamed features are the cache's bytes exactly."""
    from tiny_recipe import cached_recipe

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEEPSPEC_CACHE_DEVICE", "cpu")
        return cached_recipe(tmp_path_factory.mktemp("stream"), tiny_llama_dir, samples=24, heldout=4, max_length=128,
                             exp="offline", logging="wandb: false", model="draft_vocab_size: 64",
                             cache=f"batch_tokens: 1, spool_gb: {CAP_GB}, stream_ahead: 2, stream_timeout_s: 120",
                             train=f"optimizer: adamw, global_batch_size: {GLOBAL}, micro_batch_size: 1, max_steps: {STEPS}, "
                                   "save_every: 4, val_every: 6, log_every: 1, keep_last: 2")


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", DEEPSPEC_NO_PROGRESS="1", WANDB_MODE="offline", PYTHONPATH=str(REPO),
               CUDA_VISIBLE_DEVICES="", DEEPSPEC_CACHE_DEVICE="cpu")
    env.pop("DEEPSPEC_TRAIN_KILL_AFTER_STEP", None)
    env.update(extra)
    return env


def _losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in rows}


def _plan(cfg):
    from deepspec.data.cache.plan import plan_split
    from deepspec.data.batches import BatchPlan

    plan = plan_split(cfg, "train")
    return plan, BatchPlan(len(plan.samples), GLOBAL, 1, 1, cfg.train.seed)


def _reads(spool: Path) -> list[dict]:
    return [json.loads(line) for p in sorted(spool.glob("ledger.*.jsonl")) for line in p.read_text().splitlines()]


def _assert_each_sample_once_per_epoch(cfg, spool: Path, first_step: int = 0) -> None:
    """The ledgers hold exactly the plan's samples of steps first_step.. (each epoch's permutation), each once."""
    plan, order = _plan(cfg)
    expected = Counter(i for s in range(first_step, STEPS) for i in order.global_indices(s))
    reads = _reads(spool)
    assert Counter(r["index"] for r in reads) == expected
    assert all(plan.samples[r["index"]].id == r["id"] for r in reads)
    assert max(expected.values()) == 2  # two epochs: every sample twice, once in each


@pytest.fixture(scope="module")
def reference(recipe) -> Path:
    from deepspec.config import load_config
    from deepspec.train import train

    cfg = load_config(recipe)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("torch.cuda.is_available", lambda: False)
        train(cfg)
    return cfg.run_dir


@pytest.mark.slow
def test_streamed_run_trains_exactly_like_the_offline_cache(recipe, reference, tmp_path):
    """One worker fed by the trainer's own two local producers (each making every other sample, each with half the
    cap): the same losses, bit for bit, as training from the cache; the spool stayed under its cap and is empty at the
    end; the ledger counts each sample once per epoch. With cache.spool_keep the second epoch is linked back from the
    kept records (no target forward), and at the end they are an offline cache equal to the one built offline."""
    import shutil

    import torch

    from deepspec.config import load_config
    from deepspec.data.cache.reader import CacheDataset
    from deepspec.data.stream.spool import spool_dir
    from deepspec.train import train

    offline = load_config(recipe)
    shutil.copytree(offline.cache_heldout_dir, tmp_path / "cache" / "heldout")  # validation reads the same held-out cache
    cfg = load_config(recipe, ["exp=stream", "cache.mode=stream", "cache.stream_producers=2", f"cache.spool_gb={2 * CAP_GB}",
                               "cache.spool_keep=true", f"cache.dir={tmp_path / 'cache'}"])
    spool = spool_dir(cfg)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("torch.cuda.is_available", lambda: False)
        mp.setenv("DEEPSPEC_CACHE_DEVICE", "cpu")
        mp.setenv("DEEPSPEC_FAULT_KEEP_DELAY_S", "3")  # the kept cache is written well after the trainer's last read
        out = train(cfg)
    assert out.name == f"step_{STEPS}"
    assert _losses(cfg.run_dir) == _losses(reference)
    _assert_each_sample_once_per_epoch(cfg, spool)
    # with spool_keep the producers still write the kept records into an offline cache after the trainer's last read:
    # train() waits for them before it returns, so this process finds the kept cache complete at once
    beats = [json.loads((spool / f"producer.{w}.json").read_text()) for w in (0, 1)]
    assert all(b["state"] == "stopped" for b in beats), beats
    # 24 samples captured once; epoch 2 linked back from kept/ (more than 24 links: the small cap evicts some ahead)
    assert sum(b["produced"] for b in beats) == 24 and sum(b.get("restored", 0) for b in beats) >= 24, beats
    assert all(0 < b["peak_bytes"] <= CAP_GB * 1e9 for b in beats), beats  # each its half of the cap
    assert {r["producer"] for r in _reads(spool)} == {0, 1}
    assert not list(spool.glob("*.rec")) and not list(spool.glob(".*.tmp"))
    kept, built = CacheDataset(cfg.cache_train_dir), CacheDataset(offline.cache_train_dir)
    assert len(kept) == len(built) and torch.equal(kept.token_counts(), built.token_counts())
    assert kept.manifest["counts"] == built.manifest["counts"] and kept.verify_all(progress_bar=False) == []
    for i in range(len(kept)):
        a, b = kept[i], built[i]
        assert kept.sample_id(i) == built.sample_id(i) and all(torch.equal(a[k], b[k]) for k in b), i


def _opts(name: str, producers: int) -> list[str]:
    return [f"exp={name}", "cache.mode=stream", f"cache.stream_producers={producers}"]


def _train_sh(recipe: Path, opts: list[str], **env: str) -> subprocess.Popen:
    cmd = ["bash", str(REPO / "scripts/train/train.sh"), str(recipe), "--nproc", "2", "--opts", *opts]
    return subprocess.Popen(cmd, env=_env(PYTHON=sys.executable, **env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _producer(recipe: Path, opts: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "deepspec.cli", "data", "stream", str(recipe), "--opts", *opts]
    return subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)


def _wait(cond, timeout: float, what: str):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        v = cond()
        if v:
            return v
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _stalled(spool: Path) -> int:
    """Wait until the trainer's reads stop (none for 2 s); returns how many there were."""

    def still():
        n = len(_reads(spool))
        time.sleep(2.0)
        return n == len(_reads(spool)) and n + 1

    return _wait(still, 60, "the trainer to stall") - 1


@pytest.mark.slow
def test_trainer_killed_resumes_and_its_producer_makes_again_what_it_needs(recipe, reference):
    """train.sh with 2 workers and the trainer's own producer; rank 0 SIGKILLed after step 5 (last checkpoint: step 4),
    with records of the next step (plan step 5, counted from 0) already prefetched, read and deleted but never trained,
    and those of plan step 4 trained but in no checkpoint: its producer stops with it; the
    rerun resumes at step 4, a new producer makes steps 4.. again, and the ledgers, the lines written before the crash
    included, count every sample exactly once per epoch: what was read after the checkpoint is not counted twice."""
    from deepspec.config import load_config
    from deepspec.data.stream.spool import spool_dir

    opts = _opts("kill-trainer", 1)
    cfg = load_config(recipe, opts)
    spool = spool_dir(cfg)
    crashed = _train_sh(recipe, opts, DEEPSPEC_TRAIN_KILL_AFTER_STEP="5")
    _, err = crashed.communicate(timeout=300)
    assert crashed.returncode != 0, err[-2000:]
    assert os.path.realpath(cfg.run_dir / "step_latest").endswith("step_4")
    _wait(lambda: (json.loads((spool / "producer.0.json").read_text()).get("state") == "stopped"), 30, "the orphaned producer to stop")
    read_for = Counter(r["step"] for r in _reads(spool))
    assert 0 < read_for[5] and all(read_for[s] == GLOBAL for s in range(5)), read_for  # plan step 5 read, not trained
    rerun = _train_sh(recipe, opts)
    _, err = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, err[-3000:]
    assert "resuming from" in err and "step 4" in err
    _assert_each_sample_once_per_epoch(cfg, spool)  # both runs' lines: steps 0..3 before the crash, 4..11 after
    ref, got = _losses(reference), _losses(cfg.run_dir)
    assert all(abs(got[s] - ref[s]) < 1e-5 for s in range(5, STEPS + 1)), (got, ref)


@pytest.mark.slow
def test_a_killed_producer_is_replaced_and_a_sigterm_while_waiting_for_a_paused_one_resumes_exactly(recipe, reference):
    """2 gloo workers fed by a separately started producer, one run through two faults.
    SIGKILL the producer mid-epoch: the trainer waits (no read is lost or invented), and a new producer picks up where
    the running trainer is. Then pause that one (SIGSTOP): the trainer waits for the spool, and SIGTERM to train.sh
    stops it at once (the ranks stop waiting, agree, checkpoint their last finished step; exit 143, one line), not
    after cache.stream_timeout_s or the launcher's grace. The producer continues (SIGCONT), the same command resumes:
    every step's loss and the final weights are the uninterrupted offline run's, and the ledgers count every sample
    once per epoch."""
    from deepspec.config import load_config
    from deepspec.data.stream.spool import spool_dir

    opts = _opts("producer-faults", 0)
    cfg = load_config(recipe, opts)
    spool = spool_dir(cfg)
    trainer = _train_sh(recipe, opts, DEEPSPEC_PREEMPT_GRACE_S="100")
    producer = _producer(recipe, opts)
    try:
        _wait(lambda: len(_reads(spool)) >= 10, 180, "10 reads")
        os.kill(producer.pid, signal.SIGKILL)
        producer.wait()
        stalled_at = _stalled(spool)  # the reads stop once what the dead producer left in the spool is used up
        assert stalled_at < STEPS * GLOBAL and trainer.poll() is None, stalled_at

        producer = _producer(recipe, opts)  # picks up where the running trainer is
        _wait(lambda: len(_reads(spool)) >= stalled_at + GLOBAL, 180, "the trainer to read again")
        os.kill(producer.pid, signal.SIGSTOP)
        paused_at = _stalled(spool)  # what the producer made before it paused is read; then the trainer waits
        assert stalled_at < paused_at < STEPS * GLOBAL and trainer.poll() is None, (stalled_at, paused_at)
        t0 = time.monotonic()
        trainer.send_signal(signal.SIGTERM)
        _, err = trainer.communicate(timeout=90)
        stopped_s = time.monotonic() - t0
        assert trainer.returncode == 143, err[-3000:]
        finished = max(_losses(cfg.run_dir))  # the last step that trained (every step is logged)
        assert 0 < finished < STEPS and stopped_s < 30, (finished, stopped_s)
        assert os.path.realpath(cfg.run_dir / "step_latest").endswith(f"step_{finished}")  # steps lost: 0
        assert f"SIGTERM received: stopped after step {finished} with checkpoint step_{finished}" in err, err[-3000:]
        assert err.count("stopped by SIGTERM") == 1, err[-3000:]  # the launcher's one line
        os.kill(producer.pid, signal.SIGCONT)
        rerun = _train_sh(recipe, opts)
        _, err = rerun.communicate(timeout=300)
        assert rerun.returncode == 0, err[-3000:]
        assert f"resuming from {cfg.run_dir / f'step_{finished}'}" in err, err[-3000:]
        p_out, p_err = producer.communicate(timeout=60)
        assert producer.returncode == 0, p_err[-3000:]
    finally:
        for p in (trainer, producer):
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
    stats = json.loads(p_out.strip().splitlines()[-1])
    assert 0 < stats["produced"] <= STEPS * GLOBAL and stats["peak_bytes"] <= CAP_GB * 1e9, stats
    ref, got = step_weights(reference / f"step_{STEPS}"), step_weights(cfg.run_dir / f"step_{STEPS}")
    assert ref.keys() == got.keys() and all((got[k].double() - ref[k].double()).abs().max() < 1e-5 for k in ref)
    ref_loss, got_loss = _losses(reference), _losses(cfg.run_dir)  # steps 1..finished from the first run, then the rerun's
    assert set(got_loss) == set(ref_loss) and all(abs(got_loss[s] - ref_loss[s]) < 1e-5 for s in ref_loss), (got_loss, ref_loss)
    _assert_each_sample_once_per_epoch(cfg, spool)


_SPOOL_RANK = """
import os, sys
from types import SimpleNamespace as NS
import torch, torch.distributed as dist
from gloo_ranks import init_gloo
from deepspec.data.stream import spool as sp
from deepspec.data.stream.channel import FileChannel
from deepspec.data.batches import Prefetcher
from deepspec.preemption import PreemptionWatch, WaitPreempted
rank, spool, wait_s, group_s = int(os.environ["RANK"]), sys.argv[1], float(sys.argv[2]), sys.argv[3]
init_gloo(float(group_s) if group_s else None)
plan = NS(samples=[NS(id=f"s{i}", length=4) for i in range(2)], hidden_size=8, dtype="fp32", signature={}, token_counts=None)
ds = sp.SpoolDataset(FileChannel(spool), plan, global_batch=2, rank=rank, world=2, taps=[0], rows=1, local=spool, timeout_s=wait_s)
watch = PreemptionWatch(rank == 0)
batches = watch.wait_vote(Prefetcher(ds, lambda items: items, [(0, 0, [rank])], 1), ds)  # read in a loader thread
"""
_WAITING_RANK = _SPOOL_RANK + """
try:
    next(batches)
    dist.all_reduce(torch.ones(1))  # the step's gradient all-reduce
    print("trained", flush=True)
except WaitPreempted:
    print("stopped", flush=True)
"""
_OUTWAITED_RANK = _SPOOL_RANK + """
try:
    next(batches)
    print("read", flush=True)
except Exception as e:
    print(type(e).__name__, str(e).replace(chr(10), " ")[:300], flush=True)
    os._exit(1)
"""


def _spool_ranks(spool: Path, script: str, wait_s: float, group_s: str = "") -> list[subprocess.Popen]:
    """Ranks 0 and 1 (gloo) running `script` on a spool that holds sample 0 only: rank 0 has its data, rank 1 waits
    for sample 1 up to `wait_s`; `group_s`, the process group's timeout (empty: torch's default)."""
    from deepspec.data.cache import format as fmt
    from deepspec.data.stream import spool as sp
    from deepspec.data.stream.channel import FileChannel

    data = bytes(fmt.record_nbytes(4, 2, 8, "fp32"))
    sp.write_record(FileChannel(spool), 0, "s0", data, length=4, n_layers=2, hidden=8, dtype="fp32", truncated=False, producer=0)
    return start_ranks(script, str(spool), str(wait_s), group_s, env=_env())


def test_a_rank_that_holds_its_data_stops_with_the_rank_that_waits_for_the_spool(tmp_path):
    """2 gloo ranks read sample 0 and 1 from a spool that holds only sample 0: rank 0 has its data, rank 1 waits. SIGTERM
    to rank 1 alone ends its wait, and rank 0, which would otherwise enter the step's all-reduce and wait there for
    rank 1 for good, learns it from the vote after its fetch: both stop, at the same micro-batch, in seconds."""
    ranks = _spool_ranks(tmp_path, _WAITING_RANK, 60)
    try:
        _wait(lambda: (tmp_path / "ledger.0.jsonl").exists(), 60, "rank 0 to read its sample")  # rank 1 is waiting
        time.sleep(1.0)
        assert all(p.poll() is None for p in ranks)
        t0 = time.monotonic()
        ranks[1].send_signal(signal.SIGTERM)
        outs = [p.communicate(timeout=30) for p in ranks]
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
    assert time.monotonic() - t0 < 10 and [o.strip() for o, _ in outs] == ["stopped", "stopped"], outs


def test_a_rank_holding_its_data_outwaits_the_rank_that_waits_for_the_spool(tmp_path):
    """The same two ranks, no signal: rank 1 waits out the spool's timeout and stops with its own sentence (which
    sample, what the producers did). Rank 0, in the vote meanwhile, must not give up first on the process group's
    timeout - here 2 s against the spool's 5 s, as gloo's 30-minute default against a longer cache.stream_timeout_s,
    which it did while the vote went over the default group: the vote's group outlasts the dataset's wait."""
    outs = outputs(_spool_ranks(tmp_path, _OUTWAITED_RANK, 5, "2"), 120)
    waited, held = outs[1], outs[0]
    assert waited.startswith("CacheError Sample 1 ('s1') did not reach the spool"), outs
    assert "no producer has started" in waited, outs
    assert "Timed out" not in held and "timed out" not in held.lower(), outs  # rank 0 gave up only once rank 1 was gone


@pytest.fixture(scope="module")
def mooncake_store(tmp_path_factory) -> list[str]:
    """A Mooncake master with its HTTP metadata service on 127.0.0.1 (scripts/data/mooncake_master.sh), for the test
    that needs it; the --opts that point a recipe at it."""
    import socket

    from deepspec.data.engines.server import free_port
    from deepspec.data.stream.channel import import_mooncake
    from deepspec.errors import CacheError

    try:
        import_mooncake()
    except CacheError as e:
        pytest.skip(str(e))
    port, meta = free_port(), free_port()
    log = open(tmp_path_factory.mktemp("mooncake") / "master.log", "w")
    master = subprocess.Popen(["bash", str(REPO / "scripts/data/mooncake_master.sh"), "--host", "127.0.0.1", "--port", str(port),
                               "--metadata-port", str(meta), "--metrics-port", str(free_port())],
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def up() -> bool:
        for p in (port, meta):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", p)) != 0:
                    return False
        return True

    try:
        _wait(up, 60, "mooncake_master")
        yield ["cache.spool_transport=mooncake", f"cache.mooncake_master=127.0.0.1:{port}",
               f"cache.mooncake_metadata=http://127.0.0.1:{meta}/metadata"]
    finally:
        os.killpg(master.pid, signal.SIGKILL)
        master.wait()
        log.close()


@pytest.mark.slow
def test_a_mooncake_spool_trains_like_the_offline_cache_and_survives_a_killed_producer(recipe, reference, mooncake_store):
    """The spool in a Mooncake store (cache.spool_transport=mooncake, over TCP): records, plan, positions and heartbeats
    travel through the store, not the spool folder. A producer is SIGKILLed mid-epoch: its records leave with its
    memory segment, the trainer waits, a new producer makes again what was not read, and training ends with the
    offline run's losses and every sample read exactly once per epoch."""
    import threading

    from deepspec.config import load_config
    from deepspec.data.stream.spool import spool_dir
    from deepspec.train import train

    opts = [*_opts("mooncake", 0), *mooncake_store]
    cfg = load_config(recipe, opts)
    spool = spool_dir(cfg)
    spool.mkdir(parents=True, exist_ok=True)
    seen: dict[str, object] = {}

    def producers() -> None:  # beside the trainer: one producer, killed after 10 reads, then its replacement
        first = _producer(recipe, opts)
        try:
            _wait(lambda: len(_reads(spool)) >= 10, 180, "10 reads")
            os.kill(first.pid, signal.SIGKILL)
            first.wait()

            seen["stalled_at"] = _stalled(spool)
            second = _producer(recipe, opts)
            seen["second"] = second.communicate(timeout=300)
            seen["rc"] = second.returncode
        except BaseException as e:  # noqa: BLE001 - reported by the test body
            seen["error"] = e
            if first.poll() is None:
                first.kill()

    helper = threading.Thread(target=producers, daemon=True)
    helper.start()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("torch.cuda.is_available", lambda: False)
        train(cfg)
    helper.join(timeout=120)
    assert "error" not in seen, seen.get("error")
    assert seen["stalled_at"] < STEPS * GLOBAL and seen["rc"] == 0, seen
    stats = json.loads(seen["second"][0].strip().splitlines()[-1])
    assert 0 < stats["produced"] < STEPS * GLOBAL and stats["peak_bytes"] <= CAP_GB * 1e9, stats
    _assert_each_sample_once_per_epoch(cfg, spool)
    ref, got = _losses(reference), _losses(cfg.run_dir)
    assert set(got) == set(ref) and all(abs(got[s] - ref[s]) < 1e-5 for s in ref), (got, ref)
    assert json.loads((spool / "done.0").read_text())["reads"] == STEPS * GLOBAL  # the store's done mark, kept here too
    # nothing of the spool but the ledger (and the producers' logs) touched the folder
    assert not list(spool.glob("*.rec")) and not list(spool.glob("pos.*")) and not list(spool.glob("producer.*.json"))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_deepseek_v4_flash_dflash_recipe_trains_streamed_on_tiny_mhc(tmp_path, monkeypatch, one_torch_thread):
    """The V4-Flash DFlash recipe (4 residual streams concatenated per tap) streamed end to end on tiny-mhc: the cache
    stage builds only the held-out cache, the trainer's producer streams 5 taps x 4 streams + the final state per token,
    and the draft's fc reads 5 x 4 x 64 features."""
    from test_targets_mhc import RECIPES, SMALL, _write_data

    from deepspec.config import load_config
    from deepspec.data.cache.format import is_complete
    from deepspec.data.stream.spool import spool_dir
    from deepspec.drafts.checkpoint import load_draft
    from deepspec.pipeline import run

    monkeypatch.setenv("DEEPSPEC_CACHE", str(tmp_path / "dscache"))
    monkeypatch.setenv("DEEPSPEC_CACHE_DEVICE", "cpu")
    data = tmp_path / "data"
    _write_data(data, 8, "regenerated.jsonl", 0)
    _write_data(data, 2, "regenerated.heldout.jsonl", 1)
    recipe, extra = RECIPES["dflash"]
    opts = [f"output_root={tmp_path / 'out'}", f"train.output_root={tmp_path / 'ckpt'}", f"data.dir={data}",
            f"cache.dir={tmp_path / 'cache'}", *SMALL, *extra, "cache.mode=stream", "cache.spool_gb=0.001"]
    (res,) = run([str(REPO / recipe)], opts, stages=("cache", "train"), engine=False)
    assert res.checkpoint is not None and res.checkpoint.name == "step_2"
    assert is_complete(tmp_path / "cache" / "heldout") and not (tmp_path / "cache" / "train").exists()
    draft = load_draft(res.checkpoint)
    assert (draft.arch.target_hc_mult, draft.arch.tap_reduction) == (4, "concat") and draft.fc.in_features == 5 * 4 * 64
    spool = spool_dir(load_config(str(REPO / recipe), opts))
    assert json.loads((spool / "plan.json").read_text())["signature"]["tap_reduction"] == "concat"
    beat = json.loads((spool / "producer.0.json").read_text())
    assert beat["produced"] == 4 and beat["state"] == "stopped", beat  # 2 steps x 2 samples
    assert sum(1 for _ in _reads(spool)) == 4


@pytest.mark.slow
def test_a_trainer_stops_at_once_when_its_producer_fails(recipe):
    """Two local producers sharing a cap that cannot hold one sample each: they stop with their sentence, and the
    trainer stops with it too, at once, not after cache.stream_timeout_s."""
    from deepspec.config import load_config
    from deepspec.errors import CacheError
    from deepspec.train import train

    cfg = load_config(recipe, ["exp=failing", "cache.mode=stream", "cache.stream_producers=2", "cache.spool_gb=0.00004"])
    t0 = time.monotonic()
    with pytest.MonkeyPatch.context() as mp, pytest.raises(CacheError, match=r"Producer [01] of the spool .* stopped: Sample .* needs .* raise cache.spool_gb"):
        mp.setattr("torch.cuda.is_available", lambda: False)
        mp.setenv("DEEPSPEC_CACHE_DEVICE", "cpu")
        train(cfg)
    assert time.monotonic() - t0 < 100  # cache.stream_timeout_s is 120


def test_a_producer_refuses_another_plan_and_a_cap_smaller_than_a_sample(recipe, tmp_path):
    """Boundary errors are sentences: a producer started with other --opts than the trainer (other taps) names the field;
    a spool share that cannot hold one sample names the sizes and cache.spool_gb."""
    from deepspec.config import load_config
    from deepspec.data.stream import spool as sp
    from deepspec.data.stream.channel import FileChannel
    from deepspec.data.stream.producer import Producer
    from deepspec.data.cache.plan import plan_split
    from deepspec.errors import CacheError

    spool = tmp_path / "spool"
    spool.mkdir()
    cfg = load_config(recipe, ["cache.mode=stream"])
    plan = plan_split(cfg, "train")
    sp.put_json(FileChannel(spool), sp.PLAN, {**sp.plan_document(plan, seed=0, global_batch=GLOBAL, total_steps=STEPS, bucketing="length"), "world": 1})
    other = load_config(recipe, ["cache.mode=stream", "model.target_layer_ids=[1,2,4]"])
    with pytest.raises(CacheError, match=r"planned taps=\[0, 2, 4\] but this producer's recipe gives \[1, 2, 4\]"):
        Producer(other, spool=spool).run(max_idle_s=5)
    (spool / "pos.0").write_text("0")
    tiny = load_config(recipe, ["cache.mode=stream", "cache.spool_gb=0.000001"])
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEEPSPEC_CACHE_DEVICE", "cpu")
        with pytest.raises(CacheError, match=r"needs [\d.]+ kB in the spool but each of the 1 producer\(s\) may hold 1\.0 kB \(cache.spool_gb=1e-06 / producers\); raise"):
            Producer(tiny, spool=spool).run(max_idle_s=5)
    assert not list(spool.glob("*.rec"))


def test_a_producer_fills_the_first_steps_before_the_trainer_reads(recipe, tmp_path, monkeypatch):
    """A trainer's rank 0 publishes where its ranks will start reading (the plan's start_step: the resume step) before
    it builds its model, so its producers fill those steps at once instead of idling until the first read; and only
    those steps: nothing of the steps already trained."""
    import threading

    from deepspec.config import load_config
    from deepspec.data.stream import spool as sp
    from deepspec.data.stream.channel import FileChannel
    from deepspec.data.stream.producer import Producer
    from deepspec.data.cache.plan import plan_split
    from deepspec.data.batches import BatchPlan

    monkeypatch.setenv("DEEPSPEC_CACHE_DEVICE", "cpu")
    spool = tmp_path / "spool"
    spool.mkdir()
    cfg = load_config(recipe, ["cache.mode=stream", "cache.stream_ahead=1", "cache.spool_gb=0.01"])
    plan = plan_split(cfg, "train")
    doc = sp.plan_document(plan, seed=0, global_batch=GLOBAL, total_steps=STEPS, bucketing="length")
    sp.put_json(FileChannel(spool), sp.PLAN, {**doc, "world": 1, "start_step": 2})  # a trainer resuming at step 2
    order = BatchPlan(len(plan.samples), GLOBAL, GLOBAL, 1, 0, "length")
    want = set(order.read_order(2, [s.length for s in plan.samples]))

    def made() -> set[int]:
        return {i for i in range(len(plan.samples)) if sp.record_path(spool, i).exists()}

    stats: dict = {}
    producer = threading.Thread(target=lambda: stats.update(Producer(cfg, spool=spool).run()))
    producer.start()
    try:
        _wait(lambda: made() == want or not producer.is_alive(), 120, "step 2's records")
        time.sleep(1.0)  # a producer that went on past its window would show it here
        assert made() == want and not list(spool.glob("pos.*"))  # made before any read, and only step 2's samples
    finally:
        (spool / "done.0").write_text("{}")
        producer.join(60)
    assert stats["produced"] == GLOBAL, stats


def test_a_read_record_evicted_before_its_move_is_kept_from_the_bytes_read(tmp_path):
    """With cache.spool_keep, once a reader has published its next position a producer may evict the record it just read
    (it is no longer wanted) before the reader moves it to kept/: the kept copy is then written from the bytes read."""
    from deepspec.data.stream.keep import kept_path
    from deepspec.data.stream.spool import consume

    path = tmp_path / "3.rec"
    path.write_bytes(b"record bytes")
    blob = path.read_bytes()
    path.unlink()  # the producer's eviction
    consume(path, True, blob)
    assert kept_path(tmp_path, 3).read_bytes() == blob and not list((tmp_path / "kept").glob(".*"))
    with pytest.raises(FileNotFoundError):
        consume(tmp_path / "4.rec", True)  # without the bytes there is nothing to keep


def test_a_full_disk_under_the_spool_is_one_sentence_and_leaves_no_partial_record(tmp_path):
    """The spool's cap counts the spool, not what else fills its disk: a write that runs out of room (here a file-size
    limit, as `ulimit -f` sets) stops the producer with a sentence naming the record, and no partial file remains."""
    code = f"""
import resource, signal
resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000)); signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
from pathlib import Path
from deepspec.data.stream import spool as sp
from deepspec.data.stream.channel import FileChannel
sp.write_record(FileChannel({str(tmp_path)!r}), 0, "small", b"x" * 1000, length=1, n_layers=1, hidden=1, dtype="bf16", truncated=False, producer=0)
sp.write_record(FileChannel({str(tmp_path)!r}), 1, "big", b"x" * 100000, length=1, n_layers=1, hidden=1, dtype="bf16", truncated=False, producer=0)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert out.returncode != 0 and "DiskFullError: No room to write the streamed record" in out.stderr, out.stderr[-2000:]
    assert "lower cache.spool_gb" in out.stderr
    from deepspec.data.stream import spool as sp

    assert sp.record_path(tmp_path, 0).is_file() and not sp.record_path(tmp_path, 1).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [sp.record_path(tmp_path, 0).name]  # no temporary left


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_producer_streams_the_features_the_hf_cache_holds(smollm2_dir, tmp_path, monkeypatch):
    """A producer capturing with vLLM's extract_hidden_states (cache.capture_backend=vllm) writes, for the positions a
    trainer publishes, records whose features equal a transformers-built cache's within fp32 round-off; it stops
    when the trainer says done."""
    pytest.importorskip("vllm")
    import threading

    import torch

    from deepspec.config import config_from_dict
    from deepspec.data.stream import spool as sp
    from deepspec.data.stream.channel import FileChannel
    from deepspec.data.cache.format import record_item
    from deepspec.data.cache.reader import CacheDataset
    from deepspec.data.stream.producer import Producer
    from deepspec.data.cache.plan import plan_split
    from deepspec.data.cache.writer import build_cache

    monkeypatch.setenv("DEEPSPEC_CACHE_DEVICE", "cpu")
    (tmp_path / "data").mkdir()
    rng = random.Random(1)
    (tmp_path / "data" / "regenerated.jsonl").write_text("".join(json.dumps(conversation(rng, i)) + "\n" for i in range(4)))

    def cfg_for(backend: str):
        return config_from_dict({
            "target": {"name": str(smollm2_dir), "dtype": "float32"}, "data": {"dir": str(tmp_path / "data")},
            "cache": {"dir": str(tmp_path / backend), "dtype": "fp32", "capture_backend": backend, "max_length": 128,
                      "mode": "stream", "spool_dir": str(tmp_path / "spool")},
            "train": {"global_batch_size": 2, "micro_batch_size": 1, "max_steps": 2},
        })

    hf = CacheDataset(build_cache(cfg_for("hf"), "train"))
    cfg = cfg_for("vllm")
    plan = plan_split(cfg, "train")
    spool = tmp_path / "spool"
    spool.mkdir()
    sp.put_json(FileChannel(spool), sp.PLAN, {**sp.plan_document(plan, seed=0, global_batch=2, total_steps=2, bucketing="length"), "world": 1})
    (spool / "pos.0").write_text("0")  # a trainer at the start of its plan
    stats: dict = {}
    producer = threading.Thread(target=lambda: stats.update(Producer(cfg, spool=spool).run()))
    producer.start()
    _wait(lambda: len(list(spool.glob("*.rec"))) == 4 or not producer.is_alive(), 300, "4 records")
    records = [sp.read_record(sp.record_path(spool, i), verify=True) for i in range(4)]
    (spool / "done.0").write_text("{}")  # the trainer's end: the producer removes what it made and stops
    producer.join(60)
    assert not producer.is_alive() and stats["produced"] == 4, stats
    assert not list(spool.glob("*.rec"))
    for i, (header, data) in enumerate(records):
        got, ref = record_item(data, 0, header["length"], len(hf.taps), 1, hf.hidden_size, "fp32"), hf[i]
        assert header["id"] == hf.sample_id(i) and torch.equal(got["input_ids"], ref["input_ids"])
        torch.testing.assert_close(got["taps"], ref["taps"], rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(got["final_hidden"], ref["final_hidden"], rtol=1e-3, atol=1e-3)
