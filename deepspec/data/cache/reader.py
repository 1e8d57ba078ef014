"""Reading a cache: a torch Dataset over mmap'd shards, and collation into a DraftBatch.

Shards are opened lazily as read-only memory maps, at most `max_open_files` at a time (LRU), so
a cache with thousands of shards never exhausts file handles. Open maps are dropped when the
dataset is pickled, so it can be handed to DataLoader workers, each of which re-opens its own.
Every read checks the record's size and (by default) crc32 against the index: a truncated or
corrupt shard is reported with the sample id instead of being decoded as garbage.
"""

from __future__ import annotations

import json
import mmap
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from deepspec.data.cache import format as fmt
from deepspec.errors import CacheError


class CacheDataset:
    """Samples of a complete cache: dicts {input_ids, loss_mask, taps, final_hidden} (see `__getitem__`)."""

    def __init__(self, directory: str | Path, *, verify: bool = True, max_open_files: int = 16):
        self.directory = Path(directory)
        self.manifest = fmt.load_manifest(self.directory)
        self.index = np.load(self.directory / fmt.INDEX)
        if len(self.index) != self.manifest["counts"]["samples"]:
            raise CacheError(f"{self.directory}/{fmt.INDEX} has {len(self.index)} rows but the manifest says "
                             f"{self.manifest['counts']['samples']}; rebuild the cache with --overwrite.")
        self.verify = verify
        self.max_open_files = max(1, max_open_files)
        self.taps: list[int] = list(self.manifest["taps"])
        self.hidden_size: int = int(self.manifest["hidden_size"])
        self.dtype: str = self.manifest["dtype"]
        # multi-stream targets: a tap reduced by `concat` is S*H wide, stored as S rows of H (writer.tap_rows)
        self.hc_mult: int = int(self.manifest.get("hc_mult", 1))
        self.tap_reduction: str = self.manifest.get("tap_reduction", "mean")
        self._rows = self.hc_mult if self.tap_reduction == "concat" else 1
        self.tap_width: int = self.hidden_size * self._rows
        self._n_layers = len(self.taps) * self._rows + 1
        self._maps: OrderedDict[int, tuple[Any, mmap.mmap]] = OrderedDict()
        self._ids: list[str] | None = None

    # -- pickling: never ship open maps to another process
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_maps"] = OrderedDict()
        return state

    def __len__(self) -> int:
        return len(self.index)

    @property
    def lengths(self) -> np.ndarray:
        """Tokens per sample (for length bucketing)."""
        return self.index["length"].astype(np.int64)

    def sample_id(self, i: int) -> str:
        if self._ids is None:
            self._ids = json.loads((self.directory / fmt.IDS).read_text())
        return self._ids[i]

    def token_counts(self):
        """Loss-masked token counts [V_target] int64 (for the draft vocabulary)."""
        import torch

        return torch.from_numpy(np.load(self.directory / fmt.TOKEN_COUNTS))

    def _shard(self, s: int) -> mmap.mmap:
        if s in self._maps:
            self._maps.move_to_end(s)
            return self._maps[s][1]
        while len(self._maps) >= self.max_open_files:
            _, (f, m) = self._maps.popitem(last=False)
            m.close()
            f.close()
        path = self.directory / fmt.shard_name(s)
        try:
            f = open(path, "rb")
        except OSError as e:
            raise CacheError(f"Cannot open shard {path} ({e}); the cache is incomplete — rebuild it with --overwrite.") from None
        size = path.stat().st_size
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        self._maps[s] = (f, m)
        return m

    def close(self) -> None:
        while self._maps:
            _, (f, m) = self._maps.popitem()
            if hasattr(m, "close"):
                m.close()
            f.close()

    def __getitem__(self, i: int) -> dict[str, Any]:
        """input_ids [T] int64, loss_mask [T] bool, taps [T, n_taps, W] float32 (W = tap_width), final_hidden [T, H] float32."""
        row = self.index[i]
        s, off, nbytes, length = int(row["shard"]), int(row["offset"]), int(row["nbytes"]), int(row["length"])
        m = self._shard(s)
        if off + nbytes > len(m):
            raise CacheError(
                f"Sample {self.sample_id(i)!r} lies past the end of {fmt.shard_name(s)} ({len(m)} bytes, needs {off + nbytes}): "
                "the shard is truncated. Rebuild the cache with --overwrite."
            )
        buf = m[off : off + nbytes]
        if self.verify and zlib.crc32(buf) != int(row["crc32"]):
            raise CacheError(
                f"Sample {self.sample_id(i)!r} in {fmt.shard_name(s)} fails its checksum: the shard is corrupt. "
                "Rebuild the cache with --overwrite."
            )
        ids, mask, feats = fmt.decode_record(buf, length, self._n_layers, self.hidden_size, self.dtype)
        n = len(self.taps) * self._rows
        taps = feats[:, :n].reshape(length, len(self.taps), self.tap_width)
        return {"input_ids": ids, "loss_mask": mask, "taps": taps, "final_hidden": feats[:, n]}


def collate(samples: Sequence[dict[str, Any]], pad_token_id: int = 0, pad_to_multiple_of: int = 1):
    """Right-pad samples into a DraftBatch (attention_mask marks real tokens; padding is never in loss_mask)."""
    import torch

    from deepspec.drafts.base import DraftBatch

    if not samples:
        raise CacheError("collate() got an empty list of samples.")
    B = len(samples)
    T = max(len(s["input_ids"]) for s in samples)
    T = -(-T // pad_to_multiple_of) * pad_to_multiple_of
    n_taps, W = samples[0]["taps"].shape[1:]
    H = samples[0]["final_hidden"].shape[-1]
    ids = torch.full((B, T), pad_token_id, dtype=torch.long)
    loss = torch.zeros(B, T, dtype=torch.bool)
    att = torch.zeros(B, T, dtype=torch.bool)
    taps = torch.zeros(B, T, n_taps, W, dtype=samples[0]["taps"].dtype)
    final = torch.zeros(B, T, H, dtype=samples[0]["final_hidden"].dtype)
    for b, s in enumerate(samples):
        t = len(s["input_ids"])
        ids[b, :t] = s["input_ids"]
        loss[b, :t] = s["loss_mask"]
        att[b, :t] = True
        taps[b, :t] = s["taps"]
        final[b, :t] = s["final_hidden"]
    return DraftBatch(input_ids=ids, loss_mask=loss, attention_mask=att, taps=taps, final_hidden=final)


def expected_provenance(cfg, target=None) -> dict[str, Any]:
    """What a training run expects of its cache: from its config and the target (the loaded one, or
    its tokenizer + HF config, which are cheap to read)."""
    from deepspec.data.cache.writer import _load_plan_inputs, resolve_taps, tap_rows
    from deepspec.targets import template_hash

    exp: dict[str, Any] = {"target": cfg.target.name, "dtype": cfg.cache.dtype, "target_revision": cfg.target.revision,
                           "chat_template_kwargs": dict(cfg.target.chat_template_kwargs or {})}
    if target is not None:
        tconf, thash = target.config, target.template_hash
    else:
        tokenizer, tconf = _load_plan_inputs(cfg)
        thash = template_hash(tokenizer)
    exp["hidden_size"] = tconf.hidden_size
    exp["template_hash"] = thash
    exp["taps"] = resolve_taps(cfg, tconf.num_hidden_layers)
    exp["hc_mult"], exp["tap_reduction"], _ = tap_rows(cfg, tconf)
    return exp


def open_cache(directory: str | Path, cfg=None, target=None, **kwargs) -> CacheDataset:
    """Open a cache for training, refusing one built for another setup (see format.check_manifest)."""
    ds = CacheDataset(directory, **kwargs)
    if cfg is not None:
        fmt.check_manifest(ds.manifest, expected_provenance(cfg, target))
    return ds
