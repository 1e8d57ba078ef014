"""DeepSeek-V4 (transformers' DeepseekV4ForCausalLM): hyper-connection residual of hc_mult = 4 streams, so a
decoder layer's output (a tap) is [B, T, 4, H]; the final state is the HyperHead's weighted sum, normed.
The real model is 43 layers of MoE (256 routed experts): capture it with vLLM's extract_hidden_states backend
under tensor / expert parallelism, or with target.device_map=auto across GPUs (docs/targets.md)."""

from __future__ import annotations

from typing import Any

from deepspec.targets.adapters.base import TargetAdapter, register
from deepspec.targets.adapters.llama import TINY_COMMON


def tiny_deepseek_v4_config(**overrides: Any):
    from transformers import DeepseekV4Config

    n = overrides.get("num_hidden_layers", 4)
    fields = {
        "vocab_size": TINY_COMMON["vocab_size"], "hidden_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": n,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32, "q_lora_rank": 32, "num_experts_per_tok": 2,
        "n_routed_experts": 4, "n_shared_experts": 1, "hc_mult": 4, "hc_sinkhorn_iters": 3, "o_groups": 2, "o_lora_rank": 16,
        "index_n_heads": 2, "index_head_dim": 16, "index_topk": 8, "sliding_window": 16, "max_position_embeddings": 1024,
        "num_nextn_predict_layers": 0, "bos_token_id": None, "eos_token_id": TINY_COMMON["eos_token_id"],
        "pad_token_id": TINY_COMMON["pad_token_id"],
    }
    return DeepseekV4Config(**{**fields, **overrides})


DEEPSEEK_V4 = register(TargetAdapter("deepseek_v4", ("deepseek_v4",), tiny_config=tiny_deepseek_v4_config, moe=True))
