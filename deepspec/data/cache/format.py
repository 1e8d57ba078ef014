"""On-disk format of the target hidden-state cache, in one place.

A cache directory holds:
  * ``shard_NNNNN.bin`` — concatenated sample records, read by memory mapping;
  * ``index.npy`` — a fixed-record structured array, one row per sample (shard, byte offset,
    tokens, bytes, crc32, loss tokens), so any sample is one seek away and a damaged shard is
    detected before its bytes are interpreted;
  * ``ids.json`` — the sample ids in index order (for error messages and provenance);
  * ``token_counts.npy`` — loss-masked token counts ``[V_target]`` int64 (builds d2t/t2d);
  * ``manifest.json`` — versioned provenance + counts. It is written last and atomically, so
    its presence is what makes a cache complete.

A record of T tokens is: input_ids int32 [T] | loss_mask uint8 [T] | features [T, L, H] | (fp8
only) scales float32 [T, L], where L = n_taps * rows + 1 (the taps in manifest order, then the final
normed hidden state). rows = 1, except for a multi-stream target (manifest `hc_mult` = S > 1) cached with
`tap_reduction` = concat: each tap is then S*H wide and stored as its S slices of H. Sections start on 16-byte boundaries. fp8 is e4m3 with one scale per token
per layer (amax / 448), so outliers in one token never crush the precision of another.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from deepspec.errors import CacheError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
INDEX = "index.npy"
IDS = "ids.json"
TOKEN_COUNTS = "token_counts.npy"
PLAN = "plan.json"
FP8_MAX = 448.0
ALIGN = 16

# Bytes per stored feature element; fp32 exists for exact golden tests, not for real runs.
DTYPE_BYTES = {"bf16": 2, "fp8": 1, "fp32": 4}

INDEX_DTYPE = np.dtype(
    [
        ("shard", "<i4"),
        ("offset", "<i8"),
        ("length", "<i4"),
        ("nbytes", "<i8"),
        ("crc32", "<u4"),
        ("num_loss_tokens", "<i4"),
        ("truncated", "u1"),
    ]
)


def shard_name(i: int) -> str:
    return f"shard_{i:05d}.bin"


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def record_layout(length: int, n_layers: int, hidden: int, dtype: str) -> dict[str, tuple[int, int]]:
    """Byte (offset, size) of every section of a T-token record; 'total' is the padded record size."""
    if dtype not in DTYPE_BYTES:
        raise CacheError(f"Unknown cache dtype {dtype!r}; use bf16 or fp8.")
    sizes = {
        "input_ids": 4 * length,
        "loss_mask": length,
        "features": DTYPE_BYTES[dtype] * length * n_layers * hidden,
        "scales": 4 * length * n_layers if dtype == "fp8" else 0,
    }
    out, pos = {}, 0
    for name, size in sizes.items():
        out[name] = (pos, size)
        pos = _align(pos + size)
    out["total"] = (0, pos)
    return out


def record_nbytes(length: int, n_layers: int, hidden: int, dtype: str) -> int:
    return record_layout(length, n_layers, hidden, dtype)["total"][1]


def encode_record(input_ids, loss_mask, features, dtype: str) -> bytes:
    """Serialize one sample; `features` is a float tensor [T, L, H] (taps then final hidden)."""
    import torch

    stored, scales = to_storage(features.detach().to("cpu", torch.float32).contiguous(), dtype)
    return encode_stored(input_ids, loss_mask, stored, scales, dtype)


def to_storage(x, dtype: str):
    """Features [..., H] -> (the storage dtype's tensor, fp8 scales [...] float32 or None), on x's device.

    The one conversion of the format: the writer runs it on the target's device before the device-to-host copy
    (half or a quarter of the float32 bytes cross), `encode_record` on the host; the same elementwise IEEE casts and
    fp32 arithmetic either way, so both give the same bytes."""
    import torch

    if dtype == "fp32":
        return x.to(torch.float32), None
    if dtype == "bf16":
        return x.to(torch.bfloat16), None
    if dtype == "fp8":
        return quantize_fp8(x.to(torch.float32))
    raise CacheError(f"Unknown cache dtype {dtype!r}; use bf16 or fp8.")


def encode_stored(input_ids, loss_mask, stored, scales, dtype: str) -> bytes:
    """Serialize one sample whose features are already in the storage dtype (host tensors [T, L, H], fp8 scales [T, L])."""
    import torch

    T, L, H = stored.shape
    layout = record_layout(T, L, H, dtype)
    buf = bytearray(layout["total"][1])

    def put(name: str, data: bytes) -> None:
        off, size = layout[name]
        assert len(data) == size, (name, len(data), size)
        buf[off : off + size] = data

    put("input_ids", np.asarray(input_ids, dtype="<i4").tobytes())
    put("loss_mask", np.asarray(loss_mask, dtype=np.uint8).tobytes())
    x = stored.contiguous()
    if dtype == "fp32":
        put("features", x.numpy().astype("<f4").tobytes())
    elif dtype == "bf16":
        put("features", x.view(torch.int16).numpy().tobytes())
    else:
        put("features", x.view(torch.uint8).numpy().tobytes())
        put("scales", scales.contiguous().numpy().astype("<f4").tobytes())
    return bytes(buf)


def quantize_fp8(x):
    """e4m3 with a per-row (token, layer) scale over the last dim: returns (q [.., H] fp8, scale [..] f32)."""
    import torch

    amax = x.abs().amax(dim=-1).clamp_min(1e-12)
    scale = (amax / FP8_MAX).to(torch.float32)
    q = (x / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


# Storage dtype of the features section, as torch names it.
def torch_dtype(dtype: str):
    import torch

    return {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "fp32": torch.float32}[dtype]


def record_views(buf, offset: int, length: int, n_layers: int, hidden: int, dtype: str):
    """Zero-copy tensors over one record of a mapped shard: (input_ids int32 [T], loss_mask uint8 [T],
    features [T, L, H] in the storage dtype, fp8 scales float32 [T, L] or None).

    The tensors share `buf`'s memory (a writable mapping: torch refuses read-only buffers without a warning),
    so reading a sample costs no copy; the one copy of its features is the collate into the batch.
    """
    import torch

    layout = record_layout(length, n_layers, hidden, dtype)

    def view(name: str, tdtype, shape: tuple[int, ...]):
        off, size = layout[name]
        n = size // tdtype.itemsize
        if n == 0:
            return torch.empty(shape, dtype=tdtype)
        return torch.frombuffer(buf, dtype=tdtype, count=n, offset=offset + off).view(shape)

    feats = view("features", torch_dtype(dtype), (length, n_layers, hidden))
    scales = view("scales", torch.float32, (length, n_layers)) if dtype == "fp8" else None
    return view("input_ids", torch.int32, (length,)), view("loss_mask", torch.uint8, (length,)), feats, scales


def record_item(buf, offset: int, length: int, n_taps: int, rows: int, hidden: int, dtype: str) -> dict[str, Any]:
    """A cache record as the trainer's item: input_ids [T] int64, loss_mask [T] bool, taps [T, n_taps, rows*H] and
    final_hidden [T, H] as views in the storage dtype (+ fp8 scales) — the layout of CacheDataset items."""
    import torch

    n_layers = n_taps * rows + 1
    ids, mask, feats, scales = record_views(buf, offset, length, n_layers, hidden, dtype)
    n = n_taps * rows
    item = {
        "input_ids": ids.to(torch.int64),
        "loss_mask": mask.to(torch.bool),
        "taps": feats[:, :n].reshape(length, n_taps, rows * hidden),
        "final_hidden": feats[:, n],
    }
    if scales is not None:
        item["taps_scale"] = scales[:, :n].reshape(length, n_taps, rows)
        item["final_scale"] = scales[:, n]
    return item


def decode_record(buf, length: int, n_layers: int, hidden: int, dtype: str):
    """Bytes of one record -> (input_ids int64 [T], loss_mask bool [T], features float32 [T, L, H])."""
    import torch

    layout = record_layout(length, n_layers, hidden, dtype)

    def arr(name: str, np_dtype) -> np.ndarray:
        off, size = layout[name]
        return np.frombuffer(buf, dtype=np_dtype, count=size // np.dtype(np_dtype).itemsize, offset=off)

    ids = torch.from_numpy(arr("input_ids", "<i4").astype(np.int64))
    mask = torch.from_numpy(arr("loss_mask", np.uint8).astype(bool))
    shape = (length, n_layers, hidden)
    if dtype == "fp32":
        feats = torch.from_numpy(arr("features", "<f4").reshape(shape).copy())
    elif dtype == "bf16":
        feats = torch.from_numpy(arr("features", "<i2").reshape(shape).copy()).view(torch.bfloat16).float()
    else:
        q = torch.from_numpy(arr("features", np.uint8).reshape(shape).copy()).view(torch.float8_e4m3fn).float()
        scale = torch.from_numpy(arr("scales", "<f4").reshape(shape[:2]).copy())
        feats = q * scale.unsqueeze(-1)
    return ids, mask, feats


# ---------------------------------------------------------------------------------- files


def write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_npy_atomic(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.save(f, array, allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_manifest(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise CacheError(f"{directory} is not a complete cache (no {MANIFEST}); run `deepspec data cache` (it resumes).")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CacheError(f"{path} is not valid JSON ({e}); rebuild the cache with --overwrite.") from None
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise CacheError(
            f"Cache {directory} has format version {version}, this deepspec reads version {FORMAT_VERSION}; rebuild it with --overwrite."
        )
    return manifest


def is_complete(directory: str | Path) -> bool:
    """True when the cache has a valid manifest whose counts agree with its index."""
    d = Path(directory)
    try:
        manifest = load_manifest(d)
        index = np.load(d / INDEX, mmap_mode="r")
    except (CacheError, OSError, ValueError):
        return False
    if len(index) != manifest["counts"]["samples"]:
        return False
    sizes = np.zeros(manifest["num_shards"], dtype=np.int64)
    np.add.at(sizes, index["shard"], index["nbytes"])
    for i, size in enumerate(sizes):
        p = d / shard_name(i)
        if not p.is_file() or p.stat().st_size != size:
            return False
    return True


# Fields a training run must agree with, and how to name them for a user.
CHECKED_FIELDS = {
    "taps": "model.target_layer_ids",
    "tap_reduction": "model.tap_reduction",
    "hc_mult": "the target's hc_mult (residual streams)",
    "hidden_size": "the target's hidden size",
    "target": "target.name",
    "template_hash": "the target's chat template",
    "dtype": "cache.dtype",
    "target_revision": "target.revision",
    "chat_template_kwargs": "target.chat_template_kwargs (e.g. thinking mode)",
}


# What a manifest written before a field existed means by its absence.
MANIFEST_DEFAULTS = {"hc_mult": 1, "tap_reduction": "mean"}


def check_manifest(manifest: dict[str, Any], expected: dict[str, Any]) -> None:
    """Refuse a cache built for another setup; the error names every differing field.

    `expected` holds any of CHECKED_FIELDS (missing keys or None values are not checked)."""
    diffs = []
    for key, where in CHECKED_FIELDS.items():
        want = expected.get(key)
        if want is None:
            continue
        have = manifest.get(key, MANIFEST_DEFAULTS.get(key))
        if isinstance(want, tuple):
            want = list(want)
        if have != want:
            diffs.append(f"{key}: cache has {have!r}, run wants {want!r} ({where})")
    if diffs:
        raise CacheError(
            "The cache was built for a different setup — " + "; ".join(diffs)
            + ". Rebuild it (`deepspec data cache ... --overwrite`) or point cache.dir at a matching cache."
        )
