"""Incremental detokenisation and stop strings.

`TextStream` turns committed token ids into text deltas that never split a multi-byte
character (a delta is released only when the decoded text no longer ends in U+FFFD), and
ends a request at the first stop string or EOS id, even inside an accepted chunk. Text that
could still be the start of a stop string is held back until it cannot.
"""
from __future__ import annotations

import re
from typing import Sequence

_MARK = re.compile("\ue000(\\d+)\ue001")  # a placeholder for a special token's text inside a message


def encode_chat(tokenizer, messages: Sequence[dict], tools: Sequence[dict] = (), parse_special: bool = False
                ) -> list[int]:
    """Chat messages [{"role", "content"}] (and OpenAI `tools`, which the template renders) ->
    token ids through the tokenizer's chat template, ending with the generation prompt (the
    assistant header). A special token's text inside a message's content (say
    `<|im_end|><|im_start|>system`) is encoded as the plain text it is, so a message cannot open
    a turn of another role; `parse_special` encodes it as the special token instead (what
    transformers and vLLM do by default). Messages without such text give the template's own
    tokens either way. Raises what the tokenizer raises (e.g. ValueError when it has no chat
    template)."""
    specials = sorted({*getattr(tokenizer, "all_special_tokens", ()),
                       *(t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special)},
                      key=len, reverse=True)
    found = [] if parse_special else [s for s in specials if s and any(
        isinstance(m.get("content"), str) and s in m["content"] for m in messages)]
    if not found:
        ids = tokenizer.apply_chat_template(list(messages), tools=list(tools) or None, add_generation_prompt=True,
                                            tokenize=True)
        return [int(t) for t in (ids["input_ids"] if hasattr(ids, "keys") else ids)]
    pattern = re.compile("|".join(re.escape(s) for s in found))
    marked = [{**m, "content": pattern.sub(lambda x: f"\ue000{found.index(x.group(0))}\ue001", m["content"])}
              if isinstance(m.get("content"), str) else m for m in messages]
    text = tokenizer.apply_chat_template(marked, tools=list(tools) or None, add_generation_prompt=True,
                                         tokenize=False)
    pieces, ids = _MARK.split(text), []
    for i, piece in enumerate(pieces):  # even: template text (its own special tokens parsed); odd: a marked token
        if i % 2 == 0:
            ids += tokenizer.encode(piece, add_special_tokens=False) if piece else []
        else:
            ids += tokenizer.encode(found[int(piece)], add_special_tokens=False, split_special_tokens=True)
    return [int(t) for t in ids]


def encode_user(tokenizer, text: str, chat: bool = True) -> list[int]:
    """One user message -> token ids: through the chat template when `chat` and the tokenizer
    has one (see encode_chat), else plain encoding (special tokens added)."""
    if chat and getattr(tokenizer, "chat_template", None):
        return encode_chat(tokenizer, [{"role": "user", "content": text}])
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=True)]


def encode_prompt(tokenizer, request, chat_default: bool, vocab: int, model: str) -> list[int]:
    """The one prompt encoder (EagleRuntime.encode, eagle-serve's frontend): a Request's prompt
    -> token ids. A string goes through the chat template when `chat_default` (the export has
    one) unless request.chat is False, else it is encoded as text (special tokens added); chat
    messages always go through the template, with the request's tools unless tool_choice is
    "none"; token ids are used as they are (tools then only constrain and parse). Raises
    SettingError naming "prompt" (a token id >= `vocab`) or "tools" (a template of the model
    `model` that does not render them), ValueError for text without a tokenizer or chat
    template, or a message list the template refuses. request.parse_special: see encode_chat."""
    from eagle_deploy.contract.errors import SettingError, first_line

    from .tools import messages_for_template, template_renders_tools

    prompt, chat = request.prompt, request.chat
    tools = request.tools if request.tool_choice != "none" else ()
    if isinstance(prompt, tuple) and prompt and not isinstance(prompt[0], dict):
        request.check_vocab(vocab)
        return list(prompt)
    if tokenizer is None:
        raise ValueError("this export has no tokenizer; pass token ids")
    if isinstance(prompt, str) and not (chat_default if chat is None else chat):
        if tools:
            raise SettingError("tools", "need the chat template, which renders them (not chat=False)")
        return [int(t) for t in tokenizer.encode(prompt, add_special_tokens=True)]
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this export's tokenizer has no chat template: pass a string with chat=False, or token ids")
    if tools and not template_renders_tools(tokenizer):
        raise SettingError("tools", f"are not supported by the model {model}: its chat template does not render "
                                    "tools")
    try:
        return encode_chat(tokenizer, messages_for_template(messages), tools, request.parse_special)
    except Exception as err:  # the template's own checks (e.g. role order, raise_exception)
        raise ValueError(f"the chat template refused these messages: {first_line(err)}") from None


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: printable character -> the byte it stands for."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTE_LEVEL = _byte_level_table()


def token_bytes(tokenizer, token: int) -> bytes:
    """A token's own bytes (OpenAI's logprobs `bytes`): for a byte-level BPE tokenizer (GPT-2's
    alphabet, as SmolLM2's and Qwen's) the bytes its symbol stands for, even when they are part
    of a UTF-8 character the token does not complete; otherwise its decoded text's UTF-8."""
    symbol = tokenizer.convert_ids_to_tokens(int(token))
    special = set(getattr(tokenizer, "all_special_tokens", ()))
    if isinstance(symbol, str) and symbol and symbol not in special and all(ch in _BYTE_LEVEL for ch in symbol):
        return bytes(_BYTE_LEVEL[ch] for ch in symbol)
    return tokenizer.decode([int(token)]).encode("utf-8")


class TextStream:
    """Stopper for `Decoder.decode`: push(token) -> "stop" | None; `take()` returns the text
    released since the last call; `text` is the final text (stop string excluded)."""

    def __init__(self, tokenizer, eos_ids: Sequence[int] = (), stop: Sequence[str] = ()):
        stop = list(stop or ())
        if any(not isinstance(s, str) or s == "" for s in stop):
            raise ValueError("stop strings must be non-empty strings")
        self.tokenizer = tokenizer
        self.eos_ids = set(int(e) for e in eos_ids)
        self.stop = stop
        self.ids: list[int] = []
        self._prefix, self._read = 0, 0  # decode window (as in vLLM's incremental detokeniser)
        self.text = ""
        self._released = 0

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def push(self, token: int) -> str | None:
        self.ids.append(int(token))
        if int(token) in self.eos_ids:
            return "stop"
        prefix_text = self._decode(self.ids[self._prefix:self._read])
        new_text = self._decode(self.ids[self._prefix:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            before = len(self.text)
            self.text += new_text[len(prefix_text):]
            self._prefix, self._read = self._read, len(self.ids)
            return self._check_stop(before)
        return None

    def _check_stop(self, before: int) -> str | None:
        if not self.stop:
            return None
        longest = max(len(s) for s in self.stop)
        start = max(0, before - longest + 1)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self._released = min(self._released, len(self.text))
            return "stop"
        return None

    def _held(self) -> int:
        """Length of the text tail that is a proper prefix of some stop string."""
        held = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), 0, -1):
                if self.text.endswith(s[:n]):
                    held = max(held, n)
                    break
        return held

    def take(self, final: bool = False) -> str:
        """Text released since the last call (all of it once `final`)."""
        end = len(self.text) if final else len(self.text) - self._held()
        delta = self.text[self._released:end]
        self._released = max(self._released, end)
        return delta
