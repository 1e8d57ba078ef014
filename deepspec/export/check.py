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
  right -> tokens -> (DSpark with a confidence head) each drafted slot's confidence.

The confidence stage is what vLLM's adaptive verification and SGLang's confidence-driven verify modes rank draft slots
by: `Qwen3DSparkForCausalLM.compute_confidence` in vLLM, `Qwen3DSparkModel.compute_confidence` in SGLang (built in its
`cap-accept` verify mode: its default `static` mode skips the head) — sigmoid of the head over the slot's final-norm row
and the Markov embedding of the token before it — from the export's weights, against sigmoid(a z + b) of our head's
logit z, with the (a, b) the export declares baked (`deepspec export --calibration`; none: (1, 0)). Its tolerance is
derived, not relative: the head's Lipschitz bound (1/4 of the summed |weight| over the hidden part) times the
difference block.norm shows, plus the fp32 rounding of both sides' dot products (check_reference.confidence_tolerance).
A head whose weights lost (or gained) the declared calibration, or a head the engine does not load, diverges there.

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

The files: our side, the seeded inputs and the comparison (export/check_reference.py, shared by both engines' code);
each engine's runner in this process (export/check_vllm_runner.py, export/check_sglang_runner.py), which starts the
engine's own process (export/check_vllm.py, export/check_sglang.py); this file: the report, the verdict and the
entry points (check_export, check_exports).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from deepspec.export.check_reference import Row, compare, declared_calibration, our_side, trace_ours
from deepspec.export.check_sglang_runner import SGLANG_CLASSES, run_sglang
from deepspec.export.check_vllm_runner import VLLM_CLASSES, VLLM_PYTHON_ENV, run_vllm, vllm_here, vllm_runner, vllm_unchecked

ENGINES = ("vllm", "sglang")

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
    ("confidence", "the confidence head (confidence_head.proj, confidence_head_with_markov, enable_confidence_head) or the "
     "calibration baked into it (deepspec.confidence_calibration)", ("confidence_head", "confidence_calibration")),
]


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


# --- the export and the verdict ------------------------------------------------------------------

def _export_config(export: Path) -> dict[str, Any]:
    from deepspec.errors import CheckpointError

    path = export / "config.json"
    if not path.is_file() or not (export / "model.safetensors").is_file():
        raise CheckpointError(f"{export} is not a deepspec export (no config.json / model.safetensors); pass the folder `deepspec export` wrote.")
    cfg = json.loads(path.read_text())
    if "deepspec" not in cfg:
        raise CheckpointError(f"{export}/config.json has no `deepspec` block; `deepspec check` needs an export written by `deepspec export`.")
    return cfg


def expected_export(checkpoint: Path, fmt: str, calibration: tuple[float, float] | None = None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The config and weights `deepspec export` writes for this checkpoint (in memory, without files); `calibration`:
    the (a, b) baked into a DSpark confidence head, as `--calibration` does."""
    from deepspec.drafts.checkpoint import load_draft, read_draft_config
    from deepspec.export import writers
    from deepspec.export.sglang import BUILDERS

    meta = read_draft_config(checkpoint)["deepspec"]
    draft = load_draft(checkpoint)
    algo = meta["algorithm"]
    cfg, weights = {"eagle3": lambda: writers._eagle3(draft, meta), "dflash": lambda: writers._dflash(draft, meta),
                    "dspark": lambda: writers._dspark(draft, meta, None), "dflash2": lambda: writers._dflash2(draft, meta)}[algo]()
    if calibration is not None and "confidence_head.proj.weight" in weights:
        weights = writers.bake_confidence(weights, *calibration)
    if fmt == "sglang":
        cfg, weights = BUILDERS[algo](cfg, weights, draft, meta)
    return cfg, weights


def config_diffs(export: Path, cfg: dict[str, Any], checkpoint: Path) -> list[str]:
    """Config fields and tensors in which the export differs from what the checkpoint exports to."""
    from safetensors.torch import load_file

    try:
        want_cfg, want_w = expected_export(checkpoint, cfg["deepspec"].get("format", "vllm"), declared_calibration(cfg))
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


def _skip(engine: str, why: str) -> EngineCheck:
    return EngineCheck(engine, "skipped", why)


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
    runner: tuple[str | None, str | None, str | None] | None = None  # vLLM's: decided once, when a vLLM check is due
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
                why = vllm_unchecked(algo, ckpt)
                if why is None:
                    if runner is None:
                        runner = vllm_runner(vllm_here(), os.environ.get(VLLM_PYTHON_ENV) or None)
                    why = runner[2]
                if why:
                    report.engines.append(_skip("vllm", why))
                    continue
                draft, inputs = our_side(ckpt, cfg, ds)
                ec = EngineCheck("vllm", "pass", engine_class=VLLM_CLASSES[algo], ran=runner[1])
                report.engines.append(ec)
                conf = (declared_calibration(cfg) or (1.0, 0.0)) if algo == "dspark" else None
                pending_vllm.append((report, ec, trace_ours(draft, inputs, conf), inputs, cfg, export, ckpt))
            elif algo not in SGLANG_CLASSES:
                report.engines.append(_skip(engine, f"no {engine} check for {algo} (EAGLE-3 / 3.1, DFlash and DSpark are covered)."))
            elif find_side_dir() is None:
                report.engines.append(_skip("sglang", "SGLang's sources are not installed beside deepspec "
                                                      "(run `bash scripts/sglang_side.sh` or set DEEPSPEC_SGLANG_SIDE)."))
            else:
                draft, inputs = our_side(ckpt, cfg, ds)
                ec = EngineCheck("sglang", "pass", engine_class=SGLANG_CLASSES[algo])
                report.engines.append(ec)
                conf = (declared_calibration(cfg) or (1.0, 0.0)) if algo == "dspark" else None
                pending.append((report, ec, trace_ours(draft, inputs, conf), inputs, cfg, export, ckpt))
    for run, jobs in ((lambda j: run_sglang(find_side_dir(), j, timeout), pending), (lambda j: run_vllm(j, timeout, runner[0]), pending_vllm)):
        if jobs:
            for (report, ec, ours, _, cfg, export, ckpt), theirs in zip(jobs, run([(p[5], p[3]) for p in jobs])):
                if "skipped" in theirs:  # the engine's side found it cannot run here (e.g. vLLM built for a GPU)
                    ec.status, ec.reason = "skipped", str(theirs["skipped"])
                    continue
                _verdict(report, ec, ours, theirs, cfg, export, ckpt)
    return reports


def check_export(export: str | Path, engines: tuple[str, ...] = ENGINES, checkpoint: str | Path | None = None,
                 timeout: float = 600.0) -> CheckReport:
    """Compare the export with its checkpoint's draft in each engine's own code; see the module docstring."""
    return check_exports([export], engines, [checkpoint] if checkpoint else None, timeout)[0]
