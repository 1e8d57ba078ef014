"""Sliding windows inside a block draft. vLLM runs the exported bidirectional block with flash-attention's symmetric window
(w - 1, w - 1): a key is visible iff |q_pos - k_pos| <= w - 1; deepspec hides only keys >= w behind the query. The two
agree exactly when the window is at least the block (golden test below), so a shorter window is refused by the config and
by the export (config/model.py: block_window_error)."""

from __future__ import annotations

import pytest
import torch

from deepspec.config.model import ModelConfig
from deepspec.drafts import get_algorithm
from deepspec.drafts.checkpoint import target_weights
from deepspec.errors import ConfigError
from deepspec.targets import capture, tiny_target

K = 4


@pytest.mark.parametrize("algorithm", ["dflash", "dspark"])
def test_a_block_draft_window_shorter_than_its_block_is_refused(algorithm):
    kw = dict(algorithm=algorithm, block_size=K, layer_types=["sliding_attention"])
    with pytest.raises(ConfigError, match="shorter than model.block_size"):
        ModelConfig(sliding_window=K - 1, **kw).validate()
    ModelConfig(sliding_window=K, **kw).validate()
    ModelConfig(sliding_window=2048, **dict(kw, block_size=8)).validate()  # the shipped recipes' window and block
    ModelConfig(sliding_window=K - 1, **dict(kw, layer_types=["full_attention"])).validate()  # no sliding layer: no window


def test_eagle3_windows_are_not_limited_by_the_block():
    ModelConfig(algorithm="eagle3", block_size=K, layer_types=["sliding_attention"], sliding_window=2).validate()


def _engine_vs_ours(window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(our proposer's block hidden, the same block under vLLM's symmetric window rule) for a window of `window`."""
    torch.manual_seed(0)
    target, _ = tiny_target("qwen3")
    cfg = ModelConfig(algorithm="dflash", block_size=K, target_layer_ids=[0, 2, 4], mask_token_id=259,
                      num_draft_layers=2, layer_types=["sliding_attention"] * 2, sliding_window=K)
    d = get_algorithm("dflash").from_target_config(target.config, cfg)
    d.load_target_weights(*target_weights(target))
    d.eval()
    d.arch.sliding_window = window  # past validation, to show what a shorter window would do
    ids = torch.randint(0, 250, (1, 16), generator=torch.Generator().manual_seed(1))
    taps = capture(target, ids, d.taps)[0]
    anchor = 12
    prop = d.proposer()
    with torch.no_grad():
        prop.propose(ids[0, : anchor + 1], taps[0, :anchor], 0, K - 1)
        pos = torch.arange(anchor, anchor + K)[None]
        keys = torch.cat([torch.arange(anchor), pos[0]])
        engine = ((pos[0, :, None] - keys[None, :]).abs() <= window - 1)[None, None]  # flash window (w-1, w-1)
        block = torch.full((1, K), 259)
        block[0, 0] = ids[0, anchor]
        kv = d.context_kv(d.context(taps[:, :anchor]), torch.arange(anchor)[None])
        h = d.backbone(d.embed(block), pos, kv, [engine, engine])[0, 1:]
    return prop.last_hidden, h


def test_ours_equals_the_engine_rule_from_a_window_of_one_block(one_torch_thread):
    ours, engine = _engine_vs_ours(K)
    torch.testing.assert_close(ours, engine, rtol=1e-6, atol=1e-6)
    # what the refusal prevents: the engine hides the last slot from the first, which reaches the drafts in layer 2
    ours, engine = _engine_vs_ours(K - 1)
    assert not torch.allclose(ours, engine, atol=1e-4)
