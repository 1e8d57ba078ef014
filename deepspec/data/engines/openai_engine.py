"""OpenAI-compatible servers (vLLM / SGLang), one or many base URLs: the scale-out path.

Each server gets at most `concurrency_per_server` requests in flight; each request goes to the
least-loaded healthy server. Connection errors, timeouts, 429 and 5xx are retried with
exponential backoff (on whichever server is least loaded then); other 4xx are permanent.
Servers are probed before starting, so a typo in a URL fails in seconds, not after hours.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

from deepspec.data.engines.base import ConversationState, Engine, Job, LengthGuard, OnResult, TurnOutput, request_seed
from deepspec.errors import ConfigError, EngineError
from deepspec.log import get_logger

log = get_logger(__name__)

RETRY_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}


def normalize_url(url: str) -> str:
    """'host:port', 'http://host:port/', '.../v1' -> 'http://host:port' (the server root)."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        url = "http://" + url
    if url.endswith("/v1"):
        url = url[:-3]
    return url


def read_urls(urls: list[str], urls_file: str | None) -> list[str]:
    """URLs from the config/CLI plus a file (one per line, '#' comments), deduplicated in order."""
    out = list(urls)
    if urls_file:
        p = Path(urls_file).expanduser()
        if not p.is_file():
            raise ConfigError(f"data.regenerate.urls_file {p} does not exist; start servers with scripts/data/launch_vllm_servers.sh.")
        out += [ln.split("#")[0].strip() for ln in p.read_text().splitlines()]
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


class OpenAIEngine(Engine):
    name = "openai"

    def __init__(self, urls: list[str], sampling, chat_template_kwargs: dict[str, Any], *, concurrency_per_server: int = 32,
                 timeout_s: float = 600.0, max_retries: int = 4, model: str | None = None, tokenizer=None,
                 max_model_len: int | None = None, probe_timeout_s: float = 30.0, backoff_base_s: float = 0.5):
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
            log.warning("server %s did not answer /v1/models; leaving it out", base)
        if not healthy:
            raise EngineError(f"No OpenAI-compatible server answered at {', '.join(self.urls)}; start them (scripts/data/launch_vllm_servers.sh) or fix the URLs.")
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

    def _pick(self) -> _Server:
        return min(self.servers, key=lambda s: (s.inflight / s.capacity, s.failures))

    async def _request(self, client, messages, max_tokens: int, seed: int) -> TurnOutput:
        import httpx

        body = self._body(messages, max_tokens, seed)
        last = ""
        for attempt in range(self.max_retries + 1):
            server = self._pick()
            async with server.slots:
                server.inflight += 1
                try:
                    r = await client.post(server.base + "/v1/chat/completions", json=body, timeout=self.timeout_s)
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
                    last = f"{type(e).__name__} from {server.base}: {e}"
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
            await asyncio.gather(*(worker(client) for _ in range(min(total, len(jobs)))))

    def run(self, jobs: list[Job], on_result: OnResult) -> None:
        if jobs:
            asyncio.run(self._run(jobs, on_result))
