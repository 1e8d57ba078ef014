"""Training checkpoints: `<run_dir>/step_N/` + `step_latest` / `step_best` pointers.

A step directory holds the draft in HF form (config.json + model.safetensors, fp32 master
weights, with provenance), the resolved config.yaml, and the trainer state needed for an exact
resume: optimizer + scheduler + RNG + data position. That state is written once — by rank 0
under DDP (all ranks hold the same copy), as a sharded torch.distributed.checkpoint under FSDP
(each rank writes its shard; it reshards on load, so another worker count can resume).

Writes are atomic: everything goes to `step_N.tmp/` which is renamed when complete; pointers are
symlinks replaced atomically, or small text files on filesystems without symlinks.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from deepspec.diskfull import room_for, tensor_bytes
from deepspec.errors import CheckpointError
from deepspec.log import get_logger
from deepspec.train.dist import host_barrier, host_group

log = get_logger(__name__)

STEP_RE = re.compile(r"^step_(\d+)$")
TRAINER_STATE = "trainer_state.pt"
OPTIMIZER_FILE = "optimizer.pt"
OPTIMIZER_DCP = "optimizer_dcp"
WEIGHTS = "model.safetensors"


# ----------------------------------------------------------------------------- pointers


def write_pointer(run_dir: Path, name: str, target: str) -> None:
    """Point `run_dir/name` at the sibling directory `target` (symlink, or a text file)."""
    link = run_dir / name
    tmp = run_dir / f".{name}.tmp"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    try:
        os.symlink(target, tmp, target_is_directory=True)
    except (OSError, NotImplementedError):
        tmp.write_text(target + "\n")
    if link.is_dir() and not link.is_symlink():
        raise CheckpointError(f"{link} is a real directory, not a pointer; move it away so it can be updated.")
    os.replace(tmp, link)


def resolve_step_dir(path: str | Path) -> Path:
    """A checkpoint path as users pass it: step_N, step_latest/step_best (link or file), or a run dir."""
    p = Path(path)
    if p.is_file() and not p.is_symlink() and p.stat().st_size < 256 and STEP_RE.match(p.read_text().strip()):
        p = p.parent / p.read_text().strip()
    elif p.is_dir() and not (p / "config.json").exists() and (p / "step_latest").exists():
        return resolve_step_dir(p / "step_latest")
    p = p.resolve()
    if not (p / "config.json").is_file():
        raise CheckpointError(f"{path} is not a draft checkpoint (no config.json); pass a step_N directory or step_latest.")
    return p


def latest_step_dir(run_dir: Path) -> Path | None:
    """The checkpoint to resume from, or None: step_latest if it is intact, else the newest intact step_N (a
    half-written step_N.tmp is never one; a truncated or corrupt file is named in one warning and skipped)."""
    ptr = run_dir / "step_latest"
    candidates: list[Path] = []
    if ptr.exists():
        try:
            candidates.append(resolve_step_dir(ptr))
        except CheckpointError:
            log.warning("step_latest in %s is broken; falling back to the newest complete step_N", run_dir)
    candidates += [run_dir / f"step_{s}" for s in reversed(list_steps(run_dir))]
    seen: set[Path] = set()
    skipped = False
    for step_dir in candidates:
        if step_dir.resolve() in seen:
            continue
        seen.add(step_dir.resolve())
        damage = damaged(step_dir)
        if damage is None:
            if skipped:
                log.warning("using %s, the newest intact checkpoint of %s", step_dir.name, run_dir)
            return step_dir
        skipped = True
        log.warning("%s is damaged (%s); it is skipped (training it again overwrites it)", step_dir, damage)
    return None


def damaged(step_dir: Path) -> str | None:
    """Why a training checkpoint cannot be resumed (a truncated or unreadable file), or None when it is intact.
    Cheap: the trainer state is read, the weights' header and size are checked, the optimizer file is mapped."""
    f = step_dir / TRAINER_STATE
    try:
        state = safe_torch_load(f)
        if not isinstance(state, dict) or "step" not in state:
            return f"{TRAINER_STATE} has no step"
    except Exception as e:  # noqa: BLE001 - any failure to read means the file is damaged
        return f"{TRAINER_STATE}: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    try:
        from safetensors import safe_open

        with safe_open(str(step_dir / WEIGHTS), framework="pt") as w:
            for key in list(w.keys())[-1:]:
                w.get_slice(key)
    except Exception as e:  # noqa: BLE001
        return f"{WEIGHTS}: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    if (step_dir / OPTIMIZER_FILE).is_file():
        try:
            safe_torch_load(step_dir / OPTIMIZER_FILE, mmap=True)
        except Exception as e:  # noqa: BLE001
            return f"{OPTIMIZER_FILE}: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    return None


def list_steps(run_dir: Path) -> list[int]:
    if not run_dir.is_dir():
        return []
    out = []
    for p in run_dir.iterdir():
        m = STEP_RE.match(p.name)
        if m and p.is_dir() and not p.is_symlink() and (p / TRAINER_STATE).is_file():
            out.append(int(m.group(1)))
    return sorted(out)


def read_best(run_dir: Path) -> dict[str, Any] | None:
    f = run_dir / "best.json"
    return json.loads(f.read_text()) if f.is_file() else None


def record_best(run_dir: Path, step: int, metric: str, value: float) -> None:
    """Make `step` the best checkpoint. A non-finite value never becomes the best (NaN compares false anyway)."""
    if not math.isfinite(value):
        log.warning("validation of step %d gave %s=%s; step_best stays where it was", step, metric, value)
        return
    data = {"step": step, "metric": metric, "value": value}
    tmp = run_dir / "best.json.tmp"
    tmp.write_text(json.dumps(data))
    os.replace(tmp, run_dir / "best.json")
    if (run_dir / f"step_{step}").is_dir():
        write_pointer(run_dir, "step_best", f"step_{step}")


def prune(run_dir: Path, keep_last: int) -> None:
    """Delete all but the last `keep_last` step dirs, never the best one."""
    best = read_best(run_dir)
    keep_best = best["step"] if best else None
    steps = list_steps(run_dir)
    for s in steps[:-keep_last]:
        if s != keep_best:
            shutil.rmtree(run_dir / f"step_{s}", ignore_errors=True)


# ----------------------------------------------------------------------------- RNG


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = (name, keys.tolist(), pos, has_gauss, cached)  # plain data: loadable with weights_only=True
    except ImportError:
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# ----------------------------------------------------------------------------- save / load


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def save_checkpoint(
    run_dir: Path,
    step: int,
    *,
    weights: dict[str, torch.Tensor] | None,
    write_draft,
    optimizer: torch.optim.Optimizer,
    model: nn.Module,
    scheduler: Any,
    trainer_state: dict[str, Any],
    sharded: bool,
    save_config,
    keep_last: int,
) -> Path:
    """Write step_N atomically. Collective: every rank must call it.

    weights: full fp32 trainable state dict on rank 0 (None elsewhere); write_draft(dir, weights)
    writes config.json + model.safetensors; save_config(dir) writes config.yaml.
    """
    final = run_dir / f"step_{step}"
    tmp = run_dir / f"step_{step}.tmp"
    rank = _rank()
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    host_barrier()
    rngs: list[Any] = [None] * _world()
    if dist.is_initialized() and _world() > 1:
        dist.all_gather_object(rngs, rng_state())
    else:
        rngs = [rng_state()]
    previous = latest_step_dir(run_dir) if rank == 0 else None
    after = (f"{previous} is intact; free some space and rerun the same command to resume from it." if previous
             else "Free some space and rerun the same command.")
    drop_tmp = (lambda: shutil.rmtree(tmp, ignore_errors=True)) if rank == 0 else None
    if sharded:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        osd = get_optimizer_state_dict(model, optimizer)
        with room_for(tmp / OPTIMIZER_DCP, lambda: tensor_bytes(osd), "the checkpoint's optimizer shards", after, drop_tmp):
            # its planning collectives wait on the host too: one rank's shards may take long to write
            dcp.save({"optimizer": osd}, checkpoint_id=str(tmp / OPTIMIZER_DCP), process_group=host_group())
    if rank == 0:
        def needed() -> int:
            return tensor_bytes(weights) + (0 if sharded else tensor_bytes(optimizer.state_dict()))

        with room_for(tmp, needed, "the checkpoint", after, drop_tmp):  # the previous step_N is untouched
            write_draft(tmp, weights)
            save_config(tmp)
            if not sharded:
                torch.save(optimizer.state_dict(), tmp / OPTIMIZER_FILE)
            state = dict(trainer_state, step=step, scheduler=scheduler.state_dict(), rng=rngs, world_size=_world())
            torch.save(state, tmp / TRAINER_STATE)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        write_pointer(run_dir, "step_latest", final.name)
        prune(run_dir, keep_last)
    host_barrier()  # rank 0 alone may write for long (a shared filesystem): the others wait on the host
    return final


def check_resume_settings(cfg, step_dir: Path) -> None:
    """Resuming `step_dir` with settings other than those it was trained with: print the differences and stop,
    unless `run.allow_changes` (a typo in --opts must not silently continue, or start, another experiment)."""
    import yaml

    from deepspec.config import config_to_dict
    from deepspec.config.diff import settings_diff

    saved_file = Path(step_dir) / "config.yaml"
    if not saved_file.is_file():
        return
    try:
        saved = yaml.safe_load(saved_file.read_text()) or {}
    except yaml.YAMLError:
        log.warning("%s is not readable YAML; cannot compare this run's settings with it", saved_file)
        return
    diff = settings_diff(saved, config_to_dict(cfg))
    if not diff:
        return
    listing = "; ".join(diff)
    if cfg.run.allow_changes:
        log.warning("resuming %s with changed settings (run.allow_changes=true): %s", step_dir, listing)
        return
    raise CheckpointError(
        f"Run {step_dir.parent} was trained with other settings ({listing}); to resume it anyway pass "
        f"--opts run.allow_changes=true, or start a new experiment with --opts run.name=<new name>."
    )


def load_trainer_state(step_dir: Path) -> dict[str, Any]:
    f = step_dir / TRAINER_STATE
    if not f.is_file():
        raise CheckpointError(f"{step_dir} has no {TRAINER_STATE}; it is not a complete training checkpoint (delete it to restart).")
    return safe_torch_load(f)


def resume_step(cfg) -> int:
    """The step a (re)started run resumes at: its newest intact checkpoint's (what the loop resumes from), else 0.
    The builder passes it to a streamed run's datasets, which start reading there."""
    if not cfg.train.resume:
        return 0
    step_dir = latest_step_dir(cfg.run_dir)
    return int(load_trainer_state(step_dir)["step"]) if step_dir is not None else 0


def safe_torch_load(path: Path, mmap: bool = False) -> Any:
    """torch.load that cannot run code (weights_only=True). Trainer states written before 2026-11-25 hold numpy's
    RNG state as an array: numpy's array reconstruction (and nothing else) is allowed for them."""
    import numpy as np

    allowed: list[Any] = [np.dtype, np.ndarray]
    try:
        allowed += [np._core.multiarray._reconstruct, type(np.dtype(np.uint32))]
    except AttributeError:  # numpy 1.x
        allowed += [np.core.multiarray._reconstruct, type(np.dtype(np.uint32))]
    with torch.serialization.safe_globals(allowed):
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)


def load_weights(step_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(step_dir / WEIGHTS))


def load_optimizer(step_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer, sharded: bool) -> None:
    if sharded:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        path = step_dir / OPTIMIZER_DCP
        if not path.is_dir():
            raise CheckpointError(
                f"{step_dir} was saved without FSDP (no {OPTIMIZER_DCP}/); resume it with train.parallel=ddp."
            )
        osd = get_optimizer_state_dict(model, optimizer)
        state = {"optimizer": osd}
        dcp.load(state, checkpoint_id=str(path), process_group=host_group())
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
        return
    f = step_dir / OPTIMIZER_FILE
    if not f.is_file():
        raise CheckpointError(f"{step_dir} was saved with FSDP (no {OPTIMIZER_FILE}); resume it with train.parallel=fsdp.")
    optimizer.load_state_dict(safe_torch_load(f))
