"""The decoding side of eagle-serve: a scheduler with a queue and one decode worker per slot.

The HTTP layer only ever talks to a `Scheduler`: `submit(work, loop) -> Job`, then awaits
the job's events; `Job.cancel()` when the client goes away. `SlotScheduler` implements it:
with one slot, one worker owns an `EagleRuntime` and decodes the queued requests one at a
time; with `--slots N`, N workers each drive one slot of a `runtime.batch.BatchRuntime`, which
runs the slots' forwards as batched forwards (continuous batching: a finished request frees
its slot at once and the next queued one takes it).

Cancellation: `Job.cancel()` cancels the job's runtime `Generation` (the runtime's one
cancellation path, checked before every verification round), so a cancelled request stops
within one round and frees its slot.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Callable, ContextManager, Protocol, Sequence

from eagle_deploy.runtime.api import EagleRuntime, Generation, GenerationResult
from eagle_deploy.runtime.batch import BatchRuntime
from eagle_deploy.runtime.options import RuntimeOptions
from eagle_deploy.runtime.request import Request

log = logging.getLogger("eagle_deploy.serve")


@dataclass(frozen=True)
class Work:
    """One validated request for a decode worker: `request` (a runtime Request whose prompt is the
    token ids, fewer than the export's max_length) and `user`, the client's tag (OpenAI
    `user`), for logs and test hooks."""

    request: Request
    user: str | None = None

    @property
    def prompt_ids(self) -> tuple[int, ...]:
        return self.request.prompt


@dataclass(frozen=True)
class Event:
    """What a decode worker reports about a job. kind: "delta" (text, and with Request.logprobs the
    TokenLogprobs of the tokens committed since the previous delta), "done" (result), "error"
    (error: the exception that ended the job), "cancelled"."""

    kind: str
    text: str = ""
    result: GenerationResult | None = None
    error: BaseException | None = None
    logprobs: tuple = ()


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
        self.slot: int | None = None  # the slot that decodes it, once taken
        self.t_submit = time.perf_counter()
        self.t_start: float | None = None
        self.t_first: float | None = None
        self.t_done: float | None = None
        self._dequeue: Callable[["Job"], None] | None = None  # set by the scheduler that queues it
        self.generation: Generation | None = None  # the runtime's stream, once a worker runs it

    def cancel(self) -> None:
        """Ask the worker to drop this job (a no-op once it has finished): a running job's
        Generation is cancelled (it stops before its next round); a job still queued leaves
        the queue at once (its scheduler's dequeue callback). Thread-safe."""
        self._cancel.set()
        generation = self.generation
        if generation is not None:
            generation.cancel()
        if self._dequeue is not None:
            self._dequeue(self)

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
    """What the HTTP layer needs from the decoding side: the app reads nothing else of it.
    runtime: the export's manifest, tokenizer folder and grammar checks (the same in every
    slot); submitted, completed, failed, cancelled: jobs submitted, and those ended each way
    (/health); acceptance, threshold: how drafts are accepted (a response's `eagle` field and
    `system_fingerprint`)."""

    runtime: EagleRuntime
    submitted: int
    completed: int
    failed: int
    cancelled: int

    def start(self) -> None: ...

    def close(self, timeout: float = 5.0) -> None: ...

    def submit(self, work: Work, loop: asyncio.AbstractEventLoop) -> Job:
        """Queue `work`; raises QueueFull."""
        ...

    @property
    def acceptance(self) -> str: ...

    @property
    def threshold(self) -> float: ...

    @property
    def queued(self) -> int: ...

    @property
    def active(self) -> int: ...

    @property
    def batching(self) -> dict: ...

    @property
    def prefix_cache(self): ...


class RoundGate:
    """The round observer a scheduler installs in each slot's runtime: after every verification
    round of the slot's current job it counts the round and calls the test hook (whose
    exception fails that job alone). Cancellation is the runtime's (`Job.cancel`)."""

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


@dataclass
class Slot:
    """One decode worker's sequence: the runtime it decodes with (its round observers include
    `gate`) and `busy()`, the context a request runs in (BatchRuntime.busy for a batched slot)."""

    runtime: EagleRuntime
    gate: RoundGate
    busy: Callable[[], ContextManager] = nullcontext
    job: Job | None = None


class SlotScheduler:
    """A FIFO queue and one decode worker thread per slot; each worker decodes one request at a
    time on its slot, first come first served. With one slot requests run one after another;
    with several (`load(slots=N)`) they share a `runtime.batch.BatchRuntime`, whose batched
    forwards serve every busy slot at once (continuous batching: a worker takes the next queued
    request as soon as its slot frees).

    max_queue: jobs waiting (not running) at most; `submit` raises QueueFull beyond it.
    Counters: submitted, completed, failed, cancelled (jobs ended that way)."""

    def __init__(self, slots: Sequence[Slot], max_queue: int = 64, batch: BatchRuntime | None = None):
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        if not slots:
            raise ValueError("a scheduler needs at least one slot")
        self.slots, self.max_queue, self.batch = list(slots), max_queue, batch
        self.runtime = self.slots[0].runtime  # tokenizer, manifest and settings (the same in every slot)
        self._jobs: deque[Job] = deque()
        self._lock = threading.Condition()
        self._idle: set[int] = set()  # slots whose worker waits for a job
        self._closing = False
        self._threads: list[threading.Thread] = []
        self.submitted = self.completed = self.failed = self.cancelled = 0

    @classmethod
    def load(cls, folder, options: RuntimeOptions | None = None, slots: int = 1, max_queue: int = 64,
             round_hook: RoundHook | None = None, shrink_trees: bool = True, round_observers=(),
             drafter=None, drafters=None, **changes) -> "SlotScheduler":
        """Load `folder` for `slots` concurrent requests, decoded as `options` (with `changes`
        on top, as for EagleRuntime.load) say: one slot is an `EagleRuntime`; several share a
        `BatchRuntime` (shrink_trees: see BatchRuntime; one slot always drafts its configured
        tree). Each slot's runtime gets its own round gate after `round_observers`. drafter
        (one slot) / drafters (several): a custom drafter, as EagleRuntime.load / BatchRuntime
        take them (tests).
        round_hook: see RoundHook (tests). Raises what those loaders raise (BatchError, before
        any graph is opened, for an export or setting batched decoding cannot serve)."""
        options = RuntimeOptions.of(options, **changes)
        gates = [RoundGate(round_hook) for _ in range(slots)]
        extra = list(round_observers)
        if slots == 1:
            runtime = EagleRuntime.load(folder, options, round_observers=[*extra, gates[0]], drafter=drafter)
            return cls([Slot(runtime, gates[0])], max_queue)
        batch = BatchRuntime.load(folder, slots, options, round_observers=lambda b: [*extra, gates[b]],
                                  drafters=drafters, shrink_trees=shrink_trees)
        return cls([Slot(rt, gates[b], partial(batch.busy, b)) for b, rt in enumerate(batch.runtimes)], max_queue,
                   batch)

    @property
    def acceptance(self) -> str:
        return self.runtime.decoder.acceptance

    @property
    def threshold(self) -> float:
        return self.runtime.decoder.threshold

    @property
    def queued(self) -> int:
        """Jobs waiting for a worker (a cancelled one leaves the queue when it is cancelled)."""
        return len(self._jobs)

    @property
    def active(self) -> int:
        """Jobs being decoded now (at most one per slot)."""
        return sum(slot.job is not None for slot in self.slots)

    @property
    def idle(self) -> int:
        """Slots whose worker waits for a job (a slot stays busy a little after its response
        is sent: it settles the request into the prefix cache first)."""
        with self._lock:
            return len(self._idle)

    @property
    def prefix_cache(self):
        """The batch runtime's PrefixCache (every slot's), or None when it is off."""
        return self.runtime.prefix_cache

    @property
    def batching(self) -> dict:
        """{"slots", "batched_forwards", "solo_forwards", "prefill_chunks"}: forwards the
        BatchRuntime ran for two or more slots at once, and alone (prefills, or one busy slot),
        and how many of those were chunks of a chunked prefill; zeros with one slot."""
        e = self.batch
        return {"slots": len(self.slots), "batched_forwards": e.batched_forwards if e else 0,
                "solo_forwards": e.solo_forwards if e else 0, "prefill_chunks": e.prefill_chunks if e else 0}

    def start(self) -> None:
        if not self._threads:
            self._closing = False
            self._threads = [threading.Thread(target=self._work, args=(b,), name=f"eagle-decode-{b}", daemon=True)
                             for b in range(len(self.slots))]
            for t in self._threads:
                t.start()

    def close(self, timeout: float = 5.0) -> None:
        """Cancel the running jobs, drop the queued ones, stop the workers."""
        with self._lock:
            self._closing = True
            for slot in self.slots:
                if slot.job is not None:
                    slot.job.cancel()
            self._lock.notify_all()
        for t in self._threads:
            t.join(timeout)
        self._threads = []

    def submit(self, work: Work, loop: asyncio.AbstractEventLoop) -> Job:
        """Queue `work` and return its Job. Raises QueueFull when `max_queue` jobs already wait
        that no idle worker is about to take (a job submitted while a worker is idle is not
        counted as waiting, though it sits in the queue until that worker takes it)."""
        with self._lock:
            waiting = len(self._jobs) - len(self._idle)
            if waiting >= self.max_queue:
                raise QueueFull(f"the queue holds {waiting} requests (--max-queue {self.max_queue})")
            self.submitted += 1
            job = Job(work, loop, self.submitted)
            job._dequeue = self._dequeue
            self._jobs.append(job)
            self._lock.notify_all()
        return job

    def _dequeue(self, job: Job) -> None:
        """Drop a cancelled job that no worker has taken yet, so its place is free at once."""
        with self._lock:
            try:
                self._jobs.remove(job)
            except ValueError:  # taken by a worker (which stops it) or already ended
                return
        self._end(job, "cancelled", Event("cancelled"))

    def _take(self, b: int) -> Job | None:
        """The next job for slot b, given only to the lowest idle slot (busy slots stay packed
        at the low end, which keeps batched forwards narrow); None when closing."""
        with self._lock:
            self._idle.add(b)
            self._lock.notify_all()  # a lower slot is idle now: the others re-check
            while not self._closing and not (self._jobs and b == min(self._idle)):
                self._lock.wait()
            self._idle.discard(b)
            if self._closing:
                return None
            job = self._jobs.popleft()
            self.slots[b].job, job.slot = job, b
            self._lock.notify_all()  # the next idle slot may take the next job
            return job

    def _work(self, b: int) -> None:
        slot = self.slots[b]
        while (job := self._take(b)) is not None:
            if job.cancelled:
                slot.job = None
                self._end(job, "cancelled", Event("cancelled"))
                continue
            slot.gate.job = job
            try:
                self._run(slot, job)
            finally:
                slot.job, slot.gate.job = None, None

    def _run(self, slot: Slot, job: Job) -> None:
        """Decode `job` on `slot`, then, with its response sent, settle it into the prefix cache
        (EagleRuntime.settle; inside the slot's busy block, whose rows hold it): prompt and
        answer when no request is waiting, else its prompt alone (no forward), so a queued
        request never waits for a settle."""
        job.state, job.t_start = "running", time.perf_counter()
        ended = False
        try:
            with slot.busy():
                gen = job.generation = slot.runtime.stream(job.work.request)
                gen.defer_settle()  # the response first
                if job.cancelled:  # cancelled while the stream was being made
                    gen.cancel()
                sent = 0
                for delta in gen:
                    new = tuple(gen.logprobs[sent:]) if gen.logprobs is not None else ()
                    sent += len(new)
                    job.emit(Event("delta", text=delta, logprobs=new))
                if gen.result.finish_reason == "cancelled":
                    self._end(job, "cancelled", Event("cancelled"))
                else:
                    self._end(job, "done", Event("done", result=gen.result))
                ended = True
                with self._lock:
                    idle = not self._jobs
                gen.settle(answer=idle)
        except Exception as err:  # one request fails alone; the worker keeps serving
            if ended:  # answered already: only its prefix-cache entry is lost
                log.exception("settling request %s into the prefix cache failed", job.seq)
            else:
                log.exception("request %s failed in its decode worker", job.seq)
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


def decoding_info(acceptance: str, threshold: float, mode: str) -> dict:
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
    and total decoding time in ms, limited_by (which limit ended a "length" finish, named as the
    HTTP request names it: "max_tokens" (the request's max_tokens or max_completion_tokens) |
    "capacity" (the export's KV capacity) | None), drafter (what proposed the draft tokens:
    "hybrid", "eagle", "lookup"; None for vanilla). A subset of `Stats.to_json()` (prefill_ms,
    total_ms: its time_ms prefill, total), plus `Stats.rounds`."""
    j = result.stats.to_json()
    limited_by = "max_tokens" if j["limited_by"] == "max_new_tokens" else j["limited_by"]
    return {"drafter": j["drafter"], "mean_accept_len": j["mean_accept_len"], "rounds": result.stats.rounds,
            "target_forwards": j["target_forwards"], "draft_forwards": j["draft_forwards"],
            "prefill_ms": j["time_ms"]["prefill"], "total_ms": j["time_ms"]["total"], "limited_by": limited_by}
