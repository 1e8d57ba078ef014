"""What the GPU check measures, checked on a CPU: the FLOP counter on every attention kernel op (grouped-query
attention included, on meta tensors, so the CUDA kernels' ops are counted without a GPU) and on whole drafts; the
profile summary a row reports; building drafts under any torch.device context; bench_cache's fp8 error; and
`benchmarks/gpu_check.sh --smoke` end to end, with the files it writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from deepspec.train.flops import FlopCounter, attention_flops, count_flops
from script_loader import load_script

ROOT = Path(__file__).resolve().parents[1]
aten = torch.ops.aten


def _bench(name: str):
    return load_script(f"benchmarks/{name}.py")


# ----------------------------------------------------------------------------- the attention formula


def test_attention_formula_by_hand_and_equal_to_torch_without_gqa():
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    # a lone GQA call: 4 * B * Hq * Lq * Lk * D forward, 10 * B * Hq * Lq * Lk * D backward (per query head)
    assert attention_flops((2, 8, 32, 16), (2, 2, 48, 16), (2, 2, 48, 16)) == 4 * 2 * 8 * 32 * 48 * 16
    assert attention_flops((2, 8, 32, 16), (2, 2, 48, 16), (2, 2, 48, 16), backward=True) == 10 * 2 * 8 * 32 * 48 * 16
    for q, k, v in [((1, 4, 7, 8), (1, 4, 9, 8), (1, 4, 9, 8)), ((3, 2, 5, 16), (3, 2, 5, 16), (3, 2, 5, 32))]:
        assert attention_flops(q, k, v) == sdpa_flop_count(q, k, v)
        assert attention_flops(q, k, v, backward=True) == sdpa_backward_flop_count(q[:3] + v[3:], q, k, v)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        attention_flops((1, 6, 4, 8), (1, 4, 4, 8), (1, 4, 4, 8))
    with pytest.raises(ValueError, match="do not fit"):
        attention_flops((1, 4, 4, 8), (1, 2, 4, 8), (1, 2, 5, 8))


def _meta(*shape):
    return torch.empty(*shape, device="meta", dtype=torch.bfloat16)


def _kernel_calls(q, k, v, g):
    """Every SDPA kernel op and its backward, as CUDA / CPU dispatch them, called directly (meta tensors: shapes only)."""
    lq, lk = q.shape[2], k.shape[2]

    def flash():
        o = aten._scaled_dot_product_flash_attention(q, k, v)
        aten._scaled_dot_product_flash_attention_backward(g, q, k, v, o[0], o[1], o[2], o[3], o[4], o[5], 0.0, False, o[6], o[7])

    def efficient():
        o = aten._scaled_dot_product_efficient_attention(q, k, v, None, True)
        aten._scaled_dot_product_efficient_attention_backward(g, q, k, v, None, o[0], o[1], o[2], o[3], 0.0, [True] * 3 + [False])

    def cudnn():
        o = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True)
        aten._scaled_dot_product_cudnn_attention_backward(g, q, k, v, o[0], o[1], o[6], o[7], None, o[2], o[3], o[4], o[5], 0.0, False)

    def cpu_flash():
        o = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)
        aten._scaled_dot_product_flash_attention_for_cpu_backward(g, q, k, v, o[0], o[1], 0.0, False)

    def low_flash():  # the flash kernel's own op: [B, L, H, D]
        qt, kt, vt, gt = (x.transpose(1, 2) for x in (q, k, v, g))
        o = aten._flash_attention_forward(qt, kt, vt, None, None, lq, lk, 0.0, False, False)
        aten._flash_attention_backward(gt, qt, kt, vt, o[0], o[1], None, None, lq, lk, 0.0, False, o[2], o[3])

    def low_efficient():
        qt, kt, vt, gt = (x.transpose(1, 2) for x in (q, k, v, g))
        o = aten._efficient_attention_forward(qt, kt, vt, None, None, None, lq, lk, 0.0, 0, True)
        aten._efficient_attention_backward(gt, qt, kt, vt, None, o[0], None, None, lq, lk, o[1], 0.0, o[2], o[3], 0, False)

    return {"flash": flash, "efficient": efficient, "cudnn": cudnn, "cpu_flash": cpu_flash, "low_flash": low_flash,
            "low_efficient": low_efficient}


@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
def test_every_sdpa_kernel_op_and_its_backward_is_counted(heads):
    """Each kernel op (CUDA's flash / efficient / cuDNN, the CPU flash kernel, the low-level flash / efficient ops)
    counts forward + backward = 3.5x the forward formula, GQA included; where torch's registry counts the op (the
    SDPA-level CUDA ops without GQA on torch <= 2.11, with it on later ones) the totals are equal."""
    from torch.utils.flop_counter import FlopCounterMode

    hq, hkv = heads
    q, k, v, g = _meta(2, hq, 32, 16), _meta(2, hkv, 48, 16), _meta(2, hkv, 48, 16), _meta(2, hq, 32, 16)
    fwd = attention_flops(q.shape, k.shape, v.shape)
    assert fwd == 4 * 2 * hq * 32 * 48 * 16
    for name, call in _kernel_calls(q, k, v, g).items():
        with FlopCounter() as c:
            call()
        assert not c.count.uncounted, name
        assert c.count.total == 3.5 * fwd, name
        assert c.count.by_dtype["bf16"] == c.count.total, name  # bf16 inputs: counted against the bf16 peak
        if name in ("flash", "efficient", "cudnn"):
            try:
                with FlopCounterMode(display=False) as theirs:
                    call()
            except AssertionError:  # torch's formula refuses GQA (torch <= 2.11): the case this counter exists for
                assert hq != hkv
                continue
            assert theirs.get_total_flops() == c.count.total, name


class _SdpaSpy:
    """Records the shapes of every F.scaled_dot_product_attention call and the CPU kernel chosen for it."""

    def __init__(self):
        from torch.overrides import TorchFunctionMode

        calls = self.calls = []

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if func is F.scaled_dot_product_attention:
                    q, k, v = args[:3]
                    choice = int(torch._fused_sdp_choice(q, k, v, kwargs.get("attn_mask"), kwargs.get("dropout_p", 0.0),
                                                         kwargs.get("is_causal", False), scale=kwargs.get("scale"),
                                                         enable_gqa=kwargs.get("enable_gqa", False)))
                    calls.append((tuple(q.shape), tuple(k.shape), tuple(v.shape), choice))
                return func(*args, **kwargs)

        self.mode = Mode()


def _tiny_draft_step(algorithm: str, **fields):
    from deepspec.config.model import ModelConfig
    from deepspec.drafts import DraftBatch, get_algorithm
    from deepspec.targets import tiny_config

    torch.manual_seed(0)
    tc = tiny_config("qwen3", num_attention_heads=4, num_key_value_heads=2)
    cfg = ModelConfig(algorithm=algorithm, target_layer_ids=[0, 2, 4], **fields)
    draft = get_algorithm(algorithm).from_target_config(tc, cfg)
    v, h = tc.vocab_size, tc.hidden_size
    draft.load_target_weights(torch.randn(v, h) * 0.02, torch.randn(v, h) * 0.02)
    if algorithm == "eagle3":
        draft.set_token_frequencies(torch.arange(v).float())
    draft.train()
    t = 48
    ids = torch.randint(0, v, (1, t))
    lm = torch.ones(1, t, dtype=torch.bool)
    lm[:, :8] = False
    batch = DraftBatch(ids, lm, torch.ones(1, t, dtype=torch.bool), torch.randn(1, t, 3, h), torch.randn(1, t, h))

    def step():
        loss, _ = draft.loss(batch)
        loss.backward()

    return draft, step


@pytest.mark.parametrize("algorithm,fields", [
    ("eagle3", dict(ttt_length=3, draft_vocab_size=128)),
    ("dflash", dict(block_size=4, num_anchors=6, mask_token_id=300, num_draft_layers=2)),
], ids=["eagle3", "dflash"])
def test_gqa_draft_step_counts_every_attention_call(algorithm, fields, one_torch_thread):
    """A GQA draft (4 query heads, 2 key / value heads): a positive count whose attention part equals the formula
    summed over the attention calls the step made (SDPA's and the flash kernel's EAGLE-3's chain makes itself; each
    forward and backward), and whose other ops equal torch's own
    FlopCounterMode (which leaves CPU attention uncounted). (Under torch <= 2.11 this is the count that raised in
    torch's registry on CUDA for EAGLE-3.)"""
    from torch.utils.flop_counter import FlopCounterMode

    import deepspec.drafts.attention as attention

    draft, step = _tiny_draft_step(algorithm, **fields)
    spy = _SdpaSpy()
    real = attention._causal_lse

    def chain_call(q, k, v, scale, forward, buckets):  # EAGLE-3's later TTT steps call the flash kernel itself
        out = real(q, k, v, scale, forward, buckets)
        pad = out[3].shape[2]
        spy.calls.append(tuple(tuple(x.shape[:2]) + (x.shape[2] + pad, x.shape[3]) for x in (q, k, v)) + (1,))
        return out

    attention._causal_lse = chain_call
    try:
        with spy.mode:
            count = count_flops(step)
    finally:
        attention._causal_lse = real
    draft.zero_grad(set_to_none=True)
    assert count.total > 0 and not count.uncounted
    assert spy.calls and all(c[3] == 1 for c in spy.calls)  # CPU flash kernel: counted as attention, not as bmm
    assert draft.arch.num_key_value_heads < draft.arch.num_attention_heads
    if algorithm == "eagle3":  # its calls pass the grouped heads as they are (DFlash folds them into the query axis)
        assert any(q[1] > k[1] for q, k, _, _ in spy.calls)
    expected = sum(3.5 * attention_flops(q, k, v) for q, k, v, _ in spy.calls)
    attention = sum(n for op, n in count.by_op.items() if "attention" in op)
    assert attention == expected
    with FlopCounterMode(display=False) as theirs:
        step()
    assert theirs.get_total_flops() == count.total - attention


def test_a_product_with_an_output_dtype_counts_at_its_factors_precision():
    """Liger's fused loss (EAGLE-3's on CUDA) accumulates its weight gradient with `addmm(acc, a, b,
    out_dtype=float32, out=acc)`: the `.dtype_out` overload passes the dtype positionally, and torch's formula took it
    for `out_shape` ("addmm_flop() got multiple values for argument 'out_shape'": the H200 row's MFU was null). It
    counts 2*M*K*N like a plain addmm, as bf16 work (its factors), though the accumulator is fp32. Run on the meta
    device: the CPU has no kernel for these overloads."""
    acc = torch.zeros(8, 4, device="meta")
    a = torch.empty(8, 16, dtype=torch.bfloat16, device="meta")
    b = torch.empty(16, 4, dtype=torch.bfloat16, device="meta")
    try:
        torch.addmm(acc, a, b, out_dtype=torch.float32)
    except (RuntimeError, TypeError, NotImplementedError) as e:  # torch 2.11's meta decomposition of it is broken
        pytest.skip(f"this torch cannot run addmm(out_dtype=...) on meta tensors: {e}")
    count = count_flops(lambda: torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc))
    assert count.by_op == {"addmm": 2 * 8 * 16 * 4}
    assert count.by_dtype == {"bf16": 2 * 8 * 16 * 4, "fp32": 0.0}
    x = torch.empty(3, 8, 16, dtype=torch.bfloat16, device="meta")
    y = torch.empty(3, 16, 4, dtype=torch.bfloat16, device="meta")
    assert count_flops(lambda: torch.bmm(x, y, out_dtype=torch.float32)).by_op == {"bmm": 2 * 3 * 8 * 16 * 4}
    plain = count_flops(lambda: torch.addmm(acc, a.float(), b.float()))  # an fp32 product stays fp32
    assert plain.by_dtype == {"bf16": 0.0, "fp32": 2 * 8 * 16 * 4}




# ----------------------------------------------------------------------------- a row's profiled step


def test_profile_summary_counts_busy_time_once_and_names_launches_and_syncs():
    bench = _bench("bench_train")
    events = [  # (name, on the device, start us, end us, enclosing host op)
        ("aten::linear", False, 0, 300, None), ("aten::addmm", False, 10, 290, "aten::linear"),
        ("cudaLaunchKernel", False, 20, 30, "aten::addmm"), ("cuLaunchKernelEx", False, 40, 45, "aten::addmm"),
        ("MmBackward0", False, 400, 500, None), ("aten::mm", False, 410, 490, "MmBackward0"),
        ("cudaStreamSynchronize", False, 600, 700, None),
        ("gemm_kernel", True, 100, 300, None), ("copy_kernel", True, 250, 400, None),  # overlapping streams: 300 us
        ("Memcpy DtoH", True, 800, 900, None),
    ]
    s = bench.summarize_profile(events, wall_s=0.001, traced_device=True)
    assert s["gpu_busy_ms"] == 0.4 and s["gpu_busy_share"] == 0.4 and s["step_wall_ms"] == 1.0
    assert s["launches"] == 2 and s["host_syncs"] == 1 and s["device_ops"] == 3
    assert s["aten_ops"] == 2  # aten::linear and aten::mm (under autograd's node); aten::addmm is inside aten::linear
    cpu = bench.summarize_profile(events, wall_s=0.001, traced_device=False)
    assert cpu["aten_ops"] == 2 and cpu["gpu_busy_share"] is None and cpu["launches"] is None


def test_profile_events_leave_out_annotations_on_the_device_timeline():
    """torch.profiler mirrors a user annotation (an optimizer step's range) on the device timeline: a span with the
    gaps between its kernels, not work; counted, it would fill the idle time the summary exists to show."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    bench = _bench("bench_train")

    def event(name, device, start, end, annotation=False, parent=None):
        return SimpleNamespace(name=name, device_type=device, is_user_annotation=annotation, cpu_parent=parent,
                               time_range=SimpleNamespace(start=start, end=end))

    step = event("Optimizer.step#Muon.step", DeviceType.CPU, 0, 1000)
    prof = SimpleNamespace(events=lambda: [
        step, event("aten::mm", DeviceType.CPU, 10, 20, parent=step),
        event("Optimizer.step#Muon.step", DeviceType.CUDA, 0, 1000, annotation=True),
        event("gemm", DeviceType.CUDA, 100, 200), event("gemm", DeviceType.CUDA, 800, 900),
    ])
    events = bench.profile_events(prof)
    assert [(n, d) for n, d, *_ in events] == [("Optimizer.step#Muon.step", False), ("aten::mm", False), ("gemm", True), ("gemm", True)]
    assert events[1][4] == "Optimizer.step#Muon.step"
    assert bench.summarize_profile(events, wall_s=0.001, traced_device=True)["gpu_busy_ms"] == 0.2


def test_check_rows_report_failures_and_timeouts_and_go_on(tmp_path):
    procs = _bench("_procs")
    rows, log = tmp_path / "rows.jsonl", tmp_path / "log.txt"
    py = sys.executable
    ok = procs.run_row("fine", [py, "-c", "print('hello')"], 30, rows, log)
    bad = procs.run_row("broken", [py, "-c", "raise ValueError('no such shape')"], 30, rows, log)
    slow = procs.run_row("hangs", [py, "-c", "import time; print('started', flush=True); time.sleep(60)"], 2, rows, log, min_s=1, grace_s=1)
    late = procs.run_row("late", [py, "-c", "print(1)"], 5, rows, log)  # under min_s: not run
    assert ok["status"] == "ok" and bad["status"] == "error" and slow["status"] == "timeout" and late["status"] == "skipped"
    assert "ValueError: no such shape" in bad["error"] and slow["wall_s"] < 20
    lines = [json.loads(x) for x in rows.read_text().splitlines()]
    assert [x["row"] for x in lines] == ["fine", "broken", "hangs", "late"]
    text = log.read_text()
    assert "hello" in text and "started" in text and "late" not in text


# ----------------------------------------------------------------------------- bench_cache's fp8 error


def test_bench_cache_error_widens_float8_before_comparing():
    bench = _bench("bench_cache")
    exact = torch.randn(16, 3, 8).to(torch.bfloat16)
    approx = exact.to(torch.float8_e4m3fn)
    with pytest.raises(RuntimeError):  # what the benchmark did: torch does not promote float8
        (approx - exact).norm()
    err = bench.relative_error(approx, exact)
    assert 0 < err < 0.1
    assert bench.relative_error(exact, exact) == 0.0


# ----------------------------------------------------------------------------- the whole check, on a CPU


@pytest.mark.slow
def test_gpu_check_smoke_writes_every_row(tmp_path):
    """`bash benchmarks/gpu_check.sh OUT --smoke`: every row in order with its status line, the measured rows as
    JSON lines (tokens/s, FLOPs, the profiled step), the profile tables, the recipe's measured memory, at most 8
    files."""
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=sys.executable, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", DEEPSPEC_NO_PROGRESS="1")
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), str(out), "--smoke"], capture_output=True,
                          text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and {"rows.jsonl", "log.txt"} <= set(files), files
    rows = [json.loads(x) for x in (out / "rows.jsonl").read_text().splitlines()]
    status = {r["row"]: r for r in rows if r.get("benchmark") == "gpu_check" and "status" in r}
    assert list(status) == ["env", "tests", "ours", "liger-off", "sentinel", "cache", "peer", "v4-memory", "long", "flex",
                            "eager", "mixed-sdpa", "mixed-flex", "recipe-batch", "recipe-sdpa", "summary"]
    assert rows[-1]["row"] == "summary"
    for name in ("env", "tests", "ours", "sentinel", "cache", "v4-memory", "long", "mixed-sdpa", "recipe-batch"):
        assert status[name]["status"] == "ok", (name, status[name], (out / "log.txt").read_text()[-3000:])
    assert status["peer"]["status"] in ("ok", "skipped")
    assert all(status[name]["status"] == "skipped" for name in ("liger-off", "flex", "eager", "mixed-flex", "recipe-sdpa"))
    assert rows[0]["row"] == "env" and "torch" in rows[0] and rows[0]["liger"].startswith("not installed"), rows[0]
    log = (out / "log.txt").read_text()
    assert "collected" in log and "test_on_cuda_the_chain_merged_through_the_flash_lse" in log  # the merge's CUDA test
    assert not any("eagle3_chain_fallback" in r for r in rows)  # collected, not failed: the rows keep the default path
    train = [r for r in rows if r.get("benchmark") == "train" and "algorithm" in r]
    by: dict = {}  # the first row of each key: `ours` comes before the peer row (EAGLE-3 again, where .peer-venv exists)
    for r in train:
        if r.get("length_spread") is None and r.get("micro_batch") == 1:
            by.setdefault((r["algorithm"], r["reader"], r["seq_len"]), r)
    # the smoke checks the rows' code: they train in bench_train's own process (a measurement gives each its own)
    assert train and all(r["row_process"] == "shared (--smoke)" for r in train), [r.get("row_process") for r in train]
    packed = [r for r in train if r.get("micro_batch") == 2]  # recipe-batch: DFlash, then DSpark
    assert [r["algorithm"] for r in packed] == ["dflash", "dspark"], packed
    assert all("error" not in r and r["accum"] == 2 and r["tokens_per_s"] > 0 for r in packed), packed
    assert all(r["attention"] == "sdpa" for r in packed)  # the default (auto) on a CPU: what a user's run trains
    for key in [("eagle3", "memory", 64), ("dflash", "memory", 64), ("dspark", "memory", 64), ("dflash", "disk", 64)]:
        r = by[key]
        assert "error" not in r, r
        # the smoke trains in the recipe's bf16_if_native: bf16 FLOPs on a CPU with native bf16, fp32 ones without it
        assert r["tokens_per_s"] > 0 and r["flops_per_token"] + r["fp32_flops_per_token"] > 0
        assert r["accum"] == 2 and r["measured_steps"] == 1
        phases = r["phase_s"]  # the row's start-up, its FLOP count (counted in the smoke) and the compiling first step
        assert phases["start_to_draft_built"] > 0 and phases["flop_count"] > 0 and phases["first_step"] > 0, phases
        assert r["profiled_step"] == 1 and r["profile"]["aten_ops"] > 0 and r["profile"]["step_wall_ms"] > 0
        assert f"profile_{key[0]}_{key[1]}_{key[2]}.txt" in files
    assert by[("eagle3", "memory", 64)]["eagle3_chain"] == "flash log-sum-exp"  # the CPU kernel returns it
    sentinel = [r for r in train if r.get("eagle3_chain", "").startswith("sentinel")]  # the sentinel row: the A/B
    assert len(sentinel) == 1 and sentinel[0]["eagle3_chain"] == "sentinel call (DEEPSPEC_CHAIN_SENTINEL=1)", sentinel
    assert "error" not in sentinel[0] and sentinel[0]["tokens_per_s"] > 0, sentinel
    mixed = [r for r in train if r.get("length_spread") == 24]
    assert len(mixed) == 1 and "error" not in mixed[0] and mixed[0]["steady_tokens_per_s"] > 0, mixed
    long = by[("eagle3", "memory", 512)]
    assert long["tokens_per_s"] > 0 and long["activation_checkpointing"] and "profile" not in long
    memory = next(r for r in rows if r.get("benchmark") == "draft_memory")
    assert memory["measured_on"] == "cpu" and memory["measured_peak_gb"] > 0 and memory["state"]["trainable_params"] > 1e9


def test_a_failed_flash_merge_test_sends_the_later_rows_to_the_sentinel_call(tmp_path):
    """The tests row's JUnit report read as gpu_check.sh reads it: a failure or an error of the chain merge's CUDA test
    (one of its parameters is enough) appends a note naming it and exits 0 (the script then exports
    DEEPSPEC_CHAIN_SENTINEL=1); a pass, a skip, another test's failure, or no report and no earlier note exit 1. A
    later call without a report (its --rows leave out `tests`) keeps an earlier call's fallback from rows.jsonl; one
    whose own report passes does not."""
    script = ROOT / "benchmarks" / "_sentinel_fallback.py"
    test = "test_on_cuda_the_chain_merged_through_the_flash_lse_equals_the_reference"

    def report(**cases: str) -> Path:  # name -> "", "failure", "error" or "skipped"
        body = "".join(f'<testcase classname="tests.test_attention" name="{n}">' + (f'<{kind} message="x"/>' if kind else "")
                       + "</testcase>" for n, kind in cases.items())
        path = tmp_path / f"report{len(list(tmp_path.glob('report*')))}.xml"
        path.write_text(f'<?xml version="1.0"?><testsuites><testsuite name="pytest">{body}</testsuite></testsuites>')
        return path

    def verdict(xml: Path, keep: bool = False) -> tuple[int, list[dict]]:
        rows = tmp_path / "rows.jsonl"
        if not keep:
            rows.write_text("")
        proc = subprocess.run([sys.executable, str(script), str(xml), str(rows)], capture_output=True, text=True, timeout=60)
        return proc.returncode, [json.loads(x) for x in rows.read_text().splitlines()]

    code, notes = verdict(report(**{f"{test}[64]": "", f"{test}[128]": "failure", "test_other": ""}))
    assert code == 0 and notes[0]["eagle3_chain_fallback"] == [f"{test}[128]"] and "DEEPSPEC_CHAIN_SENTINEL=1" in notes[0]["note"]
    assert verdict(report(**{f"{test}[64]": "error"}))[0] == 0
    for cases in ({f"{test}[64]": "", f"{test}[128]": ""}, {f"{test}[64]": "skipped"}, {"test_other_cuda": "failure"}):
        assert verdict(report(**cases)) == (1, []), cases
    assert verdict(tmp_path / "missing.xml") == (1, [])
    # a rerun of some rows into the same folder: no report of its own, the earlier note holds (and is not written twice)
    verdict(report(**{f"{test}[64]": "failure"}))
    code, notes = verdict(tmp_path / "missing.xml", keep=True)
    assert code == 0 and len(notes) == 1 and notes[0]["eagle3_chain_fallback"] == [f"{test}[64]"]
    assert verdict(report(**{f"{test}[64]": ""}), keep=True)[0] == 1  # this call's own passing report wins


def _wheel(folder: Path, dist: str, module: str, version: str, files: dict[str, str] | None = None) -> Path:
    """A real (tiny) pure-Python wheel that pip installs: `module` with an empty __init__, and `files` (path: text)."""
    import zipfile

    info = f"{dist.replace('-', '_')}-{version}.dist-info"
    files = {f"{module}/__init__.py": "", **(files or {}),
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"])
    path = folder / f"{dist.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return path


@pytest.mark.slow
def test_gpu_check_runs_only_the_rows_named_and_refuses_an_unknown_one(tmp_path):
    """`--rows env,peer`: those rows run, every other row writes a "not selected" line in the usual order (so a rerun
    of the rows a GPU run missed leaves a complete rows.jsonl); a misspelt row is refused before anything runs. With
    --peer-wheels, Liger-Kernel's wheel from the folder is installed for our rows (the env row sees it; on a CPU the
    loss does not use it) and kept out of the peer's; a peer that does not run fails its row (its point is the
    side-by-side figure) with the reason, instead of passing with our figure alone.

    The peer's interpreter is the GPU machine's, which has no deepspec: a stand-in `deepspec` in the peer's wheels
    (first on its path) refuses to import, as the missing package did on that machine's image when bench_train's
    peer-data writer imported deepspec, so the peer gets as far as its trainer (a stand-in that stops there)."""
    out, wheels = tmp_path / "out", tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "liger-kernel", "liger_kernel", "0.0.1")
    _wheel(wheels, "speculators", "speculators", "0.0.1", {"speculators/train/__init__.py": "",
                                                           "speculators/train/trainer.py": ""})
    _wheel(wheels, "not-deepspec", "deepspec", "0.0.1",
           {"deepspec/__init__.py": "raise ImportError('the peer interpreter has no deepspec')\n"})
    shim = tmp_path / "peer_shim.py"  # the peer's trainer on a CPU (benchmarks/bench_train.py PEER_CPU_SHIM)
    shim.write_text("import sys, speculators.train.trainer\nsys.exit('stand-in peer trainer: reached, trains nothing')\n")
    env = dict(os.environ, PYTHON=sys.executable, DEEPSPEC_NO_PROGRESS="1", PEER_CPU_SHIM=str(shim))
    script = str(ROOT / "benchmarks" / "gpu_check.sh")
    proc = subprocess.run(["bash", script, str(out), "--smoke", "--rows", "env,peer", "--peer-wheels", str(wheels)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(x) for x in (out / "rows.jsonl").read_text().splitlines()]
    status = {r["row"]: r for r in rows if r.get("benchmark") == "gpu_check" and "status" in r}
    assert list(status) == ["env", "tests", "ours", "liger-off", "sentinel", "cache", "peer-install", "peer", "v4-memory",
                            "long", "flex", "eager", "mixed-sdpa", "mixed-flex", "recipe-batch", "recipe-sdpa", "summary"]
    assert status["env"]["status"] == "ok" and status["peer-install"]["status"] == "ok"
    assert rows[0]["row"] == "env" and rows[0]["liger"] == "0.0.1 (not used by EAGLE-3's loss)", rows[0]
    install = next(ln for ln in (out / "log.txt").read_text().splitlines() if ln.startswith("===== peer-install"))
    assert "speculators-0.0.1" in install and "liger_kernel" not in install, install
    peer = status["peer"]
    assert peer["status"] == "error" and "--require-peer" in peer["error"], peer
    ours = next(r for r in rows if r.get("benchmark") == "train" and r.get("algorithm") == "eagle3")
    # the peer's data was written by its own interpreter and its trainer ran: what stopped it is the stand-in
    assert ours["tokens_per_s"] > 0 and "stand-in peer trainer: reached" in ours["peer_note"], ours
    assert "writing the peer's data" not in ours["peer_note"], ours
    for name in ("tests", "ours", "sentinel", "cache", "v4-memory", "long"):
        assert status[name]["status"] == "skipped" and "not selected" in status[name]["why"], status[name]
    # a rerun of one row into the same folder (as on a warm GPU machine) appends; its summary is that run's alone
    again = subprocess.run(["bash", script, str(out), "--smoke", "--rows", "env"], capture_output=True, text=True, env=env,
                           timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    lines = [json.loads(x) for x in (out / "rows.jsonl").read_text().splitlines()]
    assert len(lines) > len(rows) and lines[: len(rows)] == rows
    summary = lines[-1]["status"]
    assert "summary" not in summary and summary["env"] == "ok" and summary["peer"] == "skipped", summary
    bad = subprocess.run(["bash", script, str(tmp_path / "bad"), "--smoke", "--rows", "env,ourz"], capture_output=True,
                         text=True, env=env, timeout=60)
    assert bad.returncode == 2 and "unknown row 'ourz'" in bad.stderr and not (tmp_path / "bad").exists()


def test_the_peer_rates_are_measured_as_ours_are():
    """The peer's rates from its console (records wrapped over lines): its first step left out, the mean and the median
    step - so the H200 row's ours-over-peer can be read on medians too (ours' first timed step recompiles its loss
    region once: 0.47 s against 0.18 s, which moved its mean below the peer's)."""
    bench = _bench("bench_train")
    log = "".join(f"step {i} | profile/step_ms={ms}\n  | profile/tokens_per_s=\n{4096 / ms * 1000}\n"
                  for i, ms in enumerate([900.0, 200.0, 200.0, 400.0]))
    log = log.replace("=\n", "=")  # as its console prints them: key=value, records split across lines
    steps = bench._peer_steps(log)
    assert [round(t) for t, _ in steps] == [4096] * 4 and [ms for _, ms in steps] == [900.0, 200.0, 200.0, 400.0]
    rates = bench._peer_rates(steps)
    assert rates["peer_measured_steps"] == 3 and rates["peer_step_s"] == [0.2, 0.2, 0.4]
    assert rates["peer_tokens_per_s"] == pytest.approx(3 * 4096 / 0.8, abs=0.1)
    assert rates["peer_steady_tokens_per_s"] == pytest.approx(4096 / 0.2, abs=0.1)


def test_the_peer_interpreter_may_be_a_name_on_path(monkeypatch, tmp_path):
    """gpu_check.sh passes the machine's interpreter by name (`python3`): bench_train finds it on PATH (an H200 run
    reported "no peer venv at ." for it and ran without the peer); a name that is nowhere says so."""
    bench = _bench("bench_train")
    exe = Path(sys.executable)
    monkeypatch.setenv("PATH", f"{exe.parent}{os.pathsep}{os.environ.get('PATH', '')}")
    found = bench.peer_interpreter(exe.name, tmp_path / "venv")
    assert found.is_absolute() and found.is_file() and found.parent == exe.parent, found
    assert bench.peer_interpreter(None, tmp_path / "venv") == tmp_path / "venv" / "bin" / "python"
    assert bench.peer_interpreter(str(exe), tmp_path) == exe
    why = bench.peer_available(Path("no-such-python-3.99"), explicit=True)
    assert "--peer-python no-such-python-3.99 is not an interpreter" in why, why
    assert "no peer venv" in bench.peer_available(tmp_path / "venv" / "bin" / "python")


@pytest.mark.slow
def test_a_row_past_its_time_says_how_far_it_got(tmp_path):
    """A check's row runner tells bench_train when it will be killed (BENCH_TIME_LIMIT_S, benchmarks/_procs.py): its
    row's process stops in time for bench_train to write the row, whose error names the phases and the optimizer
    steps it finished (two H200 rows ran out of time with no line at all). The row's process keeps the caller's
    PYTHONPATH after the repository (an H200 run's EAGLE-3 rows lost the Liger-Kernel gpu_check.sh put there)."""
    import re
    import time

    # a stand-in Liger-Kernel on PYTHONPATH (gpu_check.sh installs the real one there): the row's process must see it
    fake = tmp_path / "site" / "liger_kernel" / "ops"
    fake.mkdir(parents=True)
    (fake.parent / "__init__.py").write_text("")
    (fake / "__init__.py").write_text("")
    (fake / "fused_linear_kl_div.py").write_text("def fused_linear_kl_div_forward(*args):\n    raise NotImplementedError\n")
    env = dict(os.environ, BENCH_TIME_LIMIT_S="35", DEEPSPEC_NO_PROGRESS="1", HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(x for x in [os.environ.get("PYTHONPATH", ""), str(tmp_path / "site")] if x))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_train.py"), "--shape", "tiny", "--seq-len", "64",
                           "--accum", "1", "--steps", "100000", "--algorithms", "dflash", "--no-peer", "--no-profile",
                           "--workdir", str(tmp_path)], capture_output=True, text=True, env=env, timeout=120)
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = json.loads(proc.stdout.splitlines()[0])
    err = row["error"]
    assert row["tokens_per_s"] is None and err.startswith("GroupTimeout") and wall < 35, (wall, err)
    assert "process started" in err and "draft built" in err and "training" in err, err
    assert "Liger-Kernel importable" in err, err  # the caller's PYTHONPATH reached the row's process
    first = re.search(r"optimizer step 1/100000 done in ([0-9.]+) s", err)
    last = re.findall(r"optimizer step (\d+)/100000", err)
    assert first and len(last) >= 2 and int(last[-1]) > 2, err


def test_the_rehearsal_refuses_an_interpreter_that_is_not_the_gpu_machines_python(tmp_path):
    """benchmarks/gpu_rehearsal.sh builds its venv from Python 3.12 (the GPU image's): anything else is refused with a
    sentence naming PYTHON312 before a venv or a download is made. (The rehearsal itself needs ~3.6 GB of wheels: it
    runs by hand before a GPU session, not here.)"""
    script = str(ROOT / "benchmarks" / "gpu_rehearsal.sh")
    venv = tmp_path / "venv"
    env = dict(os.environ, GPU_IMAGE_VENV=str(venv), PYTHON312=sys.executable if sys.version_info[:2] != (3, 12) else "/nonexistent")
    proc = subprocess.run(["bash", script, str(tmp_path / "out")], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 2 and "is not a working Python 3.12" in proc.stderr and "PYTHON312" in proc.stderr, proc.stderr
    assert not venv.exists() and not (tmp_path / "out").exists()
    usage = subprocess.run(["bash", script], capture_output=True, text=True, env=env, timeout=60)
    assert usage.returncode == 2 and "usage:" in usage.stderr


def test_the_target_stub_appears_whole_or_not_at_all(monkeypatch, tmp_path):
    """gpu_check keeps the training rows' target stub across its runs on a machine; a row killed while writing it must
    not leave a folder that the next row takes for a whole stub (bench_train writes beside it, then renames)."""
    import safetensors.torch as st

    bench = _bench("bench_train")
    stub = tmp_path / "stubs" / "target-tiny"
    real = st.save_file

    def killed(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"half a file")
        raise KeyboardInterrupt("killed while writing")

    monkeypatch.setattr(st, "save_file", killed)
    with pytest.raises(KeyboardInterrupt):
        bench.write_verifier_stub(stub, "tiny")
    assert not stub.exists()
    # as if another row's process had been killed there: a leftover of a process that has ended goes, one of a
    # running process (a row writing its stub right now) stays
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (left,) = stub.parent.glob("target-tiny.part-*")
    left.rename(stub.parent / f"target-tiny.part-{dead.stdout.strip()}")
    running = stub.parent / f"target-tiny.part-{os.getppid()}"
    running.mkdir()
    monkeypatch.setattr(st, "save_file", real)
    assert bench.write_verifier_stub(stub, "tiny") == stub
    weights = st.load_file(str(stub / "model.safetensors"))
    assert weights["model.embed_tokens.weight"].dtype == torch.bfloat16 and (stub / "config.json").is_file()
    assert sorted(p.name for p in stub.parent.iterdir()) == sorted(["target-tiny", running.name])  # leftovers cleared
