"""Schema of the `model` section: the draft algorithm and its architecture.

One flat section for all algorithms (as DeepSpec recipes are): fields that an algorithm
does not use are ignored by it. Layer ids follow deepspec's tap convention: tap k is the
output of 0-based decoder layer k, -1 the embeddings (see deepspec/targets/taps.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from deepspec.errors import ConfigError


@dataclass
class ModelConfig:
    algorithm: str = "eagle3"  # a name in deepspec.drafts.REGISTRY: eagle3 | dflash | dspark | dflash2
    # Taps in our convention; empty = the algorithm's default for the target depth.
    target_layer_ids: list[int] = field(default_factory=list)
    num_draft_layers: int = 1
    # Multi-stream (hyper-connection) targets, e.g. DeepSeek-V4 with hc_mult = 4: a tap is [T, S, H]. `mean`: the
    # draft reads the streams' mean (width H); `concat`: their concatenation (width S*H, a wider fc). The cache stores
    # the reduced taps and records the choice; single-stream targets are unaffected by it.
    tap_reduction: Literal["mean", "concat"] = "mean"
    # Draft sizes default to the target's; override to shrink the draft.
    hidden_size: int | None = None
    intermediate_size: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    # Draft vocabulary (every algorithm): the most frequent loss-masked target ids; null = full target vocabulary.
    draft_vocab_size: int | None = None
    # EAGLE-3 / EAGLE-3.1
    ttt_length: int = 7
    step_loss_decay: float = 0.8
    fc_norm: bool = True
    norm_output: bool = True
    norm_before_fc: bool = False
    norm_before_residual: bool = False
    # Keep the draft LM head at the target's rows for the draft vocabulary instead of training it:
    # far fewer trainable weights, so small datasets (the CPU quickstart) over-fit much less.
    freeze_lm_head: bool = False
    # Training-only augmentation (EAGLE's trick against over-fitting small caches): each tap gets uniform
    # noise U(-a, a) x its per-token RMS before the draft reads it. 0 = off. Never applied at eval/serving.
    feature_noise: float = 0.0
    # EAGLE-3: weight of a smooth-L1 loss pulling the draft's final normed state towards the target's next
    # final state (EAGLE-1's feature regression; a denser signal per token for small caches). 0 = off.
    hidden_loss_weight: float = 0.0
    # EAGLE-3: temperature of the soft labels (the target's distribution on the draft vocabulary). < 1 sharpens
    # them towards the target's argmax, which is what greedy verification accepts; metrics always use T=1.
    label_temperature: float = 1.0
    # EAGLE-3: what TTT steps >= 1 read in training. `data`: the next data token (teacher forcing). `draft`: the
    # draft's own argmax of the previous step (on-policy, as speculators trains). Validation always uses `data`.
    ttt_inputs: Literal["data", "draft"] = "data"
    # EAGLE-3: start the draft decoder layer(s) as a copy of target decoder layer k (0-based; draft layer i gets
    # target layer k+i) with fc passing the deepest tap through, instead of random weights: the draft begins as
    # "the target's next layer over its deepest tap", a prior that small caches cannot teach. null = random init.
    init_from_target_layer: int | None = None
    # EAGLE-3: start the first layer's attention as a copy (induction) head instead of random weights. Needs the
    # embeddings as a tap (-1 in target_layer_ids): each row's key is its own token (that tap, passed through fc),
    # each query the row's input token, each value the row's input token, so a row attends to the earlier
    # positions that hold its token and predicts what followed there. Greedy answers of small targets loop; a
    # one-layer draft learns this copy far too slowly from a small cache (docs/algorithms.md, "Copy heads"). Training starts from it.
    init_copy_heads: bool = False
    # DFlash / DSpark
    block_size: int = 7
    num_anchors: int = 512
    mask_token_id: int | None = None
    # Which block slots predict. false: slot j>=1 (a MASK at position anchor+j) predicts token anchor+j,
    # K-1 drafts per block, as vLLM's DFlashDraftModel runs; true: slot j predicts token anchor+j+1
    # (DeepSpec/DSpark), K drafts. null = the algorithm's default (dflash false, dspark true).
    sample_from_anchor: bool | None = None
    loss_decay_gamma: float = 4.0
    # DSpark
    markov_rank: int = 256
    markov_head_type: Literal["vanilla", "gated", "rnn"] = "vanilla"
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    ce_loss_alpha: float = 0.1
    l1_loss_alpha: float = 0.9
    confidence_head_alpha: float = 1.0
    confidence_threshold: float = 0.0
    # DFlash2 (vLLM's DFlash2DraftModel): an input-conditioned causal convolution over the block's slots around each
    # layer's attention and MLP (conv_kernel_size taps; one dynamic coefficient per conv_group_size channels), and a
    # candidate selector that rescores the top selector_top_k tokens of each slot by a rank-selector_rank bilinear term
    # in the token drafted before it.
    conv_kernel_size: int = 3
    conv_group_size: int = 64
    selector_rank: int = 64
    selector_top_k: int = 8
    # Full-vocabulary softmax/TV computed in chunks of this many rows (memory bound).
    vocab_chunk_rows: int = 1024
    # Per draft layer: "full_attention" or "sliding_attention" (keys within `sliding_window` positions of
    # the query: q_pos - k_pos < window, as HF/vLLM count it); null = every layer full. Exported as the
    # draft config's layer_types / sliding_window.
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    # Recompute each draft layer in the backward instead of keeping its activations (long samples).
    activation_checkpointing: bool = False
    # Gemma-style options, for targets that need them.
    logit_softcap: float | None = None
    # EAGLE-3: q/k RMSNorms in the draft's attention. null = follow the target family (Qwen3 / Gemma 3 targets get
    # them, as vLLM's Eagle3Qwen3ForCausalLM has); false = Llama-style draft layers on any target, the only EAGLE-3
    # layout SGLang serves. DFlash / DSpark layers always have them (both engines build Qwen3-style block drafts).
    qk_norm: bool | None = None

    def validate(self) -> None:
        if self.fc_norm and self.norm_before_fc:
            raise ConfigError(
                "model.fc_norm and model.norm_before_fc are mutually exclusive (EAGLE-3.1 per-tap norms vs the legacy "
                "single norm); set one of them to false."
            )
        if self.tap_reduction not in ("mean", "concat"):
            raise ConfigError(f"model.tap_reduction must be mean or concat, got {self.tap_reduction!r}.")
        if self.block_size < 1 or self.ttt_length < 1:
            raise ConfigError("model.block_size and model.ttt_length must be >= 1.")
        if self.markov_rank < 1 and self.algorithm == "dspark":
            raise ConfigError("model.markov_rank must be >= 1 for DSpark (use model.algorithm=dflash for no Markov head).")
        if not 0.0 <= self.feature_noise < 1.0:
            raise ConfigError(f"model.feature_noise must be in [0, 1) (relative noise amplitude), got {self.feature_noise}.")
        if self.label_temperature <= 0:
            raise ConfigError(f"model.label_temperature must be > 0 (1 = the target's own distribution), got {self.label_temperature}.")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise ConfigError(f"model.draft_vocab_size={self.draft_vocab_size} must be >= 1 (or null for the full vocabulary).")
        if self.qk_norm is False and self.algorithm in ("dflash", "dspark", "dflash2"):
            raise ConfigError(
                f"model.qk_norm=false is not available for {self.algorithm}: vLLM and SGLang build its draft layers with q/k "
                "norms; leave model.qk_norm null."
            )
        if self.num_draft_layers < 1:
            raise ConfigError("model.num_draft_layers must be >= 1.")
        if self.layer_types is not None:
            bad = sorted(set(self.layer_types) - {"full_attention", "sliding_attention"})
            if bad:
                raise ConfigError(f"model.layer_types has unknown entries {bad}; use full_attention or sliding_attention.")
            if len(self.layer_types) != self.num_draft_layers:
                raise ConfigError(
                    f"model.layer_types lists {len(self.layer_types)} layers but model.num_draft_layers={self.num_draft_layers}; give one entry per draft layer."
                )
            if "sliding_attention" in self.layer_types and (self.sliding_window is None or self.sliding_window < 1):
                raise ConfigError("model.layer_types has sliding_attention layers but model.sliding_window is not a positive integer; set it.")
            short = block_window_error(self.algorithm, self.block_size, self.layer_types, self.sliding_window)
            if short:
                raise ConfigError(short)
        if self.init_from_target_layer is not None and self.init_from_target_layer < 0:
            raise ConfigError(f"model.init_from_target_layer must be a 0-based target layer index or null, got {self.init_from_target_layer}.")


def block_window_error(algorithm: str, block_size: int, layer_types: list[str] | None, sliding_window: int | None) -> str | None:
    """The sentence refusing a block draft (DFlash / DSpark) whose sliding window is shorter than its block, else None.

    Inside a block, deepspec (training and decoding) hides only keys >= window positions behind the query, while
    vLLM and SGLang run the bidirectional block with a symmetric window (|q - k| < window) that also hides block slots
    that far ahead. The rules agree exactly when window >= block_size (a block spans block_size - 1 positions), so a
    shorter window is refused rather than trained under one rule and served under another."""
    if algorithm not in ("dflash", "dspark", "dflash2") or not layer_types or "sliding_attention" not in layer_types or sliding_window is None:
        return None
    if sliding_window >= block_size:
        return None
    return (
        f"model.sliding_window={sliding_window} is shorter than model.block_size={block_size}: inference engines apply the window "
        "to block slots ahead of the query too, so this draft would not be served as trained; use sliding_window >= block_size."
    )
