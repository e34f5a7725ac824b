"""How the records of `manifest.json` meet their JSON: `Record`, the frozen pydantic base of
every record (`manifest_records`, `manifest.Manifest`), and `read`.

A record is declared once: each field with its type, default and check. `model_dump(mode=
"json")` writes it; two declarations shape the JSON where it is not the record's own layout: a
field marked `JsonAt("extra", key)` lives under the object's `"extra"` (a graph's draft and
quantisation records), and a field declared `omitted(default)` is left out of the JSON while it
holds its default. `replace(**changes)` makes a changed, validated copy.

`read(Record, data, source)` validates parsed JSON in that layout (strict: `true` is no integer,
`"2"` no number) and turns the first problem into one `ManifestError` line naming `source`, the
field's JSON path, what was expected and what was found:

    /x/manifest.json dims.hidden: expected an integer >= 1, found "x"

What a field must be, in words, is its `Expect`, or derived from its type (field_errors).
Records built in Python are validated field by field, not in strict mode, and without the
checks across records (`Manifest`'s, run on a read).
"""
from __future__ import annotations

import dataclasses
import json
import typing
from functools import cache
from typing import Annotated, ClassVar, TypeVar, get_args, get_origin

from annotated_types import Ge, MinLen
from pydantic import BaseModel, ConfigDict, Field, ValidationError, WrapValidator, model_serializer

from .errors import ManifestError
from .field_errors import (
    CHECK,
    MISSING,
    Expect,
    JsonAt,
    Problem,
    bare,
    describe,
    field_type,
    join_path,
    known_keys,
    problems,
)

JSON_LAYOUT = {"layout": "json"}  # the validation context of `read`: data in the JSON layout
R = TypeVar("R", bound="Record")

# ---------------------------------------------------------------------------------------------
# Field types


def at_least(minimum: int, what: str | None = None):
    """An integer >= `minimum` (`what`: its words, when not "an integer >= N")."""
    return Annotated[int, Ge(minimum), Expect(what)] if what else Annotated[int, Ge(minimum)]


def omitted(default, **kwargs):
    """A field left out of the JSON while it holds `default`."""
    return Field(default, exclude_if=lambda value: value == default, **kwargs)


def _as_given(value, handler):
    handler(value)  # validated as a number, kept as written (an int stays an int)
    return value


Text = Annotated[str, MinLen(1)]
Number = Annotated[float, WrapValidator(_as_given), Expect("a number")]
Sha256 = Annotated[str, Field(min_length=64, max_length=64, pattern="^[0-9a-f]+$"),
                   Expect("a sha256 (64 lowercase hex digits)")]

# ---------------------------------------------------------------------------------------------
# The base: frozen, the JSON layout, one-line errors


@cache
def _moved(record: type) -> dict[str, tuple[str, str]]:
    """{field name: (object key, key inside it)} of `record`'s fields marked JsonAt."""
    return {name: next(m.path for m in f.metadata if isinstance(m, JsonAt))
            for name, f in record.model_fields.items() if any(isinstance(m, JsonAt) for m in f.metadata)}


class Record(BaseModel):
    """A frozen manifest record: unknown keys refused, `replace` for a changed copy, its JSON
    layout (JsonAt, omitted) applied by `model_dump` and by `read`."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    label: ClassVar[str] = "record"  # what `from_json` calls it in errors

    @model_serializer(mode="wrap")
    def _to_json_layout(self, handler):
        out = handler(self)
        for name, (parent, key) in _moved(type(self)).items():
            held = out.setdefault(parent, {})
            if name in out:
                held[key] = out.pop(name)
        return out

    def replace(self: R, **changes) -> R:
        """A validated copy with `changes` (field names)."""
        unknown = sorted(set(changes) - set(type(self).model_fields) - set(self.model_extra or ()))
        if unknown and self.model_config.get("extra") != "allow":
            raise TypeError(f"{type(self).__name__} has no field {', '.join(unknown)}")
        return type(self).model_validate({**dict(self), **changes})

    @classmethod
    def from_json(cls: type[R], data, source: str | None = None) -> R:
        """A validated record from its parsed JSON; ManifestError names a bad field."""
        return read(cls, data, source or cls.label)


def read(record: type[R], data, source: str) -> R:
    """`data` (parsed JSON) validated as `record`; ManifestError (one line: the first problem,
    "(and N more)") otherwise."""
    try:
        values = _fields_of(record, data, "")
    except _Misplaced as err:
        path, expected, found, more = err.args
        raise ManifestError(f"{source} {path}: expected {expected}, found {shown(found)}"
                            + (f" (and {more} more)" if more else "")) from None
    try:  # JSON mode: strict types, and JSON lists read as the records' tuples
        return record.model_validate_json(json.dumps(values), strict=True, context=JSON_LAYOUT)
    except ValidationError as err:
        lines = list(dict.fromkeys(line(p, source) for p in problems(record, err, data)))
        more = f" (and {len(lines) - 1} more)" if len(lines) > 1 else ""
        raise ManifestError(lines[0] + more) from None


class _Misplaced(Exception):
    """(path, expected, found, more problems): a key where the JSON layout has none, or none
    where it has one."""


def _fields_of(tp, data, path: str):
    """`data` (JSON of type `tp`) with each record's "extra" keys lifted to its own fields
    (JsonAt). Outside pydantic, whose validators would read what they return as Python, not
    JSON. Also: a dataclass in the JSON names every field but those None by default (the
    defaults of TreeConfig and ProfileSpec are for Python callers; a manifest holds what was
    exported)."""
    base = bare(tp)
    if isinstance(data, dict) and isinstance(base, type) and issubclass(base, Record):
        inside = {at: name for name, at in _moved(base).items()}  # (object key, key inside it) -> field
        objects = {parent for parent, _ in inside}
        out = {k: v for k, v in data.items() if k not in objects}
        for key in out:
            if key in _moved(base):  # a field of "extra" beside the record's own
                raise _Misplaced(join_path(path, key), f"no such field (known: {', '.join(known_keys(base))})",
                                 out[key], 0)
        for parent in objects:
            held = data.get(parent, {})
            if not isinstance(held, dict):
                raise _Misplaced(join_path(path, parent), "a JSON object", held, 0)
            for key, value in held.items():
                if (parent, key) not in inside:
                    known = ", ".join(k for p, k in inside if p == parent)
                    raise _Misplaced(join_path(join_path(path, parent), key), f"no such field (known: {known})",
                                     value, 0)
                out[inside[parent, key]] = value
        at = {name: join_path(*where) for name, where in _moved(base).items()}
        return {k: _fields_of(field_type(base, k)[0], v, join_path(path, at.get(k, k))) for k, v in out.items()}
    if isinstance(data, dict) and dataclasses.is_dataclass(base):
        defaulted = [f.name for f in dataclasses.fields(base) if f.default is not None
                     and (f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING)]
        missing = [name for name in defaulted if name not in data]  # the others pydantic reports
        if missing:
            hint = typing.get_type_hints(base, include_extras=True)[missing[0]]
            raise _Misplaced(join_path(path, missing[0]), describe(hint), MISSING, len(missing) - 1)
        return data
    if isinstance(data, dict) and get_origin(base) is dict:
        return {k: _fields_of(get_args(base)[1], v, join_path(path, k, dict_key=True)) for k, v in data.items()}
    if isinstance(data, list) and get_origin(base) in (list, tuple) and get_args(base):
        return [_fields_of(get_args(base)[0], v, join_path(path, i)) for i, v in enumerate(data)]
    return data


def line(p: Problem, source: str) -> str:
    """One problem as "{source} {field}: expected ..., found ..."."""
    said = p.ctx if p.kind == CHECK else {}  # failed()'s words
    if "text" in said:
        return f"{source} {p.path}: {said['text']}"
    if "expected" in said:
        expected = said["expected"]
    elif p.kind == "extra_forbidden":
        expected = f"no such field (known: {', '.join(known_keys(p.parent))})"
    else:
        expected = p.expected()
    return f"{source} {p.path or '(top level)'}: expected {expected}, found {shown(said.get('found', p.found))}"


class Said(str):
    """A found value already described in words (shown as is, not quoted)."""


def shown(value) -> str:
    if value is MISSING:
        return "nothing (the key is missing)"
    if isinstance(value, Said):
        return str(value)
    text = repr(value) if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:77] + "..."
