"""What deepspec needs from a target family, and the registry that maps HF model types to it.

A target is four pieces: embeddings, decoder layers (whose outputs are taps), final norm + LM head,
and a tokenizer with a chat template. An adapter names where the first three live in the family's HF
module tree and how many residual streams a decoder layer carries (`hc_mult`: 1 for ordinary models,
S for hyper-connection models whose layer outputs are [B, T, S, H]). Taps are captured with forward
hooks on those modules (deepspec.targets.taps.capture), so no family needs its own forward code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from deepspec.errors import TargetError

_REGISTRY: dict[str, "TargetAdapter"] = {}
ADAPTERS_DIR = "deepspec/targets/adapters"


@dataclass(frozen=True)
class TargetAdapter:
    """Where a family keeps its pieces (attribute paths from the CausalLM) + a tiny config for tests."""

    family: str
    model_types: tuple[str, ...]
    # Builds a small random-weight HF config of this family (tests build the target in-process from it).
    tiny_config: Callable[..., Any] | None = None
    decoder: str = "model"  # the decoder stack (runs embeddings -> layers -> final norm)
    embeddings: str = "model.embed_tokens"
    layers: str = "model.layers"
    final_norm: str = "model.norm"
    lm_head: str = "lm_head"
    # Config attribute holding the number of residual streams (hyper-connections); absent = 1.
    streams_attr: str = "hc_mult"
    moe: bool = False
    notes: dict[str, str] = field(default_factory=dict)

    @staticmethod
    def _get(model: Any, path: str) -> Any:
        obj = model
        for part in path.split("."):
            obj = getattr(obj, part)
        return obj

    def get_decoder(self, model: Any) -> Any:
        return self._get(model, self.decoder)

    def get_embeddings(self, model: Any) -> Any:
        return self._get(model, self.embeddings)

    def get_layers(self, model: Any) -> Any:
        return self._get(model, self.layers)

    def get_final_norm(self, model: Any) -> Any:
        return self._get(model, self.final_norm)

    def get_lm_head(self, model: Any) -> Any:
        return self._get(model, self.lm_head)

    def hc_mult(self, config: Any) -> int:
        return int(getattr(text_config(config), self.streams_attr, None) or 1)


def text_config(config: Any) -> Any:
    """Multimodal configs nest the language model's config; taps live there."""
    return getattr(config, "text_config", None) or config


def register(adapter: TargetAdapter) -> TargetAdapter:
    for mt in adapter.model_types:
        _REGISTRY[mt] = adapter
    return adapter


def registered() -> dict[str, TargetAdapter]:
    """model_type -> adapter, for every built-in and registered family."""
    return dict(_REGISTRY)


def families() -> dict[str, TargetAdapter]:
    return {a.family: a for a in _REGISTRY.values()}


def adapter_for(config: Any) -> TargetAdapter:
    """The adapter of an HF config; an unknown model type is a TargetError saying what to implement."""
    cfg = text_config(config)
    model_type = getattr(cfg, "model_type", None) or "?"
    adapter = _REGISTRY.get(model_type)
    if adapter is None:
        arch = (getattr(config, "architectures", None) or [model_type])[0]
        raise TargetError(
            f"Target architecture {arch} (model_type '{model_type}') is not supported yet; supported model types: "
            f"{', '.join(sorted(_REGISTRY))}. To add it, write {ADAPTERS_DIR}/<family>.py registering a TargetAdapter "
            "that names its 4 pieces: the embeddings, the decoder layers (their outputs are the taps), the final norm + "
            "LM head, and a tokenizer with a chat template; then import it in "
            f"{ADAPTERS_DIR}/__init__.py and add a tiny config test (see docs/targets.md)."
        )
    return adapter
