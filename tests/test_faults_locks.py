"""One run per folder: a live holder (a real process) stops a second training run, cache build or regeneration at
once with one sentence naming it; a holder killed with SIGKILL leaves a lock that the next run takes over."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

HOLDER = """
import sys, time
from deepspec.locks import FolderLock
FolderLock(sys.argv[1], "training run").acquire()
print("locked", flush=True)
time.sleep(300)
"""


@pytest.fixture
def holder():
    """Start a process that holds the lock of a folder; yields start(folder) -> Popen."""
    procs = []

    def start(folder: Path) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder)], stdout=subprocess.PIPE, text=True,
                                env=dict(os.environ, PYTHONPATH=str(REPO)))
        procs.append(proc)
        assert proc.stdout.readline().strip() == "locked"
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_second_training_run_on_a_folder_in_use_stops_at_once_naming_the_holder(tmp_path, holder):
    from deepspec.config import load_config, save_config

    cfg = load_config(REPO / "config/quickstart/eagle3.yaml", [f"train.output_root={tmp_path / 'ckpt'}", "run.name=busy"])
    recipe = save_config(cfg, tmp_path, "recipe.yaml")
    proc = holder(cfg.run_dir)
    second = subprocess.run([sys.executable, "-m", "deepspec.cli", "train", str(recipe)], capture_output=True, text=True,
                            timeout=120, env=dict(os.environ, PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES=""))
    assert second.returncode == 2
    line = [ln for ln in second.stderr.splitlines() if ln.startswith("deepspec: error:")]
    assert len(line) == 1 and f"is in use by another training run: pid {proc.pid} on host {socket.gethostname()} (started " in line[0]
    assert not (cfg.run_dir / "config.yaml").exists()  # it wrote nothing


def test_cache_build_and_regeneration_refuse_a_folder_in_use(tmp_path, holder, tiny_llama_dir):
    from deepspec.config import load_config
    from deepspec.data.cache import build_cache
    from deepspec.data.regenerate import regenerate
    from deepspec.locks import FolderInUseError

    cfg = load_config(None, [f"target.name={tiny_llama_dir}", f"data.dir={tmp_path / 'data'}", f"cache.dir={tmp_path / 'cache'}"])
    proc = holder(cfg.cache_train_dir)
    with pytest.raises(FolderInUseError, match=f"pid {proc.pid}"):
        build_cache(cfg, "train")
    proc = holder(cfg.data_dir)
    with pytest.raises(FolderInUseError, match=f"{cfg.data_dir.name} is in use by another training run: pid {proc.pid}"):
        regenerate(cfg)


def test_lock_of_a_killed_holder_is_taken_over_with_a_warning(tmp_path, holder, logs):
    from deepspec.locks import FolderLock, lock_path

    folder = tmp_path / "run"
    proc = holder(folder)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert lock_path(folder).is_file()  # SIGKILL leaves the file behind
    with FolderLock(folder, "training run"):
        pass
    assert any(f"taking over the lock of pid {proc.pid}" in r.getMessage() for r in logs.records)
    assert not lock_path(folder).exists()  # released cleanly this time


def test_eval_and_export_refuse_an_output_folder_in_use(tmp_path, holder, tiny_llama_dir):
    from random_drafts import random_draft_checkpoint

    from deepspec.config import load_config
    from deepspec.eval.runner import evaluate
    from deepspec.export.writers import export_draft
    from deepspec.locks import FolderInUseError

    _, ckpt = random_draft_checkpoint(tmp_path / "run" / "step_2", "llama", "eagle3")
    out = tmp_path / "exports" / "e3"
    export_draft(ckpt, out)
    before = (out / "model.safetensors").read_bytes()
    proc = holder(out)
    with pytest.raises(FolderInUseError, match=f"e3 is in use by another training run: pid {proc.pid}"):
        export_draft(ckpt, out)
    assert (out / "model.safetensors").read_bytes() == before and not list(out.parent.glob(".e3.tmp-*"))
    from deepspec import cli

    assert cli.main(["export", str(ckpt), "--out", str(out), "--skip-check"]) == 2  # the command: the same refusal
    assert (out / "model.safetensors").read_bytes() == before and sorted(p.name for p in out.parent.iterdir()) == [".e3.lock", "e3"]
    proc.kill()
    proc.wait()
    export_draft(ckpt, out)  # the lock of the killed holder is taken over
    assert (out / "model.safetensors").read_bytes() == before and sorted(p.name for p in out.parent.iterdir()) == ["e3"]
    cfg = load_config(None, [f"target.name={tiny_llama_dir}", "eval.tasks=[mt_bench]", "eval.max_samples=1"])
    proc = holder(tmp_path / "ev")
    with pytest.raises(FolderInUseError, match=f"ev is in use by another training run: pid {proc.pid}"):
        evaluate(cfg, ckpt, output_dir=tmp_path / "ev")
    assert not list((tmp_path / "ev").iterdir())  # it wrote nothing
