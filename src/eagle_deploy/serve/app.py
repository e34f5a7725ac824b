"""The eagle-serve FastAPI application: OpenAI-compatible endpoints over a `Scheduler`.

    POST /v1/chat/completions, POST /v1/completions   (stream and non-stream)
    GET  /v1/models, /health, /metrics (Prometheus text format)

A request's body is read up to `max_body_mb` (413 beyond), then parsed, validated and
tokenised here, on the frontend's own thread (its own tokenizer instance, so a long prompt
never stalls the event loop: other streams and /health go on), before it reaches the engine:
an invalid one gets a 400 and never touches it. With `api_key` every route but /health and
/metrics (those too with `protect_health_metrics`) needs `Authorization: Bearer <key>` (401).
A request's deadline (`request_timeout_s`, shortened by the request's own field) is counted
from the arrival of its head: a body still uploading at the server's deadline gets a 408
`request_timeout` with `Connection: close`; later the job is cancelled and the client gets a
408 (or, once streaming, an SSE error event with that code). At the end of a shutdown's drain
(`Drain`) the requests still running get a 503 `server_shutdown` (a stream: an error event
with that code, then `data: [DONE]`).

A streamed response starts once the engine has produced the first text (or finished): a
request that fails before that gets a JSON 500; one that fails later gets an
SSE event `data: {"error": {...}}` and the stream ends. Either way only that request fails.
While waiting for the engine the handler polls `request.is_disconnected()` every `poll_s`
seconds (and the streaming generator's `finally` cancels the job when the server closes it),
so a client that goes away frees the engine within one decode round.
"""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from importlib import metadata

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from eagle_deploy.contract.errors import SettingError, prompt_too_long
from eagle_deploy.runtime.api import load_tokenizer
from eagle_deploy.runtime.grammar import GrammarError
from eagle_deploy.runtime.request import Request as GenerationRequest
from eagle_deploy.runtime.text import encode_prompt, token_bytes

from .engine import Event, Job, QueueFull, Scheduler, Work, engine_info, fingerprint, stats_info
from .guard import OPEN_PATHS, BearerAuth, RequestLimit, read_body
from .metrics import ServeMetrics
from .protocol import (
    CHAT,
    DONE,
    ApiError,
    CompletionRequest,
    Envelope,
    invalid,
    logprobs_body,
    parse_chat,
    parse_completion,
    parse_json,
    sse,
    usage,
)

POLL_S = 0.05  # seconds between disconnect checks while a request waits for the engine
MAX_BODY_MB = 8.0  # request body size limit (--max-body-mb)
PREFIX_CHARS_PER_TOKEN = 16  # a text over max_length * this many characters is first counted on that prefix


def package_version() -> str:
    try:
        return metadata.version("eagle-deploy")
    except metadata.PackageNotFoundError:
        return "0"


class Frontend:
    """Prompt -> token ids on the HTTP side, with the checks that need the tokenizer: a chat
    template exists, token ids lie in [0, vocab), the prompt leaves room for one output token
    in the KV capacity (max_length rows). Raises ApiError (400). Runs on `executor` (one
    thread: the tokenizer is used by one thread at a time), off the event loop.

    A text longer than max_length * PREFIX_CHARS_PER_TOKEN characters is first tokenised on
    prefixes of it (`_check_prefix`): once a prefix passes the capacity the request is refused
    without tokenising the rest."""

    def __init__(self, tokenizer, max_length: int, vocab: int, length_limit: int | None = None,
                 model_name: str = "this model"):
        """length_limit: the largest max_length a re-export may have (Manifest.length_limit;
        None: unknown), named in the too-long error; model_name: named in the error for tools a
        template cannot render."""
        self.tokenizer, self.max_length, self.vocab = tokenizer, max_length, vocab
        self.length_limit, self.model_name = length_limit, model_name
        self.parse_special = False  # special-token text in messages: plain text (--parse-special: tokens)
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="eagle-frontend")

    @classmethod
    def for_runtime(cls, runtime) -> "Frontend":
        """A second tokenizer instance loaded from the export (the engine thread keeps its own)."""
        m = runtime.manifest
        tokenizer = load_tokenizer(runtime.folder, m)
        if tokenizer is None:
            raise ValueError("this export has no tokenizer; eagle-serve needs one (re-export with the tokenizer)")
        return cls(tokenizer, m.max_length, m.dims.vocab, m.length_limit, m.name)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def _too_long(self, n: int, param: str, at_least: bool = False) -> ApiError:
        message = prompt_too_long(n, self.max_length, self.length_limit, at_least)
        return invalid(param, message, "context_length_exceeded")

    def _check_prefix(self, text: str, param: str) -> None:
        """Refuse a text whose first max_length * PREFIX_CHARS_PER_TOKEN characters alone
        encode to more tokens than fit (+ 8 for the word the cut splits), without tokenising
        the rest; a prefix that fits is tried again 4 times longer (text that packs many
        characters into a token, such as runs of spaces), so at most 4/3 of what refuses it is
        tokenised."""
        cut = self.max_length * PREFIX_CHARS_PER_TOKEN
        while len(text) > cut:
            n = len(self.tokenizer.encode(text[:cut], add_special_tokens=False))
            if n >= self.max_length + 8:
                raise self._too_long(n - 8, param, at_least=True)
            cut *= 4

    def prompt_ids(self, req: CompletionRequest) -> list[int]:
        """The request's prompt -> token ids by the runtime's one encoder (text.encode_prompt:
        chat messages through the template with the request's tools, a completions prompt as
        raw text or token ids), after the prefix check of a very long text. Raises ApiError."""
        param = req.prompt_param
        if req.messages is not None:
            self._check_prefix("\n".join(m.get("content") or "" for m in req.messages), param)
            if not self.has_chat_template:
                raise invalid("messages", "this model has no chat template: use /v1/completions", "unsupported_value")
        elif isinstance(req.prompt, str):
            self._check_prefix(req.prompt, param)
        try:
            request = GenerationRequest(req.messages if req.messages is not None else req.prompt,
                                        chat=False if req.messages is None else None, tools=req.tools,
                                        tool_choice=req.tool_choice, parse_special=self.parse_special)
            ids = encode_prompt(self.tokenizer, request, False, self.vocab, self.model_name)
        except SettingError as err:
            base = err.field.partition("[")[0].partition(".")[0]
            field = (param + err.field[len(base):]) if base == "prompt" else err.field
            code = "unsupported_value" if err.rule.startswith("are not supported") else "invalid_value"
            raise invalid(field, err.named(field) if base != "tools" else str(err), code) from None
        except ValueError as err:  # the template's own checks (e.g. role order)
            raise invalid(param, str(err)) from None
        if not ids:
            raise invalid(param, "the prompt encodes to no tokens")
        if len(ids) >= self.max_length:
            raise self._too_long(len(ids), param)
        return ids


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


def engine_error(error: BaseException | None) -> ApiError:
    what = f"{type(error).__name__}: {error}" if error is not None else "unknown error"
    return ApiError(500, f"the engine failed on this request ({what}); the server keeps serving", None,
                    "engine_error", "server_error")


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


def create_app(scheduler: Scheduler, *, model_name: str | None = None, default_mode: str = "eagle",
               frontend: Frontend | None = None, poll_s: float = POLL_S, max_body_mb: float = MAX_BODY_MB,
               request_timeout_s: float | None = None, api_key: str | None = None, parse_special: bool = False,
               protect_health_metrics: bool = False, max_requests: int | None = None) -> FastAPI:
    """The app over `scheduler` (started and closed by the app's lifespan). model_name: the id
    clients must send as `model` (default: the export's manifest name); default_mode: "eagle"
    or "vanilla" for requests that do not set the `mode` extension field; max_body_mb: the
    request body limit; request_timeout_s: the deadline in seconds of every request, from the
    arrival of its head, the upload of its body included (None: none; a request may set a
    shorter one); api_key: required as a Bearer token (None: open; surrounding whitespace is
    not part of it); max_requests: requests in progress at most, counted once their head has
    arrived and their key passed (`guard.RequestLimit`; None: no limit). `app.state.drain`
    (`Drain`) ends the requests still running at the end of a shutdown; parse_special: a special
    token's text in a chat message is that special token (default: plain text, so a message
    cannot open a turn of another role; runtime.text.encode_chat). Raises ValueError for an
    API key that is empty or only whitespace."""
    runtime = scheduler.runtime
    manifest = runtime.manifest
    model_name = model_name or manifest.name
    frontend = frontend or Frontend.for_runtime(runtime)
    frontend.parse_special = parse_special
    metrics = ServeMetrics(model_name)
    metrics.bind(scheduler)
    max_body = int(max_body_mb * 2**20)
    version = package_version()
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        try:
            yield
        finally:
            scheduler.close()
            frontend.executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="eagle-serve", version=version, lifespan=lifespan)
    app.state.scheduler, app.state.metrics, app.state.frontend = scheduler, metrics, frontend
    app.state.drain = drain = Drain()
    if max_requests is not None:  # added first: inside BearerAuth, so requests without the key never count
        app.add_middleware(RequestLimit, limit=max_requests)
    if api_key is not None:
        app.add_middleware(BearerAuth, key=api_key.strip(), open_paths=() if protect_health_metrics else OPEN_PATHS)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found" if exc.status_code == 404 else None
        return error_response(ApiError(exc.status_code, str(exc.detail), None, kind))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):  # a bug: still one JSON line, never a traceback page
        return error_response(ApiError(500, f"internal error ({type(exc).__name__}: {exc})", None, "internal_error",
                                       "server_error"))

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name, "queued": scheduler.queued, "active": scheduler.active,
                "submitted": scheduler.submitted, "completed": scheduler.completed, "failed": scheduler.failed,
                "cancelled": scheduler.cancelled, "batching": scheduler.batching,
                "engine": {**engine_info(scheduler.acceptance, scheduler.threshold, default_mode),
                           "max_length": manifest.max_length, "chat_template": frontend.has_chat_template}}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": started,
                                            "owned_by": "eagle-deploy", "max_model_len": manifest.max_length}]}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _complete(request, CHAT, parse_chat, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _complete(request, "completion", parse_completion, "completions")

    def _prepare(raw: bytes, parse) -> tuple[CompletionRequest, list[int]]:
        """Body -> (request, prompt ids), on the frontend's thread. Raises ApiError."""
        req = parse(parse_json(raw))
        if req.model != model_name:  # 404 model_not_found, as OpenAI and vLLM answer it
            raise ApiError(404, f"the model {req.model!r} does not exist; this server serves {model_name!r} "
                                "(GET /v1/models)", "model", "model_not_found")
        return req, frontend.prompt_ids(req)

    def _runtime_request(req: CompletionRequest, ids: list[int], max_tokens: int, mode: str) -> GenerationRequest:
        """The runtime's Request (its own checks, so nothing it would refuse reaches the
        engine); a SettingError is answered as a 400 naming the HTTP field."""
        try:
            request = GenerationRequest(tuple(ids), max_tokens, req.temperature, req.top_p, req.top_k, req.seed,
                                        req.stop, mode, min_p=req.min_p, logit_bias=req.logit_bias,
                                        presence_penalty=req.presence_penalty,
                                        frequency_penalty=req.frequency_penalty,
                                        repetition_penalty=req.repetition_penalty, logprobs=req.logprobs,
                                        response_format=req.response_format, tools=req.tools,
                                        tool_choice=req.tool_choice)
            request.check_vocab(manifest.dims.vocab)
            scheduler.runtime.grammar_for(request)  # a schema the grammar engine refuses: a 400, here
            return request
        except SettingError as err:
            names = {"prompt": req.prompt_param, "max_new_tokens": "max_tokens",
                     "logprobs": "top_logprobs" if req.kind == CHAT else "logprobs"}
            base = err.field.partition("[")[0]
            field = names.get(base, base) + err.field[len(base):]
            raise invalid(field, err.named(field)) from None

    def _logprobs(kind: str, entries, offset: int = 0) -> dict | None:
        """The response's `logprobs` for these TokenLogprobs (None when the request asked for none)."""
        if entries is None:
            return None
        return logprobs_body(kind, entries, lambda t: frontend.tokenizer.decode([t]), offset,
                             lambda t: token_bytes(frontend.tokenizer, t))

    def _deadline(t0: float, req: CompletionRequest) -> tuple[float, float] | None:
        """(monotonic deadline, its length in s) of a request that arrived at t0, or None."""
        limits = [t for t in (request_timeout_s, req.request_timeout_s) if t is not None]
        return (t0 + min(limits), min(limits)) if limits else None

    async def _complete(request: Request, kind: str, parse, endpoint: str):
        t0 = time.monotonic()
        try:
            try:  # the server's deadline covers the upload of the body (the request's own is in the body)
                raw = await asyncio.wait_for(read_body(request, max_body), request_timeout_s)
            except TimeoutError:
                metrics.requests.labels(endpoint, "timeout").inc()
                return timeout_response(request_timeout_s, close=True)
            req, ids = await asyncio.get_running_loop().run_in_executor(frontend.executor, _prepare, raw, parse)
            mode = req.mode or default_mode
            max_tokens = req.max_tokens if req.max_tokens is not None else manifest.max_length
            work = Work(_runtime_request(req, ids, max_tokens, mode), req.user)
            job = scheduler.submit(work, asyncio.get_running_loop())
        except ApiError as err:
            metrics.requests.labels(endpoint, "invalid").inc()
            return error_response(err)
        except ClientDisconnect:  # gone before its body had arrived
            metrics.requests.labels(endpoint, "cancelled").inc()
            return Response(status_code=499)
        except QueueFull as err:
            metrics.requests.labels(endpoint, "rejected").inc()
            return error_response(ApiError(429, f"the server is busy: {err}; retry later", None, "queue_full",
                                           "server_busy"))
        info = engine_info(scheduler.acceptance, scheduler.threshold, mode)
        env = Envelope(kind, model_name, fingerprint(version, info))
        deadline = _deadline(t0, req)
        first = await _next(job, request, deadline)
        if first is None or first.kind == "cancelled":
            metrics.requests.labels(endpoint, "cancelled").inc()
            return Response(status_code=499)  # the client has gone; nobody reads this
        if first.kind == "timeout":
            metrics.requests.labels(endpoint, "timeout").inc()
            return timeout_response(deadline[1])
        if first.kind == "shutdown":
            metrics.requests.labels(endpoint, "cancelled").inc()
            return error_response(shutting_down())
        if first.kind == "error":
            if isinstance(first.error, GrammarError):  # a schema the engine accepted but cannot follow
                metrics.requests.labels(endpoint, "invalid").inc()
                field = "tools" if req.tools and req.tool_choice not in (None, "none", "auto") else "response_format"
                return error_response(invalid(field, str(first.error), "unsupported_value"))
            metrics.requests.labels(endpoint, "error").inc()
            return error_response(engine_error(first.error))
        if req.stream:
            return StreamingResponse(_stream(job, request, env, req, first, info, endpoint, deadline),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                                     background=BackgroundTask(job.cancel))  # also when the stream never started
        ev = first
        while ev is not None and ev.kind == "delta":
            ev = await _next(job, request, deadline)
        if ev is None or ev.kind == "cancelled":
            metrics.requests.labels(endpoint, "cancelled").inc()
            return Response(status_code=499)
        if ev.kind == "timeout":
            metrics.requests.labels(endpoint, "timeout").inc()
            return timeout_response(deadline[1])
        if ev.kind == "shutdown":
            metrics.requests.labels(endpoint, "cancelled").inc()
            return error_response(shutting_down())
        if ev.kind == "error":
            metrics.requests.labels(endpoint, "error").inc()
            return error_response(engine_error(ev.error))
        result = ev.result
        metrics.finished(endpoint, job, result)
        body = env.response(result.text, result.finish_reason, _usage(len(ids), result),
                            {"eagle": {**info, **stats_info(result)}}, _logprobs(kind, result.logprobs),
                            result.tool_calls)
        return JSONResponse(body)

    def _usage(prompt_tokens: int, result) -> dict:
        """OpenAI's usage (prompt_tokens_details.cached_tokens: prompt tokens read from the
        prefix cache) and the speculative-decoding counts."""
        return {**usage(prompt_tokens, len(result.token_ids)),
                "prompt_tokens_details": {"cached_tokens": result.stats.cached_tokens},
                "speculative": result.stats.to_json()["speculative"]}

    async def _next(job: Job, request: Request, deadline: tuple[float, float] | None) -> Event | None:
        """The job's next event; None (job cancelled) once the client has disconnected; an
        Event "timeout" (job cancelled) once the deadline has passed; an Event "shutdown" (job
        cancelled) once the drain of a shutdown is over (`Drain.due`)."""
        while True:
            if drain.due:
                job.cancel()
                return Event("shutdown")
            wait = poll_s if deadline is None else min(poll_s, deadline[0] - time.monotonic())
            try:
                if wait <= 0:
                    raise TimeoutError
                return await job.next_event(wait)
            except TimeoutError:
                if deadline is not None and time.monotonic() >= deadline[0]:
                    job.cancel()
                    return Event("timeout")
                if await request.is_disconnected():
                    job.cancel()
                    return None

    async def _stream(job: Job, request: Request, env: Envelope, req: CompletionRequest, first: Event, info: dict,
                      endpoint: str, deadline: tuple[float, float] | None):
        nulls = req.include_usage  # with include_usage every chunk carries "usage": null, then a usage chunk
        ended = False
        sent_lp, sent_chars = 0, 0  # logprobs and characters streamed so far (completions' text_offset)
        # with tools the answer's text is held until it ends: it may turn out to be a call
        hold = env.kind == CHAT and bool(req.tools) and req.tool_choice != "none"
        last_check = time.monotonic()
        try:
            if env.kind == CHAT:
                yield sse(env.chunk(role=True, usage_null=nulls))
            ev = first
            while True:
                if ev.kind == "delta" and hold:
                    pass
                elif ev.kind == "delta":
                    lp = _logprobs(env.kind, ev.logprobs, sent_chars) if req.logprobs is not None else None
                    sent_lp, sent_chars = sent_lp + len(ev.logprobs), sent_chars + len(ev.text)
                    yield sse(env.chunk(ev.text, usage_null=nulls, logprobs=lp))
                elif ev.kind == "done":
                    result = ev.result
                    if hold:
                        if result.text:
                            yield sse(env.chunk(result.text, usage_null=nulls))
                        if result.tool_calls:
                            yield sse(env.chunk(usage_null=nulls, tool_calls=result.tool_calls))
                    rest = None if result.logprobs is None else result.logprobs[sent_lp:]  # after the last delta
                    yield sse(env.chunk(None, result.finish_reason, usage_null=nulls,
                                        extra={"eagle": {**info, **stats_info(result)}},
                                        logprobs=_logprobs(env.kind, rest, sent_chars) if rest else None))
                    if req.include_usage:
                        yield sse(env.usage_chunk(_usage(len(job.work.prompt_ids), result)))
                    yield DONE
                    metrics.finished(endpoint, job, result)
                    ended = True
                    return
                elif ev.kind == "error":
                    metrics.requests.labels(endpoint, "error").inc()
                    ended = True
                    yield sse(engine_error(ev.error).body())
                    return
                elif ev.kind == "timeout":
                    metrics.requests.labels(endpoint, "timeout").inc()
                    ended = True
                    yield sse(timed_out(deadline[1]).body())
                    return
                elif ev.kind == "shutdown":  # the client learns why, and the stream is complete
                    yield sse(shutting_down().body())
                    yield DONE
                    return
                else:
                    return
                if time.monotonic() - last_check >= poll_s:  # events may never pause long enough for _next to poll
                    last_check = time.monotonic()
                    if await request.is_disconnected():
                        return
                ev = await _next(job, request, deadline)
                if ev is None:
                    return
        finally:
            job.cancel()  # a no-op once the job has finished
            if not ended:
                metrics.requests.labels(endpoint, "cancelled").inc()

    return app
