"""Training under faults, with real processes and real signals on a tiny random Llama target's real cache:
preemption (SIGTERM to the launcher, SIGUSR1 to one worker only), non-finite losses, two runs on one folder,
corrupt checkpoints at resume. docs/reliability.md quotes what these tests measure."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from gloo_ranks import outputs, start_ranks
from tiny_recipe import max_weight_diff, step_weights

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def recipe(tmp_path_factory, tiny_llama_dir) -> Path:
    """fp32: the equalities below are fp32-exact (pinned, not the quickstart's bf16_if_native, bf16 on some CPUs)."""
    from tiny_recipe import cached_recipe

    return cached_recipe(tmp_path_factory.mktemp("faults"), tiny_llama_dir, samples=16, heldout=4, max_length=64, project="f",
                         answer=(6, 20),
                         train="optimizer: adamw, precision: fp32, global_batch_size: 4, micro_batch_size: 1, max_steps: 40, "
                               "save_every: 1000, val_every: 1000, log_every: 1, keep_last: 2, num_workers: 0")


def _cfg(recipe: Path, *opts: str):
    from deepspec.config import load_config

    return load_config(recipe, list(opts))


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", DEEPSPEC_NO_PROGRESS="1", WANDB_MODE="offline", PYTHONPATH=str(REPO),
               CUDA_VISIBLE_DEVICES="", PYTHON=sys.executable)
    for key in ("DEEPSPEC_TRAIN_KILL_AFTER_STEP", "WANDB_SERVICE"):
        env.pop(key, None)
    env.update(extra)
    return env


def _train_sh(recipe: Path, nproc: int, *opts: str, **env: str) -> subprocess.Popen:
    cmd = ["bash", str(REPO / "scripts/train/train.sh"), str(recipe), "--nproc", str(nproc), "--opts", *opts]
    return subprocess.Popen(cmd, env=_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _logged_steps(run_dir: Path) -> list[int]:
    f = run_dir / "train_log.jsonl"
    if not f.is_file():
        return []
    return [json.loads(line)["step"] for line in f.read_text().splitlines() if line.strip()]


def _wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int, timeout: float = 180) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise AssertionError(f"training ended before step {step}: {proc.stderr.read()[-3000:]}")
        if any(s >= step for s in _logged_steps(run_dir)):
            return
        time.sleep(0.05)
    raise AssertionError(f"no step {step} after {timeout} s")


def _finish(proc: subprocess.Popen, timeout: float = 180) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        raise AssertionError(f"did not exit within {timeout} s: {err[-3000:]}")
    return proc.returncode, err


def _children(pid: int) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                fields = (p / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(p.name))
    return out


def _rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


# ----------------------------------------------------------------------------- preemption


@pytest.mark.slow
def test_sigterm_checkpoints_the_current_step_and_the_rerun_loses_none(recipe):
    """SIGTERM to train.sh (2 workers) mid-run: exit status 143 with a checkpoint of the last finished step (0 steps
    lost); the same command resumes from it and ends with the weights of an uninterrupted run."""
    from deepspec.train import train
    from deepspec.train.checkpoint import latest_step_dir, load_trainer_state

    opts = ("run.name=term",)
    run_dir = _cfg(recipe, *opts).run_dir
    proc = _train_sh(recipe, 2, *opts)
    _wait_for_step(proc, run_dir, 3)
    proc.send_signal(signal.SIGTERM)  # the process train.sh exec'ed: deepspec's torchrun wrapper
    rc, err = _finish(proc)
    assert rc == 143, err[-3000:]
    done = _logged_steps(run_dir)[-1]
    saved = latest_step_dir(run_dir)
    assert saved.name == f"step_{done}" and load_trainer_state(saved)["step"] == done  # steps lost: 0
    assert f"SIGTERM received: stopped after step {done} with checkpoint step_{done}" in err
    assert "Traceback" not in err, err[-3000:]
    assert done < 40

    rc, err = _finish(_train_sh(recipe, 2, *opts))
    assert rc == 0, err[-3000:]
    assert f"resuming from {saved}" in err and f"step {done}," in err
    reference = _cfg(recipe, "run.name=reference")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: False)
        ref = train(reference)
    assert max_weight_diff(step_weights(ref), step_weights(run_dir / "step_40")) < 1e-5
    assert _logged_steps(run_dir) == list(range(1, 41))


@pytest.mark.slow
def test_muon_sharded_across_two_workers_trains_exactly_as_every_rank_doing_all_of_it(recipe):
    """train.sh with 2 DDP workers and Muon: with train.muon_shard each rank orthogonalises half the matrices and
    broadcasts them (deepspec/train/muon_shard.py); the checkpoints — weights and Muon's momentum — equal those of the
    same run with every rank doing all of it, bit for bit."""
    runs = {}
    for shard in ("true", "false"):
        opts = (f"run.name=muon-shard-{shard}", "train.optimizer=muon", "train.max_steps=4", "train.save_every=4",
                f"train.muon_shard={shard}")
        rc, err = _finish(_train_sh(recipe, 2, *opts))
        assert rc == 0, err[-3000:]
        runs[shard] = _cfg(recipe, *opts).run_dir / "step_4"
    a, b = step_weights(runs["true"]), step_weights(runs["false"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    moments_a, moments_b = _optimizer_state(runs["true"]), _optimizer_state(runs["false"])
    assert any(k.endswith("momentum_buffer") for k in moments_a)
    assert moments_a.keys() == moments_b.keys() and all(torch.equal(moments_a[k], moments_b[k]) for k in moments_a)


@pytest.mark.slow
def test_sigusr1_to_one_worker_stops_every_rank_at_the_same_step(recipe):
    """Slurm's --signal may reach one process only: the flag is all-reduced, so both ranks checkpoint the same step."""
    from deepspec.train.checkpoint import latest_step_dir, load_trainer_state

    opts = ("run.name=usr1",)
    run_dir = _cfg(recipe, *opts).run_dir
    proc = _train_sh(recipe, 2, *opts)
    _wait_for_step(proc, run_dir, 2)
    workers = {_rank_of(pid): pid for pid in _children(proc.pid)}
    assert set(workers) == {0, 1}, workers
    os.kill(workers[1], signal.SIGUSR1)
    rc, err = _finish(proc)
    assert rc == 138, err[-3000:]
    done = _logged_steps(run_dir)[-1]
    state = load_trainer_state(latest_step_dir(run_dir))
    assert state["step"] == done and len(state["rng"]) == 2  # both ranks took part in the checkpoint
    assert "SIGUSR1 received" in err and "Traceback" not in err, err[-3000:]


def test_a_signal_that_lands_during_the_vote_is_kept_for_the_next_step(monkeypatch):
    """Ranks vote on the flag with an all-reduce every step; Python runs a signal handler as that call returns, so a
    signal landing during the vote is not in its result. It must count at the next step, not be overwritten with 0
    (seen as a SIGUSR1 to one worker that training never acted on)."""
    import torch.distributed as dist

    from deepspec.preemption import PreemptionWatch

    watch = PreemptionWatch(is_main=False)
    try:
        watch._multi = True  # as with several ranks; the vote is replaced below
        arrivals = [signal.SIGUSR1, None]

        def vote(flag, op=None, group=None):
            sig = arrivals.pop(0)
            if sig is not None:
                watch._handle(sig, None)  # the handler runs while this rank's flag (0) is already on its way

        monkeypatch.setattr(dist, "all_reduce", vote)
        assert watch.requested() is False  # this step's vote had no signal in it ...
        assert watch.requested() is True and watch.signum == signal.SIGUSR1  # ... the next one carries it
    finally:
        watch.close()


@pytest.mark.parametrize(
    "codes, expected",
    [
        ((138, -signal.SIGTERM), 138),  # rank 0 left first; torchrun SIGTERMed rank 1 while it tore down
        ((143, 143), 143),
        ((138, -signal.SIGKILL), 138),
        ((1, -signal.SIGTERM), None),  # a real failure stays one
        ((-signal.SIGTERM, -signal.SIGTERM), None),  # nobody checkpointed on a signal: not a preemption
    ],
)
def test_launcher_reads_a_peer_torn_down_after_a_preemption_as_the_preemption(monkeypatch, codes, expected, capsys):
    """torchrun reports the rank that exits first with 128 + signal and SIGTERMs the rest; the launcher's status is the
    preemption's whichever rank torchrun caught first."""
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from deepspec.train.launcher import run_torchrun

    def fail(argv):
        raise ChildFailedError("deepspec.train.worker",
                               {rank: ProcessFailure(rank, 1000 + rank, code, "<N/A>") for rank, code in enumerate(codes)})

    monkeypatch.setattr(torchrun, "main", fail)
    if expected is None:
        with pytest.raises(ChildFailedError):
            run_torchrun([])
    else:
        assert run_torchrun([]) == expected
        assert "checkpointed their last step" in capsys.readouterr().err


# ----------------------------------------------------------------------------- non-finite numbers


class _Poisoned:
    """The cache's samples, with NaN features for the chosen indices (a corrupt row in a real cache)."""

    def __init__(self, data, bad: set[int]):
        self.data, self.bad = data, bad

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict:
        sample = self.data[i]
        if i in self.bad:
            sample = dict(sample, taps=torch.full_like(sample["taps"], float("nan")))
        return sample

    def __getattr__(self, name: str):
        if name in ("data", "bad"):
            raise AttributeError(name)
        return getattr(self.data, name)


class _PoisonedPasses(_Poisoned):
    """Held-out samples that are all NaN during the chosen validation passes (1-based) and clean in the others."""

    def __init__(self, data, passes: set[int]):
        super().__init__(data, set())
        self.passes, self.seen = passes, 0

    def __getitem__(self, i: int) -> dict:
        if i == 0:  # every validation pass reads sample 0 first
            self.seen += 1
            self.bad = set(range(len(self.data))) if self.seen in self.passes else set()
        return super().__getitem__(i)


def _train_poisoned(cfg, bad: set[int], bad_val_passes: set[int] = frozenset()):
    from deepspec.train import train
    from deepspec.train.build import build_parts
    from deepspec.train.dist import DistInfo

    parts = build_parts(cfg, DistInfo(0, 1, 0, torch.device("cpu"), False))
    parts.train_data = _Poisoned(parts.train_data, bad if bad != {"all"} else set(range(len(parts.train_data))))
    if bad_val_passes:
        parts.val_data = _PoisonedPasses(parts.val_data, bad_val_passes)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: False)
        return train(cfg, parts)


def _optimizer_state(step_dir: Path) -> dict[str, torch.Tensor]:
    """Every state tensor of a checkpoint's optimizers by a flat name (Muon's momentum; AdamW's step, exp_avg, exp_avg_sq)."""
    saved = torch.load(step_dir / "optimizer.pt", weights_only=True)
    return {f"{j}.{idx}.{key}": torch.as_tensor(value)
            for j, opt in enumerate(saved.get("optimizers", [saved])) for idx, state in opt["state"].items()
            for key, value in state.items()}


def test_nonfinite_steps_update_nothing_and_a_streak_stops_with_the_last_good_checkpoint(recipe, logs):
    """A NaN row makes its steps' loss NaN: those steps leave the weights and every optimizer state tensor (Muon's
    momentum, AdamW's moments and step count) exactly as they were and are logged with their samples; a NaN
    validation never becomes step_best; 3 non-finite steps in a row stop training and step_latest stays the last
    good checkpoint."""
    from deepspec.data.batches import BatchPlan
    from deepspec.train.checkpoint import latest_step_dir, read_best
    from deepspec.train.guard import NonFiniteLossError

    opts = ("run.name=nan", "train.max_steps=8", "train.save_every=1", "train.keep_last=20", "train.max_nonfinite_steps=3",
            "train.optimizer=muon", "train.val_every=2")
    cfg = _cfg(recipe, *opts)
    plan = BatchPlan(16, 4, 1, 1, cfg.train.seed, cfg.train.bucketing)
    bad_sample = plan.global_indices(2)[0]  # in step 3 (and once in steps 5-8, the second epoch)
    bad_steps = [s + 1 for s in range(8) if bad_sample in plan.global_indices(s)]
    assert bad_steps[0] == 3 and len(bad_steps) == 2
    out = _train_poisoned(cfg, {bad_sample}, bad_val_passes={1})  # the first validation (step 2) is all NaN
    run_dir = cfg.run_dir
    rows = {json.loads(x)["step"]: json.loads(x) for x in (run_dir / "train_log.jsonl").read_text().splitlines()}
    for s in range(1, 9):
        before, after = step_weights(run_dir / f"step_{s - 1}") if s > 1 else None, step_weights(run_dir / f"step_{s}")
        opt_before, opt_after = _optimizer_state(run_dir / f"step_{s - 1}") if s > 1 else None, _optimizer_state(run_dir / f"step_{s}")
        assert all(torch.isfinite(v).all() for v in after.values())
        updates = s - sum(b <= s for b in bad_steps)  # AdamW counts the updates it made, not the steps
        counts = [v for k, v in opt_after.items() if k.endswith(".step")]
        assert counts and all(float(c) == updates for c in counts)
        assert any(k.endswith(".momentum_buffer") for k in opt_after) and any(k.endswith(".exp_avg_sq") for k in opt_after)
        if s in bad_steps:
            assert rows[s]["train/loss"] != rows[s]["train/loss"]  # NaN logged as it was
            assert max_weight_diff(before, after) == 0.0  # no update at all
            assert opt_before.keys() == opt_after.keys() and all(torch.equal(opt_before[k], opt_after[k]) for k in opt_after)
        elif before is not None:
            assert max_weight_diff(before, after) > 0
            assert all(not torch.equal(opt_before[k], opt_after[k]) for k in opt_after if k.endswith((".momentum_buffer", ".exp_avg")))
    assert out.name == "step_8"
    sid = str(json.loads((cfg.cache_train_dir / "ids.json").read_text())[bad_sample])
    assert any(f"step {bad_steps[0]} skipped" in r.getMessage() and sid in r.getMessage() for r in logs.records)
    val = {json.loads(x)["step"]: json.loads(x) for x in (run_dir / "val_log.jsonl").read_text().splitlines()}
    assert sorted(val) == [2, 4, 6, 8] and val[2]["loss"] != val[2]["loss"] and val[2]["expected_tau"] != val[2]["expected_tau"]
    finite = {s: v["expected_tau"] for s, v in val.items() if s != 2}
    assert all(torch.isfinite(torch.tensor(v)) for v in finite.values())
    best = read_best(run_dir)
    assert best["step"] == max(finite, key=lambda s: (finite[s], -s)) and best["value"] == finite[best["step"]]
    assert (run_dir / "step_best").resolve() == (run_dir / f"step_{best['step']}").resolve()

    # every sample poisoned from now on: steps 9, 10, 11 are non-finite -> a sentence; the newest checkpoint holds
    # step 8's weights (the skipped steps 9 and 10 were saved unchanged) and step 11 was not saved
    more = _cfg(recipe, *opts, "train.max_steps=12", "run.allow_changes=true")
    with pytest.raises(NonFiniteLossError, match="3 steps in a row .*up to step 11"):
        _train_poisoned(more, {"all"})
    latest = latest_step_dir(run_dir)
    assert latest.name == "step_10" and max_weight_diff(step_weights(latest), step_weights(run_dir / "step_8")) == 0.0


def test_a_nonfinite_validation_is_never_a_step_best_candidate():
    """A draft that reports only alpha_tf@k gets expected τ derived with NaN α counted as 0 (a finite 1.0): the NaN
    loss still keeps that validation out of step_best; so does an infinite expected τ, which would outrank every
    later validation."""
    from deepspec.train.validate import best_metric, derive

    nan, inf = float("nan"), float("inf")
    derived = derive({"loss": nan, "alpha_tf@1": nan, "alpha_tf@2": nan})
    assert derived["expected_tau"] == 1.0 and best_metric(derived) == ("expected_tau", None)
    assert best_metric({"loss": 2.0, "expected_tau": inf}) == ("expected_tau", None)
    assert best_metric({"loss": -inf, "expected_tau": 2.5}) == ("expected_tau", None)
    assert best_metric(derive({"loss": 2.0, "alpha_tf@1": 0.5})) == ("expected_tau", 1.5)


# ----------------------------------------------------------------------------- corrupt checkpoints, secrets


def test_truncated_checkpoint_falls_back_to_the_newest_intact_step_and_secrets_stay_out_of_the_run(recipe, logs):
    """step_4's weights cut in half (a disk that filled up, a copy that stopped): the rerun says which file is damaged,
    resumes from step_2 and ends where an uninterrupted run ends. An API key and a URL password given as overrides
    appear in no file of the run folder."""
    from deepspec.train import train

    secret_opts = ("data.regenerate.urls=[http://user:hunter2@127.0.0.1:9]", "eval.engine_extra_args=[--api-key,sk-SECRET42]")
    opts = ("run.name=corrupt", "train.max_steps=4", "train.save_every=2", "train.keep_last=3", *secret_opts)
    cfg = _cfg(recipe, *opts)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: False)
        first = train(cfg)
        assert first.name == "step_4"
        weights = first / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
        again = train(_cfg(recipe, *opts))
        reference = train(_cfg(recipe, "run.name=corrupt-ref", *opts[1:]))
    assert any("step_4 is damaged (model.safetensors: SafetensorError" in r.getMessage() for r in logs.records)
    assert any("resuming from" in r.getMessage() and "step_2" in r.getMessage() for r in logs.records)
    assert again.name == "step_4" and max_weight_diff(step_weights(again), step_weights(reference)) < 1e-6
    leaked = [p for p in cfg.run_dir.rglob("*") if p.is_file() and (b"hunter2" in p.read_bytes() or b"sk-SECRET42" in p.read_bytes())]
    assert not leaked, leaked
    assert "<redacted>" in (cfg.run_dir / "config.yaml").read_text()


# ----------------------------------------------------------------------------- full disks (RLIMIT_FSIZE: EFBIG)


def _file_size_limit(limit: int):
    """preexec_fn: files of the child may not grow past `limit` bytes (ulimit -f); SIGXFSZ ignored, so a write
    past it fails with EFBIG as it would with ENOSPC on a full disk."""
    import resource

    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    return apply


def _cli_limited(limit: int | None, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deepspec.cli", *args], env=_env(), capture_output=True, text=True, timeout=300,
                          preexec_fn=_file_size_limit(limit) if limit else None)


def test_full_disk_while_checkpointing_and_exporting_keeps_the_previous_ones_and_the_rerun_continues(recipe):
    """The weights (231 KB) do not fit under a 150 KB file-size limit: one sentence with the path and the bytes,
    step_2 stays the intact newest checkpoint, no partial step_4 exists; without the limit the same command resumes
    from step_2. An export under the limit leaves no folder behind."""
    from deepspec.train import train
    from deepspec.train.checkpoint import damaged, latest_step_dir

    opts = ("run.name=disk", "train.max_steps=2", "train.save_every=2")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: False)
        train(_cfg(recipe, *opts))
    run_dir = _cfg(recipe, *opts).run_dir
    more = ["--opts", *opts, "train.max_steps=4", "run.allow_changes=true"]
    full = _cli_limited(150_000, "train", str(recipe), *more)
    assert full.returncode == 2, full.stderr[-3000:]
    errors = [ln for ln in full.stderr.splitlines() if ln.startswith("deepspec: error:")]
    assert len(errors) == 1 and f"No room to write the checkpoint {run_dir / 'step_4.tmp'}: it needs about " in errors[0]
    assert "files may not exceed 150,000 bytes" in errors[0] and f"{run_dir / 'step_2'} is intact" in errors[0]
    assert latest_step_dir(run_dir).name == "step_2" and damaged(run_dir / "step_2") is None
    assert not (run_dir / "step_4").exists() and not (run_dir / "step_4.tmp").exists()  # partial bytes kept: 0
    again = _cli_limited(None, "train", str(recipe), *more)
    assert again.returncode == 0 and "resuming from" in again.stderr and "step_2 (step 2" in again.stderr, again.stderr[-3000:]
    assert latest_step_dir(run_dir).name == "step_4"

    out = run_dir / "export-vllm"
    exported = _cli_limited(60_000, "export", str(run_dir / "step_4"), "--out", str(out), "--dtype", "float32")
    assert exported.returncode == 2 and "No room to write the export" in exported.stderr, exported.stderr[-3000:]
    assert not out.exists() and not list(run_dir.glob(".export-vllm.tmp*"))


_SLOW_SAVE = """
import os, sys, time
from pathlib import Path
import torch
from torch.distributed.checkpoint import filesystem
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from deepspec.train.checkpoint import load_optimizer, save_checkpoint
from gloo_ranks import init_gloo
rank, run_dir = int(os.environ["RANK"]), Path(sys.argv[1])
# a process-group timeout (2 s) shorter than one rank's slow file work (4 s): as NCCL's 10 minutes against a large
# checkpoint on a slow shared filesystem
init_gloo(2)
torch.manual_seed(0)
model = fully_shard(torch.nn.Linear(4, 4), mesh=init_device_mesh("cpu", (2,)))  # the optimizer state in shards (DCP)
optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)

def step():
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()

def slow_on(slow_rank, f):
    def wrapped(*args, **kwargs):
        if rank == slow_rank:
            time.sleep(4)
        return f(*args, **kwargs)
    return wrapped

write_draft = slow_on(0, lambda directory, weights: torch.save(weights, directory / "weights.pt"))  # rank 0's alone
filesystem.FileSystemWriter.write_data = slow_on(1, filesystem.FileSystemWriter.write_data)  # rank 1's shards
filesystem.FileSystemReader.read_data = slow_on(1, filesystem.FileSystemReader.read_data)
try:
    step()
    saved = [t.to_local().clone() for t in optimizer.state_dict()["state"][0].values() if hasattr(t, "to_local")]
    final = save_checkpoint(run_dir, 1, weights={"w": torch.zeros(1)} if rank == 0 else None, write_draft=write_draft,
                            optimizer=optimizer, model=model, scheduler=scheduler, trainer_state={}, sharded=True,
                            save_config=lambda d: None, keep_last=2)
    step()  # the state moves on; the load brings back the saved one
    load_optimizer(final, model, optimizer, sharded=True)
    loaded = [t.to_local() for t in optimizer.state_dict()["state"][0].values() if hasattr(t, "to_local")]
    same = len(saved) == 2 and all(torch.equal(a, b) for a, b in zip(saved, loaded))
    print("saved", final.name, "loaded", "the same" if same else "other", "state", flush=True)
except Exception as e:
    print(type(e).__name__, str(e).replace(chr(10), " ")[:300], flush=True)
"""


def test_ranks_wait_on_the_host_while_one_writes_or_reads_a_slow_checkpoint(tmp_path):
    """Two gloo ranks save a checkpoint and load its optimizer shards back, under a process-group timeout (2 s) shorter
    than each rank's slow part: rank 0 writing the weights alone, rank 1 writing and reading its shards (4 s each). The
    others wait on the host (a gloo group of up to 2 hours) instead of timing out in the group's collectives: both
    return step_1, written whole, and load the saved state. (NCCL's watchdog would abort a training job mid-save so,
    at every later save again.)"""
    outs = outputs(start_ranks(_SLOW_SAVE, str(tmp_path / "run"), env=_env()), 120)
    assert outs == ["saved step_1 loaded the same state"] * 2, outs
    assert (tmp_path / "run" / "step_1" / "weights.pt").is_file() and not (tmp_path / "run" / "step_1.tmp").exists()
