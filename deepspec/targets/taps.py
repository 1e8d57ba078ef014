"""Layer taps: which target hidden states a draft reads, and the one place ids are translated.

deepspec convention: tap ``k`` is the output of 0-based decoder layer ``k`` — Hugging Face's
``output_hidden_states[k + 1]`` — and ``-1`` is the embeddings (``hidden_states[0]``).
The last decoder layer cannot be tapped this way: HF's last entry is *after* the final norm
(vLLM's is before it), so the two engines would disagree; we refuse it.

Multi-stream (hyper-connection) targets carry the residual as S = hc_mult streams, so a tap is
[T, S, H]; ``model.tap_reduction`` says what the draft reads: ``mean`` (width H) or ``concat`` (S*H).
Single-stream targets have S = 1, where both reductions are the identity.

Engines count differently; translate only here:
  * vLLM ``eagle_aux_hidden_state_layer_ids`` / speculators ``aux_hidden_state_layer_ids`` = k + 1
  * z-lab DFlash ``dflash_config.target_layer_ids`` = k (our convention)
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

from deepspec.errors import ConfigError, TargetError

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


def resolve_taps(explicit: Sequence[int], num_layers: int, default_count: int = 3) -> list[int]:
    """The taps a draft reads and a cache stores: `model.target_layer_ids` when given, else the algorithm's default
    count spread by `default_taps`; validated, in increasing layer order. The one rule both stages use, so a cache and
    the draft built on it always agree."""
    taps = validate_taps(list(explicit) or default_taps(num_layers, default_count), num_layers)
    if taps != sorted(taps):
        raise ConfigError(
            f"model.target_layer_ids {taps} must be in increasing layer order: engines concatenate the tapped states by layer "
            f"index, so give {sorted(taps)}."
        )
    return taps


def to_vllm_aux_ids(taps: Sequence[int]) -> list[int]:
    """Our tap k -> vLLM/speculators aux id k+1 (the hidden state entering layer k+1)."""
    return [k + 1 for k in taps]


def from_vllm_aux_ids(ids: Sequence[int]) -> list[int]:
    return [j - 1 for j in ids]


def to_dflash_layer_ids(taps: Sequence[int]) -> list[int]:
    """z-lab DFlash target_layer_ids use our convention."""
    return list(taps)


TAP_REDUCTIONS = ("mean", "concat")


def tap_width(hidden_size: int, hc_mult: int, reduction: str) -> int:
    """Width of one reduced tap: H for `mean` (or a single stream), S*H for `concat`."""
    if reduction not in TAP_REDUCTIONS:
        raise ConfigError(f"model.tap_reduction={reduction!r} is not one of {', '.join(TAP_REDUCTIONS)}.")
    return hidden_size * hc_mult if reduction == "concat" else hidden_size


def reduce_streams(x: "torch.Tensor", reduction: str) -> "torch.Tensor":
    """[..., S, H] -> [..., H] (mean over streams) or [..., S*H] (streams concatenated, stream-major)."""
    if reduction == "mean":
        return x.mean(dim=-2)
    if reduction == "concat":
        return x.flatten(-2)
    raise ConfigError(f"model.tap_reduction={reduction!r} is not one of {', '.join(TAP_REDUCTIONS)}.")


def select_taps(hidden_states: Sequence["torch.Tensor"], taps: Sequence[int], reduction: str = "mean") -> "torch.Tensor":
    """Stack HF `output_hidden_states` entries for `taps`: returns [B, T, n_taps, W].

    Entries are [B, T, H] (W = H) or, for multi-stream targets, [B, T, S, H] (reduced to W by `reduction`).
    deepspec itself captures with `tap_hooks`; this is the reference its taps are golden-tested against."""
    import torch

    out = torch.stack([hidden_states[k + 1] for k in taps], dim=2)
    return reduce_streams(out, reduction) if out.dim() == 5 else out


class TapRecorder:
    """What the tap hooks caught in the target's latest forward; `stacked()` hands it over as [B, T, n_taps, W].

    Each hook keeps only its module's newest output, so a reader gets exactly the last forward's taps
    (a prefill's P positions, or a verify forward's 1 + k with a KV cache) and nothing older."""

    def __init__(self, taps: Sequence[int], streams: int, reduction: str):
        self.taps, self.streams, self.reduction = list(taps), streams, reduction
        self._caught: dict[int, "torch.Tensor"] = {}

    def _hook(self, k: int) -> Callable[..., None]:
        def hook(_module, _args, output):
            self._caught[k] = output[0] if isinstance(output, (tuple, list)) else output
        return hook

    def stacked(self, device: "torch.device | None" = None) -> "torch.Tensor":
        """The last forward's taps, stacked and reduced: [B, T, n_taps, W]; emptied so none is read twice.

        A multi-stream target's embeddings tap is the embeddings copied into every stream, as its first
        layer reads them; its [B, T, S, H] taps are reduced to W (H or S*H) by the recorder's reduction."""
        import torch

        missing = [k for k in self.taps if k not in self._caught]
        if missing:
            raise TargetError(
                f"No output was caught for taps {missing}: read the taps after a forward of the target's decoder "
                "(its tapped layers and, for -1, its embeddings must run)."
            )
        if device is None:
            device = self._caught[self.taps[0]].device
        states = []
        for k in self.taps:
            h = self._caught[k].to(device)
            if self.streams > 1 and h.dim() == 3:  # embeddings: the same vector enters every stream
                h = h.unsqueeze(2).expand(*h.shape[:2], self.streams, h.shape[-1])
            states.append(h)
        self._caught.clear()
        out = torch.stack(states, dim=2)
        return reduce_streams(out, self.reduction) if out.dim() == 5 else out


@contextmanager
def tap_hooks(model, taps: Sequence[int], reduction: str = "mean") -> Iterator[TapRecorder]:
    """Forward hooks on the tapped decoder layers (and the embeddings for -1) that the family's adapter names,
    for as long as the block runs; yields the recorder to read each forward's taps from.

    Only the tapped states are kept — never every layer's, as `output_hidden_states` would. Both the cache
    stage (`capture`) and the evaluator's decoding loop read taps through this one piece."""
    from deepspec.targets.adapters import adapter_for, text_config

    adapter = adapter_for(model.config)
    validate_taps(taps, text_config(model.config).num_hidden_layers)
    recorder = TapRecorder(taps, adapter.hc_mult(model.config), reduction)
    layers = adapter.get_layers(model)
    handles = [(adapter.get_embeddings(model) if k < 0 else layers[k]).register_forward_hook(recorder._hook(k))
               for k in recorder.taps]
    try:
        yield recorder
    finally:
        for h in handles:
            h.remove()


def capture(model, input_ids: "torch.Tensor", taps: Sequence[int], attention_mask: "torch.Tensor | None" = None,
            reduction: str = "mean"):
    """Run the target once; return (taps [B, T, n_taps, W], final normed hidden [B, T, H]).

    Taps come from `tap_hooks` (hooks on the tapped modules only), reduced by `reduction` for multi-stream
    targets. The final normed hidden state is what the frozen LM head maps to logits, so target
    distributions can be recomputed later without storing logits.
    """
    import torch

    from deepspec.targets.adapters import adapter_for

    with tap_hooks(model, taps, reduction) as recorder, torch.no_grad():
        out = adapter_for(model.config).get_decoder(model)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    return recorder.stacked(out.last_hidden_state.device), out.last_hidden_state
