"""The capture audit: are the cached hidden states the target's own, tap by tap, before anything trains on them?

Why: the costliest failure of the field is a draft that trains well on wrong features and collapses when served —
all-zero states from a hybrid target, a tap shifted by one layer, garbage from a broken capture. Training cannot
see it (the loss falls on any consistent features), so the cache is audited once, right after it is built
(`cache.audit`), or on demand (`deepspec data cache CONFIG --audit`), and training refuses a cache whose audit failed.

What is checked, per tap (and the final normed state), on a few records (`cache.audit_records`, spread over the cache):
  * non-finite values, and rows that are all zero or constant (a real hidden state never is);
  * the median per-token norm against the target's own at that layer (a factor of `NORM_FACTOR` either way fails);
  * for `cache.audit_recompute` of those records, agreement with the target's `output_hidden_states` recomputed in
    transformers for the same tokens: tap k is `hidden_states[k + 1]` (deepspec/targets/taps.py), and it must be the
    layer that matches best — a tap that matches another layer clearly better is reported as shifted.
The report is `audit.json` beside the manifest; a failure is one sentence naming the tap and the record.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from deepspec.data.cache import format as fmt
from deepspec.errors import CacheError
from deepspec.log import get_logger

log = get_logger(__name__)

REPORT = "audit.json"
# Median per-token relative error against the recomputed layer that still passes: bf16 or fp8 storage (fp8 e4m3 rounds
# to 3 mantissa bits), a bf16 target on a GPU against another kernel's forward, vLLM against transformers.
MAX_REL_ERROR = 0.15
# A tap that another layer matches this many times better is shifted (unless it matches its own within NOISE).
SHIFT_RATIO = 0.5
NOISE = 0.01
# A tap whose median token norm is this factor away from the target's own at that layer fails.
NORM_FACTOR = 2.0


def _median_norm(x) -> float:
    return float(x.float().norm(dim=-1).median()) if x.numel() else 0.0


def _rel_error(x, ref) -> float:
    """Median over tokens of |x_t - ref_t| / |ref_t| (a median, so an attention-sink token does not decide it)."""
    import torch

    num = (x.float() - ref.float()).norm(dim=-1)
    den = ref.float().norm(dim=-1).clamp_min(1e-6)
    return float(torch.median(num / den))


def _rows_stats(x) -> dict[str, int]:
    """Counts over the rows [T, W] of one tap: non-finite values, all-zero rows, constant rows (zero ones included)."""
    import torch

    finite = torch.isfinite(x)
    xf = torch.where(finite, x, torch.zeros((), dtype=x.dtype))
    return {"nonfinite": int((~finite).sum()), "zero_rows": int((xf == 0).all(dim=-1).sum()),
            "constant_rows": int((x.amax(dim=-1) == x.amin(dim=-1)).sum()), "rows": int(x.shape[0])}


def pick_records(n: int, records: int, recompute: int) -> tuple[list[int], list[int]]:
    """`records` indices spread evenly over [0, n) (the first included), and the first `recompute` of them."""
    chosen = sorted({int(i) for i in np.linspace(0, n - 1, num=min(records, n))}) if n and records > 0 else []
    return chosen, chosen[: max(0, recompute)]


def _reference(model, input_ids, streams: int, reduction: str):
    """The target's hidden states for one record, as the cache stores them: (per hidden_states index [T, W], final [T, H])."""
    import torch

    from deepspec.targets.adapters import adapter_for
    from deepspec.targets.taps import reduce_streams

    device = next(model.parameters()).device
    with torch.no_grad():
        out = adapter_for(model.config).get_decoder(model)(input_ids=input_ids[None].to(device), output_hidden_states=True,
                                                          use_cache=False)
    states = []
    for h in out.hidden_states:
        h = h[0].float().cpu()
        if streams > 1 and h.dim() == 2:  # embeddings: the same vector enters every stream
            h = h.unsqueeze(1).expand(h.shape[0], streams, h.shape[-1])
        states.append(reduce_streams(h, reduction) if h.dim() == 3 else h)
    return states, out.last_hidden_state[0].float().cpu()


def load_reference_model(cfg=None, manifest: dict[str, Any] | None = None, device: str | None = None):
    """The target as plain transformers loads it (weights only: no tokenizer), where the cache build would run it."""
    import os

    from transformers import AutoModelForCausalLM

    from deepspec.targets.load import resolve_dtype, resolve_target_path

    manifest = manifest or {}
    if device is None:
        import torch

        device = os.environ.get("DEEPSPEC_CACHE_DEVICE") or (
            f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if torch.cuda.is_available() else "cpu")
    tcfg = getattr(cfg, "target", None)
    name = tcfg.name if tcfg is not None else manifest.get("target")
    if not name:
        raise CacheError("The cache's manifest names no target, so its capture cannot be audited; pass the recipe instead of the folder.")
    revision = tcfg.revision if tcfg is not None else manifest.get("target_revision")
    dtype = resolve_dtype(tcfg.dtype if tcfg is not None else manifest.get("target_dtype", "auto"), device)
    trust = bool(getattr(tcfg, "trust_remote_code", False))
    device_map = getattr(tcfg, "device_map", None)
    kwargs: dict[str, Any] = {"dtype": dtype, "revision": revision, "trust_remote_code": trust}
    if device_map is not None:
        kwargs["device_map"] = device_map
    model = AutoModelForCausalLM.from_pretrained(resolve_target_path(name), **kwargs)
    if device_map is None:
        model.to(device)
    return model.eval().requires_grad_(False)


def _tap_name(k: int) -> str:
    return "final" if k is None else ("tap -1 (the embeddings)" if k < 0 else f"tap {k} (the output of decoder layer {k})")


def audit_cache(directory: str | Path, *, model=None, cfg=None, records: int = 16, recompute: int = 2,
                save: bool = True) -> dict[str, Any]:
    """Audit a finished cache; returns the report (also written to `<directory>/audit.json` when `save`).

    `model`: the target already loaded (transformers); otherwise it is loaded from `cfg` (or the manifest) when
    `recompute` > 0. The report's `ok` is False with `failures` (one sentence each) when a check fails."""
    from deepspec.data.cache.reader import CacheDataset, widen

    t0 = time.perf_counter()
    directory = Path(directory)
    ds = CacheDataset(directory)
    taps = list(ds.taps)
    keys: list[int | None] = [*taps, None]
    chosen, again = pick_records(len(ds), records, recompute)
    stats = {k: {"nonfinite": 0, "zero_rows": 0, "constant_rows": 0, "rows": 0} for k in keys}
    norms: dict[Any, list] = {k: [] for k in keys}
    failures: list[str] = []

    def fail(k, i: int, what: str) -> None:
        failures.append(f"{_tap_name(k)} of sample {ds.sample_id(i)!r} {what}")

    items = {}
    for i in chosen:
        item = widen(ds[i])
        items[i] = item
        for j, k in enumerate(keys):
            x = item["taps"][:, j] if k is not None else item["final_hidden"]
            st = _rows_stats(x)
            for name, v in st.items():
                stats[k][name] += v
            if st["nonfinite"]:
                fail(k, i, f"holds {st['nonfinite']} non-finite value(s)")
            elif st["zero_rows"]:
                fail(k, i, f"has {st['zero_rows']} of {st['rows']} token rows all zero")
            elif st["constant_rows"]:
                fail(k, i, f"has {st['constant_rows']} of {st['rows']} token rows constant")
            norms[k].append(x.float().norm(dim=-1))
    import torch

    median = {k: (float(torch.cat(v).median()) if v else 0.0) for k, v in norms.items()}
    agreement: dict[Any, dict[str, Any]] = {}
    target_norms: list[float] = []
    target_final_norm = None
    load_s = 0.0
    if again:
        if model is None:
            t1 = time.perf_counter()
            model = load_reference_model(cfg, ds.manifest)
            load_s = time.perf_counter() - t1
        reduction = ds.tap_reduction if ds.hc_mult > 1 else "mean"
        per_layer: list[list] = []
        finals = []
        errors: dict[Any, list[list[float]]] = {k: [] for k in keys}
        for i in again:
            states, final = _reference(model, items[i]["input_ids"], ds.hc_mult, reduction)
            per_layer = per_layer or [[] for _ in states]
            for h, acc in zip(states, per_layer):
                acc.append(h.norm(dim=-1))
            finals.append(final.norm(dim=-1))
            for j, k in enumerate(keys):
                x = items[i]["taps"][:, j] if k is not None else items[i]["final_hidden"]
                cands = states + [final] if k is not None else [final]
                errors[k].append([_rel_error(x, c) if c.shape == x.shape else float("inf") for c in cands])
                own = k + 1 if k is not None else 0
                err = errors[k][-1]
                e, best = err[own], int(np.argmin(err))
                if best != own and e > NOISE and err[best] < SHIFT_RATIO * e:
                    other = ("the final normed state" if best == len(states) else
                             "the embeddings" if best == 0 else f"decoder layer {best - 1}")
                    fail(k, i, f"matches {other} (error {err[best]:.1%}) better than its own layer (error {e:.1%}): "
                               "the tap is shifted — check the layer-index convention of the capture (tap k = hidden_states[k + 1])")
                elif e > MAX_REL_ERROR:
                    fail(k, i, f"differs from the target's recomputed hidden state by {e:.0%} (median per token; at most "
                               f"{MAX_REL_ERROR:.0%} passes): the capture is not the target's forward")
        target_norms = [float(torch.cat(acc).median()) for acc in per_layer]
        target_final_norm = float(torch.cat(finals).median())
        for k in keys:
            own = k + 1 if k is not None else 0
            agreement[k] = {"rel_error": float(np.median([err[own] for err in errors[k]])),
                            "best_match": int(np.argmin(np.median(np.asarray(errors[k]), axis=0))) - 1 if k is not None else None}
        for k in keys:
            ref = target_final_norm if k is None else target_norms[k + 1]
            ratio = median[k] / ref if ref > 0 else float("inf")
            if not 1 / NORM_FACTOR <= ratio <= NORM_FACTOR:
                failures.append(f"{_tap_name(k)} has a median token norm of {median[k]:.3g} over {len(chosen)} sample(s), "
                                f"{ratio:.2f}x the target's own at that layer ({ref:.3g})")
    ds.close()
    report = {
        "ok": not failures,
        "verdict": verdict(directory, failures, len(chosen), len(again)),
        "failures": failures,
        "manifest_created": ds.manifest.get("created"),
        "records": [ds.sample_id(i) for i in chosen],
        "recomputed": [ds.sample_id(i) for i in again],
        "taps": [{"tap": "final" if k is None else k, **stats[k], "median_norm": median[k],
                  "target_median_norm": (target_final_norm if k is None else target_norms[k + 1]) if again else None,
                  **agreement.get(k, {})} for k in keys],
        "target_median_norms": target_norms,
        "limits": {"max_rel_error": MAX_REL_ERROR, "shift_ratio": SHIFT_RATIO, "norm_factor": NORM_FACTOR},
        "seconds": round(time.perf_counter() - t0, 3),
        "target_load_seconds": round(load_s, 3),
    }
    if save:
        fmt.write_json_atomic(directory / REPORT, report)
    return report


def verdict(directory: Path, failures: list[str], records: int, recomputed: int) -> str:
    """One sentence: the audit passed (what it covered), or the first failure and what to do."""
    if not failures:
        return (f"capture audit ok: every tap of {records} sample(s) of {directory} is finite and non-constant, and "
                f"{recomputed} recomputed sample(s) match the target's hidden states.")
    more = f" (and {len(failures) - 1} more finding(s) in {directory / REPORT})" if len(failures) > 1 else ""
    return (f"The cache {directory} fails its capture audit: {failures[0]}{more}; the draft would train on features the "
            "served target never produces — fix the capture (model.target_layer_ids, the target's loading or backend) and "
            "rebuild with `deepspec data cache CONFIG --overwrite`.")


def require_passed(directory: str | Path) -> None:
    """Training's check: refuse a cache whose saved audit failed (one sentence naming the tap and the record). A cache
    without a report for its current manifest (built before audits, or with cache.audit off) is only warned about."""
    directory = Path(directory)
    path = directory / REPORT
    manifest = fmt.load_manifest(directory)
    report = None
    if path.is_file():
        try:
            report = json.loads(path.read_text())
        except json.JSONDecodeError:
            report = None
    if report is None or report.get("manifest_created") != manifest.get("created"):
        log.warning("cache %s has no capture audit for this build; run `deepspec data cache CONFIG --audit` to check that its "
                    "hidden states are the target's own", directory)
        return
    if not report.get("ok", False):
        raise CacheError(report.get("verdict") or f"The cache {directory} failed its capture audit ({path}).")


def audit_after_build(cfg, directory: str | Path, session=None) -> dict[str, Any] | None:
    """The writer's last step (`cache.audit`): audit the cache just built, save the report, log its verdict and raise
    CacheError when it failed. `session` (writer.CaptureSession) keeps the loaded target for the build's next split."""
    if not cfg.cache.audit:
        return None
    t0 = time.perf_counter()
    model = getattr(session, "audit_model", None)
    if model is None and cfg.cache.audit_recompute > 0:
        model = load_reference_model(cfg)
        if session is not None:
            session.audit_model = model
    load_s = time.perf_counter() - t0
    report = audit_cache(directory, model=model, cfg=cfg, records=cfg.cache.audit_records, recompute=cfg.cache.audit_recompute,
                         save=False)
    report["target_load_seconds"] = round(load_s, 3)
    report["seconds"] = round(report["seconds"] + load_s, 3)
    fmt.write_json_atomic(Path(directory) / REPORT, report)
    if not report["ok"]:
        raise CacheError(report["verdict"])
    log.info("%s (%.2f s)", report["verdict"], report["seconds"])
    return report
