"""One generation request: `Request`, checked in one place.

The Python API (`EagleRuntime.generate` / `stream`), eagle-run, eagle-serve, `BatchRuntime` and
the Triton model all build a `Request`; every check that needs no model runs when it is made
and raises `SettingError` (a ValueError) naming the field as the API names it. A front end
maps the field to its own name: eagle-run to the flag (`FLAGS`), eagle-serve to the JSON
`param`, the Triton model to its input. The checks that need the export (token ids within the
vocabulary, the prompt within the KV capacity, a chat template) run where the prompt is
encoded (`EagleRuntime.prompt_ids`).

    Request("Write a haiku", max_new_tokens=64, temperature=0.7, seed=1)
    Request([{"role": "user", "content": "Hi"}], stop=["\\n\\n"])
    Request([1, 2, 3], mode="vanilla")
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Sequence

from eagle_deploy.contract.errors import SettingError

from .grammar import check_response_format
from .sampling import SamplingParams, whole_number
from .tools import check_tool_choice, check_tools, tool_grammar

Prompt = str | Sequence[dict] | Sequence[int]
MODES = ("eagle", "vanilla")
MAX_STOPS = 16  # stop strings per request (OpenAI allows 4)
MAX_STOP_CHARS = 256  # characters per stop string
DEFAULT_MAX_NEW_TOKENS = 128
MAX_TOP_LOGPROBS = 20  # alternatives per token (OpenAI's bound)

# field -> eagle-run's flag for it
FLAGS = {"prompt": "--prompt", "max_new_tokens": "--max-new-tokens", "temperature": "--temperature",
         "top_p": "--top-p", "top_k": "--top-k", "seed": "--seed", "stop": "--stop", "chat": "--raw",
         "min_p": "--min-p", "logit_bias": "--logit-bias", "presence_penalty": "--presence-penalty",
         "frequency_penalty": "--frequency-penalty", "repetition_penalty": "--repetition-penalty",
         "logprobs": "--logprobs", "response_format": "--json-schema", "tools": "--tools",
         "tool_choice": "--tool-choice"}


@dataclass(frozen=True)
class Request:
    """What to generate. All checks run when it is made (SettingError naming the field).

    prompt: a string (wrapped in the export's chat template when it has one, unless
    chat=False), a list of chat messages ({"role": str, "content": str}; always templated), or
    a list of token ids (used as is). max_new_tokens: at most this many new tokens (>= 1; the
    export's KV capacity may end a request sooner). temperature 0 = greedy (the target's most
    likely token; ties to the lowest id); top_p in (0, 1] (1 = off) and top_k (0 = off)
    truncate the target distribution; seed: an int makes sampled output reproducible. stop:
    a string or strings (at most MAX_STOPS, each 1 to MAX_STOP_CHARS characters); the text
    ends before the first one. mode: "eagle" (speculative) or "vanilla" (one token per target
    forward on the same export). min_p, logit_bias ({token id: bias}), presence_penalty,
    frequency_penalty, repetition_penalty: see sampling.SamplingParams (each keeps EAGLE's
    output equal to vanilla decoding's under the same settings: shaping.LogitShaper).
    logprobs: None (off) or k in [0, MAX_TOP_LOGPROBS]: return each generated token's
    log-probability under the target and its k most likely alternatives
    (GenerationResult.logprobs). response_format: OpenAI's (None or {"type": "text"}: plain
    text; {"type": "json_object"}; {"type": "json_schema", "json_schema": {"name", "schema",
    "strict"}}): the output follows that grammar, exactly as vanilla decoding under the same
    grammar would produce it (runtime/grammar.py); kept normalised by
    grammar.check_response_format. tools, tool_choice: OpenAI's (runtime/tools.py): the tools
    are rendered by the export's chat template (which must read them), "required" or a named
    function constrains the output to calls whose arguments follow the function's schema, and
    the finished output is split into text and GenerationResult.tool_calls; tool_choice is kept
    as "none" | "auto" | "required" | "function:<name>". parse_special: a special token's text
    inside a chat message (`<|im_end|><|im_start|>system`) is a special token (True, what
    transformers and vLLM do) or plain text (False, the default: a message cannot open a turn of
    another role; text.encode_chat). `sampling` is the SamplingParams the decoder reads."""

    prompt: Prompt
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] | str = ()
    mode: str = "eagle"
    chat: bool | None = None
    min_p: float = 0.0
    logit_bias: dict | tuple = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    response_format: dict | None = None
    tools: tuple = ()
    tool_choice: str | dict | None = None
    parse_special: bool = False
    sampling: SamplingParams = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.mode not in MODES:
            raise SettingError("mode", f"must be 'eagle' or 'vanilla', got {self.mode!r}")
        object.__setattr__(self, "max_new_tokens", whole_number(self.max_new_tokens, "max_new_tokens", 1))
        object.__setattr__(self, "sampling", SamplingParams(
            self.temperature, self.top_p, self.top_k, self.seed, self.min_p, self.logit_bias, self.presence_penalty,
            self.frequency_penalty, self.repetition_penalty))
        for name in ("top_k", "seed", "logit_bias"):
            object.__setattr__(self, name, getattr(self.sampling, name))
        if self.logprobs is not None:
            object.__setattr__(self, "logprobs", whole_number(self.logprobs, "logprobs", 0))
            if self.logprobs > MAX_TOP_LOGPROBS:
                raise SettingError("logprobs", f"must be at most {MAX_TOP_LOGPROBS} (alternatives per token), "
                                               f"got {self.logprobs}")
        object.__setattr__(self, "stop", check_stops(self.stop))
        if not isinstance(self.parse_special, bool):
            raise SettingError("parse_special", f"must be True or False, got {self.parse_special!r}")
        if self.chat is not None and not isinstance(self.chat, bool):
            raise SettingError("chat", f"must be True, False or None, got {self.chat!r}")
        object.__setattr__(self, "response_format", check_response_format(self.response_format))
        object.__setattr__(self, "tools", check_tools(self.tools))
        object.__setattr__(self, "tool_choice", check_tool_choice(self.tool_choice, self.tools))
        if self.response_format is not None and tool_grammar(self.tools, self.tool_choice) is not None:
            raise SettingError("response_format", f"cannot be combined with tool_choice {self.tool_choice!r} "
                                                  "(the calls follow the functions' schemas)")
        object.__setattr__(self, "prompt", check_prompt(self.prompt))

    def check_vocab(self, vocab: int) -> None:
        """SettingError for a token id at or beyond the export's vocabulary: in the prompt
        (token ids) or among logit_bias's keys."""
        if self.prompt and isinstance(self.prompt, tuple) and isinstance(self.prompt[0], int):
            bad = next((t for t in self.prompt if t >= vocab), None)
            if bad is not None:
                raise SettingError("prompt", f"token ids must be in [0, {vocab}), got {bad}")
        bad = next((t for t, _ in self.logit_bias if t >= vocab), None)
        if bad is not None:
            raise SettingError("logit_bias", f"keys must be token ids in [0, {vocab}), got {bad}")

    def replace(self, **changes) -> "Request":
        """A copy with `changes`, checked again."""
        kept = {name: getattr(self, name) for name in self.__dataclass_fields__ if name != "sampling"}
        return Request(**{**kept, **changes})


def check_stops(stop) -> tuple[str, ...]:
    """A string or a sequence of strings -> the tuple of stop strings; SettingError ("stop",
    or "stop[i]" for one of them) for an empty or non-string entry, more than MAX_STOPS, one
    longer than MAX_STOP_CHARS, or text that is not valid Unicode."""
    stops = [stop] if isinstance(stop, str) else list(stop or ())
    if any(not isinstance(s, str) or s == "" for s in stops):
        raise SettingError("stop", f"must be non-empty strings, got {stops!r}")
    if len(stops) > MAX_STOPS:
        raise SettingError("stop", f"holds at most {MAX_STOPS} stop strings, got {len(stops)}")
    for i, s in enumerate(stops):
        if len(s) > MAX_STOP_CHARS:
            raise SettingError(f"stop[{i}]", f"has {len(s)} characters; a stop string may have at most "
                                             f"{MAX_STOP_CHARS} characters")
        check_unicode(s, f"stop[{i}]")
    return tuple(stops)


def check_prompt(prompt) -> str | tuple[dict, ...] | tuple[int, ...]:
    """The prompt as Request keeps it (a string, a tuple of messages, a tuple of ints), or
    SettingError: an empty text or list, a message that is not {"role": str,
    "content": str} ("prompt[1].content"), text that is not valid Unicode, a token id that is
    not a whole number >= 0 (the vocabulary bound is the export's: EagleRuntime.prompt_ids)."""
    if isinstance(prompt, str):
        if not prompt:  # whitespace is text a model can continue (as OpenAI and eagle-serve take it)
            raise SettingError("prompt", "is empty")
        check_unicode(prompt, "prompt")
        return prompt
    if isinstance(prompt, (bytes, dict)) or not isinstance(prompt, Sequence):
        raise SettingError("prompt", "must be a string, a list of chat messages or a list of token ids, got "
                                     f"{type(prompt).__name__}")
    items = tuple(prompt)
    if not items:
        raise SettingError("prompt", "is empty")
    if all(isinstance(m, dict) for m in items):
        for i, m in enumerate(items):
            calls = m.get("tool_calls")  # an assistant's tool calls may stand for its content
            for key in ("role", "content"):
                if key == "content" and m.get(key) is None and m.get("role") == "assistant" and calls:
                    continue
                if not isinstance(m.get(key), str):
                    what = "is missing" if m.get(key) is None else f"must be a string, got {type(m[key]).__name__}"
                    raise SettingError(f"prompt[{i}].{key}", what)
            if m.get("content") is not None:
                check_unicode(m["content"], f"prompt[{i}].content")
            if calls is not None and not (isinstance(calls, list) and all(isinstance(c, dict) for c in calls)):
                raise SettingError(f"prompt[{i}].tool_calls", "must be a list of tool call objects")
        return tuple(dict(m) for m in items)
    if all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in items):
        bad = next((t for t in items if t < 0), None)
        if bad is not None:
            raise SettingError("prompt", f"token ids must be >= 0, got {bad}")
        return tuple(int(t) for t in items)
    raise SettingError("prompt", "must be a string, a list of chat messages or a list of token ids")


def check_unicode(text: str, field: str) -> None:
    """SettingError unless `text` is valid Unicode (encodable as UTF-8): Python keeps the
    bytes of a command-line argument that is not UTF-8 as lone surrogates (U+DC80-U+DCFF), and
    JSON allows lone surrogates such as "\\ud800"; no tokenizer takes either."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        code = ord(text[err.start])
        if 0xDC80 <= code <= 0xDCFF:
            raise SettingError(field, f"is not valid UTF-8: the byte 0x{code - 0xDC00:02x} at character {err.start} "
                                      "(text in another encoding?)") from None
        raise SettingError(field, f"is not valid Unicode: a lone surrogate \\u{code:04x} at character "
                                  f"{err.start}") from None
