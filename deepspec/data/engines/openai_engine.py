"""OpenAI-compatible servers (vLLM / SGLang), one or many base URLs: the scale-out path.

Each server gets at most `concurrency_per_server` requests in flight; each request goes to the
least-loaded healthy server. Connection errors, timeouts, 429 and 5xx are retried with
exponential backoff (on whichever server is least loaded then); other 4xx are permanent.
Servers are probed before starting, so a typo in a URL fails in seconds, not after hours.

A server that stops answering (connection refused or reset, timeout) is taken out of rotation at once: its
in-flight requests are retried on the others, and it is probed every few seconds until it answers again. Every job
still yields exactly one result (the caller writes each once). When no server has answered for `down_grace_s`
seconds, the stage stops with an EngineError naming the servers and their logs (a `# log: PATH` comment after a URL
in the urls file, as scripts/data/launch_vllm_servers.sh writes); finished answers are kept and a rerun continues.
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import Any

from deepspec.data.engines.base import ConversationState, Engine, Job, LengthGuard, OnResult, TurnOutput, request_seed
from deepspec.config.secrets import redact_text
from deepspec.errors import ConfigError, EngineError
from deepspec.log import get_logger

log = get_logger(__name__)

RETRY_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}
# url -> server log, from `URL  # log: PATH` lines of a urls file (read_urls fills it)
SERVER_LOGS: dict[str, str] = {}


class AllServersDown(Exception):
    """No server answered for the grace period (internal: becomes an EngineError in run())."""


def normalize_url(url: str) -> str:
    """'host:port', 'http://host:port/', '.../v1' -> 'http://host:port' (the server root)."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        url = "http://" + url
    if url.endswith("/v1"):
        url = url[:-3]
    return url


def read_urls(urls: list[str], urls_file: str | None, setting: str = "data.regenerate.urls_file") -> list[str]:
    """URLs from the config/CLI plus a file (one per line, '#' comments), deduplicated in order."""
    out = list(urls)
    if urls_file:
        p = Path(urls_file).expanduser()
        if not p.is_file():
            raise ConfigError(f"{setting} {p} does not exist; start the servers first (scripts/data/launch_vllm_servers.sh "
                              "writes such a file).")
        for ln in p.read_text().splitlines():
            url, _, comment = ln.partition("#")
            out.append(url.strip())
            if url.strip() and comment.strip().startswith("log:"):
                SERVER_LOGS[normalize_url(url)] = comment.strip()[4:].strip()
    seen, result = set(), []
    for u in out:
        if u and normalize_url(u) not in seen:
            seen.add(normalize_url(u))
            result.append(normalize_url(u))
    return result


class _Server:
    def __init__(self, base: str, capacity: int):
        self.base = base
        self.capacity = capacity
        self.inflight = 0
        self.slots = asyncio.Semaphore(capacity)
        self.failures = 0
        self.down_since: float | None = None  # set on a connection failure, cleared by the next answer
        self.last_error = ""

    @property
    def up(self) -> bool:
        return self.down_since is None


class OpenAIEngine(Engine):
    name = "openai"

    def __init__(self, urls: list[str], sampling, chat_template_kwargs: dict[str, Any], *, concurrency_per_server: int = 32,
                 timeout_s: float = 600.0, max_retries: int = 4, model: str | None = None, tokenizer=None,
                 max_model_len: int | None = None, probe_timeout_s: float = 30.0, backoff_base_s: float = 0.5,
                 down_grace_s: float = 60.0, reprobe_s: float = 2.0):
        import httpx

        if not urls:
            raise ConfigError("The openai engine needs server URLs; pass --urls http://127.0.0.1:8000 or set data.regenerate.urls / urls_file.")
        self.urls = [normalize_url(u) for u in urls]
        self.sampling = sampling
        self.chat_template_kwargs = dict(chat_template_kwargs)
        self.concurrency = concurrency_per_server
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_base_s = backoff_base_s
        self.down_grace_s = down_grace_s
        self.reprobe_s = reprobe_s
        self.tokenizer = tokenizer
        self._httpx_version = httpx.__version__
        self.model, server_len, self._server_version = self._probe(model, probe_timeout_s)
        self.guard = LengthGuard(tokenizer, max_model_len or server_len, self.chat_template_kwargs) if tokenizer else None

    # ------------------------------------------------------------------ probing

    def _probe(self, model: str | None, timeout_s: float) -> tuple[str, int | None, str]:
        """Keep the servers that answer /v1/models within `timeout_s`; learn the model name and context."""
        import time

        import httpx

        healthy, info = [], None
        deadline = time.monotonic() + timeout_s
        pending = list(self.urls)
        while pending and time.monotonic() < deadline:
            still = []
            for base in pending:
                try:
                    r = httpx.get(base + "/v1/models", timeout=5.0)
                    r.raise_for_status()
                    data = r.json()["data"]
                    healthy.append(base)
                    info = info or data
                except (httpx.HTTPError, ValueError, KeyError):
                    still.append(base)
            pending = still
            if pending and healthy:
                break  # some servers are up: do not wait for stragglers
            if pending:
                time.sleep(1.0)
        for base in pending:
            log.warning("server %s did not answer /v1/models; leaving it out", redact_text(base))
        if not healthy:
            raise EngineError(f"No OpenAI-compatible server answered at {', '.join(redact_text(u) for u in self.urls)}; start them "
                              "(scripts/data/launch_vllm_servers.sh) or fix the URLs.")
        self.urls = healthy
        names = [m.get("id") for m in info]
        if model is None or model not in names:
            if model is not None:
                log.info("model %r is not served (%s); using %r", model, names, names[0])
            model = names[0]
        entry = next(m for m in info if m.get("id") == model)
        version = ""
        try:
            version = httpx.get(healthy[0] + "/version", timeout=5.0).json().get("version", "")
        except (httpx.HTTPError, ValueError, AttributeError):
            pass
        log.info("openai engine: %d server(s), model %s, %d concurrent each", len(healthy), model, self.concurrency)
        return model, entry.get("max_model_len"), version

    @property
    def version(self) -> str:
        return f"server {self._server_version or 'unknown'}; httpx {self._httpx_version}"

    @property
    def template_hash(self) -> str:
        from deepspec.targets import template_hash

        return template_hash(self.tokenizer) if self.tokenizer is not None else ""

    # ------------------------------------------------------------------ requests

    def _body(self, messages, max_tokens: int, seed: int) -> dict[str, Any]:
        s = self.sampling
        body: dict[str, Any] = {
            "model": self.model, "messages": messages, "max_tokens": max_tokens,
            "temperature": s.temperature, "top_p": s.top_p,
        }
        if s.temperature > 0:
            body["seed"] = seed
        if s.top_k > 0:
            body["top_k"] = s.top_k
        if s.min_p > 0:
            body["min_p"] = s.min_p
        if self.chat_template_kwargs:
            body["chat_template_kwargs"] = self.chat_template_kwargs
        return body

    def _pick(self) -> _Server | None:
        up = [s for s in self.servers if s.up]
        return min(up, key=lambda s: (s.inflight / s.capacity, s.failures)) if up else None

    async def _pick_up(self) -> _Server:
        """The least-loaded server in rotation; waits while every server is down, up to the grace period."""
        while True:
            server = self._pick()
            if server is not None:
                return server
            since = min(s.down_since or time.monotonic() for s in self.servers)
            if time.monotonic() - since > self.down_grace_s:
                raise AllServersDown
            await asyncio.sleep(0.2)

    def _mark_down(self, server: _Server, error: str) -> None:
        if server.up:
            log.warning("server %s stopped answering (%s); retrying its requests on the other servers", redact_text(server.base), error)
            server.down_since = time.monotonic()
        server.last_error = error

    def _mark_up(self, server: _Server) -> None:
        if not server.up:
            log.info("server %s answers again; back in rotation", redact_text(server.base))
        server.down_since = None

    async def _watch(self, client) -> None:
        """Probe servers out of rotation every `reprobe_s` seconds; stop the run when none answered for the grace."""
        import httpx

        while True:
            await asyncio.sleep(self.reprobe_s)
            for server in self.servers:
                if server.up:
                    continue
                try:
                    r = await client.get(server.base + "/v1/models", timeout=5.0)
                    if r.status_code == 200:
                        self._mark_up(server)
                except (httpx.TransportError, httpx.TimeoutException):
                    pass
            if all(not s.up for s in self.servers):
                since = min(s.down_since or time.monotonic() for s in self.servers)
                if time.monotonic() - since > self.down_grace_s:
                    raise AllServersDown

    def _all_down_error(self) -> EngineError:
        logs = [f"{redact_text(s.base)}: {SERVER_LOGS[s.base]}" for s in self.servers if s.base in SERVER_LOGS]
        where = ("; see their logs (" + ", ".join(logs) + ")") if logs else (
            "; see the servers' logs (scripts/data/launch_vllm_servers.sh writes <log-dir>/server_<port>.log)")
        last = "; ".join(f"{redact_text(s.base)}: {s.last_error or 'no answer'}" for s in self.servers)
        return EngineError(
            f"Every regeneration server stopped answering for {self.down_grace_s:.0f} s ({last}){where}. Finished answers "
            "are saved; restart the servers and rerun the same command to continue."
        )

    async def _request(self, client, messages, max_tokens: int, seed: int) -> TurnOutput:
        import httpx

        body = self._body(messages, max_tokens, seed)
        last = ""
        for attempt in range(self.max_retries + 1):
            server = await self._pick_up()
            async with server.slots:
                server.inflight += 1
                try:
                    r = await client.post(server.base + "/v1/chat/completions", json=body, timeout=self.timeout_s)
                    self._mark_up(server)
                    if r.status_code == 200:
                        data = r.json()
                        choice = data["choices"][0]
                        usage = data.get("usage") or {}
                        server.failures = 0
                        return TurnOutput(text=choice["message"].get("content") or "", tokens=int(usage.get("completion_tokens", 0)),
                                          finish_reason=str(choice.get("finish_reason")))
                    last = f"HTTP {r.status_code} from {server.base}: {r.text[:300]}"
                    if r.status_code not in RETRY_STATUS:
                        return TurnOutput(error=last, permanent=True)
                except (httpx.TransportError, httpx.TimeoutException) as e:
                    last = f"{type(e).__name__} from {redact_text(server.base)}: {e}"
                    self._mark_down(server, f"{type(e).__name__}: {e}")
                except (ValueError, KeyError, IndexError) as e:
                    last = f"malformed response from {server.base}: {e}"
                finally:
                    server.inflight -= 1
            server.failures += 1
            if attempt < self.max_retries:
                delay = min(30.0, self.backoff_base_s * 2**attempt) * (0.5 + random.random())
                log.debug("retrying in %.1fs after %s", delay, last)
                await asyncio.sleep(delay)
        return TurnOutput(error=f"gave up after {self.max_retries + 1} attempts; last error: {last}")

    async def _conversation(self, client, job: Job):
        state = ConversationState(job)
        while state.active:
            messages = state.next_messages()
            max_tokens, err = self.guard.budget(messages, self.sampling.max_tokens) if self.guard else (self.sampling.max_tokens, None)
            if err:
                state.add(TurnOutput(error=err, permanent=True))
                break
            state.add(await self._request(client, messages, max_tokens, request_seed(self.sampling.seed, job.id, state.turn)))
        return state.result()

    async def _run(self, jobs: list[Job], on_result: OnResult) -> None:
        import httpx

        self.servers = [_Server(u, self.concurrency) for u in self.urls]
        total = self.concurrency * len(self.servers)
        queue: asyncio.Queue[Job] = asyncio.Queue()
        for j in jobs:
            queue.put_nowait(j)
        limits = httpx.Limits(max_connections=total + 8, max_keepalive_connections=total + 8)

        async def worker(client):
            while True:
                try:
                    job = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                on_result(await self._conversation(client, job))

        async with httpx.AsyncClient(limits=limits, timeout=self.timeout_s) as client:
            watch = asyncio.ensure_future(self._watch(client))
            work = asyncio.ensure_future(asyncio.gather(*(worker(client) for _ in range(min(total, len(jobs))))))
            try:
                done, _ = await asyncio.wait({watch, work}, return_when=asyncio.FIRST_COMPLETED)
                if watch in done:
                    watch.result()  # raises AllServersDown
                await work
            finally:
                for task in (watch, work):
                    task.cancel()
                await asyncio.gather(watch, work, return_exceptions=True)

    def run(self, jobs: list[Job], on_result: OnResult) -> None:
        if jobs:
            try:
                asyncio.run(self._run(jobs, on_result))
            except AllServersDown:
                raise self._all_down_error() from None
