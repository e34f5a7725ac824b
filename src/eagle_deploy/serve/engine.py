"""The engine side of eagle-serve: a scheduler object with a queue and one engine worker.

The HTTP layer only ever talks to a `Scheduler`: `submit(work, loop) -> Job`, then awaits
the job's events; `Job.cancel()` when the client goes away. `SerialScheduler` is today's
implementation: one worker thread owns the `EagleRuntime` (its KV buffers hold one request)
and decodes the queued requests one at a time, first come first served. A batched scheduler
(several requests in one target forward) can replace it behind the same protocol once the KV
layout holds several sequences; that is not done yet.

Cancellation: the worker checks the job's cancel flag after every committed chunk and, through
a round observer installed in the runtime, after every verification round, so a cancelled
request stops within one round and the worker moves on to the next job.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from eagle_deploy.runtime.api import EagleRuntime, GenerationResult

log = logging.getLogger("eagle_deploy.serve")


@dataclass(frozen=True)
class Work:
    """One validated request for the engine. prompt_ids: token ids, fewer than the export's
    max_length; max_tokens >= 1; sampling settings as `EagleRuntime.generate` takes them
    (already checked); mode "eagle" | "vanilla"; user: the client's tag (OpenAI `user`), for
    logs and test hooks."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    mode: str = "eagle"
    user: str | None = None


@dataclass(frozen=True)
class Event:
    """What the engine reports about a job. kind: "delta" (text), "done" (result),
    "error" (error: the exception that ended the job), "cancelled"."""

    kind: str
    text: str = ""
    result: GenerationResult | None = None
    error: BaseException | None = None


class Cancelled(Exception):
    """Raised inside the decode loop (by the round gate) to stop a cancelled job."""


class QueueFull(Exception):
    """The scheduler's queue holds `max_queue` jobs already."""


class Job:
    """One submitted request. The worker thread emits Events onto an asyncio queue of the
    event loop that submitted it; the HTTP side awaits them with `next_event`.

    Times (time.perf_counter seconds): t_submit, t_start (the worker took it), t_first (first
    text delta), t_done. state: "queued" | "running" | "done" | "error" | "cancelled"."""

    def __init__(self, work: Work, loop: asyncio.AbstractEventLoop, seq: int):
        self.work, self.seq = work, seq
        self._loop = loop
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self._cancel = threading.Event()
        self.state = "queued"
        self.rounds = 0  # verification rounds run for this job
        self.t_submit = time.perf_counter()
        self.t_start: float | None = None
        self.t_first: float | None = None
        self.t_done: float | None = None

    def cancel(self) -> None:
        """Ask the worker to drop this job (a no-op once it has finished). Thread-safe."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    async def next_event(self, timeout: float | None = None) -> Event:
        """The next event; raises TimeoutError after `timeout` seconds without one."""
        return await asyncio.wait_for(self._events.get(), timeout)

    def emit(self, event: Event) -> None:
        """Called by the worker thread."""
        if event.kind == "delta" and self.t_first is None:
            self.t_first = time.perf_counter()
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: the server is shutting down
            pass


# called as hook(job) by the worker after every verification round of `job`, before the
# cancel check; an exception it raises fails that job alone (tests inject faults with it)
RoundHook = Callable[[Job], None]


class Scheduler(Protocol):
    """What the HTTP layer needs from the engine side."""

    runtime: EagleRuntime

    def start(self) -> None: ...

    def close(self, timeout: float = 5.0) -> None: ...

    def submit(self, work: Work, loop: asyncio.AbstractEventLoop) -> Job:
        """Queue `work`; raises QueueFull."""
        ...

    @property
    def queued(self) -> int: ...

    @property
    def active(self) -> int: ...


class RoundGate:
    """The round observer that `SerialScheduler` installs in its runtime: after every
    verification round of the current job it calls the test hook, then stops a cancelled job
    by raising `Cancelled` out of the decode loop (the runtime starts every request with a
    fresh prefill, so an abandoned round leaves nothing behind)."""

    def __init__(self, hook: RoundHook | None = None):
        self.hook = hook
        self.job: Job | None = None

    def __call__(self, tree, logits, verification) -> None:
        job = self.job
        if job is None:
            return
        job.rounds += 1
        if self.hook is not None:
            self.hook(job)
        if job.cancelled:
            raise Cancelled()


class SerialScheduler:
    """A FIFO queue and one engine worker thread that runs one request at a time on
    `runtime` (which must have `gate` among its round observers; `load` wires that up).

    max_queue: jobs waiting (not running) at most; `submit` raises QueueFull beyond it.
    Counters: submitted, completed, failed, cancelled (jobs ended that way)."""

    def __init__(self, runtime: EagleRuntime, gate: RoundGate, max_queue: int = 64):
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.runtime, self.gate, self.max_queue = runtime, gate, max_queue
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._waiting = 0
        self._running: Job | None = None
        self._thread: threading.Thread | None = None
        self.submitted = self.completed = self.failed = self.cancelled = 0

    @classmethod
    def load(cls, folder, max_queue: int = 64, round_hook: RoundHook | None = None, **runtime_kw) -> "SerialScheduler":
        """Load `folder` with `EagleRuntime.load(folder, **runtime_kw)` plus this scheduler's
        round gate. round_hook: see RoundHook (tests). Raises what EagleRuntime.load raises."""
        gate = RoundGate(round_hook)
        observers = [*runtime_kw.pop("round_observers", ()), gate]
        runtime = EagleRuntime.load(folder, round_observers=observers, **runtime_kw)
        return cls(runtime, gate, max_queue)

    @property
    def acceptance(self) -> str:
        return self.runtime.decoder.acceptance

    @property
    def threshold(self) -> float:
        return self.runtime.decoder.threshold

    @property
    def queued(self) -> int:
        """Jobs waiting for the worker (cancelled ones included until the worker drops them)."""
        return self._waiting

    @property
    def active(self) -> int:
        """Jobs being decoded now (0 or 1)."""
        return 0 if self._running is None else 1

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="eagle-engine", daemon=True)
            self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        """Cancel the running job, drop the queued ones, stop the worker."""
        running = self._running
        if running is not None:
            running.cancel()
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def submit(self, work: Work, loop: asyncio.AbstractEventLoop) -> Job:
        with self._lock:
            if self._waiting >= self.max_queue:
                raise QueueFull(f"the queue holds {self._waiting} requests (--max-queue {self.max_queue})")
            self._waiting += 1
            self.submitted += 1
            job = Job(work, loop, self.submitted)
        self._queue.put(job)
        return job

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                break
            with self._lock:
                self._waiting -= 1
            if job.cancelled:
                self._end(job, "cancelled", Event("cancelled"))
                continue
            self._running, self.gate.job = job, job
            try:
                self._run(job)
            finally:
                self._running, self.gate.job = None, None

    def _run(self, job: Job) -> None:
        w = job.work
        job.state, job.t_start = "running", time.perf_counter()
        try:
            gen = self.runtime.stream(list(w.prompt_ids), w.max_tokens, w.temperature, w.top_p, w.top_k, w.seed,
                                      list(w.stop), w.mode, chat=False)
            for delta in gen:
                job.emit(Event("delta", text=delta))
                if job.cancelled:
                    raise Cancelled()
            self._end(job, "done", Event("done", result=gen.result))
        except Cancelled:
            self._end(job, "cancelled", Event("cancelled"))
        except Exception as err:  # one request fails alone; the worker keeps serving
            log.exception("request %s failed in the engine", job.seq)
            self._end(job, "error", Event("error", error=err))

    def _end(self, job: Job, state: str, event: Event) -> None:
        job.state, job.t_done = state, time.perf_counter()
        with self._lock:
            if state == "done":
                self.completed += 1
            elif state == "error":
                self.failed += 1
            else:
                self.cancelled += 1
        job.emit(event)


def engine_info(acceptance: str, threshold: float, mode: str) -> dict:
    """How a response was decoded: {"mode", "acceptance", "lossless"} (+ "threshold" in the
    threshold acceptance mode, which is NOT lossless: the output no longer follows the
    target's distribution). Vanilla decoding verifies no draft tokens, so it is lossless."""
    lossless = acceptance == "lossless" or mode == "vanilla"
    info = {"mode": mode, "acceptance": acceptance, "lossless": lossless}
    if acceptance == "threshold":
        info["threshold"] = threshold
    return info


def fingerprint(version: str, info: dict) -> str:
    """`system_fingerprint`: "eagle-deploy-<version>-<mode>-lossless", or
    "...-eagle-threshold<X>-not-lossless" in the threshold acceptance mode."""
    if info["lossless"]:
        return f"eagle-deploy-{version}-{info['mode']}-lossless"
    return f"eagle-deploy-{version}-{info['mode']}-threshold{info['threshold']:g}-not-lossless"


def stats_info(result: GenerationResult) -> dict:
    """Per-request decoding figures for the response's `eagle` field: tau (tokens per target
    verification forward, bonus included), rounds, target and draft forwards, TTFT (prefill)
    and total engine time in ms, limited_by ("max_new_tokens" | "capacity" | None)."""
    s = result.stats
    return {"mean_accept_len": round(s.mean_accept_len, 4), "rounds": s.rounds, "target_forwards": s.target_forwards,
            "draft_forwards": s.draft_forwards, "prefill_ms": round(s.t_prefill * 1e3, 2),
            "engine_ms": round(s.t_total * 1e3, 2), "limited_by": s.limited_by}


def as_tuple(values: Sequence[int]) -> tuple[int, ...]:
    return tuple(int(v) for v in values)
