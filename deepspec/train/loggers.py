"""Metric sinks: wandb (offline by default), tensorboard, console. Rank 0 only.

All sinks receive the same flat names (`train/loss`, `train/lr`, `val/expected_tau`, ...), so an
offline wandb run, an online one and the tensorboard files show identical series.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

from deepspec.log import get_logger

log = get_logger(__name__)


class MetricLoggers:
    def __init__(self, cfg, run_dir: Path, enabled: bool, resume_step: int = 0):
        self.wandb_run = None
        self.tb = None
        if not enabled:
            return
        lcfg = cfg.logging
        if lcfg.wandb and lcfg.wandb_mode != "disabled":
            self.wandb_run = _start_wandb(cfg, run_dir)
        if lcfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step drops events a crashed run wrote after its last checkpoint.
            self.tb = SummaryWriter(str(run_dir / "tensorboard"), purge_step=resume_step + 1 if resume_step else None)

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.wandb_run is not None:
            self.wandb_run.log(dict(metrics), step=step)
        if self.tb is not None:
            for k, v in metrics.items():
                self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None


def _start_wandb(cfg, run_dir: Path):
    try:
        import wandb
    except ImportError:
        log.warning("wandb is not installed; logging to tensorboard only (pip install wandb)")
        return None
    from deepspec.config import config_to_dict

    lcfg = cfg.logging
    id_file = run_dir / "wandb_id.txt"
    if id_file.is_file():
        run_id = id_file.read_text().strip()
    else:
        run_id = uuid.uuid4().hex[:8]
        id_file.write_text(run_id)
    os.environ.setdefault("WANDB_SILENT", "true")
    return wandb.init(
        project=lcfg.wandb_project or cfg.project,
        entity=lcfg.wandb_entity,
        name=cfg.run_name,
        id=run_id,
        resume="allow",
        dir=str(run_dir),
        mode=lcfg.wandb_mode,
        config=json.loads(json.dumps(config_to_dict(cfg), default=str)),
        settings=wandb.Settings(console="off", x_disable_stats=True) if hasattr(wandb, "Settings") else None,
    )


def format_postfix(metrics: dict[str, Any]) -> dict[str, str]:
    out = {}
    for k in ("loss", "tok/s", "lr"):
        if k in metrics:
            v = metrics[k]
            out[k] = f"{v:.3g}" if k != "tok/s" else f"{v:,.0f}"
    return out
