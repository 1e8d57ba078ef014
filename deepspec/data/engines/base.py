"""One interface for every regeneration engine, plus the multi-turn bookkeeping they share.

Regeneration is on-policy: for each user turn, in order, the target answers given the history
of *its own* earlier answers (system messages kept, original assistant turns dropped). Engines
only differ in how one batch of chat requests is served; they report each finished
conversation through a callback, so the caller can persist it at once.
"""

from __future__ import annotations

import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Job:
    """One conversation to regenerate (the input record)."""

    id: str
    conversation: list[dict[str, str]]
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class JobResult:
    id: str
    conversation: list[dict[str, str]] | None
    output_tokens: int = 0
    finish_reasons: list[str] = field(default_factory=list)
    error: str | None = None
    # Permanent failures (e.g. the prompt does not fit the context) are not worth retrying.
    permanent: bool = False


@dataclass
class TurnOutput:
    """One generated assistant turn, or the reason it failed."""

    text: str = ""
    tokens: int = 0
    finish_reason: str = ""
    error: str | None = None
    permanent: bool = False


class ConversationState:
    """Walks the user turns of a conversation, building the regenerated history."""

    def __init__(self, job: Job):
        self.job = job
        self.history = [dict(m) for m in job.conversation if m["role"] == "system"][:1]
        self.user_turns = [m for m in job.conversation if m["role"] == "user"]
        self.turn = 0
        self.tokens = 0
        self.finish_reasons: list[str] = []
        self.error: str | None = None
        self.permanent = False

    @property
    def active(self) -> bool:
        return self.error is None and self.turn < len(self.user_turns)

    def next_messages(self) -> list[dict[str, str]]:
        return [*self.history, {"role": "user", "content": self.user_turns[self.turn]["content"]}]

    def add(self, out: TurnOutput) -> None:
        if out.error is not None:
            self.error = f"turn {self.turn}: {out.error}"
            self.permanent = out.permanent
            return
        self.history += [
            {"role": "user", "content": self.user_turns[self.turn]["content"]},
            {"role": "assistant", "content": out.text},
        ]
        self.tokens += out.tokens
        self.finish_reasons.append(out.finish_reason)
        self.turn += 1

    def result(self) -> JobResult:
        if self.error is not None:
            return JobResult(self.job.id, None, self.tokens, self.finish_reasons, self.error, self.permanent)
        return JobResult(self.job.id, self.history, self.tokens, self.finish_reasons)


def request_seed(base: int, job_id: str, turn: int) -> int:
    """A per-request seed that depends on (seed, id, turn) only, not on batch composition."""
    return (base * 1_000_003 + zlib.crc32(job_id.encode()) + turn * 7919) % (2**31 - 1)


class LengthGuard:
    """Counts prompt tokens with the target's chat template: rejects prompts that do not fit the
    context and clamps max_tokens, so one long prompt cannot fail a whole engine batch."""

    def __init__(self, tokenizer, max_model_len: int | None, chat_template_kwargs: dict[str, Any]):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.kwargs = dict(chat_template_kwargs)

    def prompt_tokens(self, messages: list[dict[str, str]]) -> int:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **self.kwargs)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return len(ids)

    def budget(self, messages: list[dict[str, str]], max_tokens: int) -> tuple[int, str | None]:
        """(max_tokens to request, error message if the prompt cannot be served at all)."""
        if self.tokenizer is None or not self.max_model_len:
            return max_tokens, None
        n = self.prompt_tokens(messages)
        room = self.max_model_len - n
        if room < 1:
            return 0, f"prompt too long ({n} tokens; the engine context is {self.max_model_len})"
        return min(max_tokens, room), None


OnResult = Callable[[JobResult], None]


class Engine(ABC):
    """A regeneration backend. `run` must call `on_result` exactly once per job."""

    name: str = "base"

    @property
    def version(self) -> str:
        return ""

    @property
    def template_hash(self) -> str:
        return ""

    @abstractmethod
    def run(self, jobs: list[Job], on_result: OnResult) -> None: ...

    def close(self) -> None:
        """Release the engine (processes, GPU memory)."""


class BatchEngine(Engine):
    """Engines that serve a list of chat requests at once (in-process vLLM, transformers).

    Conversations are taken `batch_size` at a time and advanced turn by turn; a chunk's results
    are reported together when its last turn is done.
    """

    batch_size: int = 64

    @abstractmethod
    def chat_batch(self, requests: list[tuple[list[dict[str, str]], int, int]]) -> list[TurnOutput]:
        """Answer [(messages, max_tokens, seed)] in order."""

    guard: LengthGuard | None = None
    max_tokens: int = 1024
    seed: int = 0

    def run(self, jobs: list[Job], on_result: OnResult) -> None:
        for start in range(0, len(jobs), self.batch_size):
            states = [ConversationState(j) for j in jobs[start : start + self.batch_size]]
            while True:
                active = [s for s in states if s.active]
                if not active:
                    break
                requests, served = [], []
                for s in active:
                    messages = s.next_messages()
                    max_tokens, err = self.guard.budget(messages, self.max_tokens) if self.guard else (self.max_tokens, None)
                    if err:
                        s.add(TurnOutput(error=err, permanent=True))
                        continue
                    requests.append((messages, max_tokens, request_seed(self.seed, s.job.id, s.turn)))
                    served.append(s)
                if requests:
                    try:
                        outs = self.chat_batch(requests)
                    except Exception as e:  # noqa: BLE001 - record the batch as failed, keep going; a rerun retries it
                        outs = [TurnOutput(error=f"engine error: {type(e).__name__}: {e}")] * len(requests)
                    for s, out in zip(served, outs):
                        s.add(out)
            for s in states:
                on_result(s.result())
