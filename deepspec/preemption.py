"""Preemption: SIGTERM / SIGUSR1 end training at a step boundary with a checkpoint, so a rerun loses no step.

Schedulers ask a job to stop before they kill it: Slurm sends SIGTERM on preemption (and the signal of
`#SBATCH --signal=USR1@120` two minutes before the time limit), Kubernetes sends SIGTERM and waits
`terminationGracePeriodSeconds`. A worker that receives either signal only sets a flag; after the current optimizer
step the workers agree on it (one all-reduce of a one-element CPU tensor per step, over gloo, so it never waits on
the GPU), every rank writes the checkpoint of that step, rank 0 logs one line, and the process exits with status
128 + the signal's number (143 for SIGTERM, 138 for SIGUSR1): the job did not finish, so a scheduler's or a
Kubernetes Job's restart policy restarts it, and the same command resumes from exactly that step.

The torchrun wrapper (`python -m deepspec.train.launcher`, what scripts/train/train.sh runs) forwards both signals to
the workers and waits `DEEPSPEC_PREEMPT_GRACE_S` seconds (default 120) for them before torchrun's SIGKILL.

A rank of a streamed run may wait for its data (the spool, up to cache.stream_timeout_s) where no step boundary comes:
its reader polls `pending()` and gives up with `WaitPreempted`. The other ranks may hold their data and be about to
enter the step's collectives, where they would wait for this rank for good; so for such datasets every micro-batch's
fetch is followed by one vote (`WaitVote`), taken before any of the step's collectives: all ranks learn together that
one of them stopped waiting, and the loop writes the checkpoint of its last finished step as at a step boundary.
A rank whose data came waits in that vote for as long as the other may wait for its own (`VOTE_MARGIN_S` more): the
vote's group outlasts the dataset's timeout, so the rank that waits ends with its own sentence (which sample, which
producers) and never the others first on the group's timeout (gloo's default, 30 minutes, under a longer
cache.stream_timeout_s).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Callable

from deepspec.log import get_logger

log = get_logger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
GRACE_ENV = "DEEPSPEC_PREEMPT_GRACE_S"
DEFAULT_GRACE_S = 120
# how much longer than a dataset's own wait (its `timeout_s`) a rank holding its data waits in the vote for the others:
# the waiting rank's own timeout comes first even where its wait began up to a step's compute after the others voted
VOTE_MARGIN_S = 600.0


def grace_seconds() -> int:
    """Seconds a launcher waits for preempted workers to checkpoint and exit before it kills them."""
    try:
        return max(1, int(float(os.environ.get(GRACE_ENV, DEFAULT_GRACE_S))))
    except ValueError:
        return DEFAULT_GRACE_S


class Preempted(SystemExit):
    """Raised after the preemption checkpoint is written (or, in data stages, at the signal): the process exits with
    128 + the signal's number unless someone catches it."""

    def __init__(self, signum: int, step: int = 0):
        super().__init__(128 + signum)
        self.signum, self.step = signum, step


class WaitPreempted(Exception):
    """A data read gave up waiting because training is being preempted (raised in the loader, and again by `WaitVote`
    on every rank once the ranks agreed: the loop then checkpoints its last finished step and exits)."""


_PENDING = threading.Event()  # set by the signal handler (main thread), read by loader threads that wait for data


def pending() -> bool:
    """True once this process was asked to stop (a signal, or the ranks' agreement): a reader waiting for data that
    has not come should give up (raise WaitPreempted) instead of waiting out its timeout."""
    return _PENDING.is_set()


class PreemptionWatch:
    """Turns SIGTERM / SIGUSR1 into a flag that every rank reads at the same step.

    Handlers are installed in the main thread only (Python delivers signals there) and restored by `close()`.
    """

    def __init__(self, is_main: bool = True):
        self.is_main = is_main
        self.signum = 0
        self.received_at = 0.0
        self._previous: dict[int, object] = {}
        _PENDING.clear()  # a new run in this process (tests): an earlier run's stop does not carry over
        import torch.distributed as dist

        self._group = None
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        if dist.is_initialized() and dist.get_world_size() > 1:
            # the flag travels over gloo on the host: agreeing on it never synchronises with a GPU stream
            self._group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
            self._multi = True
        else:
            self._multi = False

    def _handle(self, signum: int, frame) -> None:
        if not self.signum:
            self.signum, self.received_at = signum, time.monotonic()
        _PENDING.set()

    def requested(self) -> bool:
        """True on every rank once any rank received a signal (collective when there are several ranks)."""
        if not self._multi:
            return bool(self.signum)
        agreed = self._vote(self.signum)
        # A signal whose handler ran during the all-reduce (Python runs it as the call returns) is not in `agreed`:
        # keep it for the next step's vote rather than overwrite it with 0, and answer what every rank agreed on.
        if agreed:
            self.signum = agreed
            _PENDING.set()  # a reader prefetching ahead on a rank the signal missed stops waiting: the loader can close
        return bool(agreed)

    def _vote(self, signum: int) -> int:
        """The largest `signum` over the ranks (one all-reduce; this rank's value alone when it is the only one)."""
        if not self._multi:
            return signum
        import torch
        import torch.distributed as dist

        flag = torch.tensor([signum], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return int(flag.item())

    def wait_vote(self, batches, dataset):
        """`batches` with a vote after each fetch when `dataset` may wait for its data (`dataset.waits`: the spool of
        a streamed run), else `batches` unchanged: no collective added where no read can stall."""
        if not getattr(dataset, "waits", False):
            return batches
        if self._multi:  # collective: every rank wraps its loader here, at the same point
            self._group = _vote_group(getattr(dataset, "timeout_s", None))
        return WaitVote(batches, self)

    def stop(self, step: int, save: Callable[[], object]) -> None:
        """Write the checkpoint of `step` (every rank; `save` is a no-op when it exists), log one line, raise Preempted."""
        t0 = time.monotonic()
        save()
        if self.is_main:
            name = signal.Signals(self.signum).name
            log.warning(
                "%s received: stopped after step %d with checkpoint step_%d (written in %.1f s, %.1f s after the signal); "
                "rerun the same command to resume from it (exit status %d)",
                name, step, step, time.monotonic() - t0, time.monotonic() - (self.received_at or t0), 128 + self.signum,
            )
        raise Preempted(self.signum, step)

    def close(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)  # type: ignore[arg-type]
        self._previous = {}


def _vote_group(wait_s: float | None):
    """A gloo group for the votes of a run whose reads wait up to `wait_s` seconds: its timeout is that wait plus
    VOTE_MARGIN_S, and never under torch's default."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.constants import default_pg_timeout

    timeout = default_pg_timeout
    if wait_s is not None:
        timeout = max(timeout, datetime.timedelta(seconds=float(wait_s) + VOTE_MARGIN_S))
    return dist.new_group(backend="gloo", timeout=timeout)


class WaitVote:
    """Iterates the loader's (step, micro index, batch, ...) and, after each fetch, agrees with the other ranks on
    whether any of them gave up waiting for its data (the fetch raised WaitPreempted). Every rank fetches, and so
    votes, at the same point of every micro-batch, before the micro-batch's forward and backward: a rank whose data
    came never waits in a gradient collective for one whose data did not. On agreement every rank raises
    WaitPreempted (the loop checkpoints its last finished step: a partly accumulated step is simply dropped)."""

    def __init__(self, batches, watch: PreemptionWatch):
        self.batches, self.watch = iter(batches), watch

    def __iter__(self) -> "WaitVote":
        return self

    def __next__(self):
        try:
            item, gave_up = next(self.batches), 0
        except WaitPreempted:
            item, gave_up = None, self.watch.signum or int(signal.SIGTERM)
        agreed = self.watch._vote(gave_up)
        if agreed:
            if not self.watch.signum:
                self.watch.signum, self.watch.received_at = agreed, time.monotonic()
            _PENDING.set()  # this rank's own reader stops waiting too
            raise WaitPreempted(f"stopped waiting for data: {signal.Signals(self.watch.signum).name}")
        return item


# ----------------------------------------------------------------------------- data stages


@contextlib.contextmanager
def stop_on_signals(stage: str, saved: Callable[[], str]):
    """SIGTERM / SIGUSR1 during a data stage (regenerate, cache): raise Preempted in the main thread at once, so
    `finally` blocks close engines and remove partial files; complete rows / shards are already durable. Logs one
    line: `saved()` says what is kept. Outside the main thread this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(signum: int, frame) -> None:
        raise Preempted(signum, 0)

    previous = {sig: signal.signal(sig, handle) for sig in SIGNALS}
    try:
        yield
    except Preempted as e:
        for sig, handler in previous.items():  # a second signal while cleaning up must not interrupt the cleanup
            signal.signal(sig, signal.SIG_IGN)
        log.warning("%s: %s received; %s; rerun the same command to continue (exit status %d)",
                    stage, signal.Signals(e.signum).name, saved(), e.code)
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


_FAULT_COUNTS: dict[str, int] = {}


def fault_point(name: str) -> None:
    """Fault injection for tests: DEEPSPEC_FAULT_SIGTERM=<name>:<n>[:<SIGNAL>] makes this process send itself a real
    SIGTERM (or the signal named, e.g. SIGKILL) the n-th time it passes `name` (e.g. cache-batch:3 = after the third
    captured batch, mid-shard)."""
    spec = os.environ.get("DEEPSPEC_FAULT_SIGTERM")
    if not spec or not spec.startswith(name + ":"):
        return
    _, n, *sig = spec.split(":")
    _FAULT_COUNTS[name] = _FAULT_COUNTS.get(name, 0) + 1
    if _FAULT_COUNTS[name] == int(n):
        os.kill(os.getpid(), getattr(signal, sig[0]) if sig else signal.SIGTERM)
