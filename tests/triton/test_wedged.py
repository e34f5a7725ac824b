"""A decode worker that wedges (alive, silent, deaf to cancels: tests/triton/wedge.py) is killed
by triton/model.py after stall_timeout_s, or cancel_grace_s after a cancel: that request gets
one FINAL error response and the next request is served by a fresh worker. model.py runs
in-process against the stand-in for triton_python_backend_utils, as in test_model.py."""
from __future__ import annotations

import pytest

from tests.triton.conftest import ROOT, FakeSender, model_args, request
from tests.triton.wedge import WEDGE_TOKENS

WEDGING = "w" * (WEDGE_TOKENS + 10)  # byte tokenizer: one token per character


def wedged_model(model_module, tiny, **params):
    model = model_module.TritonPythonModel()
    model.initialize(model_args(tiny, drafter="tests.triton.wedge:make_drafter", worker_pythonpath=str(ROOT),
                                always_draft="true", **params))
    return model


def run(model, req):
    model.execute([req])
    return req.sender


class CancelOnceWedged(FakeSender):
    """The client goes away once the worker is wedged (the drafter's marker file exists)."""

    def __init__(self, marker):
        super().__init__()
        self.marker = marker

    def is_cancelled(self):
        self.polls += 1
        return self.marker.exists()


@pytest.mark.slow  # worker processes: in `make test`, not `make test-fast`
@pytest.mark.parametrize("params, cancel, message", [
    ({"stall_timeout_s": "2"}, False, "sent nothing for 2 s (stall_timeout_s)"),
    ({"cancel_grace_s": "1"}, True, "did not stop within 1 s of a cancel (cancel_grace_s)"),
])
def test_a_wedged_worker_is_replaced(model_module, tiny, tmp_path, monkeypatch, params, cancel, message):
    marker = tmp_path / "wedged"
    monkeypatch.setenv("EAGLE_TEST_WEDGE_MARKER", str(marker))
    model = wedged_model(model_module, tiny, **params)
    try:
        old = model.worker.proc
        sender = CancelOnceWedged(marker) if cancel else FakeSender()
        run(model, request(WEDGING, sender=sender, max_tokens=8))
        assert marker.exists()  # the worker really was wedged
        assert sender.finals == 1 and len(sender.sent) == 1
        assert message in sender.sent[0][0].error.message()
        assert old.poll() is not None and model.worker is None  # killed, not left running
        ok = run(model, request("hi", max_tokens=4))
        assert ok.finals == 1 and ok.sent[0][0].error is None
        assert model.worker.proc.pid != old.pid
    finally:
        model.finalize()
