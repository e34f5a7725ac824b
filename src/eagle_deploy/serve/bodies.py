"""The request bodies of eagle-serve's OpenAI endpoints as pydantic models: `ChatBody`
(/v1/chat/completions), `CompletionBody` (/v1/completions). Strict types (`true` is no
integer), null the same as absent, unknown fields ignored but those of `_REFUSED` (they would
change the output in ways this server does not implement). A failed check raises `_api(...)`
(contract/field_errors.failed): its message, with "{param}" for the field's name, and OpenAI's
error code; a number out of its range is described by its field's `Range`. `protocol.py`
turns the first error into the `ApiError` the client gets (the fields are documented there).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from eagle_deploy.contract.errors import SettingError
from eagle_deploy.contract.field_errors import Expect, failed
from eagle_deploy.runtime.request import MODES, check_stops

ROLES = {"system", "developer", "user", "assistant", "tool"}


def _api(message: str, code: str = "invalid_value", *at: int) -> PydanticCustomError:
    """A failed check of the field that raises it (`at`: list indices below it); "{param}" in
    `message` becomes the field's name."""
    return failed(*at, message=message, code=code)


class Range(Expect):
    """Annotation metadata: the allowed range in words ("must be >= 1"); integer: the value is
    shown as the integer it was read as (16.0 as 16)."""

    def __init__(self, text: str, integer: bool = False):
        super().__init__(text)
        self.integer = integer


def integral(v):
    return int(v) if isinstance(v, float) and v.is_integer() else v  # 16.0 is 16; 2.5 stays no integer


def _int(minimum: int):
    return Annotated[int, BeforeValidator(integral), Field(ge=minimum), Range(f"must be >= {minimum}", True)]


def _number(minimum: float, maximum: float | None = None, open_min: bool = False):
    bounds = Field(allow_inf_nan=False, **{"gt" if open_min else "ge": minimum}, le=maximum)
    hi = f"{maximum}]" if maximum is not None else "inf)"
    return Annotated[float, bounds, Range(f"must be in {'(' if open_min else '['}{minimum}, {hi}")]


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
                               "unsupported_value", j)
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


class Tail(_Body):
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
            at = err.field.removeprefix("stop")  # "" or "[i]"
            raise _api(f"{{param}} {err.rule}", "invalid_value", *([int(at[1:-1])] if at else [])) from None

    @field_validator("stream_options", mode="before")
    @classmethod
    def _only_when_streaming(cls, options, info):
        if not info.data.get("stream"):
            raise _api("stream_options is only allowed when stream is true")
        return options


class ChatBody(Tail, _ChatHead):
    pass


class CompletionBody(Tail, _CompletionHead):
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
