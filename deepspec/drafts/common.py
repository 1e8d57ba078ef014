"""What every draft shares: frozen copies of the target's embeddings / LM head, the constructor
signature used by checkpoint loading, the default tap choice and the draft vocabulary (d2t / t2d)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch
import torch.nn.functional as F

from deepspec.drafts.base import DraftModel
from deepspec.drafts.layers import DraftArch, arch_from_target, softcap
from deepspec.drafts.losses import gemm_dtype
from deepspec.drafts.vocab import build_draft_vocab, target_ids_of_draft_vocab
from deepspec.errors import CheckpointError


class TargetBackedDraft(DraftModel):
    """A DraftModel built as cls(arch, model_cfg, taps) that holds frozen target embed / LM head buffers."""

    default_num_taps = 3
    default_qk_norm: bool | None = None  # None = follow the target family

    def __init__(self, arch: DraftArch, model_cfg: Any, taps: list[int]):
        super().__init__()
        self.arch = arch
        self.model_cfg = model_cfg
        self.taps = list(taps)
        # Frozen target parts: buffers, so the optimizer never sees them and checkpoints skip them.
        self.register_buffer("target_embed", torch.zeros(arch.vocab_size, arch.hidden_size), persistent=True)
        self.register_buffer("target_lm_head", torch.zeros(arch.vocab_size, arch.hidden_size), persistent=True)
        self._target_loaded = False

    @classmethod
    def from_target_config(cls, target_config: Any, model_cfg: Any) -> "TargetBackedDraft":
        from deepspec.targets.taps import resolve_taps

        model_cfg.validate()
        cfg = getattr(target_config, "text_config", None) or target_config
        taps = resolve_taps(model_cfg.target_layer_ids, cfg.num_hidden_layers, cls.default_num_taps)
        qk_norm = model_cfg.qk_norm if getattr(model_cfg, "qk_norm", None) is not None else cls.default_qk_norm
        arch = arch_from_target(target_config, model_cfg, qk_norm=qk_norm)
        return cls(arch, model_cfg, taps)

    def load_target_weights(self, embed_tokens: torch.Tensor, lm_head: torch.Tensor) -> None:
        if tuple(embed_tokens.shape) != tuple(self.target_embed.shape) or tuple(lm_head.shape) != tuple(self.target_lm_head.shape):
            raise CheckpointError(
                f"Target weights have shapes {tuple(embed_tokens.shape)}/{tuple(lm_head.shape)} but the draft was built for "
                f"{tuple(self.target_embed.shape)}; load the target the draft was trained for."
            )
        with torch.no_grad():
            self.target_embed.copy_(embed_tokens.detach().to(self.target_embed.dtype))
            self.target_lm_head.copy_(lm_head.detach().to(self.target_lm_head.dtype))
        self._target_loaded = True
        self._on_target_loaded()

    def _on_target_loaded(self) -> None:
        """Hook: initialise trainable parts from the target (e.g. EAGLE-3's draft LM head)."""

    # --- draft vocabulary ---------------------------------------------------------------------------
    def _draft_vocab_size(self, requested: int | None) -> int:
        """model.draft_vocab_size as the draft uses it: null or >= the target's vocabulary = the full vocabulary."""
        return requested if requested and requested < self.arch.vocab_size else self.arch.vocab_size

    def _register_draft_vocab(self, draft_vocab_size: int) -> None:
        """d2t / t2d buffers (saved in checkpoints), the first ids until set_token_frequencies picks the frequent ones."""
        v = self.arch.vocab_size
        d2t, t2d = build_draft_vocab(torch.zeros(v), None if draft_vocab_size == v else draft_vocab_size)
        self.register_buffer("d2t", d2t)
        self.register_buffer("t2d", t2d)

    def set_token_frequencies(self, counts: torch.Tensor) -> None:
        """Rebuild d2t / t2d from the training data's token counts and refresh what depends on them (the LM head
        rows); a draft without a draft vocabulary (a full-vocabulary block draft) has nothing to rebuild."""
        if "d2t" not in self._buffers:
            return
        v = self.arch.vocab_size
        d2t, t2d = build_draft_vocab(counts, None if self.draft_vocab_size == v else self.draft_vocab_size)
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)
        if self._target_loaded:
            self._on_target_loaded()

    def draft_target_ids(self) -> torch.Tensor:
        """[Dv] the target id of every draft id."""
        return target_ids_of_draft_vocab(self.d2t)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        e = F.embedding(ids, self.target_embed)
        return e * self.arch.embed_scale if self.arch.embed_scale != 1.0 else e

    def target_logits(self, final_hidden: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The target's next-token logits (fp32) from its final normed hidden state; `rows`: only those
        token ids' logits (columns in that order), without running the rest of the LM head."""
        dt = gemm_dtype(final_hidden, self.target_lm_head)  # bf16 under bf16 autocast, as the served target computes it
        head = self.target_lm_head if rows is None else self.target_lm_head[rows]
        return softcap(F.linear(final_hidden.to(dt), head.to(dt)).float(), self.arch.logit_softcap)

    def hold_target_in(self, dtype: torch.dtype) -> None:
        """Keep the frozen target embedding / LM head in `dtype` (the training dtype: bf16 halves the 5 GB a 150k x 4096
        pair takes in fp32, and no step casts them again). Frozen: nothing trains them, so no precision is lost."""
        for name in ("target_embed", "target_lm_head"):
            buf = getattr(self, name)
            if buf.dtype != dtype:
                setattr(self, name, buf.to(dtype))

    def export_config(self) -> dict[str, Any]:
        return {
            "algorithm": self.algorithm,
            "arch": self.arch.to_dict(),
            "taps": self.taps,
            "model": asdict(self.model_cfg),
        }
