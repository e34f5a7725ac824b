"""contract.dtypes (the one dtype name list, numpy dtypes, CLI spellings) and
contract.errors (first line of an exception, the TensorRT import)."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from eagle_deploy.contract import dtypes
from eagle_deploy.contract.errors import first_line, import_tensorrt, max_length_hint, prompt_too_long


def test_names_numpy_and_aliases():
    assert dtypes.numpy_dtype("float16") == np.float16 and dtypes.numpy_dtype("bool") == np.bool_
    assert dtypes.host_dtype("bfloat16") == np.float32 and dtypes.host_dtype("int64") == np.int64
    assert [dtypes.host_dtype(n) for n in dtypes.NAMES if n != "bfloat16"] == [np.dtype(n) for n in dtypes.NAMES
                                                                             if n != "bfloat16"]
    with pytest.raises(TypeError, match="bfloat16"):
        dtypes.numpy_dtype("bfloat16")
    with pytest.raises(ValueError, match="float64"):
        dtypes.host_dtype("float64")
    assert {dtypes.canonical(a) for a in dtypes.CLI_NAMES} == set(dtypes.FLOAT_NAMES) <= set(dtypes.NAMES)
    assert dtypes.canonical("float16") == "float16" and dtypes.canonical("fp8") is None


def test_torch_and_trt_tables_derive_from_the_names():
    torch = pytest.importorskip("torch")
    from eagle_deploy.exporter.steps import TORCH_DTYPES
    from eagle_deploy.runtime.backends.ort_cuda import torch_dtype
    from eagle_deploy.runtime.backends.trt import TRT_MEMBERS

    assert [torch_dtype(n) for n in dtypes.NAMES][:3] == [torch.float32, torch.float16, torch.bfloat16]
    assert torch_dtype("bool") == torch.bool and set(TRT_MEMBERS) == set(dtypes.NAMES)
    assert TORCH_DTYPES == {n: torch_dtype(n) for n in dtypes.FLOAT_NAMES}
    with pytest.raises(ValueError):
        torch_dtype("complex64")


def test_first_line():
    assert first_line(RuntimeError("  bad file\n  at line 3\n")) == "bad file"
    assert first_line(OSError()) == "OSError"


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None, reason="TensorRT is installed")
def test_import_tensorrt_names_the_install():
    with pytest.raises(ImportError, match=r"pip install '\.\[gpu\]'` to build"):
        import_tensorrt("to build")


def test_a_prompt_over_the_capacity_says_what_to_do():
    assert prompt_too_long(2461, 2048, 8192) == (
        "the prompt has 2461 tokens; this export's KV capacity (max_length) is 2048 tokens, so at most 2047 prompt "
        "tokens fit (one row is left for output): shorten the prompt, or re-export with `eagle-export --max-length` "
        "2462 or more plus the new tokens wanted (at most 8192)")
    assert prompt_too_long(8191, 2048, 8192).endswith("`eagle-export --max-length` 8192 or more plus the new tokens "
                                                      "wanted (at most 8192)")
    # too long for any re-export (8192 tokens need 8193 rows): how short a re-export would need it
    for tokens in (8192, 20000):
        assert prompt_too_long(tokens, 2048, 8192).endswith(
            "fit (one row is left for output): shorten the prompt (a re-export with `eagle-export --max-length 8192`, "
            "the most this model allows, would take up to 8191 prompt tokens)")
    # already at the limit: only shortening helps
    assert prompt_too_long(9000, 8192, 8192, at_least=True) == (
        "the prompt has at least 9000 tokens; this export's KV capacity (max_length) is 8192 tokens, so at most 8191 "
        "prompt tokens fit (one row is left for output): shorten the prompt")
    assert prompt_too_long(300, 256, None).endswith("or re-export with `eagle-export --max-length` 301 or more plus "
                                                    "the new tokens wanted")
    assert max_length_hint(64, None) == "re-export with a larger `eagle-export --max-length`"
    assert max_length_hint(64, 256) == "re-export with a larger `eagle-export --max-length` (at most 256)"
    assert max_length_hint(256, 256) == ""
