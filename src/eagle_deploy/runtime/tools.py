"""Tool calls (OpenAI `tools` / `tool_choice`) for chat templates that render tools in the
hermes style Qwen2.5 uses: the model answers a call as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`check_tools` / `check_tool_choice` read the request's fields without a model (SettingError
naming the field: `tools[1].function.name`); `tool_grammar` is the grammar of `tool_choice`
"required" or a named function: one or more calls, each a function's name and arguments
following its JSON schema (strict layout), so the calls are valid by construction and their
fixed parts (tags, keys, the name) are forced tokens the grammar drafts; `parse_tool_calls`
splits a finished output into its text and its calls. "auto" lets the model choose (nothing is
constrained; the output is parsed), "none" leaves the tools out of the prompt.
"""
from __future__ import annotations

import json
import re
import uuid

from eagle_deploy.contract.errors import SettingError

from .grammar import STRICT_LAYOUT

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_OPEN = re.compile(re.escape(OPEN) + r"\s*")
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")  # OpenAI's rule for function names


def check_tools(tools) -> tuple[dict, ...]:
    """OpenAI's `tools` -> a tuple of {"type": "function", "function": {"name", "description",
    "parameters"}} (parameters default {"type": "object", "properties": {}}); SettingError
    naming the field for anything else. None or [] -> ()."""
    if tools is None:
        return ()
    if not isinstance(tools, (list, tuple)):
        raise SettingError("tools", f"must be a list of functions, got {type(tools).__name__}")
    out, names = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" \
                or not isinstance(tool.get("function"), dict):
            raise SettingError(where, 'must be {"type": "function", "function": {"name": ..., "parameters": ...}}')
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise SettingError(f"{where}.function.name", "must be 1-64 letters, digits, underscores, dots or "
                                                         f"dashes, got {name!r}")
        if name in names:
            raise SettingError(f"{where}.function.name", f"repeats the function name {name!r}")
        names.add(name)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise SettingError(f"{where}.function.parameters", f"must be a JSON schema object, got {params!r}"[:200])
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise SettingError(f"{where}.function.description", "must be a string")
        out.append({"type": "function", "function": {"name": name, **({"description": description}
                                                                      if description else {}),
                                                      "parameters": params}})
    return tuple(out)


def check_tool_choice(choice, tools: tuple[dict, ...]) -> str:
    """OpenAI's `tool_choice` -> "none" | "auto" | "required" | "function:<name>" (default:
    "auto" with tools, "none" without); SettingError naming the field otherwise."""
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise SettingError("tool_choice", f'must be "none", "auto", "required" or a named function, got {choice!r}')
        if choice != "none" and not tools:
            raise SettingError("tool_choice", f"is {choice!r} but the request has no tools")
        return choice
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in {t["function"]["name"] for t in tools}:
            raise SettingError("tool_choice.function.name", f"names no function of tools: {name!r}")
        return f"function:{name}"
    raise SettingError("tool_choice", f'must be "none", "auto", "required" or {{"type": "function", "function": '
                                      f'{{"name": ...}}}}, got {choice!r}'[:300])


def tool_grammar(tools: tuple[dict, ...], choice: str) -> str | None:
    """The lark grammar (llguidance's dialect) of `choice` "required" (one or more calls of any
    of the tools) or "function:<name>" (exactly one call of that function); None otherwise."""
    if choice not in ("required",) and not choice.startswith("function:"):
        return None
    chosen = [t for t in tools if choice == "required" or t["function"]["name"] == choice[len("function:"):]]
    schemas = [{"x-guidance": STRICT_LAYOUT, "type": "object", "additionalProperties": False,
                "required": ["name", "arguments"],
                "properties": {"name": {"const": t["function"]["name"]}, "arguments": t["function"]["parameters"]}}
               for t in chosen]
    schema = schemas[0] if len(schemas) == 1 else {"x-guidance": STRICT_LAYOUT, "anyOf": schemas}
    newline = "\\n"  # lark's escape, written into the grammar text
    call = f'"{OPEN}{newline}" %json {json.dumps(schema)} "{newline}{CLOSE}"'
    more = f' ("{newline}" call)*' if choice == "required" else ""
    return f"start: call{more}\ncall: {call}\n"


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """A finished output -> (its text outside the calls, stripped, or None when empty; the calls
    as OpenAI's [{"id", "type": "function", "function": {"name", "arguments": JSON text}}]).
    A block whose JSON does not parse, or lacks a name, is left in the text."""
    calls, kept, at = [], [], 0
    decoder = json.JSONDecoder()
    for match in _OPEN.finditer(text):
        if match.start() < at:
            continue
        try:  # the JSON object itself (a string argument may hold "</tool_call>")
            body, end = decoder.raw_decode(text, match.end())
        except ValueError:
            continue
        close = re.compile(r"\s*" + re.escape(CLOSE)).match(text, end)
        if close is None or not isinstance(body, dict) or not isinstance(body.get("name"), str):
            continue
        arguments = body.get("arguments", {})
        if isinstance(arguments, str):  # arguments given as JSON text
            try:
                arguments = json.loads(arguments)
            except ValueError:
                continue
        if not isinstance(arguments, dict):
            continue
        kept.append(text[at:match.start()])
        at = close.end()
        calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                      "function": {"name": body["name"], "arguments": json.dumps(arguments)}})
    kept.append(text[at:])
    content = "".join(kept).strip()
    return (content or None), calls


def template_renders_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template reads `tools` (a template without it would drop
    them silently)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = " ".join(str(t) for t in template.values())
    return "tools" in template


def messages_for_template(messages) -> list[dict]:
    """Chat messages as templates expect them: an assistant's tool_calls with their arguments
    as objects (OpenAI sends JSON text; vLLM parses it the same way)."""
    out = []
    for m in messages:
        m = dict(m)
        if isinstance(m.get("tool_calls"), list):
            calls = []
            for c in m["tool_calls"]:
                c = json.loads(json.dumps(c))
                fn = c.get("function", {})
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except ValueError:
                        pass
                calls.append(c)
            m["tool_calls"] = calls
        out.append(m)
    return out
