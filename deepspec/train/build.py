"""Building the default TrainParts from a config: the registered draft, the cache, provenance."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from deepspec.errors import CacheError, ConfigError
from deepspec.log import get_logger

log = get_logger(__name__)


def _weight_map(folder: Path) -> dict[str, str]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return json.loads(index.read_text())["weight_map"]
    from safetensors import safe_open

    weight_map: dict[str, str] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            weight_map.update({k: f.name for k in sf.keys()})
    return weight_map


def load_target_layer(path: str, k: int) -> dict[str, torch.Tensor]:
    """Target decoder layer k's tensors, named as inside the layer (`self_attn.q_proj.weight`, ...)."""
    from safetensors import safe_open

    folder = Path(path)
    out: dict[str, torch.Tensor] = {}
    for full, fname in _weight_map(folder).items():
        for prefix in (f"model.layers.{k}.", f"model.language_model.layers.{k}."):
            if full.startswith(prefix):
                with safe_open(str(folder / fname), "pt") as sf:
                    out[full[len(prefix) :]] = sf.get_tensor(full)
    if not out:
        raise ConfigError(f"Target layer {k} was not found in {folder}; model.init_from_target_layer must be a layer of the target.")
    return out


def load_target_head(path: str, config: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Read only the target's embedding and LM head from its safetensors (no full model load)."""
    from safetensors import safe_open

    folder = Path(path)
    weight_map = _weight_map(folder)

    def get(names: tuple[str, ...]) -> torch.Tensor | None:
        for name in names:
            if name in weight_map:
                with safe_open(str(folder / weight_map[name]), "pt") as sf:
                    return sf.get_tensor(name)
        return None

    embed = get(("model.embed_tokens.weight", "model.language_model.embed_tokens.weight"))
    if embed is None:
        raise CacheError(f"Could not find the embedding matrix in {folder}; is it a decoder-only HF checkpoint?")
    head = get(("lm_head.weight",))
    if head is None or getattr(config, "tie_word_embeddings", False):
        head = embed
    return embed, head


def build_parts(cfg, info):
    """Draft from the registry sized by the target's HF config; data from the offline cache."""
    from deepspec.drafts.registry import get_algorithm
    from deepspec.targets.hf_config import target_config as resolve_config
    from deepspec.targets.load import resolve_target_path
    from deepspec.train.parts import TrainParts

    path = resolve_target_path(cfg.target.name)
    on_finish: list = []
    if cfg.cache.mode == "online":
        train_data, val_data, target = open_online_datasets(cfg, info)
        target_config = target.config
        embed, head = target.model.get_input_embeddings().weight, target.model.get_output_embeddings().weight
    else:
        if cfg.cache.mode == "stream":
            from deepspec.data.stream.trainer import open_stream_datasets
            from deepspec.train.checkpoint import resume_step

            train_data, val_data, finish = open_stream_datasets(cfg, info, resume_step(cfg))
            on_finish.append(finish)
        else:
            train_data, val_data = open_cache_datasets(cfg)
        target_config = resolve_config(cfg.target.name, cfg.target.revision, cfg.target.trust_remote_code)
        embed, head = load_target_head(path, target_config)
    cls = get_algorithm(cfg.model.algorithm)
    model = cls.from_target_config(target_config, cfg.model)
    model.load_target_weights(embed, head)
    k = cfg.model.init_from_target_layer
    if k is not None:
        if not hasattr(model, "init_from_target_layers"):
            raise ConfigError(f"model.init_from_target_layer is an EAGLE-3 option; {cfg.model.algorithm} does not support it (set it to null).")
        count = min(cfg.model.num_draft_layers, target_config.num_hidden_layers - k)
        if count < 1:
            raise ConfigError(
                f"model.init_from_target_layer={k} is past the target's last layer ({target_config.num_hidden_layers - 1}); "
                "give a 0-based decoder layer index."
            )
        model.init_from_target_layers([load_target_layer(path, j) for j in range(k, k + count)])
    counts = getattr(train_data, "token_counts", None)
    if counts is not None:
        counts = counts() if callable(counts) else counts
        model.set_token_frequencies(torch.as_tensor(counts))
    if cfg.model.init_copy_heads:
        if not hasattr(model, "init_copy_heads"):
            raise ConfigError(f"model.init_copy_heads is an EAGLE-3 option; {cfg.model.algorithm} does not support it (set it to false).")
        model.init_copy_heads()  # after the draft vocabulary: the heads are built from its embeddings
    manifest = getattr(train_data, "manifest", None) or {}
    provenance = {k: manifest[k] for k in ("target", "target_revision", "taps", "template_hash", "data_hash", "chat_template_kwargs") if k in manifest}
    provenance.setdefault("target", cfg.target.name)
    return TrainParts(model=model, train_data=train_data, val_data=val_data, provenance=provenance, on_finish=on_finish)


def open_cache_datasets(cfg):
    """The training and held-out cache datasets (held-out is optional: no validation without it)."""
    try:
        from deepspec.data.cache import open_cache  # type: ignore[attr-defined]
    except ImportError as e:
        raise CacheError(f"The offline cache reader is not available ({e}); build the cache with `deepspec data cache` first.") from None
    train = open_cache(cfg.cache_train_dir, cfg=cfg)
    val = None
    if Path(cfg.cache_heldout_dir).is_dir():
        val = open_cache(cfg.cache_heldout_dir, cfg=cfg)
    else:
        log.warning("no held-out cache at %s: training without validation", cfg.cache_heldout_dir)
    check_before_training(cfg, [ds.directory for ds in (train, val) if ds is not None])
    return train, val


def check_before_training(cfg, directories: list[Path]) -> None:
    """Refuse a cache whose capture audit failed or whose sampled shards fail their checksums (one sentence each)."""
    from deepspec.data.cache.audit import require_passed
    from deepspec.data.cache.verify import check_at_start

    for d in directories:
        require_passed(d)
        check_at_start(d, cfg.cache.start_check_mb, cfg.cache.start_check_shards)


class OnlineData:
    """Online mode: tokenized conversations whose features the co-located target computes per micro-batch."""

    def __init__(self, dataset, features, vocab_size: int):
        self.dataset, self.collate, self.vocab_size = dataset, features, vocab_size
        self.lengths = dataset.lengths
        self.manifest: dict[str, Any] = {}

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int):
        return self.dataset[i]

    def token_counts(self) -> torch.Tensor:
        import numpy as np

        counts = np.zeros(self.vocab_size, dtype=np.int64)
        for s in self.dataset.samples:
            ids = s.input_ids[s.loss_mask.astype(bool)]
            counts += np.bincount(ids, minlength=self.vocab_size)[: self.vocab_size]
        return torch.from_numpy(counts)


def open_online_datasets(cfg, info):
    """cache.mode=online: the target runs on this worker's device and computes features on the fly."""
    from deepspec.data.cache import OnlineDataset, OnlineFeatures
    from deepspec.targets.load import load_target_from_config

    target = load_target_from_config(cfg.target, device=str(info.device))
    features = OnlineFeatures.from_config(cfg, target)
    features.pad_token_id = target.tokenizer.pad_token_id or 0
    vocab = target.config.vocab_size
    train = OnlineData(OnlineDataset.from_config(cfg, target.tokenizer, "train"), features, vocab)
    train.manifest = {"target": cfg.target.name, "taps": features.taps, "template_hash": target.template_hash}
    val = None
    if Path(cfg.regenerated_heldout_path).is_file():
        val = OnlineData(OnlineDataset.from_config(cfg, target.tokenizer, "heldout"), features, vocab)
    return train, val, target


def default_write_draft(model: nn.Module, directory: Path, weights: dict[str, torch.Tensor], provenance: dict[str, Any]) -> None:
    """The draft checkpoint layout of deepspec.drafts.checkpoint (config.json + model.safetensors), written from
    the gathered fp32 weights (so it also works when the live parameters are FSDP shards)."""
    from safetensors.torch import save_file

    from deepspec.drafts.base import default_checkpoint_files

    directory.mkdir(parents=True, exist_ok=True)
    cfg_path, weights_path = default_checkpoint_files(directory)
    try:
        from deepspec.drafts.checkpoint import draft_config_dict

        config = draft_config_dict(model, provenance)
    except ImportError:
        config = {"deepspec": {"algorithm": getattr(model, "algorithm", "?"), **model.export_config(), "provenance": provenance}}
    cfg_path.write_text(json.dumps(config, indent=2, default=str))
    save_file(weights, str(weights_path), metadata={"format": "pt", "algorithm": str(getattr(model, "algorithm", ""))})
