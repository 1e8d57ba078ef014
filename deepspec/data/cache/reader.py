"""Reading a cache: a torch Dataset over mmap'd shards, and collation into a DraftBatch.

Shards are opened lazily as memory maps, at most `max_open_files` at a time (LRU), so a cache with
thousands of shards never exhausts file handles. Open maps are dropped when the dataset is pickled, so
it can be handed to DataLoader worker processes, each of which re-opens its own.

A sample is read without copying: its tensors are views of the mapped shard in the cache's own dtype
(bf16, fp8 + scales, fp32), and the only copy of its features is the collate into the batch (pinned or
shared memory), so bytes move once from the page cache to the GPU, where they are widened. Every read
checks the record's bounds; crc32 checksums are verified when a cache is built and by
`deepspec data cache --verify` (or `CacheDataset(verify=True)`), not on every read: at the users'
scale (200 MB per 4k-token Qwen3-8B sample) a checksum per read costs as much as the copy.
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

    # Reads are plain file maps: the trainer may read ahead in worker processes (deepspec/train/loader.py).
    supports_worker_processes = True

    def __init__(self, directory: str | Path, *, verify: bool = False, max_open_files: int = 16):
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

    def _shard(self, s: int) -> mmap.mmap | bytes:
        if s in self._maps:
            self._maps.move_to_end(s)
            return self._maps[s][1]
        while len(self._maps) >= self.max_open_files:
            _, (f, m) = self._maps.popitem(last=False)
            _release(f, m)
        path = self.directory / fmt.shard_name(s)
        try:
            f = open(path, "rb")
        except OSError as e:
            raise CacheError(f"Cannot open shard {path} ({e}); the cache is incomplete — rebuild it with --overwrite.") from None
        size = path.stat().st_size
        # ACCESS_COPY: a private mapping, writable to torch (no copy is made unless a page is written; nothing writes)
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else b""
        self._maps[s] = (f, m)
        return m

    def close(self) -> None:
        while self._maps:
            _, (f, m) = self._maps.popitem()
            _release(f, m)

    def _record(self, i: int) -> tuple[Any, int, int, int]:
        """(mapped shard, byte offset, bytes, tokens) of sample i, bounds-checked."""
        row = self.index[i]
        s, off, nbytes, length = int(row["shard"]), int(row["offset"]), int(row["nbytes"]), int(row["length"])
        m = self._shard(s)
        if off + nbytes > len(m):
            raise CacheError(
                f"Sample {self.sample_id(i)!r} lies past the end of {fmt.shard_name(s)} ({len(m)} bytes, needs {off + nbytes}): "
                "the shard is truncated. Rebuild the cache with --overwrite."
            )
        return m, off, nbytes, length

    def check(self, i: int) -> None:
        """Verify sample i's crc32 against the index (raises CacheError naming the sample)."""
        m, off, nbytes, _ = self._record(i)
        with memoryview(m) as view:
            ok = zlib.crc32(view[off : off + nbytes]) == int(self.index[i]["crc32"])
        if not ok:
            raise CacheError(
                f"Sample {self.sample_id(i)!r} in {fmt.shard_name(int(self.index[i]['shard']))} fails its checksum: "
                "the shard is corrupt. Rebuild the cache with --overwrite."
            )

    def verify_all(self, progress_bar: bool = True) -> list[str]:
        """Check every sample's bounds and crc32; returns the ids of the bad ones (empty = the cache is intact)."""
        from deepspec.log import progress

        bad: list[str] = []
        quiet = {} if progress_bar else {"disable": True}
        with progress(total=len(self), desc=f"verify {self.directory.name}", unit="sample", **quiet) as bar:
            for i in range(len(self)):
                try:
                    self.check(i)
                except CacheError:
                    bad.append(self.sample_id(i))
                bar.update(1)
        return bad

    def __getitem__(self, i: int) -> dict[str, Any]:
        """input_ids [T] int64, loss_mask [T] bool, taps [T, n_taps, W] (W = tap_width), final_hidden [T, H].

        taps / final_hidden are zero-copy views in the cache's dtype (bf16, fp32, or fp8 with per-row
        scales `taps_scale` [T, n_taps, rows] and `final_scale` [T]); `DraftBatch.to(device, dtype)`
        widens them where the batch is used. `widen(item)` gives float32 copies for inspection."""
        m, off, nbytes, length = self._record(i)
        if self.verify:
            self.check(i)
        return fmt.record_item(m, off, length, len(self.taps), self._rows, self.hidden_size, self.dtype)


def _release(f, m) -> None:
    """Forget a shard's map without unmapping it: tensors of samples read from it keep a reference to the map
    (torch.frombuffer) but no buffer export, so closing it here would leave them pointing at unmapped memory.
    The map is unmapped when its last tensor is freed."""
    f.close()


def widen(item: dict[str, Any], dtype=None) -> dict[str, Any]:
    """A sample with float features (fp8 scales applied), float32 by default: for inspection and tests."""
    import torch

    from deepspec.drafts.base import dequantize

    dtype = dtype or torch.float32
    out = {k: v for k, v in item.items() if not k.endswith("_scale")}
    out["taps"] = dequantize(item["taps"], item.get("taps_scale"), dtype)
    out["final_hidden"] = dequantize(item["final_hidden"], item.get("final_scale"), dtype)
    return out


def collate(samples: Sequence[dict[str, Any]], pad_token_id: int = 0, pad_to_multiple_of: int = 1):
    """Right-pad samples into a DraftBatch (attention_mask marks real tokens; padding is never in loss_mask)."""
    from deepspec.data.batches import collate_features

    if not samples:
        raise CacheError("collate() got an empty list of samples.")
    return collate_features(list(samples), pad_token_id=pad_token_id, pad_to_multiple_of=pad_to_multiple_of)


def expected_provenance(cfg, target=None) -> dict[str, Any]:
    """What a training run expects of its cache: from its config and the target (the loaded one, or
    its tokenizer + HF config, which are cheap to read)."""
    from deepspec.data.cache.plan import load_target_config, resolve_taps, tap_rows
    from deepspec.targets import chat_template_hash

    exp: dict[str, Any] = {"target": cfg.target.name, "dtype": cfg.cache.dtype, "target_revision": cfg.target.revision,
                           "chat_template_kwargs": dict(cfg.target.chat_template_kwargs or {})}
    if target is not None:
        tconf, thash = target.config, target.template_hash
    else:
        tconf = load_target_config(cfg)
        thash = chat_template_hash(cfg.target.name, cfg.target.revision, cfg.target.trust_remote_code)
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
