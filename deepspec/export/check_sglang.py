"""SGLang's side of `deepspec check`: an export pushed through SGLang's own draft classes on CPU, with SGLang's own
attention backend (TorchNativeAttnBackend: its causal / encoder-only flags, prefix handling, GQA and windows).

Run in a subprocess by export/check_sglang_runner.py (SGLang's import chain and its torch.distributed init stay
out of the caller; the shared tables and layer hooks come from export/check_reference.py):

    python -m deepspec.export.check_sglang SIDE_DIR [JOB.json ...]   (JOB: {"export", "inputs", "out"};
                                                                       no jobs: serve job paths read from stdin)

Each job writes `out` (torch.save): {stage name: tensor} in the order SGLang computes them, or {"error": text}.
What SGLang's workers do around the model is reproduced from their source (speculative/eagle_worker*.py,
dflash_worker_v2.py): which target layers are captured (the ids in the config, + 1), the block of
[anchor, mask x (block - 1)] with the mask id the config names, the context K/V written with the model's own
kv_proj_only / apply_k_norm / apply_k_rope, the hot-token map from d2t. Only the KV pool is ours: a plain
per-layer tensor store with SGLang's set/get interface (the pool holds storage, no semantics).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import traceback
import types
from pathlib import Path

import torch

from deepspec.export.check_reference import engine_layer_streams, target_tables


class _Pool:
    """Per-layer K/V storage with the interface SGLang's attention backends call (set_kv_buffer / get_*_buffer)."""

    def __init__(self, size: int):
        self.size = size
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def set_kv_buffer(self, layer, loc, k, v, *args, **kwargs):
        lid = layer.layer_id
        if lid not in self.k:
            self.k[lid] = torch.zeros(self.size, *k.shape[1:], dtype=k.dtype)
            self.v[lid] = torch.zeros(self.size, *v.shape[1:], dtype=v.dtype)
        idx = loc.loc if hasattr(loc, "loc") else loc
        self.k[lid][idx] = k.reshape(len(idx), *self.k[lid].shape[1:])
        self.v[lid][idx] = v.reshape(len(idx), *self.v[lid].shape[1:])

    def get_key_buffer(self, lid):
        return self.k[lid]

    def get_value_buffer(self, lid):
        return self.v[lid]


class _Runner:
    """SGLang's attention backend over one request whose KV slots are 0..n-1 (req_to_token row 0)."""

    def __init__(self, size: int):
        from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
        from sglang.srt.model_executor.forward_context import ForwardContext

        self.pool = _Pool(size)
        req_to_token = types.SimpleNamespace(req_to_token=torch.arange(size, dtype=torch.int64)[None])
        runner = types.SimpleNamespace(device="cpu", req_to_token_pool=req_to_token, token_to_kv_pool=self.pool)
        self.backend = TorchNativeAttnBackend(runner)
        self.ctx = ForwardContext(attn_backend=self.backend)

    def batch(self, mode: str, prefix: int, new: int, hidden=None):
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        fb = types.SimpleNamespace(
            forward_mode=ForwardMode.DECODE if mode == "decode" else ForwardMode.EXTEND,
            out_cache_loc=torch.arange(prefix, prefix + new), req_pool_indices=torch.tensor([0]),
            seq_lens=torch.tensor([prefix + new]), extend_prefix_lens=torch.tensor([prefix]),
            extend_seq_lens=torch.tensor([new]), encoder_lens=None, encoder_out_cache_loc=None,
            global_num_token_non_padded_cpu=None, mha_return_lse=False, moe_num_token_non_padded=None,
            spec_info=types.SimpleNamespace(hidden_states=hidden), mm_input_embeds=None,
            contains_mm_inputs=lambda: False,
        )
        self.backend.init_forward_metadata(fb)
        return fb

    def run(self, fn, fb):
        from sglang.srt.model_executor.forward_context import forward_context

        with forward_context(self.ctx):
            return fn(fb)


# SGLang builds a DSpark confidence head only in its confidence-driven verify modes (`static`, its default, skips the
# head's weights): an export that carries a head is checked in one of them, as a server that uses the head runs it
CONFIDENCE_VERIFY_MODE = "cap-accept"


def _build(export: Path):
    from safetensors.torch import load_file
    from sglang.srt.utils.hf_transformers_utils import get_config

    cfg = get_config(str(export), trust_remote_code=False)
    arch = cfg.architectures[0]
    module = {"LlamaForCausalLMEagle3": "llama_eagle3", "DFlashDraftModel": "dflash", "Qwen3DSparkModel": "dspark"}.get(arch)
    if module is None:
        raise ValueError(f"no SGLang check for architecture {arch}")
    weights = load_file(str(export / "model.safetensors"))
    mode = CONFIDENCE_VERIFY_MODE if any(k.startswith("confidence_head.") for k in weights) else None
    saved = os.environ.get("SGLANG_RAGGED_VERIFY_MODE")
    if mode:
        os.environ["SGLANG_RAGGED_VERIFY_MODE"] = mode
    try:
        model = getattr(importlib.import_module(f"sglang.srt.models.{module}"), arch)(cfg).float().eval()
        model.load_weights(list(weights.items()))
    finally:
        if mode:
            if saved is None:
                os.environ.pop("SGLANG_RAGGED_VERIFY_MODE", None)
            else:
                os.environ["SGLANG_RAGGED_VERIFY_MODE"] = saved
    return cfg, model


def _gather(states: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """SGLang's targets capture `id + 1` (set_eagle3_layers_to_capture / set_dflash_layers_to_capture): HF index id + 1."""
    return states[:, [i + 1 for i in ids]].flatten(-2)


def trace_eagle3(export: Path, inp: dict) -> dict[str, torch.Tensor]:
    cfg, model = _build(export)
    ids, states = inp["input_ids"], inp["states"]
    embed, _ = target_tables(*inp["tables"].tolist())
    m = ids.numel() - 1
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(embed)  # shared with the target by SGLang's EAGLE worker
        hot = model.get_hot_token_id()
        head = model.lm_head.weight[: int(getattr(cfg, "draft_vocab_size", None) or cfg.vocab_size)]  # SGLang pads its head
        to_target = (lambda d: hot.long()[d]) if hot is not None else (lambda d: d)
        layer_ids = (getattr(cfg, "eagle_config", None) or {}).get("eagle_aux_hidden_state_layer_ids")
        if layer_ids is None:
            raise ValueError("config.json has no eagle_config.eagle_aux_hidden_state_layer_ids: SGLang would capture its default layers")
        taps = _gather(states, layer_ids)
        out["step1.taps"] = taps
        fc_out: list = []
        hooks = [model.model.fc.register_forward_hook(lambda mod, a, r: fc_out.append(r))]
        streams: list = []
        hooks += engine_layer_streams(model.model.layers, streams)
        run = _Runner(m + 4)
        step_ids, pos = ids[1:], torch.arange(m)
        fb = run.batch("extend", 0, m, taps)
        normed, aux = run.run(lambda fb: model.model(step_ids, pos, fb, input_embeds=embed[step_ids]), fb)
        out["step1.fc"] = fc_out[0]
        for i, s in enumerate(streams):
            out[f"step1.layer{i}"] = s
        logits = normed @ head.T
        out["step1.norm"], out["step1.logits"] = normed, logits
        out["step1.tokens"] = to_target(logits.argmax(-1))
        out["step1.next_hidden"] = aux[0]
        # chain step 2: the last row's token and hidden, one decode query over the step-1 cache
        tok = out["step1.tokens"][-1:]
        streams.clear()
        fb = run.batch("decode", m, 1, aux[0][-1:])
        normed2, aux2 = run.run(lambda fb: model.model(tok, torch.tensor([m]), fb, input_embeds=embed[tok]), fb)
        out["step2.input_token"] = tok
        for i, s in enumerate(streams):
            out[f"step2.layer{i}"] = s
        logits2 = normed2 @ head.T
        out["step2.norm"], out["step2.logits"] = normed2, logits2
        out["step2.tokens"] = to_target(logits2.argmax(-1))
        for h in hooks:
            h.remove()
    return out


def trace_dflash(export: Path, inp: dict) -> dict[str, torch.Tensor]:
    """One block as SGLang's DFlash worker runs it (dflash_worker_v2) or, for DSpark, its DSpark worker
    (dspark_components/dspark_draft.py): the block is gamma slots when the anchor slot predicts (sample_from_anchor),
    else gamma + 1; the sampled rows go through the target head and, left to right, the Markov head's bias for the
    token drafted before (greedy, as its _draft_step: base + step_bias, argmax)."""
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    cfg, model = _build(export)
    ids, states = inp["input_ids"], inp["states"]
    embed, head = target_tables(*inp["tables"].tolist())
    m = ids.numel() - 1
    dcfg = getattr(cfg, "dflash_config", None) or {}
    block = int(dcfg.get("block_size") or getattr(cfg, "block_size", 16))
    dspark = hasattr(model, "markov_head")
    from_anchor = dspark and bool(model.sample_from_anchor)
    if dspark and not from_anchor:
        block += 1  # DSpark's block_size is gamma, the drafted tokens; the bonus slot comes on top
    mask_id = dcfg.get("mask_token_id")
    if mask_id is None:
        raise ValueError("config.json has no dflash_config.mask_token_id")
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        taps = _gather(states, dcfg["target_layer_ids"])
        out["block.taps"] = taps
        fc_out: list = []
        hooks = [model.fc.register_forward_hook(lambda mod, a, r: fc_out.append(r))]
        ctx = model.project_target_hidden(taps)
        out["block.fc"], out["block.context"] = fc_out[0], ctx
        run = _Runner(m + block + 2)
        ctx_pos, loc = torch.arange(m), torch.arange(m)
        if dspark:  # the DSpark model writes its own context K/V (its fused GPU kernel, else per layer as below)
            model.write_target_hidden_kv(target_hidden=ctx, pool=run.pool, positions=ctx_pos, cache_loc=loc,
                                         target_hidden_is_projected=True)
        for layer in [] if dspark else model.layers:  # as dflash_worker_v2._append_target_hidden_sequential
            attn = layer.self_attn
            k, v = attn.kv_proj_only(model.prepare_context_hidden_for_kv(layer, ctx))
            k = attn.apply_k_rope(ctx_pos, attn.apply_k_norm(k))
            run.pool.set_kv_buffer(attn.attn, KVWriteLoc(loc), k.view(-1, attn.num_kv_heads, attn.head_dim),
                                   v.view(-1, attn.num_kv_heads, attn.head_dim))
        block_ids = torch.full((block,), int(mask_id), dtype=torch.long)
        block_ids[0] = ids[-1]
        out["block.input_ids"] = block_ids
        streams: list = []
        hooks += engine_layer_streams(model.layers, streams)
        fb = run.batch("extend", m, block)
        res = run.run(lambda fb: model(block_ids, torch.arange(m, m + block), fb, input_embeds=embed[block_ids]), fb)
        for i, s in enumerate(streams):
            out[f"block.layer{i}"] = s
        h = res.hidden_states
        out["block.norm"] = h
        rows = h if from_anchor else h[1:]
        logits = rows @ head.T  # SGLang scores the predicted slots with the target's LM head
        out["block.logits"] = logits
        if dspark:
            prev, state, steps, toks = block_ids[:1], model.markov_head.init_state(rows[None]), [], []
            for i in range(rows.shape[0]):
                bias, state = model.markov_head.step_bias(prev, hidden_states=rows[i : i + 1], state=state)
                steps.append(logits[i] + bias[0])
                prev = steps[-1].argmax(-1, keepdim=True)
                toks.append(prev[0])
            out["block.markov_logits"] = torch.stack(steps)
            out["block.tokens"] = torch.stack(toks)
            if getattr(model, "confidence_head", None) is not None:  # as its verify modes rank the drafted slots
                conf, _ = model.compute_confidence(anchor_tokens=block_ids[:1], draft_tokens=out["block.tokens"][None],
                                                   confidence_features=rows[None])
                out["block.confidence"] = conf[0]
        else:
            out["block.tokens"] = logits.argmax(-1)
        for hk in hooks:
            hk.remove()
    return out


def unavailable(e: ImportError) -> str:
    """Why SGLang's code cannot run here at all: a module it imports is missing. Not a verdict on the export (the
    caller skips the check, as it does where vLLM is not installed)."""
    return (f"SGLang's code does not import in this environment ({type(e).__name__}: {e}). The side folder holds "
            "SGLang's sources and borrows its other dependencies from this environment, where vLLM's requirements "
            "provide them: install the missing package to check against SGLang.")


def run_job(path: str, missing: str | None = None) -> None:
    """One job; `missing`: SGLang did not import (every job is then skipped with that reason)."""
    job = json.loads(Path(path).read_text())
    export = Path(job["export"])
    if missing is not None:
        torch.save({"skipped": missing}, job["out"])
        return
    try:
        inp = torch.load(job["inputs"], weights_only=True)
        arch = json.loads((export / "config.json").read_text())["architectures"][0]
        fn = trace_eagle3 if arch == "LlamaForCausalLMEagle3" else trace_dflash
        res = fn(export, inp)
    except ImportError as e:  # the draft class's module imports something this environment lacks
        res = {"skipped": unavailable(e)}
    except Exception as e:  # noqa: BLE001 - the caller reports SGLang's failure as the divergence
        res = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    torch.save(res, job["out"])


def main(side: str, jobs: list[str]) -> None:
    """Run the job files given; with no job files, serve: one job path per stdin line, `DONE path` per job on stdout
    (SGLang's import takes ~20 s on 2 cores: one process serves every check of its parent)."""
    from deepspec.export.sglang_side import import_sglang

    missing = None
    try:
        import_sglang(side)
    except ImportError as e:
        missing = unavailable(e)
    for path in jobs:
        run_job(path, missing)
    if not jobs:
        print("READY", flush=True)
        for line in sys.stdin:
            if line.strip():
                run_job(line.strip(), missing)
                print(f"DONE {line.strip()}", flush=True)


if __name__ == "__main__":
    from deepspec.exiting import exit_process

    main(sys.argv[1], sys.argv[2:])
    exit_process(0)
