"""Featurizing: run the target on a batch of planned samples and capture its tap hidden states.

Why apart from the shard writer: the same featurizer feeds a cache build (shards.py), a streamed run's producers
(deepspec/data/stream/) and online training (online.py); each only decides where the features go.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from deepspec.data.cache import format as fmt
from deepspec.data.cache.plan import Plan
from deepspec.data.cache.sample import Sample
from deepspec.errors import CacheError


def length_batches(samples: list[Sample], batch_tokens: int) -> list[list[Sample]]:
    """Consecutive samples whose padded size (n * longest) stays <= batch_tokens (>= 1 sample)."""
    out: list[list[Sample]] = []
    cur: list[Sample] = []
    longest = 0
    for s in samples:
        t = len(s.input_ids)
        if cur and (len(cur) + 1) * max(longest, t) > batch_tokens:
            out.append(cur)
            cur, longest = [], 0
        cur.append(s)
        longest = max(longest, t)
    if cur:
        out.append(cur)
    return out


def device_features(model, batch: list[Sample], taps: list[int], reduction: str = "mean"):
    """Run the target on a right-padded batch: features [B, T, n_taps * rows + 1, H] where the target computed them
    (its device, its dtype), each tap reduced by `reduction` to W = rows * H and stored as its `rows` slices of H
    (rows = 1 unless concat). Rows past a sample's length are the target's output for padding, not zeros."""
    import torch

    from deepspec.targets import capture

    device = next(model.parameters()).device
    T = max(len(s.input_ids) for s in batch)
    ids = torch.zeros(len(batch), T, dtype=torch.long)
    att = torch.zeros(len(batch), T, dtype=torch.long)
    for b, s in enumerate(batch):
        ids[b, : len(s.input_ids)] = torch.from_numpy(s.input_ids.astype(np.int64))
        att[b, : len(s.input_ids)] = 1
    # No mask for a single sample: the exact computation HF does for an unpadded sequence.
    mask = att.to(device) if len(batch) > 1 else None
    tap_h, final = capture(model, ids.to(device), taps, attention_mask=mask, reduction=reduction)
    B, T, n, W = tap_h.shape
    H = final.shape[-1]
    return torch.cat([tap_h.reshape(B, T, n * W // H, H), final.unsqueeze(2)], dim=2)


def sample_features(model, batch: list[Sample], taps: list[int], reduction: str = "mean"):
    """`device_features` per sample, on the host in float32: yields (sample, features [T, n_taps * rows + 1, H])."""
    feats = device_features(model, batch, taps, reduction).float().cpu()
    for b, s in enumerate(batch):
        yield s, feats[b, : len(s.input_ids)]


def stored_features(model, batch: list[Sample], taps: list[int], reduction: str, dtype: str):
    """`device_features` converted to the cache's storage dtype where the target computed them (bf16: half the
    float32 bytes cross to the host, fp8: about a quarter), copied asynchronously into page-locked memory on CUDA:
    yields (sample, Stored) whose bytes equal `encode_record` of `sample_features`' output."""
    import torch

    stored, scales = fmt.to_storage(device_features(model, batch, taps, reduction), dtype)
    ready = None
    if stored.device.type == "cuda":
        with torch.cuda.device(stored.device):
            host = torch.empty(stored.shape, dtype=stored.dtype, pin_memory=True)
            host.copy_(stored, non_blocking=True)
            if scales is not None:
                host_scales = torch.empty(scales.shape, dtype=scales.dtype, pin_memory=True)
                scales = host_scales.copy_(scales, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(stored.device))
        stored = host
    elif stored.device.type != "cpu":
        stored, scales = stored.cpu(), None if scales is None else scales.cpu()
    for b, s in enumerate(batch):
        n = len(s.input_ids)
        yield s, Stored(stored[b, :n], None if scales is None else scales[b, :n], ready)


@dataclass


class Stored:
    """One sample's features already in the cache's storage dtype (host tensors [T, L, H], fp8 scales [T, L]), readable
    once `ready` (the CUDA event of their device-to-host copy, None on the host) has completed."""

    features: Any
    scales: Any = None
    ready: Any = None


def encode_sample(sample: Sample, feats, dtype: str) -> bytes:
    """One captured sample's record: features already in the storage dtype (`Stored`, the HF backend) or float
    tensors on the host (the vLLM backend)."""
    if isinstance(feats, Stored):
        if feats.ready is not None:
            feats.ready.synchronize()
        return fmt.encode_stored(sample.input_ids, sample.loss_mask, feats.features, feats.scales, dtype)
    return fmt.encode_record(sample.input_ids, sample.loss_mask, feats, dtype)


class CaptureSession:
    """One vLLM capture engine shared by the splits of a build (same config, same taps): its start-up (~15-25 s for
    SmolLM2 on CPU, more for a large target) is paid once, not once per split. Closed by `build_caches`."""

    def __init__(self) -> None:
        self._engine = None
        self.audit_model = None  # the target as transformers loads it, for the capture audit of each split (audit.py)

    def engine(self, make):
        if self._engine is None:
            self._engine = make()
        return self._engine

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
        self._engine = None


def make_featurizer(plan: Plan, cfg, device: str | None, model, session: CaptureSession | None = None):
    """(batch -> iterator of (sample, features)), and how to release it, for the plan's capture backend."""
    taps = plan.signature["taps"]
    reduction = plan.signature.get("tap_reduction", "mean")
    if plan.signature.get("capture_backend", "hf") == "vllm" and model is None:
        if plan.signature.get("hc_mult", 1) > 1 and reduction == "concat":
            raise CacheError(
                "cache.capture_backend=vllm returns one H-wide hidden state per layer, so it cannot store "
                "model.tap_reduction=concat for a multi-stream target; use cache.capture_backend=hf (target.device_map=auto "
                "spreads a large target over the GPUs) or model.tap_reduction=mean."
            )
        from deepspec.data.cache.vllm_capture import VLLMFeaturizer
        from deepspec.targets import resolve_target_path

        def make():
            return VLLMFeaturizer(
                resolve_target_path(cfg.target.name), taps, dtype=cfg.target.dtype, max_model_len=cfg.cache.max_length + 8,
                batch_tokens=plan.signature["batch_tokens"], revision=cfg.target.revision,
                trust_remote_code=cfg.target.trust_remote_code, vllm_kwargs=cfg.cache.vllm_kwargs,
            )

        if session is not None:
            return session.engine(make), (lambda: None)
        vf = make()
        return vf, vf.close
    if model is None:
        from deepspec.targets import load_target_from_config

        device = device or os.environ.get("DEEPSPEC_CACHE_DEVICE")
        if device is None:
            import torch

            device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if torch.cuda.is_available() else "cpu"
        model = load_target_from_config(cfg.target, device=device).model
    return (lambda batch: stored_features(model, batch, taps, reduction, plan.dtype)), (lambda: None)
