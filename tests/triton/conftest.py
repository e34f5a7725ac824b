"""Fixtures for the Triton tests: the tiny export of tests/tiny_export.py, a stand-in for
`triton_python_backend_utils` (so triton/model.py runs in-process, without a server, over a
real decode worker), and the reference runtime the served outputs are compared with."""
from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from eagle_deploy.triton import repo as triton_repo
from tests.tiny_export import tiny_export

ROOT = Path(__file__).resolve().parents[2]
FINAL = 1  # TRITONSERVER_RESPONSE_COMPLETE_FINAL


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Path:
    """The tiny export folder (random Llama target + random head, byte tokenizer, max_length 256)."""
    return tiny_export(tmp_path_factory)


@pytest.fixture(scope="session")
def reference(tiny):
    """An in-process EagleRuntime over the tiny export with the served default drafter (hybrid,
    planned; the device costs come from the same cache as the workers'): what a served request
    must reproduce."""
    from eagle_deploy.runtime.api import EagleRuntime

    return EagleRuntime.load(tiny, threads=1, drafter_kind="hybrid", planned=True)


# ------------------------------------------------------------------ a fake triton_python_backend_utils


class FakeTensor:
    def __init__(self, name, array):
        self._name, self._array = name, np.asarray(array)

    def name(self):
        return self._name

    def as_numpy(self):
        return self._array


class FakeError:
    def __init__(self, message):
        self._message = message

    def message(self):
        return self._message


class FakeResponse:
    def __init__(self, output_tensors=(), error=None):
        self.outputs = {t.name(): t.as_numpy() for t in output_tensors}
        self.error = error

    def text(self) -> str:
        return self.outputs["text_output"][0].decode("utf-8")


class FakeSender:
    """Records (response, flags); `cancel_after`: is_cancelled() turns true once that many
    responses were sent (0 = cancelled from the start)."""

    def __init__(self, cancel_after: int | None = None):
        self.sent: list = []
        self.cancel_after = cancel_after
        self.polls = 0

    def send(self, response=None, flags=0):
        assert not any(f & FINAL for _, f in self.sent), "a response after the FINAL flag"
        self.sent.append((response, flags))

    def is_cancelled(self):
        self.polls += 1
        return self.cancel_after is not None and len(self.sent) >= self.cancel_after

    @property
    def finals(self) -> int:
        return sum(1 for _, f in self.sent if f & FINAL)


class FakeRequest:
    def __init__(self, sender: FakeSender | None = None, **inputs):
        self.sender = sender or FakeSender()
        self.inputs = {k: FakeTensor(k, v) for k, v in inputs.items()}

    def get_response_sender(self):
        return self.sender


def request(text=None, sender=None, **kw) -> FakeRequest:
    """A FakeRequest with Triton-typed inputs (text_input BYTES [1], max_tokens INT32 [1], ...)."""
    types_ = {"max_tokens": np.int32, "top_k": np.int32, "seed": np.uint64, "temperature": np.float32,
              "top_p": np.float32, "stream": np.bool_, "exclude_input_in_output": np.bool_, "min_p": np.float32,
              "presence_penalty": np.float32, "frequency_penalty": np.float32, "repetition_penalty": np.float32}
    inputs = {}
    if text is not None:
        inputs["text_input"] = np.array([text.encode() if isinstance(text, str) else text], dtype=object)
    for k, v in kw.items():
        if k == "stop":
            inputs[k] = np.array([s.encode() if isinstance(s, str) else s for s in v], dtype=object)
        elif k == "response_format":
            inputs[k] = np.array([v.encode()], dtype=object)
        else:
            inputs[k] = np.array([v], dtype=types_[k])
    return FakeRequest(sender, **inputs)


def fake_pb_utils() -> types.ModuleType:
    m = types.ModuleType("triton_python_backend_utils")
    m.Tensor, m.InferenceResponse, m.TritonError = FakeTensor, FakeResponse, FakeError
    m.TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL
    m.TritonModelException = RuntimeError
    m.get_input_tensor_by_name = lambda req, name: req.inputs.get(name)
    m.using_decoupled_model_transaction_policy = lambda cfg: cfg["model_transaction_policy"]["decoupled"]
    m.logs = []
    m.Logger = types.SimpleNamespace(log_info=m.logs.append, log_error=m.logs.append, log_warn=m.logs.append)
    return m


@pytest.fixture(scope="module")
def model_module():
    """triton/model.py loaded under a private name with the fake pb_utils in sys.modules."""
    fake = fake_pb_utils()
    saved = sys.modules.get("triton_python_backend_utils")
    sys.modules["triton_python_backend_utils"] = fake
    try:
        spec = importlib.util.spec_from_file_location("eagle_triton_model_under_test", triton_repo.MODEL_FILE)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        if saved is None:
            sys.modules.pop("triton_python_backend_utils", None)
        else:
            sys.modules["triton_python_backend_utils"] = saved


def model_args(engines: Path, name: str = "eagle", instances: int = 1, **params) -> dict:
    """`initialize` args as Triton passes them, for the parameters write_repo would write."""
    values = {"engines": str(engines), "threads": "1", "worker_python": sys.executable, **params}
    config = {"name": name, "model_transaction_policy": {"decoupled": True},
              "instance_group": [{"count": instances, "kind": "KIND_CPU"}],
              "parameters": {k: {"string_value": str(v)} for k, v in values.items()}}
    return {"model_config": json.dumps(config), "model_name": name, "model_instance_name": f"{name}_0_0",
            "model_instance_kind": "CPU", "model_instance_device_id": "0", "model_repository": str(engines.parent),
            "model_version": "1"}
