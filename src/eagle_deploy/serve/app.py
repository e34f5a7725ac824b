"""The eagle-serve FastAPI application: OpenAI-compatible endpoints over a `Scheduler`.

    POST /v1/chat/completions, POST /v1/completions   (stream and non-stream)
    GET  /v1/models, /health, /metrics (Prometheus text format)

`create_app` is the router: the app, its middleware, exception handlers (errors in OpenAI's
shape, never a traceback page) and routes. The two completion routes hand the request to
`completion.Completions`, where its body is read, validated and tokenised (by this module's
`Frontend`, on its own thread), submitted, and answered: how a request that times out, is
cancelled, fails or meets the end of a shutdown's drain is answered is written there. With
`api_key` every route but /health and /metrics (those too with `protect_health_metrics`)
needs `Authorization: Bearer <key>` (401).
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from importlib import metadata

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from eagle_deploy.contract.errors import SettingError, prompt_too_long
from eagle_deploy.runtime.api import load_tokenizer
from eagle_deploy.runtime.request import Request as GenerationRequest
from eagle_deploy.runtime.text import encode_prompt

from .completion import Completions, Drain, error_response
from .guard import OPEN_PATHS, BearerAuth, RequestLimit
from .metrics import ServeMetrics
from .protocol import ApiError, CompletionRequest, invalid, parse_chat, parse_completion
from .scheduler import Scheduler, decoding_info

POLL_S = 0.05  # seconds between disconnect checks while a request waits for a slot
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
        """A second tokenizer instance loaded from the export (the decode workers keep their own)."""
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
    app.state.drain = Drain()
    complete = Completions(scheduler, frontend, metrics, app.state.drain, model_name=model_name,
                           default_mode=default_mode, version=version, poll_s=poll_s,
                           max_body=int(max_body_mb * 2**20), request_timeout_s=request_timeout_s)
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
                "decoding": {**decoding_info(scheduler.acceptance, scheduler.threshold, default_mode),
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
        return await complete(request, parse_chat, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, parse_completion, "completions")

    return app
