"""A pydantic ValidationError as the field it names, what that field must be and what was
found there: the one-line errors of `manifest.json` (contract/manifest.py) and of the OpenAI
request bodies (serve/protocol.py) are both written from `problems(model, err, data)`.

Each pydantic error becomes a `Problem`: the field's path as the JSON spells it
(`dims.hidden`, `draft.extra.graph_top_k`, `messages[1].content`, `files['a/b.json']`),
pydantic's error type, the value found there (MISSING when the key is absent) and the type
declared there, whose `Expect` metadata (or, without one, `describe`) says what it must be.
A check written in a validator raises `failed(*at, **ctx)`: `at` continues the path below the
field that raises it, `ctx` reaches the caller's wording (`Problem.ctx`).

The walk follows models (a field marked `JsonAt` lives at that path inside its object, as a
manifest graph's `extra.quant`), standard-library dataclasses, dicts, lists, tuples, Optional
and unions, and stops at a type whose Expect is `whole` (an error anywhere inside such a value
is reported at the value). Imports pydantic_core and annotated_types only, so that the records
of `onnx_io`, `tree_config` and `profiles` can be annotated with it cheaply.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from annotated_types import Ge, Gt, MinLen
from pydantic_core import PydanticCustomError, ValidationError

MISSING: Any = type("Missing", (), {"__repr__": lambda self: "MISSING"})()  # a key that is absent
CHECK = "check"  # the error type of failed()
# the dataclass spellings of a missing and an unknown key, as a model's
_KINDS = {"missing_argument": "missing", "unexpected_keyword_argument": "extra_forbidden"}


class Expect:
    """Annotation metadata: what a value must be, in words ("an integer >= 1"). whole: an
    error anywhere inside the value is reported at this field, with the whole value as found."""

    def __init__(self, text: str, whole: bool = False):
        self.text, self.whole = text, whole


class JsonAt:
    """Annotation metadata of a model field stored elsewhere in its object's JSON: `path`
    (e.g. ("extra", "quant")) from the object to the value."""

    def __init__(self, *path: str):
        self.path = path


def failed(*at: str | int, **ctx) -> PydanticCustomError:
    """A failed check inside a validator: `at` the keys from the validated value down to the
    field at fault (none: the value itself); `ctx` the caller's words (e.g. expected=, found=)."""
    words = ctx.get("text") or ctx.get("message") or f"expected {ctx.get('expected', 'otherwise')}"
    where = ".".join(map(str, at))
    return PydanticCustomError(CHECK, "{said}", {"at": at, "said": f"{where}: {words}" if where else words, **ctx})


@dataclass(frozen=True)
class Problem:
    """One pydantic error, located: path (JSON spelling, "" at the top), kind (pydantic's error
    type; CHECK for failed()), found (the value in the data, MISSING when absent), input and
    message (pydantic's own), tp (the type declared there), parent (the last model or dataclass
    on the way), ctx (the error's context: failed()'s keywords)."""

    path: str
    kind: str
    found: Any
    input: Any
    message: str
    tp: Any
    parent: type | None
    ctx: dict

    def expect(self, kind: type[Expect] = Expect) -> Expect | None:
        """The first `kind` in the declared type's metadata (through Optional), or None."""
        return next((m for m in metadata(self.tp) if isinstance(m, kind)), None)

    def expected(self) -> str:
        """What the value must be, in words: its Expect, else `describe`."""
        said = self.expect()
        return said.text if said is not None else describe(self.tp)


def problems(model: type, err: ValidationError, data: Any) -> list[Problem]:
    """Every error of `err` (raised validating `data` as `model`) located, an object's unknown
    keys before the problems of its fields (a misspelt key explains the missing one)."""
    errors = [dict(e, type=_KINDS.get(e["type"], e["type"])) for e in err.errors()]
    for e in [e for e in errors if e["type"] == "extra_forbidden"]:
        errors.remove(e)
        parent = e["loc"][:-1]
        errors.insert(next((i for i, o in enumerate(errors) if o["loc"][:len(parent)] == parent), len(errors)), e)
    return [_locate(model, data, e) for e in errors]


def _locate(model: type, data: Any, error: dict) -> Problem:
    ctx = dict(error.get("ctx") or {})
    loc = (*error["loc"], *ctx.pop("at", ())) if error["type"] == CHECK else error["loc"]
    path, tp, value, parent = "", model, data, None
    loc = list(loc)
    while loc:
        if any(m.whole for m in metadata(tp) if isinstance(m, Expect)):
            break
        key, base, at = loc.pop(0), bare(tp), None
        if _is_record(base):
            parent = base
            tp, at = field_type(base, key)
        elif get_origin(base) is dict:
            if loc and loc[0] == "[key]":  # the key itself is at fault
                tp, loc = get_args(base)[0], []
                path, value = join_path(path, key, dict_key=True), key
                break
            tp = get_args(base)[1]
        elif get_origin(base) in (list, tuple):
            args = get_args(base)
            tp = args[0] if len(args) == 2 and args[1] is Ellipsis or get_origin(base) is list else (
                args[key] if isinstance(key, int) and key < len(args) else Any)
        elif _is_union(base):
            continue  # a union member's tag: not a field
        else:
            tp = Any
        for step in at or (key,):
            path = join_path(path, step, dict_key=get_origin(base) is dict)
            value = _at(value, step)
    return Problem(path, error["type"], value, error.get("input"), error.get("msg", ""), tp, parent, ctx)


def join_path(path: str, key, dict_key: bool = False) -> str:
    """`path` extended by `key` as the JSON spells it (`a.b`, `a[0]`, `files['x/y']`)."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    if dict_key and ("." in key or "/" in key or not key):
        return f"{path}[{key!r}]"
    return f"{path}.{key}" if path else str(key)


def _at(value, key):
    if isinstance(value, dict):
        return value.get(key, MISSING)
    if isinstance(value, list) and isinstance(key, int) and 0 <= key < len(value):
        return value[key]
    return MISSING


def _is_record(tp) -> bool:
    return isinstance(tp, type) and (hasattr(tp, "model_fields") or dataclasses.is_dataclass(tp))


def field_type(record: type, name) -> tuple[Any, tuple | None]:
    """(declared type of field `name`, its JsonAt path or None); (Any, None) when unknown."""
    if hasattr(record, "model_fields"):
        info = record.model_fields.get(name)
        if info is None:
            return Any, None
        tp = Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
        at = next((m.path for m in info.metadata if isinstance(m, JsonAt)), None)
        return tp, at
    hints = typing.get_type_hints(record, include_extras=True)
    return hints.get(name, Any), None


def known_keys(record: type) -> list[str]:
    """The keys a JSON object of `record` (a model or dataclass) may hold, in field order: a
    field marked JsonAt by the first key of its path."""
    if not hasattr(record, "model_fields"):
        return [f.name for f in dataclasses.fields(record)]
    keys = [next((m.path[0] for m in f.metadata if isinstance(m, JsonAt)), name)
            for name, f in record.model_fields.items()]
    return list(dict.fromkeys(keys))


def metadata(tp) -> list:
    """The Annotated metadata of `tp` (through Optional)."""
    found = []
    while True:
        if get_origin(tp) is Annotated:
            found += get_args(tp)[1:]
            tp = get_args(tp)[0]
        elif _is_union(tp) and type(None) in get_args(tp) and len(get_args(tp)) == 2:
            tp = next(a for a in get_args(tp) if a is not type(None))
        else:
            return found


def bare(tp):
    """`tp` without Annotated and Optional."""
    while True:
        if get_origin(tp) is Annotated:
            tp = get_args(tp)[0]
        elif _is_union(tp) and type(None) in get_args(tp) and len(get_args(tp)) == 2:
            tp = next(a for a in get_args(tp) if a is not type(None))
        else:
            return tp


def _is_union(tp) -> bool:
    return get_origin(tp) in (Union, types.UnionType)


def describe(tp) -> str:
    """What a value of type `tp` must be, in words, from its Expect or its type and bounds
    ("an integer >= 1", "one of int4, int8, null", "a non-empty string or null")."""
    said = [m for m in metadata(tp) if isinstance(m, Expect)]
    if said:
        return said[0].text
    args = get_args(tp)
    if _is_union(tp) and type(None) in args:
        inner = describe(next(a for a in args if a is not type(None)))
        return f"{inner}, null" if inner.startswith("one of ") else f"{inner} or null"
    if get_origin(tp) is Annotated:
        base, meta = args[0], args[1:]
        low = next((m.ge for m in meta if isinstance(m, Ge)), None)
        if base is int and low is not None:
            return f"an integer >= {low}"
        if base is float and any(isinstance(m, Gt) and m.gt == 0 for m in meta):
            return "a positive number"
        if base is str and any(isinstance(m, MinLen) and m.min_length >= 1 for m in meta):
            return "a non-empty string"
        return describe(base)
    if get_origin(tp) is Literal:
        return f"one of {', '.join(str(a) for a in args)}"
    words = {bool: "true or false", int: "an integer", float: "a number", str: "a string", list: "a JSON list",
             tuple: "a JSON list"}
    return words.get(get_origin(tp) or tp, "a JSON object")
