"""The eagle-serve FastAPI application: OpenAI-compatible endpoints over a `Scheduler`.

    POST /v1/chat/completions, POST /v1/completions   (stream and non-stream)
    GET  /v1/models, /health, /metrics (Prometheus text format)

A request is parsed, validated and tokenised here (its own tokenizer instance, used on the
event-loop thread only) before it reaches the engine: an invalid one gets a 400 and never
touches it. A streamed response starts once the engine has produced the first text (or
finished): a request that fails before that gets a plain 500; one that fails later gets an
SSE event `data: {"error": {...}}` and the stream ends. Either way only that request fails.
While waiting for the engine the handler polls `request.is_disconnected()` every `poll_s`
seconds (and the streaming generator's `finally` cancels the job when the server closes it),
so a client that goes away frees the engine within one decode round.
"""
from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from importlib import metadata
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from eagle_deploy.runtime.api import check_request
from eagle_deploy.runtime.text import encode_chat, encode_user

from .engine import Event, Job, QueueFull, Scheduler, Work, engine_info, fingerprint, stats_info
from .metrics import ServeMetrics
from .protocol import (
    CHAT,
    DONE,
    ApiError,
    CompletionRequest,
    Envelope,
    invalid,
    parse_chat,
    parse_completion,
    parse_json,
    sse,
    usage,
)

POLL_S = 0.05  # seconds between disconnect checks while a request waits for the engine


def package_version() -> str:
    try:
        return metadata.version("eagle-deploy")
    except metadata.PackageNotFoundError:
        return "0"


class Frontend:
    """Prompt -> token ids on the HTTP side, with the checks that need the tokenizer: a chat
    template exists, token ids lie in [0, vocab), the prompt leaves room for one output token
    in the KV capacity (max_length rows). Raises ApiError (400)."""

    def __init__(self, tokenizer, max_length: int, vocab: int):
        self.tokenizer, self.max_length, self.vocab = tokenizer, max_length, vocab

    @classmethod
    def for_runtime(cls, runtime) -> "Frontend":
        """A second tokenizer instance loaded from the export (the engine thread keeps its own)."""
        from transformers import AutoTokenizer

        m = runtime.manifest
        if not m.tokenizer:
            raise ValueError("this export has no tokenizer; eagle-serve needs one (re-export with the tokenizer)")
        tokenizer = AutoTokenizer.from_pretrained(str(Path(runtime.folder) / m.tokenizer))
        return cls(tokenizer, m.max_length, m.dims.vocab)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def prompt_ids(self, req: CompletionRequest) -> list[int]:
        param = req.prompt_param
        if req.messages is not None:
            if not self.has_chat_template:
                raise invalid("messages", "this model has no chat template: use /v1/completions", "unsupported_value")
            try:
                ids = encode_chat(self.tokenizer, req.messages)
            except Exception as err:  # the template's own checks (e.g. role order)
                raise invalid("messages", f"the chat template rejected these messages: {err}") from None
        elif isinstance(req.prompt, str):
            ids = encode_user(self.tokenizer, req.prompt, chat=False)
        else:
            ids = list(req.prompt or ())
            bad = [t for t in ids if not 0 <= t < self.vocab]
            if bad:
                raise invalid("prompt", f"prompt token ids must be in [0, {self.vocab}), got {bad[0]}")
        if not ids:
            raise invalid(param, "the prompt encodes to no tokens")
        if len(ids) >= self.max_length:
            raise invalid(param, f"the prompt has {len(ids)} tokens; this model's KV capacity is {self.max_length} "
                                 f"tokens, so at most {self.max_length - 1} prompt tokens fit (one row is left for "
                                 "output)", "context_length_exceeded")
        return ids


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


def engine_error(error: BaseException | None) -> ApiError:
    what = f"{type(error).__name__}: {error}" if error is not None else "unknown error"
    return ApiError(500, f"the engine failed on this request ({what}); the server keeps serving", None,
                    "engine_error", "server_error")


def create_app(scheduler: Scheduler, *, model_name: str | None = None, default_mode: str = "eagle",
               frontend: Frontend | None = None, poll_s: float = POLL_S) -> FastAPI:
    """The app over `scheduler` (started and closed by the app's lifespan). model_name: the id
    clients must send as `model` (default: the export's manifest name); default_mode: "eagle"
    or "vanilla" for requests that do not set the `mode` extension field."""
    runtime = scheduler.runtime
    manifest = runtime.manifest
    model_name = model_name or manifest.name
    frontend = frontend or Frontend.for_runtime(runtime)
    metrics = ServeMetrics()
    metrics.bind(scheduler)
    version = package_version()
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        try:
            yield
        finally:
            scheduler.close()

    app = FastAPI(title="eagle-serve", version=version, lifespan=lifespan)
    app.state.scheduler, app.state.metrics, app.state.frontend = scheduler, metrics, frontend

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found" if exc.status_code == 404 else None
        return error_response(ApiError(exc.status_code, str(exc.detail), None, kind))

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

    async def _complete(request: Request, kind: str, parse, endpoint: str):
        try:
            req = parse(parse_json(await request.body()))
            if req.model != model_name:
                raise invalid("model", f"the model {req.model!r} does not exist; this server serves {model_name!r} "
                                       "(GET /v1/models)", "model_not_found")
            ids = frontend.prompt_ids(req)
            mode = req.mode or default_mode
            max_tokens = req.max_tokens if req.max_tokens is not None else manifest.max_length
            try:  # the runtime's own checks, so nothing it would refuse reaches the engine
                check_request(max_tokens, req.temperature, req.top_p, req.top_k, req.seed, list(req.stop), mode)
            except ValueError as err:
                raise invalid(None, str(err)) from None
            work = Work(tuple(ids), max_tokens, req.temperature, req.top_p, req.top_k, req.seed, req.stop, mode,
                        req.user)
            job = scheduler.submit(work, asyncio.get_running_loop())
        except ApiError as err:
            metrics.requests.labels(endpoint, "invalid").inc()
            return error_response(err)
        except QueueFull as err:
            metrics.requests.labels(endpoint, "rejected").inc()
            return error_response(ApiError(429, f"the server is busy: {err}; retry later", None, "queue_full",
                                           "server_busy"))
        info = engine_info(scheduler.acceptance, scheduler.threshold, mode)
        env = Envelope(kind, model_name, fingerprint(version, info))
        first = await _next(job, request)
        if first is None or first.kind == "cancelled":
            metrics.requests.labels(endpoint, "cancelled").inc()
            return Response(status_code=499)  # the client has gone; nobody reads this
        if first.kind == "error":
            metrics.requests.labels(endpoint, "error").inc()
            return error_response(engine_error(first.error))
        if req.stream:
            return StreamingResponse(_stream(job, request, env, req, first, info, endpoint),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                                     background=BackgroundTask(job.cancel))  # also when the stream never started
        ev = first
        while ev is not None and ev.kind == "delta":
            ev = await _next(job, request)
        if ev is None or ev.kind == "cancelled":
            metrics.requests.labels(endpoint, "cancelled").inc()
            return Response(status_code=499)
        if ev.kind == "error":
            metrics.requests.labels(endpoint, "error").inc()
            return error_response(engine_error(ev.error))
        result = ev.result
        metrics.finished(endpoint, job, result)
        body = env.response(result.text, result.finish_reason, usage(len(ids), len(result.token_ids)),
                            {"eagle": {**info, **stats_info(result)}})
        return JSONResponse(body)

    async def _next(job: Job, request: Request) -> Event | None:
        """The job's next event, or None (job cancelled) once the client has disconnected."""
        while True:
            try:
                return await job.next_event(poll_s)
            except TimeoutError:
                if await request.is_disconnected():
                    job.cancel()
                    return None

    async def _stream(job: Job, request: Request, env: Envelope, req: CompletionRequest, first: Event, info: dict,
                      endpoint: str):
        nulls = req.include_usage  # with include_usage every chunk carries "usage": null, then a usage chunk
        ended = False
        last_check = time.monotonic()
        try:
            if env.kind == CHAT:
                yield sse(env.chunk(role=True, usage_null=nulls))
            ev = first
            while True:
                if ev.kind == "delta":
                    yield sse(env.chunk(ev.text, usage_null=nulls))
                elif ev.kind == "done":
                    result = ev.result
                    yield sse(env.chunk(None, result.finish_reason, usage_null=nulls,
                                        extra={"eagle": {**info, **stats_info(result)}}))
                    if req.include_usage:
                        yield sse(env.usage_chunk(usage(len(job.work.prompt_ids), len(result.token_ids))))
                    yield DONE
                    metrics.finished(endpoint, job, result)
                    ended = True
                    return
                elif ev.kind == "error":
                    metrics.requests.labels(endpoint, "error").inc()
                    ended = True
                    yield sse(engine_error(ev.error).body())
                    return
                else:
                    return
                if time.monotonic() - last_check >= poll_s:  # events may never pause long enough for _next to poll
                    last_check = time.monotonic()
                    if await request.is_disconnected():
                        return
                ev = await _next(job, request)
                if ev is None:
                    return
        finally:
            job.cancel()  # a no-op once the job has finished
            if not ended:
                metrics.requests.labels(endpoint, "cancelled").inc()

    return app
