"""Error-message helpers shared by the exporter and the runtime (standard library only)."""
from __future__ import annotations

import importlib


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
