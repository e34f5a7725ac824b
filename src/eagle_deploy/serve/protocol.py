"""The OpenAI wire format: request parsing and validation, response bodies, SSE framing.

Requests are validated here, before anything reaches the scheduler, by one pydantic model per
endpoint (`ChatBody`, `CompletionBody` in serve/bodies.py: strict types, so `true` is no
integer; null is the same as absent). The first bad field raises `ApiError` (HTTP 400) whose
body is OpenAI's error shape (the field located by contract/field_errors.py)

    {"error": {"message": ..., "type": "invalid_request_error", "param": FIELD, "code": ...}}

naming the field (`n`, `max_tokens`, `temperature`, `messages[1].content`, ...). Supported:
`model`, `messages` (chat) or `prompt` (completions: a string, a list of token ids, or a list
of one of either), `max_tokens` / `max_completion_tokens`, `temperature`, `top_p`, `seed`,
`stop` (a string or a list of strings), `stream`, `stream_options.include_usage`, `n` (1
only), `user` (kept as the request's tag), `logprobs` (chat: true/false with `top_logprobs`
0-20; completions: 0-20 alternatives), `logit_bias`, `presence_penalty`,
`frequency_penalty`; extensions: `top_k` (0 = off), `min_p`, `repetition_penalty` (vLLM's)
and `mode` ("eagle" | "vanilla", the decoding mode of this request; default: the server's).
Their ranges are the runtime's (`runtime.request.Request`, each error naming the HTTP field).
`response_format` (`text`, `json_object`, `json_schema`) makes the output follow that grammar
(runtime/grammar.py). Fields of OpenAI's and vLLM's that would change the output in ways
this server does not implement (`echo`, `suffix`, `best_of` > 1, `functions`, vLLM's `guided_*`,
`min_tokens`, `ignore_eos`, `stop_token_ids`, ...: `bodies._REFUSED`) are rejected rather than
ignored; other unknown fields are ignored. Text that reaches the tokenizer
(prompt, message contents, stop strings) must be valid Unicode (no lone surrogates such as
`"\\ud800"`); at most MAX_STOPS stop strings of at most MAX_STOP_CHARS characters each.
`request_timeout_s` (extension) shortens the server's per-request deadline for this request.
"""
from __future__ import annotations

import json
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from pydantic import BaseModel, ValidationError

from eagle_deploy.contract.field_errors import CHECK, Problem, problems
from eagle_deploy.runtime.request import MAX_STOP_CHARS, MAX_STOPS, MODES
from eagle_deploy.runtime.shaping import TokenLogprob

from .bodies import ChatBody, CompletionBody, Range, Tail, integral

CHAT, COMPLETION = "chat", "completion"
__all__ = ["MAX_STOPS", "MAX_STOP_CHARS", "MODES"]  # the runtime's limits, re-exported for the HTTP side


class ApiError(Exception):
    """An error answered in OpenAI's shape. status: HTTP status (400 invalid request, 429 queue
    full, 500 decoding failure); param: the offending request field or None."""

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
    logprobs: int | None = None  # None: off; k: each token's logprob and its k best alternatives
    logit_bias: Any = None
    presence_penalty: Any = 0.0
    frequency_penalty: Any = 0.0
    repetition_penalty: Any = 1.0
    min_p: Any = 0.0
    response_format: Any = None
    tools: Any = None
    tool_choice: Any = None
    extras: dict = field(default_factory=dict)

    @property
    def prompt_param(self) -> str:
        """The field that holds the prompt (for errors about it)."""
        return "messages" if self.kind == CHAT else "prompt"


MAX_DIGITS = 4300  # digits of a JSON integer at most (Python's default int_max_str_digits)


class _Digits:
    """Stands in for a JSON integer of more than MAX_DIGITS digits while the body is parsed."""

    def __init__(self, digits: int):
        self.digits = digits


def _parse_int(text: str):
    digits = len(text.lstrip("-"))
    return int(text) if digits <= MAX_DIGITS else _Digits(digits)


def _find_digits(body) -> tuple[str, int] | None:
    """(field, digits) of the first _Digits in `body` ("max_tokens", "prompt[3]"), or None."""
    todo = [("", body)]
    while todo:
        where, value = todo.pop()
        if isinstance(value, _Digits):
            return where or "the request body", value.digits
        if isinstance(value, dict):
            todo.extend((f"{where}.{k}" if where else str(k), v) for k, v in reversed(value.items()))
        elif isinstance(value, list):
            todo.extend((f"{where}[{i}]", v) for i, v in reversed(list(enumerate(value))))
    return None


def parse_json(raw: bytes) -> dict:
    """Request body -> dict. Raises ApiError (400) on a body that is not a JSON object, and on
    an integer of more than MAX_DIGITS digits (the error names the field holding it)."""
    huge = []

    def parse_int(text: str):
        value = _parse_int(text)
        if isinstance(value, _Digits):
            huge.append(value)
        return value

    try:
        body = json.loads(raw, parse_int=parse_int)
    except (ValueError, UnicodeDecodeError) as err:
        raise invalid(None, f"the request body is not valid JSON ({err})", "invalid_json") from None
    except RecursionError:
        raise invalid(None, "the request body is JSON nested too deeply to parse (about "
                            f"{sys.getrecursionlimit()} levels at most)", "invalid_json") from None
    if huge:
        where, digits = _find_digits(body)
        raise invalid(None if where == "the request body" else where,
                      f"{where} is a number with too many digits ({digits}; at most {MAX_DIGITS})")
    if not isinstance(body, dict):
        raise invalid(None, "the request body must be a JSON object", "invalid_json")
    return body


def parse_chat(body: dict) -> CompletionRequest:
    """A /v1/chat/completions body -> CompletionRequest. Raises ApiError (400)."""
    r = _read(ChatBody, body)
    if r.top_logprobs is not None and not r.logprobs:
        raise invalid("top_logprobs", "top_logprobs needs logprobs set to true")
    req = _request(r, CompletionRequest(CHAT, r.model, messages=[m.model_dump(exclude_none=True) for m in r.messages],
                                        max_tokens=r.max_completion_tokens or r.max_tokens,
                                        logprobs=(r.top_logprobs or 0) if r.logprobs else None))
    req.tools, req.tool_choice = r.tools, r.tool_choice
    return req


def parse_completion(body: dict) -> CompletionRequest:
    """A /v1/completions body -> CompletionRequest. Raises ApiError (400)."""
    r = _read(CompletionBody, body)
    return _request(r, CompletionRequest(COMPLETION, r.model, prompt=r.prompt, max_tokens=r.max_tokens,
                                         logprobs=r.logprobs))


def _request(r: Tail, req: CompletionRequest) -> CompletionRequest:
    req.temperature, req.top_p, req.top_k, req.seed, req.stop = r.temperature, r.top_p, r.top_k, r.seed, r.stop or ()
    req.stream, req.mode, req.user, req.request_timeout_s = r.stream, r.mode, r.user, r.request_timeout_s
    req.include_usage = r.stream_options is not None and r.stream_options.include_usage
    req.logit_bias, req.presence_penalty, req.frequency_penalty = r.logit_bias or {}, r.presence_penalty, \
        r.frequency_penalty
    req.repetition_penalty, req.min_p = r.repetition_penalty, r.min_p
    req.response_format = r.response_format
    return req


# what a field must be when pydantic finds it of the wrong type
_TYPES = {"int_type": "an integer", "int_from_float": "an integer", "float_type": "a number",
          "bool_type": "true or false"}
_REQUIRED = {"model": "you must provide a model parameter", "messages": "you must provide messages",
             "prompt": "you must provide a prompt"}
_SHAPES = {"model": "model must be a non-empty string",
           "messages": "messages must be a non-empty list of {role, content} objects",
           "stream_options": "stream_options must be an object", "user": "user must be a string",
           "logit_bias": "logit_bias must be an object mapping token ids to numbers"}


def _read(model: type[BaseModel], body: dict):
    try:
        return model.model_validate(body)
    except ValidationError as err:  # the first: fields in the order of the request's documentation
        raise _api_error(problems(model, err, body)[0]) from None


def _api_error(p: Problem) -> ApiError:
    """One pydantic error as OpenAI's: the field (`messages[1].content`), a sentence, a code."""
    param, kind, value = p.path, p.kind, p.input
    if kind == CHECK:
        return invalid(param or None, p.ctx["message"].replace("{param}", param), p.ctx["code"])
    if kind == "string_unicode":
        return invalid(param, f"{param} is not valid Unicode (a lone surrogate)")
    if kind == "missing" and param in _REQUIRED:
        return invalid(param, _REQUIRED[param], "missing_required_parameter")
    if param in _SHAPES:
        return invalid(param, _SHAPES[param], "invalid_type")
    if kind == "model_type":  # messages[i]
        return invalid(param, f"{param} must be an object with role and content", "invalid_type")
    if kind in _TYPES:
        return invalid(param, f"{param} must be {_TYPES[kind]}, got {value!r}", "invalid_type")
    if kind == "finite_number":
        return invalid(param, f"{param} must be a finite number, got {value!r}")
    if kind == "literal_error":
        return invalid(param, f"{param} must be one of {', '.join(MODES)}, got {value!r}")
    said = p.expect(Range)  # a number out of its range: the field's Range says which
    if said is None:
        return invalid(param, f"{param} is invalid ({p.message})")
    return invalid(param, f"{param} {said.text}, got {integral(value) if said.integer else value}")


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
              usage_null: bool = False, extra: dict | None = None, logprobs: dict | None = None,
              tool_calls: list[dict] | None = None) -> dict:
        """One streamed chunk: chat `choices[0].delta` ({"role"} and/or {"content"}, or the
        answer's `tool_calls`, each with its "index"; {} in the finishing chunk) or completions
        `choices[0].text`; logprobs: the chunk's tokens' (`logprobs_body`), or None."""
        if self.kind == CHAT:
            delta = {"role": "assistant", "content": ""} if role else {}
            if text is not None:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(tool_calls)]
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            out = self._head("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
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

    def response(self, text: str, finish_reason: str, usage: dict, extra: dict | None = None,
                 logprobs: dict | None = None, tool_calls: list[dict] | None = None) -> dict:
        """The non-streamed response body; logprobs: `logprobs_body` of its tokens, or None;
        tool_calls: the calls of a chat answer (its content then None when no text is left)."""
        if self.kind == CHAT:
            out = self._head("chat.completion")
            message = {"role": "assistant", "content": text if text or not tool_calls else None, "refusal": None}
            if tool_calls:
                message["tool_calls"] = tool_calls
            out["choices"] = [{"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}]
        else:
            out = self._head("text_completion")
            out["choices"] = [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]
        out["usage"] = usage
        if extra:
            out.update(extra)
        return out


def logprobs_body(kind: str, entries: Sequence[TokenLogprob], text_of: Callable[[int], str],
                  offset: int = 0, bytes_of: Callable[[int], bytes] | None = None) -> dict:
    """OpenAI's `logprobs` of a choice for `entries` (runtime TokenLogprobs), token texts by
    `text_of(id)` and raw bytes by `bytes_of(id)` (default: the text's UTF-8): chat {"content":
    [{"token", "logprob", "bytes", "top_logprobs": [...]}], "refusal": None}; completions
    {"tokens", "token_logprobs", "top_logprobs" ({text: logprob} per token), "text_offset" (from
    `offset`, characters)}."""
    texts = [text_of(e.token) for e in entries]
    raw = bytes_of or (lambda t: text_of(t).encode("utf-8"))
    if kind == CHAT:
        def entry(token_id: int, token: str, logprob: float) -> dict:
            return {"token": token, "logprob": logprob, "bytes": list(raw(token_id))}

        return {"content": [{**entry(e.token, t, e.logprob),
                             "top_logprobs": [entry(i, text_of(i), lp) for i, lp in e.top]}
                            for t, e in zip(texts, entries)], "refusal": None}
    offsets = [offset + sum(len(t) for t in texts[:j]) for j in range(len(texts))]
    return {"tokens": texts, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{text_of(i): lp for i, lp in e.top} for e in entries], "text_offset": offsets}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(obj) -> str:
    """One server-sent event: `data: {json}\\n\\n` (`data: [DONE]\\n\\n` for the string "[DONE]")."""
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


DONE = sse("[DONE]")
