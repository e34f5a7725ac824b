"""One completion request of eagle-serve, from its body to its answer.

`Completions` (one per app) admits a request: it reads the body up to `max_body` bytes (413
beyond) within the server's deadline, then parses, validates and tokenises it on the
frontend's own thread (its own tokenizer instance, so a long prompt never stalls the event
loop: other streams and /health go on), builds the runtime's `Request` (its own checks) and
submits it to the scheduler. An invalid request gets a 400 and never touches the scheduler; a
body still uploading at the server's deadline a 408 `request_timeout` with `Connection:
close`; a full queue a 429; a client gone before its body arrived a 499.

`Completion` (one per submitted job) waits for the job's events, polling
`request.is_disconnected()` every `poll_s` seconds, so a client that goes away frees the
scheduler within one decode round. A request's deadline (`request_timeout_s`, shortened by the
request's own field) is counted from the arrival of its head. A streamed response starts once
the decode worker has produced the first text (or finished); before that every request is answered
as JSON. However the job ends, `Completion.outcome` turns its last event into the answer and
its count in `eagle_serve_requests_total`, in one place:

    last event  counted    JSON response                           SSE events, once streaming
    done        ok         200 the response                        last chunks, usage, [DONE]
    error       error      500 decoding_error (a GrammarError         error event
                invalid    before any text: 400 unsupported_value)
    timeout     timeout    408 request_timeout, no retry            error event
    shutdown    cancelled  503 server_shutdown                      error event, [DONE]
    cancelled   cancelled  499 (the client has gone: nobody reads)  none

"timeout" and "shutdown" are the app's own events: the deadline passed, or the drain of a
shutdown (`Drain`) ended. Either way only that request fails; the job is cancelled.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.requests import ClientDisconnect

from eagle_deploy.contract.errors import SettingError
from eagle_deploy.runtime.grammar import GrammarError
from eagle_deploy.runtime.request import Request as GenerationRequest
from eagle_deploy.runtime.text import token_bytes

from .guard import read_body
from .metrics import ServeMetrics
from .protocol import CHAT, DONE, ApiError, CompletionRequest, Envelope, invalid, logprobs_body, parse_json, sse, usage
from .scheduler import Event, Job, QueueFull, Scheduler, Work, decoding_info, fingerprint, stats_info

Parse = Callable[[dict], CompletionRequest]  # protocol.parse_chat or parse_completion


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


def decoding_error(error: BaseException | None) -> ApiError:
    what = f"{type(error).__name__}: {error}" if error is not None else "unknown error"
    return ApiError(500, f"decoding failed on this request ({what}); the server keeps serving", None,
                    "decoding_error", "server_error")


def timed_out(limit: float) -> ApiError:
    return ApiError(408, f"the request ran past its deadline of {limit:g} s (--request-timeout-s or the request's "
                         "request_timeout_s) and was stopped", None, "request_timeout", "timeout_error")


def timeout_response(limit: float, close: bool = False) -> JSONResponse:
    """The 408, with `x-should-retry: false`: the openai clients retry a 408 by default, and
    the same request would only run out the same deadline again. close: also `Connection:
    close` (the body has not all arrived, so the connection cannot carry another request)."""
    headers = {"x-should-retry": "false", **({"connection": "close"} if close else {})}
    return JSONResponse(timed_out(limit).body(), status_code=408, headers=headers)


def shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down and stopped this request at the end of its drain "
                         "(--shutdown-timeout-s); retry on another server", None, "server_shutdown", "server_error")


class Drain:
    """The end of a graceful shutdown, as the app sees it: `begin(timeout_s)` (called on the
    first SIGTERM / Ctrl-C) sets the time at which the requests still running are stopped
    (`due`): a stream ends with an error event `server_shutdown` and `data: [DONE]`, any
    other request gets a 503 `server_shutdown`, before uvicorn would cancel them."""

    def __init__(self):
        self.deadline: float | None = None  # time.monotonic() seconds

    def begin(self, timeout_s: float) -> None:
        if self.deadline is None:
            self.deadline = time.monotonic() + timeout_s

    @property
    def due(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline


@dataclass
class Completions:
    """The completion endpoints of one app: `await complete(request, parse, endpoint)`
    answers one POST (endpoint: "chat" | "completions", its label in the metrics). frontend:
    the app's `Frontend` (prompt -> token ids on its executor; its tokenizer names the tokens
    of logprobs); request_timeout_s: the server's deadline (None: none); max_body: bytes."""

    scheduler: Scheduler
    frontend: Any
    metrics: ServeMetrics
    drain: Drain
    model_name: str
    default_mode: str
    version: str
    poll_s: float
    max_body: int
    request_timeout_s: float | None

    async def __call__(self, request: Request, parse: Parse, endpoint: str) -> Response:
        t0 = time.monotonic()
        try:
            try:  # the server's deadline covers the upload of the body (the request's own is in the body)
                raw = await asyncio.wait_for(read_body(request, self.max_body), self.request_timeout_s)
            except TimeoutError:
                self.metrics.requests.labels(endpoint, "timeout").inc()
                return timeout_response(self.request_timeout_s, close=True)
            loop = asyncio.get_running_loop()
            req, ids = await loop.run_in_executor(self.frontend.executor, self._prepare, raw, parse)
            mode = req.mode or self.default_mode
            job = self.scheduler.submit(Work(self._runtime_request(req, ids, mode), req.user), loop)
        except ApiError as err:
            self.metrics.requests.labels(endpoint, "invalid").inc()
            return error_response(err)
        except ClientDisconnect:  # gone before its body had arrived
            self.metrics.requests.labels(endpoint, "cancelled").inc()
            return Response(status_code=499)
        except QueueFull as err:
            self.metrics.requests.labels(endpoint, "rejected").inc()
            return error_response(ApiError(429, f"the server is busy: {err}; retry later", None, "queue_full",
                                           "server_busy"))
        return await Completion(self, request, req, job, mode, endpoint, self._deadline(t0, req)).answer()

    def _prepare(self, raw: bytes, parse: Parse) -> tuple[CompletionRequest, list[int]]:
        """Body -> (request, prompt ids), on the frontend's thread. Raises ApiError."""
        req = parse(parse_json(raw))
        if req.model != self.model_name:  # 404 model_not_found, as OpenAI and vLLM answer it
            raise ApiError(404, f"the model {req.model!r} does not exist; this server serves {self.model_name!r} "
                                "(GET /v1/models)", "model", "model_not_found")
        return req, self.frontend.prompt_ids(req)

    def _runtime_request(self, req: CompletionRequest, ids: list[int], mode: str) -> GenerationRequest:
        """The runtime's Request (its own checks, so nothing it would refuse reaches a
        decode worker; max_tokens unset: up to the KV capacity); a SettingError is answered as a 400
        naming the HTTP field."""
        runtime = self.scheduler.runtime
        max_tokens = req.max_tokens if req.max_tokens is not None else runtime.manifest.max_length
        try:
            request = GenerationRequest(tuple(ids), max_tokens, req.temperature, req.top_p, req.top_k, req.seed,
                                        req.stop, mode, min_p=req.min_p, logit_bias=req.logit_bias,
                                        presence_penalty=req.presence_penalty,
                                        frequency_penalty=req.frequency_penalty,
                                        repetition_penalty=req.repetition_penalty, logprobs=req.logprobs,
                                        response_format=req.response_format, tools=req.tools,
                                        tool_choice=req.tool_choice)
            request.check_vocab(runtime.manifest.dims.vocab)
            runtime.grammar_for(request)  # a schema the grammar engine refuses: a 400, here
            return request
        except SettingError as err:
            names = {"prompt": req.prompt_param, "max_new_tokens": "max_tokens",
                     "logprobs": "top_logprobs" if req.kind == CHAT else "logprobs"}
            base = err.field.partition("[")[0]
            field = names.get(base, base) + err.field[len(base):]
            raise invalid(field, err.named(field)) from None

    def _deadline(self, t0: float, req: CompletionRequest) -> tuple[float, float] | None:
        """(monotonic deadline, its length in s) of a request that arrived at t0, or None."""
        limits = [t for t in (self.request_timeout_s, req.request_timeout_s) if t is not None]
        return (t0 + min(limits), min(limits)) if limits else None


class Completion:
    """One submitted request until its answer: the job's events (`next_event`), the SSE events
    of a streamed answer (`stream`) and the outcome of its last event (`outcome`).
    deadline: (monotonic deadline, its length in s) or None."""

    def __init__(self, flow: Completions, request: Request, req: CompletionRequest, job: Job, mode: str,
                 endpoint: str, deadline: tuple[float, float] | None):
        self.flow, self.request, self.req, self.job = flow, request, req, job
        self.endpoint, self.deadline = endpoint, deadline
        self.info = decoding_info(flow.scheduler.acceptance, flow.scheduler.threshold, mode)
        self.env = Envelope(req.kind, flow.model_name, fingerprint(flow.version, self.info))
        self.text_seen = False  # a delta has arrived (a GrammarError after one is the grammar engine's error)
        self.sent_lp, self.sent_chars = 0, 0  # logprobs and characters streamed so far (completions' text_offset)
        # with tools a streamed answer's text is held until it ends: it may turn out to be a call
        self.hold = req.kind == CHAT and bool(req.tools) and req.tool_choice != "none"

    async def answer(self) -> Response:
        """The stream of a streamed request whose first event is text (or done); else the
        outcome of the job's last event, as JSON."""
        ev = await self.next_event()
        if self.req.stream and ev.kind in ("delta", "done"):
            return StreamingResponse(self.stream(ev), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                                     background=BackgroundTask(self.job.cancel))  # also when the stream never started
        while ev.kind == "delta":
            ev = await self.next_event()
        return self.outcome(ev, streamed=False)

    async def next_event(self) -> Event:
        """The job's next event, or one of the app's, the job cancelled: "cancelled" once the
        client has disconnected, "timeout" once the deadline has passed, "shutdown" once the
        drain of a shutdown is over (`Drain.due`)."""
        job, deadline, poll_s = self.job, self.deadline, self.flow.poll_s
        while True:
            if self.flow.drain.due:
                job.cancel()
                return Event("shutdown")
            wait = poll_s if deadline is None else min(poll_s, deadline[0] - time.monotonic())
            try:
                if wait <= 0:
                    raise TimeoutError
                ev = await job.next_event(wait)
            except TimeoutError:
                if deadline is not None and time.monotonic() >= deadline[0]:
                    job.cancel()
                    return Event("timeout")
                if await self.request.is_disconnected():
                    job.cancel()
                    return Event("cancelled")
                continue
            self.text_seen = self.text_seen or ev.kind == "delta"
            return ev

    async def stream(self, first: Event):
        """The SSE events from the first event (text or done): a chat's role chunk, a chunk per
        text delta (none while held), then the outcome's. The job is cancelled however the
        stream ends (a no-op once it has finished); one closed before its outcome (the client
        went away) counts as cancelled."""
        ended = False
        last_check = time.monotonic()
        try:
            if self.env.kind == CHAT:
                yield sse(self.env.chunk(role=True, usage_null=self.req.include_usage))
            ev = first
            while ev.kind == "delta":
                if not self.hold:
                    yield sse(self._delta_chunk(ev))
                if time.monotonic() - last_check >= self.flow.poll_s:  # events may never pause long enough to poll
                    last_check = time.monotonic()
                    if await self.request.is_disconnected():
                        ev = Event("cancelled")
                        break
                ev = await self.next_event()
            events, ended = self.outcome(ev, streamed=True), True
            for event in events:
                yield event
        finally:
            self.job.cancel()  # a no-op once the job has finished
            if not ended:
                self.flow.metrics.requests.labels(self.endpoint, "cancelled").inc()

    def outcome(self, ev: Event, streamed: bool) -> Response | list[str]:
        """The one place where the job's last event becomes the request's answer, counted in
        the metrics: the JSON response, or with `streamed` the stream's last SSE events (see
        the table in the module's docstring)."""
        if ev.kind == "done":
            self.flow.metrics.finished(self.endpoint, self.job, ev.result)
            return self._last_chunks(ev.result) if streamed else JSONResponse(self._response(ev.result))
        counted, err = self._failure(ev)
        self.flow.metrics.requests.labels(self.endpoint, counted).inc()
        if streamed:  # the client learns why; after a shutdown the stream is complete
            return [] if err is None else [sse(err.body()), *([DONE] if ev.kind == "shutdown" else [])]
        if err is None:
            return Response(status_code=499)  # the client has gone; nobody reads this
        return timeout_response(self.deadline[1]) if ev.kind == "timeout" else error_response(err)

    def _failure(self, ev: Event) -> tuple[str, ApiError | None]:
        """(how it is counted, the error the client is told: None once it has gone) of a job
        that did not finish."""
        if ev.kind == "timeout":
            return "timeout", timed_out(self.deadline[1])
        if ev.kind == "shutdown":
            return "cancelled", shutting_down()
        if ev.kind != "error":
            return "cancelled", None
        if isinstance(ev.error, GrammarError) and not self.text_seen:  # a schema accepted, then not followed
            req = self.req
            field = "tools" if req.tools and req.tool_choice not in (None, "none", "auto") else "response_format"
            return "invalid", invalid(field, str(ev.error), "unsupported_value")
        return "error", decoding_error(ev.error)

    def _delta_chunk(self, ev: Event) -> dict:
        lp = self._logprobs(ev.logprobs, self.sent_chars) if self.req.logprobs is not None else None
        self.sent_lp, self.sent_chars = self.sent_lp + len(ev.logprobs), self.sent_chars + len(ev.text)
        return self.env.chunk(ev.text, usage_null=self.req.include_usage, logprobs=lp)

    def _last_chunks(self, result) -> list[str]:
        """A finished stream's last events: a held answer's text and tool calls, the finishing
        chunk (with the logprobs after the last delta), the usage chunk, [DONE]."""
        env, nulls = self.env, self.req.include_usage
        out = []
        if self.hold:
            if result.text:
                out.append(sse(env.chunk(result.text, usage_null=nulls)))
            if result.tool_calls:
                out.append(sse(env.chunk(usage_null=nulls, tool_calls=result.tool_calls)))
        rest = None if result.logprobs is None else result.logprobs[self.sent_lp:]
        out.append(sse(env.chunk(None, result.finish_reason, usage_null=nulls, extra=self._eagle(result),
                                 logprobs=self._logprobs(rest, self.sent_chars) if rest else None)))
        if self.req.include_usage:
            out.append(sse(env.usage_chunk(self._usage(result))))
        return [*out, DONE]

    def _response(self, result) -> dict:
        return self.env.response(result.text, result.finish_reason, self._usage(result), self._eagle(result),
                                 self._logprobs(result.logprobs), result.tool_calls)

    def _eagle(self, result) -> dict:
        return {"eagle": {**self.info, **stats_info(result)}}

    def _usage(self, result) -> dict:
        """OpenAI's usage (prompt_tokens_details.cached_tokens: prompt tokens read from the
        prefix cache) and the speculative-decoding counts."""
        return {**usage(len(self.job.work.prompt_ids), len(result.token_ids)),
                "prompt_tokens_details": {"cached_tokens": result.stats.cached_tokens},
                "speculative": result.stats.to_json()["speculative"]}

    def _logprobs(self, entries, offset: int = 0) -> dict | None:
        """The response's `logprobs` for these TokenLogprobs (None when the request asked for none)."""
        if entries is None:
            return None
        tokenizer = self.flow.frontend.tokenizer
        return logprobs_body(self.env.kind, entries, lambda t: tokenizer.decode([t]), offset,
                             lambda t: token_bytes(tokenizer, t))
