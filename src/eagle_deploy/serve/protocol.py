"""The OpenAI wire format: request parsing and validation, response bodies, SSE framing.

Requests are validated here, before anything reaches the engine; a bad field raises
`ApiError` (HTTP 400) whose body is OpenAI's error shape

    {"error": {"message": ..., "type": "invalid_request_error", "param": FIELD, "code": ...}}

naming the field (`n`, `max_tokens`, `temperature`, `messages[1].content`, ...). Supported:
`model`, `messages` (chat) or `prompt` (completions: a string, a list of token ids, or a list
of one of either), `max_tokens` / `max_completion_tokens`, `temperature`, `top_p`, `seed`,
`stop` (a string or a list of strings), `stream`, `stream_options.include_usage`, `n` (1
only), `user` (kept as the request's tag); extensions: `top_k` (0 = off) and `mode`
("eagle" | "vanilla", the decoding mode of this request; default: the server's). Fields that
would change the output in ways this server does not implement (`logprobs`, `tools`,
penalties, `logit_bias`, `echo`, `suffix`, `best_of` > 1, a non-text `response_format`) are
rejected rather than ignored; other unknown fields are ignored. Text that reaches the tokenizer
(prompt, message contents, stop strings) must be valid Unicode (no lone surrogates such as
`"\\ud800"`); at most MAX_STOPS stop strings of at most MAX_STOP_CHARS characters each.
`request_timeout_s` (extension) shortens the server's per-request deadline for this request.
"""
from __future__ import annotations

import json
import math
import numbers
import sys
import time
import uuid
from dataclasses import dataclass, field

CHAT, COMPLETION = "chat", "completion"
ROLES = {"system", "developer", "user", "assistant"}
MODES = ("eagle", "vanilla")
MAX_STOPS = 16  # stop strings per request (OpenAI allows 4)
MAX_STOP_CHARS = 256  # characters per stop string


class ApiError(Exception):
    """An error answered in OpenAI's shape. status: HTTP status (400 invalid request, 429 queue
    full, 500 engine failure); param: the offending request field or None."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(param: str | None, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param, code)


@dataclass
class CompletionRequest:
    """One validated request. kind: CHAT or COMPLETION; messages: [{"role", "content": str}]
    (chat) or None; prompt: str or token ids (completions) or None; max_tokens: None = up to
    the KV capacity; stop: non-empty strings; mode: None = the server's default."""

    kind: str
    model: str
    messages: list[dict] | None = None
    prompt: str | list[int] | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    mode: str | None = None
    user: str | None = None
    request_timeout_s: float | None = None
    extras: dict = field(default_factory=dict)

    @property
    def prompt_param(self) -> str:
        """The field that holds the prompt (for errors about it)."""
        return "messages" if self.kind == CHAT else "prompt"


def parse_json(raw: bytes) -> dict:
    """Request body -> dict. Raises ApiError (400) on a body that is not a JSON object."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as err:
        raise invalid(None, f"the request body is not valid JSON ({err})", "invalid_json") from None
    except RecursionError:
        raise invalid(None, "the request body is JSON nested too deeply to parse (about "
                            f"{sys.getrecursionlimit()} levels at most)", "invalid_json") from None
    if not isinstance(body, dict):
        raise invalid(None, "the request body must be a JSON object", "invalid_json")
    return body


def parse_chat(body: dict) -> CompletionRequest:
    """A /v1/chat/completions body -> CompletionRequest. Raises ApiError (400)."""
    req = CompletionRequest(CHAT, _model(body), messages=_messages(body))
    if body.get("max_completion_tokens") is not None:
        req.max_tokens = _integer(body, "max_completion_tokens", None, 1)
    else:
        req.max_tokens = _integer(body, "max_tokens", None, 1)
    _rejected(body, CHAT)
    return _common(body, req)


def parse_completion(body: dict) -> CompletionRequest:
    """A /v1/completions body -> CompletionRequest. Raises ApiError (400)."""
    req = CompletionRequest(COMPLETION, _model(body), prompt=_prompt(body))
    req.max_tokens = _integer(body, "max_tokens", 16, 1)  # OpenAI's default for completions
    _rejected(body, COMPLETION)
    return _common(body, req)


def _common(body: dict, req: CompletionRequest) -> CompletionRequest:
    n = _integer(body, "n", 1, 1)
    if n != 1:
        raise invalid("n", f"n must be 1 (one choice per request), got {n}", "unsupported_value")
    req.temperature = _number(body, "temperature", 1.0, minimum=0.0)
    req.top_p = _number(body, "top_p", 1.0, minimum=0.0, maximum=1.0, open_min=True)
    req.top_k = _integer(body, "top_k", 0, 0)
    req.seed = _integer(body, "seed", None, 0)
    req.stop = _stop(body)
    req.stream = _boolean(body, "stream", False)
    options = body.get("stream_options")
    if options is not None:
        if not req.stream:
            raise invalid("stream_options", "stream_options is only allowed when stream is true")
        if not isinstance(options, dict):
            raise invalid("stream_options", "stream_options must be an object", "invalid_type")
        req.include_usage = _boolean(options, "include_usage", False, "stream_options.include_usage")
    mode = body.get("mode")
    if mode is not None and mode not in MODES:
        raise invalid("mode", f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    req.mode = mode
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise invalid("user", "user must be a string", "invalid_type")
    req.user = user
    if body.get("request_timeout_s") is not None:
        req.request_timeout_s = _number(body, "request_timeout_s", None, minimum=0.0, open_min=True)
    return req


def _text(value: str, param: str) -> str:
    """`value` unchanged if it is valid Unicode (encodable as UTF-8); raises ApiError naming
    `param` if it holds a lone surrogate (JSON allows "\\ud800"; no tokenizer does)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise invalid(param, f"{param} is not valid Unicode: a lone surrogate "
                             f"\\u{ord(value[err.start]):04x} at character {err.start}") from None
    return value


def _model(body: dict) -> str:
    model = body.get("model")
    if model is None:
        raise invalid("model", "you must provide a model parameter", "missing_required_parameter")
    if not isinstance(model, str) or not model:
        raise invalid("model", "model must be a non-empty string", "invalid_type")
    return model


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if messages is None:
        raise invalid("messages", "you must provide messages", "missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "messages must be a non-empty list of {role, content} objects", "invalid_type")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise invalid(f"messages[{i}]", f"messages[{i}] must be an object with role and content", "invalid_type")
        role = m.get("role")
        if role not in ROLES:
            raise invalid(f"messages[{i}].role", f"messages[{i}].role must be one of {', '.join(sorted(ROLES))}, "
                                                 f"got {role!r} (tools are not supported)")
        content = _text(_content(m.get("content"), i), f"messages[{i}].content")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def _content(content, i: int) -> str:
    """A message's content: a string or a list of {"type": "text", "text": str} parts (joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise invalid(f"messages[{i}].content[{j}]", "only text content parts are supported "
                                                             '({"type": "text", "text": ...})', "unsupported_value")
            texts.append(part["text"])
        return "".join(texts)
    raise invalid(f"messages[{i}].content", f"messages[{i}].content must be a string or a list of text parts",
                  "invalid_type")


def _prompt(body: dict) -> str | list[int]:
    prompt = body.get("prompt")
    if prompt is None:
        raise invalid("prompt", "you must provide a prompt", "missing_required_parameter")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise invalid("prompt", "the prompt is empty")
        return _text(prompt, "prompt")
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return [int(t) for t in prompt]
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise invalid("prompt", "one prompt per request: batches of prompts are not supported", "unsupported_value")
    raise invalid("prompt", "prompt must be a non-empty string or a non-empty list of token ids", "invalid_type")


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or any(not isinstance(s, str) or s == "" for s in stops):
        raise invalid("stop", "stop must be a non-empty string or a list of non-empty strings", "invalid_type")
    if len(stops) > MAX_STOPS:
        raise invalid("stop", f"at most {MAX_STOPS} stop strings are allowed, got {len(stops)}")
    for i, s in enumerate(stops):
        if len(s) > MAX_STOP_CHARS:
            raise invalid("stop", f"a stop string may have at most {MAX_STOP_CHARS} characters; stop[{i}] has "
                                  f"{len(s)}")
        _text(s, "stop")
    return tuple(stops)


# field -> (is the value harmless?, why it is refused)
_REFUSED = {
    "logprobs": (lambda v: v in (None, False, 0), "logprobs are not returned by this server"),
    "top_logprobs": (lambda v: v in (None, 0), "logprobs are not returned by this server"),
    "tools": (lambda v: not v, "tools are not supported"),
    "functions": (lambda v: not v, "functions are not supported"),
    "presence_penalty": (lambda v: v in (None, 0), "penalties are not supported (the output would not follow "
                                                   "the target distribution EAGLE verifies against)"),
    "frequency_penalty": (lambda v: v in (None, 0), "penalties are not supported"),
    "logit_bias": (lambda v: not v, "logit_bias is not supported"),
    "response_format": (lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"),
                        "only the text response_format is supported"),
    "echo": (lambda v: v in (None, False), "echo is not supported"),
    "suffix": (lambda v: not v, "suffix is not supported"),
    "best_of": (lambda v: v in (None, 1), "best_of must be 1"),
}


def _rejected(body: dict, kind: str) -> None:
    for name, (harmless, why) in _REFUSED.items():
        if name in body and not harmless(body[name]):
            raise invalid(name, why, "unsupported_value")


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _integer(body: dict, name: str, default, minimum: int):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not _is_int(v):
        raise invalid(name, f"{name} must be an integer, got {v!r}", "invalid_type")
    if v < minimum:
        raise invalid(name, f"{name} must be >= {minimum}, got {v}")
    return int(v)


def _number(body: dict, name: str, default: float, minimum: float, maximum: float | None = None,
            open_min: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, numbers.Real) or isinstance(v, bool):
        raise invalid(name, f"{name} must be a number, got {v!r}", "invalid_type")
    if not math.isfinite(v):
        raise invalid(name, f"{name} must be a finite number, got {v!r}")
    if v < minimum or (open_min and v == minimum) or (maximum is not None and v > maximum):
        lo = "(" if open_min else "["
        hi = f"{maximum}]" if maximum is not None else "inf)"
        raise invalid(name, f"{name} must be in {lo}{minimum}, {hi}, got {v}")
    return float(v)


def _boolean(body: dict, name: str, default: bool, param: str | None = None) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise invalid(param or name, f"{param or name} must be true or false, got {v!r}", "invalid_type")
    return v


# ---- responses ------------------------------------------------------------------------------

@dataclass
class Envelope:
    """What every response or chunk of one request repeats: id ("chatcmpl-..." / "cmpl-..."),
    created (Unix seconds), model, system_fingerprint."""

    kind: str
    model: str
    fingerprint: str
    id: str = ""
    created: int = 0

    def __post_init__(self):
        self.id = self.id or ("chatcmpl-" if self.kind == CHAT else "cmpl-") + uuid.uuid4().hex
        self.created = self.created or int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint}

    def chunk(self, text: str | None = None, finish_reason: str | None = None, role: bool = False,
              usage_null: bool = False, extra: dict | None = None) -> dict:
        """One streamed chunk: chat `choices[0].delta` ({"role"} and/or {"content"}; {} in the
        finishing chunk) or completions `choices[0].text`."""
        if self.kind == CHAT:
            delta = {"role": "assistant", "content": ""} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            out = self._head("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
            out = self._head("text_completion")
        out["choices"] = [choice]
        if usage_null:
            out["usage"] = None
        if extra:
            out.update(extra)
        return out

    def usage_chunk(self, usage: dict) -> dict:
        """The last chunk with stream_options.include_usage: no choices, the request's usage."""
        out = self._head("chat.completion.chunk" if self.kind == CHAT else "text_completion")
        out["choices"], out["usage"] = [], usage
        return out

    def response(self, text: str, finish_reason: str, usage: dict, extra: dict | None = None) -> dict:
        """The non-streamed response body."""
        if self.kind == CHAT:
            out = self._head("chat.completion")
            out["choices"] = [{"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                               "logprobs": None, "finish_reason": finish_reason}]
        else:
            out = self._head("text_completion")
            out["choices"] = [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]
        out["usage"] = usage
        if extra:
            out.update(extra)
        return out


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(obj) -> str:
    """One server-sent event: `data: {json}\\n\\n` (`data: [DONE]\\n\\n` for the string "[DONE]")."""
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


DONE = sse("[DONE]")
