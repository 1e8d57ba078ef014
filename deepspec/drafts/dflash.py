"""DFlash: the parallel block drafter (deepspec/drafts/block.py) with no sequential head.

Trained with position-decayed cross-entropy only (DeepSpec's DFlash recipe: ce 1, l1 0, confidence 0).
By default the anchor slot does not predict (`sample_from_anchor: false`): a block of K slots drafts
K-1 tokens, which is exactly what vLLM's `DFlashDraftModel` runs, so exports serve unchanged.
"""

from __future__ import annotations

from deepspec.drafts.block import BlockDraft
from deepspec.drafts.registry import register


@register("dflash")
class DFlashDraft(BlockDraft):
    default_sample_from_anchor = False
