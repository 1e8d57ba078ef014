"""Layer taps: which target hidden states a draft reads, and the one place ids are translated.

deepspec convention: tap ``k`` is the output of 0-based decoder layer ``k`` — Hugging Face's
``output_hidden_states[k + 1]`` — and ``-1`` is the embeddings (``hidden_states[0]``).
The last decoder layer cannot be tapped this way: HF's last entry is *after* the final norm
(vLLM's is before it), so the two engines would disagree; we refuse it.

Engines count differently; translate only here:
  * vLLM ``eagle_aux_hidden_state_layer_ids`` / speculators ``aux_hidden_state_layer_ids`` = k + 1
  * z-lab DFlash ``dflash_config.target_layer_ids`` = k (our convention)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from deepspec.errors import ConfigError

if TYPE_CHECKING:
    import torch


def default_taps(num_layers: int, count: int = 3) -> list[int]:
    """Evenly spread taps: 3 taps = vLLM's default (2, L//2, L-3) in vLLM ids, i.e. ours (1, L//2-1, L-4);
    5 taps = DeepSpec's spacing (1, ..., L-3), e.g. [1, 9, 17, 25, 33] for 36 layers."""
    if count == 3:
        taps = [1, num_layers // 2 - 1, num_layers - 4]
    else:
        last = num_layers - 3
        taps = [round(1 + i * (last - 1) / (count - 1)) for i in range(count)]
    taps = sorted({max(-1, min(t, num_layers - 2)) for t in taps})
    return taps


def validate_taps(taps: Sequence[int], num_layers: int) -> list[int]:
    """Check taps against the target depth; raise a ConfigError naming `taps` on a bad id."""
    taps = list(taps)
    if not taps:
        raise ConfigError("model.target_layer_ids is empty; give at least one tap (e.g. [1, 14, 26]).")
    for k in taps:
        if not -1 <= k <= num_layers - 2:
            raise ConfigError(
                f"Tap {k} in model.target_layer_ids is out of range for a {num_layers}-layer target: use -1 (embeddings) "
                f"to {num_layers - 2}; the last layer ({num_layers - 1}) is excluded because HF and vLLM disagree on its norm."
            )
    if len(set(taps)) != len(taps):
        raise ConfigError(f"model.target_layer_ids {taps} repeats a layer; list each tap once.")
    return taps


def to_vllm_aux_ids(taps: Sequence[int]) -> list[int]:
    """Our tap k -> vLLM/speculators aux id k+1 (the hidden state entering layer k+1)."""
    return [k + 1 for k in taps]


def from_vllm_aux_ids(ids: Sequence[int]) -> list[int]:
    return [j - 1 for j in ids]


def to_dflash_layer_ids(taps: Sequence[int]) -> list[int]:
    """z-lab DFlash target_layer_ids use our convention."""
    return list(taps)


def select_taps(hidden_states: Sequence["torch.Tensor"], taps: Sequence[int]) -> "torch.Tensor":
    """Stack HF `output_hidden_states` entries for `taps`: returns [B, T, n_taps, H]."""
    import torch

    return torch.stack([hidden_states[k + 1] for k in taps], dim=2)


def capture(model, input_ids: "torch.Tensor", taps: Sequence[int], attention_mask: "torch.Tensor | None" = None):
    """Run the target once; return (taps [B, T, n_taps, H], final normed hidden [B, T, H]).

    The final normed hidden state is what the frozen LM head maps to logits, so target
    distributions can be recomputed later without storing logits.
    """
    import torch

    num_layers = model.config.num_hidden_layers
    validate_taps(taps, num_layers)
    with torch.no_grad():
        out = model.model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False)
    hs = out.hidden_states
    if len(hs) != num_layers + 1:
        raise RuntimeError(f"expected {num_layers + 1} hidden states from the target, got {len(hs)}")
    return select_taps(hs, taps), out.last_hidden_state
