"""The OpenAI wire format: request parsing and validation, response bodies, SSE framing.

Requests are validated here, before anything reaches the engine, by one pydantic model per
endpoint (`_ChatBody`, `_CompletionBody`: strict types, so `true` is no integer; null is the
same as absent). The first bad field raises `ApiError` (HTTP 400) whose body is OpenAI's error
shape

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
`min_tokens`, `ignore_eos`, `stop_token_ids`, ...: `_REFUSED`) are rejected rather than ignored;
other unknown fields are ignored. Text that reaches the tokenizer
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
from typing import Annotated, Any, Callable, Literal, Optional, Sequence, get_args

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from eagle_deploy.contract.errors import SettingError
from eagle_deploy.runtime.request import MAX_STOP_CHARS, MAX_STOPS, MODES, check_stops
from eagle_deploy.runtime.shaping import TokenLogprob

CHAT, COMPLETION = "chat", "completion"
ROLES = {"system", "developer", "user", "assistant", "tool"}
__all__ = ["MAX_STOPS", "MAX_STOP_CHARS", "MODES"]  # the runtime's limits, re-exported for the HTTP side


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
    r = _read(_ChatBody, body)
    if r.top_logprobs is not None and not r.logprobs:
        raise invalid("top_logprobs", "top_logprobs needs logprobs set to true")
    req = _request(r, CompletionRequest(CHAT, r.model, messages=[m.model_dump(exclude_none=True) for m in r.messages],
                                        max_tokens=r.max_completion_tokens or r.max_tokens,
                                        logprobs=(r.top_logprobs or 0) if r.logprobs else None))
    req.tools, req.tool_choice = r.tools, r.tool_choice
    return req


def parse_completion(body: dict) -> CompletionRequest:
    """A /v1/completions body -> CompletionRequest. Raises ApiError (400)."""
    r = _read(_CompletionBody, body)
    return _request(r, CompletionRequest(COMPLETION, r.model, prompt=r.prompt, max_tokens=r.max_tokens,
                                         logprobs=r.logprobs))


def _request(r: _Tail, req: CompletionRequest) -> CompletionRequest:
    req.temperature, req.top_p, req.top_k, req.seed, req.stop = r.temperature, r.top_p, r.top_k, r.seed, r.stop or ()
    req.stream, req.mode, req.user, req.request_timeout_s = r.stream, r.mode, r.user, r.request_timeout_s
    req.include_usage = r.stream_options is not None and r.stream_options.include_usage
    req.logit_bias, req.presence_penalty, req.frequency_penalty = r.logit_bias or {}, r.presence_penalty, \
        r.frequency_penalty
    req.repetition_penalty, req.min_p = r.repetition_penalty, r.min_p
    req.response_format = r.response_format
    return req


# ---- request validation: pydantic models, each error one ApiError naming the field ---------

def _api(message: str, code: str = "invalid_value", at: str = "") -> PydanticCustomError:
    """A failed check of the field that raises it (`at`: a path below it); "{param}" in
    `message` becomes the field's name."""
    return PydanticCustomError("api", "{message}", {"message": message, "code": code, "at": at})


class _Range:
    """Annotation metadata: the allowed range in words ("must be >= 1"); integer: the value is
    shown as the integer it was read as (16.0 as 16)."""

    def __init__(self, text: str, integer: bool = False):
        self.text, self.integer = text, integer


def _integral(v):
    return int(v) if isinstance(v, float) and v.is_integer() else v  # 16.0 is 16; 2.5 stays no integer


def _int(minimum: int):
    return Annotated[int, BeforeValidator(_integral), Field(ge=minimum), _Range(f"must be >= {minimum}", True)]


def _number(minimum: float, maximum: float | None = None, open_min: bool = False):
    bounds = Field(allow_inf_nan=False, **{"gt" if open_min else "ge": minimum}, le=maximum)
    hi = f"{maximum}]" if maximum is not None else "inf)"
    return Annotated[float, bounds, _Range(f"must be in {'(' if open_min else '['}{minimum}, {hi}")]


class _Body(BaseModel):
    """Absent and null are the same; fields this server does not know are ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data):
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class _Message(_Body):
    role: Any = Field(None, validate_default=True)
    tool_calls: Optional[list[dict]] = None  # an assistant's calls (before content: content may then be absent)
    content: Any = Field(None, validate_default=True)
    tool_call_id: Optional[str] = None  # a tool message's answer to that call
    name: Optional[str] = None

    @field_validator("role")
    @classmethod
    def _role(cls, role):
        if not isinstance(role, str) or role not in ROLES:
            raise _api(f"{{param}} must be one of {', '.join(sorted(ROLES))}, got {role!r}")
        return "system" if role == "developer" else role

    @field_validator("content")
    @classmethod
    def _content(cls, content, info) -> str | None:
        """A string or a list of {"type": "text", "text": str} parts (joined); absent for an
        assistant message with tool_calls."""
        if content is None and info.data.get("role") == "assistant" and info.data.get("tool_calls"):
            return None
        if isinstance(content, list) and content:
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise _api('only text content parts are supported ({"type": "text", "text": ...})',
                               "unsupported_value", f"[{j}]")
            content = "".join(part["text"] for part in content)
        if not isinstance(content, str):
            raise _api("{param} must be a string or a list of text parts", "invalid_type")
        return _unicode(content)


class _StreamOptions(_Body):
    include_usage: bool = False


class _ChatHead(_Body):
    model: Annotated[str, Field(min_length=1)]
    messages: Annotated[list[_Message], Field(min_length=1)]
    max_completion_tokens: Optional[_int(1)] = None
    max_tokens: Optional[_int(1)] = None
    logprobs: bool = False
    top_logprobs: Optional[_int(0)] = None  # alternatives per token (the runtime caps them)
    tools: Any = None  # checked by the runtime's Request (runtime/tools.py)
    tool_choice: Any = None

    @model_validator(mode="before")
    @classmethod
    def _newer_name_first(cls, data):
        """max_completion_tokens replaces max_tokens (which is then not read)."""
        if isinstance(data, dict) and data.get("max_completion_tokens") is not None:
            return {k: v for k, v in data.items() if k != "max_tokens"}
        return data


class _CompletionHead(_Body):
    model: Annotated[str, Field(min_length=1)]
    prompt: Any
    max_tokens: _int(1) = 16  # OpenAI's default for completions
    logprobs: Optional[_int(0)] = None  # alternatives per token (the runtime caps them)

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, prompt) -> str | list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            if not prompt:
                raise _api("the prompt is empty")
            return _unicode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return prompt
        if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
            raise _api("one prompt per request: batches of prompts are not supported", "unsupported_value")
        raise _api("prompt must be a non-empty string or a non-empty list of token ids", "invalid_type")


# field -> (is the value harmless?, why it is refused)
_REFUSED = {
    "functions": (lambda v: not v, "functions are not supported (the legacy field: use tools)"),
    "echo": (lambda v: v in (None, False), "echo is not supported"),
    "suffix": (lambda v: not v, "suffix is not supported"),
    "best_of": (lambda v: v in (None, 1), "best_of must be 1"),
    # vLLM's and OpenAI's fields that would change the output, not served here: refused, never ignored
    **{name: (lambda v: v is None or v == [] or v == {}, f"{name} is not supported" + hint) for name, hint in (
        ("guided_json", ": use response_format"), ("guided_regex", ""), ("guided_choice", ""),
        ("guided_grammar", ""), ("structured_outputs", ": use response_format"), ("min_tokens", ""),
        ("stop_token_ids", ""), ("prediction", ""), ("audio", ""), ("reasoning_effort", ""))},
    "ignore_eos": (lambda v: v in (None, False), "ignore_eos is not supported"),
    "include_stop_str_in_output": (lambda v: v in (None, False), "include_stop_str_in_output is not supported"),
    "skip_special_tokens": (lambda v: v in (None, True), "skip_special_tokens false is not supported"),
    "modalities": (lambda v: v in (None, ["text"]), 'only the "text" modality is supported'),
    "parallel_tool_calls": (lambda v: v in (None, True), "parallel_tool_calls false is not supported"),
}


class _Tail(_Body):
    """The fields both endpoints take, checked after the prompt (a subclass lists this class
    first among its bases, so that its own fields come first)."""

    functions: Any = None  # refused (see _REFUSED) unless harmless
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    min_tokens: Any = None
    stop_token_ids: Any = None
    prediction: Any = None
    audio: Any = None
    reasoning_effort: Any = None
    ignore_eos: Any = None
    include_stop_str_in_output: Any = None
    skip_special_tokens: Any = None
    modalities: Any = None
    parallel_tool_calls: Any = None
    response_format: Any = None  # checked by the runtime's Request (runtime/grammar.py)
    echo: Any = None
    suffix: Any = None
    best_of: Any = None
    n: _int(1) = 1
    temperature: _number(0.0) = 1.0
    top_p: _number(0.0, 1.0, open_min=True) = 1.0
    top_k: _int(0) = 0
    seed: Optional[_int(0)] = None
    stop: Any = None
    stream: bool = False
    stream_options: Optional[_StreamOptions] = None
    mode: Optional[Literal[MODES]] = None
    user: Optional[str] = None
    request_timeout_s: Optional[_number(0.0, open_min=True)] = None
    # ranges checked by the runtime's Request (runtime/request.py), named as these fields
    logit_bias: Optional[dict[str, Any]] = None
    presence_penalty: Any = 0.0
    frequency_penalty: Any = 0.0
    repetition_penalty: Any = 1.0
    min_p: Any = 0.0

    @field_validator(*_REFUSED)
    @classmethod
    def _refused(cls, value, info):
        harmless, why = _REFUSED[info.field_name]
        if not harmless(value):
            raise _api(why, "unsupported_value")
        return value

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise _api(f"n must be 1 (one choice per request), got {n}", "unsupported_value")
        return n

    @field_validator("stop")
    @classmethod
    def _stop(cls, stop) -> tuple[str, ...]:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or any(not isinstance(s, str) or s == "" for s in stops):
            raise _api("stop must be a non-empty string or a list of non-empty strings", "invalid_type")
        try:  # the runtime's limits (runtime.request.check_stops), named as this field
            return check_stops(stops)
        except SettingError as err:
            at = err.field.removeprefix("stop")
            raise _api(f"{{param}} {err.rule}", at=at) from None

    @field_validator("stream_options", mode="before")
    @classmethod
    def _only_when_streaming(cls, options, info):
        if not info.data.get("stream"):
            raise _api("stream_options is only allowed when stream is true")
        return options


class _ChatBody(_Tail, _ChatHead):
    pass


class _CompletionBody(_Tail, _CompletionHead):
    pass


def _unicode(value: str) -> str:
    """`value` unchanged if it is valid Unicode (encodable as UTF-8); else the error names the
    field holding it (JSON allows a lone surrogate such as "\\ud800"; no tokenizer does)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise _api(f"{{param}} is not valid Unicode: a lone surrogate \\u{ord(value[err.start]):04x} at character "
                   f"{err.start}") from None
    return value


# what a field must be when pydantic finds it of the wrong type
_TYPES = {"int_type": "an integer", "int_from_float": "an integer", "float_type": "a number",
          "bool_type": "true or false"}
_REQUIRED = {"model": "you must provide a model parameter", "messages": "you must provide messages",
             "prompt": "you must provide a prompt"}
_SHAPES = {"model": "model must be a non-empty string",
           "messages": "messages must be a non-empty list of {role, content} objects",
           "stream_options": "stream_options must be an object", "user": "user must be a string",
           "logit_bias": "logit_bias must be an object mapping token ids to numbers"}


def _read(model: type[_Body], body: dict) -> _Body:
    try:
        return model.model_validate(body)
    except ValidationError as err:
        raise _api_error(model, err.errors()[0]) from None  # fields in the order of the request's documentation


def _api_error(model: type[_Body], e: dict) -> ApiError:
    """One pydantic error as OpenAI's: the field (`messages[1].content`), a sentence, a code."""
    loc, kind, value, ctx = e["loc"], e["type"], e.get("input"), e.get("ctx") or {}
    param = "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in loc).lstrip(".")
    if kind == "api":
        param += ctx["at"]
        return invalid(param or None, ctx["message"].replace("{param}", param), ctx["code"])
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
    field = model.model_fields[loc[0]]  # a number out of its range: the field's _Range says which
    metadata = [*field.metadata, *(m for a in get_args(field.annotation) for m in getattr(a, "__metadata__", ()))]
    said = next((m for m in metadata if isinstance(m, _Range)), None)
    if said is None:
        return invalid(param, f"{param} is invalid ({e['msg']})")
    return invalid(param, f"{param} {said.text}, got {_integral(value) if said.integer else value}")


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
