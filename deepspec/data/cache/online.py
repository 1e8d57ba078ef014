"""Online mode: the same DraftBatch as the cache path, computed on the fly by a co-located target.

No disk, no cache build: the trainer iterates `OnlineDataset` (token ids + loss masks from
chat.py, exactly as the cache writer tokenizes) with the same `ResumableBatchSampler`, and
`OnlineFeatures` (the batch's collate) runs the target once per batch to fill taps and the final hidden
state. Features are the target's own output (the cache rounds them to bf16/fp8).

Bytes move once, or not at all: the batch's features stay where the target computed them, in its dtype (bf16 on a
GPU), so with the target on the trainer's GPU they never leave it — no device-to-host copy, no float32 host tensor,
no copy back; the trainer widens them on its device (`DraftBatch.to`). Only token ids and masks, which the loop
counts on the host, are built there. Memory per GPU: the target's weights in its dtype (an 8B target is ~16 GB in
bf16) plus its activations for one micro-batch and the prefetched batches' features, beside the draft's state
(docs/data.md).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from deepspec.data.cache.featurizer import sample_features
from deepspec.data.cache.plan import read_conversations, resolve_taps
from deepspec.data.cache.sample import Sample
from deepspec.data.chat import render_conversation


_TARGET_LOCKS: "weakref.WeakKeyDictionary[Any, threading.Lock]" = weakref.WeakKeyDictionary()
_TARGET_LOCKS_GUARD = threading.Lock()


def target_lock(model) -> threading.Lock:
    """The one lock every feature computation on `model` holds for its whole forward (and the wait for it).

    Taps are caught by forward hooks registered on the target's layers for the duration of a forward
    (deepspec/targets/taps.py), and a hook sees every forward of that layer, not only its own caller's: the loader
    thread prefetching a training batch and the trainer validating on the same target at the same moment would
    each record the other's layer outputs (tests/test_cache_online.py). Taking turns costs a validation at most the
    wait for the loader's one forward in flight."""
    with _TARGET_LOCKS_GUARD:
        lock = _TARGET_LOCKS.get(model)
        if lock is None:
            lock = _TARGET_LOCKS[model] = threading.Lock()
        return lock


class OnlineDataset:
    """Tokenized conversations of a regenerated.jsonl, filtered like the cache (min_loss_tokens, max_length)."""

    def __init__(self, path: str | Path, tokenizer, *, chat_template_kwargs: dict[str, Any] | None = None,
                 max_length: int = 2048, min_loss_tokens: int = 8):
        self.samples: list[Sample] = []
        self.dropped_short = 0
        for sid, messages in read_conversations(Path(path)):
            r = render_conversation(tokenizer, messages, chat_template_kwargs, max_length)
            if sum(r.loss_mask) < min_loss_tokens:
                self.dropped_short += 1
                continue
            self.samples.append(Sample(sid, np.asarray(r.input_ids, np.int32), np.asarray(r.loss_mask, np.uint8), r.truncated))

    @classmethod
    def from_config(cls, cfg, tokenizer, split: str = "train") -> "OnlineDataset":
        path = cfg.regenerated_path if split == "train" else cfg.regenerated_heldout_path
        return cls(path, tokenizer, chat_template_kwargs=cfg.target.chat_template_kwargs,
                   max_length=cfg.cache.max_length, min_loss_tokens=cfg.cache.min_loss_tokens)

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def lengths(self) -> np.ndarray:
        return np.array([len(s.input_ids) for s in self.samples], dtype=np.int64)

    def __getitem__(self, i: int) -> Sample:
        return self.samples[i]


class OnlineFeatures:
    """Turns a list of `Sample`s into a DraftBatch by running the target (use as a DataLoader collate_fn
    with num_workers=0, or call it in the training step where the target lives)."""

    def __init__(self, model, taps: Sequence[int], *, max_batch_tokens: int | None = None, pad_token_id: int = 0,
                 tap_reduction: str = "mean"):
        self.model = model
        self.taps = list(taps)
        self.tap_reduction = tap_reduction
        self.max_batch_tokens = max_batch_tokens
        self.pad_token_id = pad_token_id

    @classmethod
    def from_config(cls, cfg, target) -> "OnlineFeatures":
        taps = resolve_taps(cfg, target.config.num_hidden_layers)
        return cls(target.model, taps, max_batch_tokens=cfg.cache.batch_tokens, tap_reduction=cfg.model.tap_reduction)

    def features(self, samples: Sequence[Sample]) -> list[dict[str, Any]]:
        """Per-sample dicts shaped exactly like CacheDataset items."""
        import torch

        from deepspec.data.cache.featurizer import length_batches

        out = []
        groups = length_batches(list(samples), self.max_batch_tokens) if self.max_batch_tokens else [list(samples)]
        n = len(self.taps)
        for group in groups:
            with target_lock(self.model):  # the hooks of a forward running elsewhere would catch this one's taps
                caught = list(sample_features(self.model, group, self.taps, self.tap_reduction))
            for s, feats in caught:
                rows = (feats.shape[1] - 1) // n
                out.append({
                    "input_ids": torch.from_numpy(s.input_ids.astype(np.int64)),
                    "loss_mask": torch.from_numpy(s.loss_mask.astype(bool)),
                    "taps": feats[:, : n * rows].reshape(feats.shape[0], n, rows * feats.shape[-1]),
                    "final_hidden": feats[:, n * rows],
                })
        return out

    def _target_stream(self):
        """The target's own CUDA stream when it sits on one GPU: its forward for the next micro-batch, issued by the
        loader thread, then runs beside the draft's step on the default stream instead of queueing behind it.
        None on CPU, and for a target spread over several devices (its layers follow each device's default stream).
        Decided at the first batch, not per micro-batch."""
        import torch

        if not hasattr(self, "_stream"):
            devices = {p.device for p in self.model.parameters()} if torch.cuda.is_available() else set()
            device = next(iter(devices)) if len(devices) == 1 else None
            self._stream = None
            if device is not None and device.type == "cuda":
                self._stream = torch.cuda.Stream(device)
                self._stream.wait_stream(torch.cuda.current_stream(device))  # after the weights' loading
        return self._stream

    def _on_target_stream(self):
        import torch

        stream = self._target_stream()
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def __call__(self, samples: Sequence[Sample], pin: bool = False):
        """A DraftBatch whose features stay on the target's device in the target's dtype (padding zeroed, as the
        cache's collate pads); ids and masks on the host (page-locked with `pin`), as the trainer counts them there."""
        import torch

        from deepspec.data.cache.featurizer import device_features, length_batches
        from deepspec.drafts.base import DraftBatch

        samples = list(samples)
        if not samples:
            from deepspec.errors import CacheError

            raise CacheError("OnlineFeatures got an empty list of samples.")
        lengths = [len(s.input_ids) for s in samples]
        B, T = len(samples), max(lengths)
        ids = torch.full((B, T), self.pad_token_id, dtype=torch.long)
        lm = torch.zeros(B, T, dtype=torch.bool)
        am = torch.zeros(B, T, dtype=torch.bool)
        for b, s in enumerate(samples):
            ids[b, : lengths[b]] = torch.from_numpy(s.input_ids.astype(np.int64))
            lm[b, : lengths[b]] = torch.from_numpy(s.loss_mask.astype(bool))
            am[b, : lengths[b]] = True
        # one forward at a time on this target (target_lock), held until its features are complete; the stream is
        # chosen under the lock too, so two threads' first batches do not each make one
        with target_lock(self.model), self._on_target_stream():
            groups = length_batches(samples, self.max_batch_tokens) if self.max_batch_tokens else [samples]
            if len(groups) == 1:
                feats = device_features(self.model, samples, self.taps, self.tap_reduction)
            else:  # several target forwards: rows gathered into one [B, T, ...] tensor on the device
                feats, b = None, 0
                for group in groups:
                    g = device_features(self.model, group, self.taps, self.tap_reduction)
                    if feats is None:
                        feats = g.new_zeros((B, T, *g.shape[2:]))
                    feats[b : b + g.shape[0], : g.shape[1]] = g
                    b += g.shape[0]
            feats.masked_fill_(~am.to(feats.device, non_blocking=True)[:, :, None, None], 0)  # the cache pads with zeros
            if feats.device.type == "cuda":
                # The loader thread waits for its own forward (the trainer never does), so the batch it hands over
                # holds finished features whichever stream reads them next (deepspec/train/staging.py).
                torch.cuda.current_stream(feats.device).synchronize()
        n = len(self.taps)
        rows = (feats.shape[2] - 1) // n
        taps = feats[:, :, : n * rows].reshape(B, T, n, rows * feats.shape[-1])
        final = feats[:, :, n * rows]
        if pin:
            ids, lm, am = ids.pin_memory(), lm.pin_memory(), am.pin_memory()
            if feats.device.type == "cpu":  # a target on the host (e.g. device_map spilling to CPU) feeding a GPU
                taps, final = taps.pin_memory(), final.pin_memory()
        return DraftBatch(input_ids=ids, loss_mask=lm, attention_mask=am, taps=taps, final_hidden=final)
