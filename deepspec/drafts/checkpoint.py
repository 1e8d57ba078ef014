"""Draft checkpoints: config.json (architecture + algorithm + provenance) + model.safetensors.

Only trainable weights and the draft vocabulary are stored; the frozen target embeddings / LM head
come back from the target at load time (`base.trainable_state_dict`). Writes are atomic: a temporary
folder is filled and renamed, so a crash never leaves a half-written checkpoint behind.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import torch

from deepspec.drafts.base import DraftModel, default_checkpoint_files, trainable_state_dict
from deepspec.errors import CheckpointError

FORMAT_VERSION = 1
FROZEN = ("target_embed", "target_lm_head")


def target_weights(model: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(embed_tokens [V, H], lm_head [V, H]) of an HF causal LM (works for tied embeddings)."""
    return model.get_input_embeddings().weight, model.get_output_embeddings().weight


def draft_config_dict(draft: DraftModel, provenance: dict[str, Any] | None = None) -> dict[str, Any]:
    from deepspec import __version__

    own = draft.export_config()
    return {
        "architectures": [type(draft).__name__],
        "deepspec": {
            "format_version": FORMAT_VERSION,
            "deepspec_version": __version__,
            "algorithm": draft.algorithm,
            "taps": list(draft.taps),
            "arch": own["arch"],
            "model": own["model"],
            "draft_vocab_size": getattr(draft, "draft_vocab_size", draft.arch.vocab_size),
            "target_vocab_size": draft.arch.vocab_size,
            "provenance": dict(provenance or {}),
        },
    }


def save_draft(draft: DraftModel, directory: str | Path, provenance: dict[str, Any] | None = None, config: Any = None) -> Path:
    """Write the draft to `directory` atomically (replacing an existing checkpoint there)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.parent / f".{directory.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        cfg_path, weights_path = default_checkpoint_files(tmp)
        cfg_path.write_text(json.dumps(draft_config_dict(draft, provenance), indent=2, sort_keys=False))
        state = {k: v.detach().to("cpu").contiguous().clone() for k, v in trainable_state_dict(draft).items()}
        save_file(state, str(weights_path), metadata={"format": "pt", "algorithm": draft.algorithm})
        if config is not None:
            from deepspec.config import save_config

            save_config(config, tmp)
        old = None
        if directory.exists():
            old = directory.parent / f".{directory.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(directory, old)
        os.replace(tmp, directory)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def read_draft_config(directory: str | Path) -> dict[str, Any]:
    cfg_path, weights_path = default_checkpoint_files(directory)
    if not cfg_path.is_file() or not weights_path.is_file():
        raise CheckpointError(f"{directory} is not a deepspec draft checkpoint (needs config.json and model.safetensors); pass a step_N folder.")
    try:
        data = json.loads(cfg_path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg_path} is damaged ({type(e).__name__}: {e}); the checkpoint cannot be read. "
                              f"{_other_steps(Path(directory))}") from e
    if not isinstance(data, dict) or "deepspec" not in data:
        raise CheckpointError(f"{cfg_path} has no 'deepspec' block; it is not a deepspec checkpoint (exported folders cannot be reloaded).")
    return data


def _other_steps(directory: Path) -> str:
    """What to do about a damaged step: the run's other steps, newest first, or a re-save."""
    this = directory.resolve()  # step_latest / step_best are links to a step_N
    steps = sorted((p for p in directory.parent.glob("step_*") if p.is_dir() and p.resolve() != this
                    and p.name.removeprefix("step_").isdigit()), key=lambda p: int(p.name.removeprefix("step_")), reverse=True)
    if steps:
        return f"Use another step of the run (the newest other one is {steps[0]}), or resume training to write this one again."
    return "Train or export it again."


def load_draft(directory: str | Path, target_model: Any = None, device: str | torch.device = "cpu") -> DraftModel:
    """Rebuild a draft from its checkpoint; copy the target's embed / LM head when `target_model` is given."""
    from safetensors.torch import load_file

    from deepspec.config.model import ModelConfig
    from deepspec.drafts.layers import DraftArch
    from deepspec.drafts.registry import get_algorithm

    meta = read_draft_config(directory)["deepspec"]
    cls = get_algorithm(meta["algorithm"])
    known = {f.name for f in fields(ModelConfig)}
    model_cfg = ModelConfig(**{k: v for k, v in meta["model"].items() if k in known})
    arch = DraftArch(**meta["arch"])
    if meta.get("draft_vocab_size") == arch.vocab_size:
        # the draft scored the full vocabulary (block drafts once ignored model.draft_vocab_size): rebuild it as trained
        model_cfg.draft_vocab_size = None
    draft = cls(arch, model_cfg, meta["taps"])
    if target_model is not None:
        draft.load_target_weights(*target_weights(target_model))
    weights = default_checkpoint_files(directory)[1]
    try:
        state = load_file(str(weights))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for a cut or corrupt file
        raise CheckpointError(f"{weights} is damaged ({type(e).__name__}: {str(e).splitlines()[0][:160]}); the checkpoint "
                              f"cannot be loaded. {_other_steps(Path(directory))}") from e
    missing, unexpected = draft.load_state_dict(state, strict=False)
    missing = [k for k in missing if k.split(".")[-1] not in FROZEN]
    if missing or unexpected:
        raise CheckpointError(
            f"Checkpoint {directory} does not match its config (missing {missing[:5]}, unexpected {unexpected[:5]}); "
            "it was written by another deepspec version or edited by hand."
        )
    return draft.to(device)


def model_config_dict(draft: DraftModel) -> dict[str, Any]:
    return asdict(draft.model_cfg)
