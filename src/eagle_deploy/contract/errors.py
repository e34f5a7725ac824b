"""Error-message helpers shared by the exporter and the runtime (standard library only)."""
from __future__ import annotations

import errno
import importlib
import os


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


def max_length_hint(max_length: int, limit: int | None, need: int | None = None) -> str:
    """What raises an export's KV capacity of `max_length` rows: "re-export with `eagle-export
    --max-length` NEED or more (at most LIMIT)" (without a need: "with a larger ..."), or ""
    when no re-export can help: `max_length` is already `limit`, or `need` rows exceed it.
    limit: the largest max_length allowed (Manifest.length_limit; None: unknown, no bound
    named); need: the rows the request needs (a prompt of n tokens: n + 1)."""
    if limit is not None and (max_length >= limit or (need is not None and need > limit)):
        return ""
    size = f" {need} or more" if need is not None else ""
    bound = f" (at most {limit})" if limit is not None else ""
    return f"re-export with {'a larger ' if need is None else ''}`eagle-export --max-length`{size}{bound}"


def prompt_too_long(tokens: int, max_length: int, limit: int | None, at_least: bool = False) -> str:
    """The one message for a prompt that does not fit an export's KV capacity of `max_length`
    rows (at most max_length - 1 prompt tokens: one row is left for output), with what to do:
    shorten the prompt, or, when a re-export within `limit` would hold it, re-export
    (`max_length_hint`). at_least: `tokens` is a lower bound (the prompt was not tokenised
    whole)."""
    hint = max_length_hint(max_length, limit, need=tokens + 1)
    return (f"the prompt has {'at least ' if at_least else ''}{tokens} tokens; this export's KV capacity "
            f"(max_length) is {max_length} tokens, so at most {max_length - 1} prompt tokens fit (one row is "
            f"left for output): shorten the prompt{', or ' + hint if hint else ''}")


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
