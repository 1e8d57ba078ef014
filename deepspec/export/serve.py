"""How an export is served as trained: the number of speculative tokens and the engines' command lines.

vLLM's DFlash proposer runs 1 + num_speculative_tokens query slots (vllm/v1/spec_decode/dflash.py) and never
reads the draft's block_size, so a DFlash draft runs its training block only at S = block_size - 1; SGLang
reads block_size from the export itself. EAGLE-3 chains may run at any depth (default: the TTT depth the
draft was trained for). vLLM's DSpark reads its depth from the speculators config.
"""

from __future__ import annotations

import shlex
from typing import Any

from deepspec.errors import ConfigError

VLLM_METHODS = {"eagle3": "eagle3", "dflash": "dflash", "dspark": "dspark", "dflash2": "dflash"}  # DFlash2: vLLM's dflash method
SGLANG_ALGORITHMS = {"eagle3": "EAGLE3", "dflash": "DFLASH", "dspark": "DSPARK"}


def served_tokens(algorithm: str, model: dict[str, Any], requested: int | None = None) -> int:
    """Speculative tokens per round the engine must use for this draft (`requested` = the user's choice).

    Raises ConfigError when the choice would run a block draft on another block than it was trained on."""
    if algorithm in ("dflash", "dflash2"):
        s = int(model["block_size"]) - 1
        if requested is not None and requested != s:
            raise ConfigError(
                f"This DFlash draft was trained with block_size={model['block_size']}, so the engine must draft "
                f"{s} tokens per round (vLLM's DFlash drafts num_speculative_tokens + 1 slots and ignores block_size); "
                f"got {requested}. Drop the setting or set it to {s}."
            )
        return s
    if algorithm == "dspark":
        anchor = model.get("sample_from_anchor")
        s = int(model["block_size"]) - 1 + int(True if anchor is None else bool(anchor))  # DSpark's anchor slot predicts by default
        if requested is not None and requested != s:
            raise ConfigError(f"This DSpark draft predicts {s} tokens per block; got {requested} speculative tokens. Use {s}.")
        return s
    if requested is not None:
        return int(requested)
    return int(model.get("ttt_length") or 3)


def vllm_command(target: str, draft_dir: str, algorithm: str, s: int) -> str:
    spec = f'{{"method":"{VLLM_METHODS[algorithm]}","model":"{draft_dir}","num_speculative_tokens":{s}}}'
    return f"vllm serve {shlex.quote(target)} --speculative-config {shlex.quote(spec)}"


def sglang_command(target: str, draft_dir: str, algorithm: str, s: int) -> str:
    """SGLang verifies the anchor + s drafts per round (`--speculative-num-draft-tokens` = s + 1: DFlash's block_size,
    DSpark's gamma + 1)."""
    args = [
        "python -m sglang.launch_server", "--model-path", shlex.quote(target),
        "--speculative-algorithm", SGLANG_ALGORITHMS[algorithm], "--speculative-draft-model-path", shlex.quote(draft_dir),
    ]
    if algorithm == "eagle3":
        args += ["--speculative-num-steps", str(s), "--speculative-eagle-topk", "1"]
    args += ["--speculative-num-draft-tokens", str(s + 1)]
    return " ".join(args)
