"""Error-message helpers shared by the exporter and the runtime (standard library only)."""
from __future__ import annotations

import errno
import importlib
import os
import stat
from pathlib import Path


class SettingError(ValueError):
    """A request field or engine option with a bad value: the one error type of
    `runtime.request.Request` and `runtime.options.RuntimeOptions`. `field` names it as the
    Python API does ("top_p", "stop[1]", "messages[0].content"), `rule` says what is wrong
    ("must be in (0, 1], got 2.0"); str() is "<field> <rule>". Each front end names the field
    its own way through `named`: eagle-run by its flag ("--top-p"), eagle-serve by its JSON
    `param` ("max_tokens"), the Triton model by its input."""

    def __init__(self, field: str, rule: str):
        super().__init__(f"{field} {rule}")
        self.field, self.rule = field, rule

    def named(self, name: str) -> str:
        """The message with the field called `name` ("--top-p must be in (0, 1], got 2.0")."""
        return f"{name} {self.rule}"


class ManifestError(ValueError):
    """An export folder or its manifest is missing, malformed or of another format version."""


def unreadable(path: Path) -> str | None:
    """Why `path` cannot be read as a file, in words that follow its name ("is missing", "is a
    symlink loop ...", "is a symlink to X, which does not exist", "is a folder, not a file",
    "cannot be read (...)"), or None for a file (symlinks followed). Path.exists and
    Path.is_file say False for all of these alike, so a loop read as "missing"."""
    try:
        st = os.stat(path)
    except OSError as err:
        if err.errno == errno.ELOOP:
            return "is a symlink loop (a link that leads back to itself, not a file)"
        if os.path.islink(path):
            return f"is a symlink to {os.readlink(path)}, which does not exist"
        if isinstance(err, FileNotFoundError):
            return "is missing"
        return f"cannot be read ({err.strerror or err})"
    if stat.S_ISDIR(st.st_mode):
        return "is a folder, not a file"
    return None


def first_line(err: BaseException) -> str:
    """The first line of an exception's message (its type name when the message is empty):
    what a one-line error report quotes of a third-party exception."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def import_tensorrt(purpose: str = ""):
    """The `tensorrt` module, imported on first need (importing this module imports nothing).
    Raises ImportError with the install hint when TensorRT is missing or cannot load;
    `purpose` (e.g. "to build TensorRT engines") ends the hint."""
    try:
        return importlib.import_module("tensorrt")
    except ImportError as err:  # also a library that fails to load surfaces as ImportError
        hint = f"on a CUDA host run `pip install '.[gpu]'`{' ' + purpose if purpose else ''}"
        raise ImportError(f"TensorRT is not installed or cannot load ({err}); {hint}") from None


def max_length_hint(max_length: int, limit: int | None) -> str:
    """What raises an export's KV capacity of `max_length` rows: "re-export with a larger
    `eagle-export --max-length` (at most LIMIT)", or "" when `max_length` is already `limit`.
    limit: the largest max_length allowed (Manifest.length_limit; None: unknown, no bound
    named)."""
    if limit is not None and max_length >= limit:
        return ""
    return f"re-export with a larger `eagle-export --max-length`{_at_most(limit)}"


def _at_most(limit: int | None) -> str:
    return f" (at most {limit})" if limit is not None else ""


def prompt_too_long(tokens: int, max_length: int, limit: int | None, at_least: bool = False) -> str:
    """The one message for a prompt that does not fit an export's KV capacity of `max_length`
    rows (at most max_length - 1 prompt tokens: one row is left for output), with what to do:
    shorten the prompt; or re-export with the --max-length that holds it (prompt + 1 rows,
    plus the output wanted) when that is within `limit` (Manifest.length_limit; None:
    unknown); or, when even `limit` is too small, how short a re-export would need it.
    at_least: `tokens` is a lower bound (the prompt was not tokenised whole)."""
    need = tokens + 1
    if not max_length_hint(max_length, limit):  # already at the limit: no re-export holds more
        remedy = "shorten the prompt"
    elif limit is not None and need > limit:
        remedy = (f"shorten the prompt (a re-export with `eagle-export --max-length {limit}`, the most this model "
                  f"allows, would take up to {limit - 1} prompt tokens)")
    else:
        remedy = (f"shorten the prompt, or re-export with `eagle-export --max-length` {need} or more plus the new "
                  f"tokens wanted{_at_most(limit)}")
    return (f"the prompt has {'at least ' if at_least else ''}{tokens} tokens; this export's KV capacity "
            f"(max_length) is {max_length} tokens, so at most {max_length - 1} prompt tokens fit (one row is "
            f"left for output): {remedy}")


# errno -> what to do, for the write failures every writing command reports in one line
DISK_ERRORS = {errno.EROFS: "the file system is read-only: choose a writable folder",
               errno.ENOSPC: "the disk is full: free space or choose a folder on another disk",
               errno.EDQUOT: "the disk quota is exceeded: free space or choose another folder",
               errno.EACCES: "permission denied: choose a folder you can write to",
               errno.EPERM: "permission denied: choose a folder you can write to"}


def disk_errno(err: BaseException | None) -> tuple[int | None, str | None]:
    """(errno, path or None) when `err`, or an exception it was raised from, is a write failure
    of DISK_ERRORS: an OSError with that errno, or a library's own error whose message carries
    it (safetensors: "No space left on device (os error 28)"); (None, None) otherwise."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in DISK_ERRORS:
            return err.errno, err.filename
        text = str(err)
        for code in DISK_ERRORS:
            if f"(os error {code})" in text or (code != errno.EPERM and os.strerror(code) in text):
                return code, None
        err = err.__cause__ or err.__context__
    return None, None
