"""triton/model.py in-process (a stand-in for triton_python_backend_utils) over a real decode
worker on the tiny export: responses and their FINAL flags, streaming, the generate-style
inputs, bad requests, cancellation and a worker that dies. The same file serves a real
tritonserver in test_server.py."""
from __future__ import annotations

import json
import math
import os
import signal

import numpy as np
import pytest

from tests.triton.conftest import FINAL, FakeSender, model_args, request

PROMPTS = ["def add(a, b):", "Hello there, how are you?", "for i in range(10): print(i)"]


@pytest.fixture(scope="module")
def served(model_module, tiny):
    model = model_module.TritonPythonModel()
    model.initialize(model_args(tiny))
    yield model
    model.finalize()


def run(model, req):
    model.execute([req])
    return req.sender


@pytest.mark.parametrize("prompt", PROMPTS)
def test_non_streamed_is_one_final_response_equal_to_the_runtime(served, reference, prompt):
    want = reference.generate(prompt, max_new_tokens=20)
    sender = run(served, request(prompt, max_tokens=20, exclude_input_in_output=True))
    assert len(sender.sent) == 1 and sender.finals == 1
    resp = sender.sent[0][0]
    assert resp.error is None and resp.text() == want.text
    assert resp.outputs["finish_reason"][0] == want.finish_reason.encode()
    assert int(resp.outputs["new_tokens"][0]) == want.stats.new_tokens == len(want.token_ids)
    assert int(resp.outputs["prompt_tokens"][0]) == want.stats.prompt_tokens
    assert int(resp.outputs["target_forwards"][0]) == want.stats.target_forwards
    assert math.isclose(float(resp.outputs["mean_accept_len"][0]), want.stats.mean_accept_len, rel_tol=1e-4)
    spec = json.loads(resp.outputs["stats"][0])["speculative"]  # vLLM's counters, as eagle-serve reports them
    assert spec == want.stats.to_json()["speculative"] and spec["rounds"] == want.stats.rounds
    assert spec["accepted_tokens"] == want.stats.round_tokens - want.stats.rounds


def test_input_is_prepended_unless_excluded(served, reference):
    want = reference.generate(PROMPTS[0], max_new_tokens=8).text
    sender = run(served, request(PROMPTS[0], max_tokens=8))
    assert sender.sent[0][0].text() == PROMPTS[0] + want


@pytest.mark.parametrize("prompt", PROMPTS)
def test_streamed_deltas_concatenate_to_the_non_streamed_text(served, prompt):
    whole = run(served, request(prompt, max_tokens=48, exclude_input_in_output=True)).sent[0][0]
    sender = run(served, request(prompt, max_tokens=48, stream=True))
    *deltas, (last, flags) = sender.sent
    assert sender.finals == 1 and flags == FINAL and all(f == 0 for _, f in deltas)
    texts = [r.outputs["text_output"][0] for r, _ in deltas]
    assert all(t and t.decode("utf-8") for t in texts)  # never empty, never half a character
    assert "".join(t.decode("utf-8") for t in texts) == whole.text()
    assert last.text() == "" and last.outputs["new_tokens"][0] == whole.outputs["new_tokens"][0]
    assert set(deltas[0][0].outputs) == {"text_output"}  # stats only on the final response


def test_stop_strings_and_sampling_settings_reach_the_runtime(served, reference):
    full = reference.generate(PROMPTS[1], max_new_tokens=40).text
    stop = next(c for c in full[3:] if c.isascii() and c.isprintable())
    want = reference.generate(PROMPTS[1], max_new_tokens=40, stop=[stop])
    sender = run(served, request(PROMPTS[1], max_tokens=40, stop=[stop, ""], exclude_input_in_output=True))
    resp = sender.sent[0][0]
    assert resp.text() == want.text and stop not in resp.text() and resp.outputs["finish_reason"][0] == b"stop"
    sampled = reference.generate(PROMPTS[2], max_new_tokens=16, temperature=0.8, top_p=0.9, top_k=20, seed=7)
    sender = run(served, request(PROMPTS[2], max_tokens=16, temperature=0.8, top_p=0.9, top_k=20, seed=7,
                                 exclude_input_in_output=True))
    assert sender.sent[0][0].text() == sampled.text


def test_penalties_reach_the_runtime_and_keep_greedy_equal_to_vanilla(served, reference):
    kw = dict(presence_penalty=0.5, frequency_penalty=0.75, repetition_penalty=1.25)
    want = reference.generate(PROMPTS[1], max_new_tokens=32, mode="vanilla", **kw)
    sender = run(served, request(PROMPTS[1], max_tokens=32, exclude_input_in_output=True, **kw))
    assert sender.sent[0][0].text() == want.text
    assert want.text != reference.generate(PROMPTS[1], max_new_tokens=32, mode="vanilla").text  # it changed the answer


def test_response_format_reaches_the_runtime_and_the_output_follows_the_schema(served, reference):
    import json as _json

    schema = {"type": "object", "additionalProperties": False, "required": ["ok"],
              "properties": {"ok": {"type": "boolean"}}}
    rf = {"type": "json_schema", "json_schema": {"name": "flag", "schema": schema, "strict": True}}
    want = reference.generate(PROMPTS[0], max_new_tokens=24, mode="vanilla", response_format=rf)
    sender = run(served, request(PROMPTS[0], max_tokens=24, exclude_input_in_output=True,
                                 response_format=_json.dumps(rf)))
    assert sender.sent[0][0].text() == want.text and want.finish_reason == "stop"
    assert _json.loads(want.text)["ok"] in (True, False)


@pytest.mark.parametrize("kw, message", [
    ({}, "text_input is missing"),
    ({"text": "   "}, "text_input is missing or empty"),
    ({"text": b"\xff\xfe"}, "not valid UTF-8"),
    ({"text": "hi", "max_tokens": 0}, "max_tokens must be"),
    ({"text": "hi", "max_tokens": -5}, "max_tokens must be"),
    ({"text": "hi", "temperature": float("nan")}, "temperature"),
    ({"text": "hi", "top_p": 1.5}, "top_p"),
    ({"text": "hi", "top_k": -1}, "top_k"),
    ({"text": "hi", "stop": [b"\xc3"]}, "stop is not valid UTF-8"),
    ({"text": "hi", "presence_penalty": 3.0}, "presence_penalty must be in [-2, 2]"),
    ({"text": "hi", "repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
    ({"text": "hi", "response_format": "{not json"}, "response_format is not JSON"),
    ({"text": "hi", "response_format": '{"type": "xml"}'}, "response_format.type must be"),
])
def test_bad_request_gets_one_error_response_and_the_instance_keeps_serving(served, kw, message):
    sender = run(served, request(**kw))
    assert len(sender.sent) == 1 and sender.finals == 1
    resp = sender.sent[0][0]
    assert resp.error is not None and message in resp.error.message()
    ok = run(served, request("hi", max_tokens=4))
    assert ok.sent[0][0].error is None and ok.finals == 1


def test_too_long_prompt_is_an_error_response(served):
    sender = run(served, request("x" * 400, max_tokens=4))
    message = sender.sent[0][0].error.message()
    assert sender.finals == 1 and "prompt has 400 tokens" in message
    assert "shorten the prompt" in message  # what to do, as eagle-run and eagle-serve say it


@pytest.mark.parametrize("stream", [True, False])
def test_cancelled_request_stops_decoding_and_gets_a_bare_final_flag(served, model_module, stream):
    logs = model_module.pb_utils.logs
    sender = FakeSender(cancel_after=0)  # the client is gone from the start
    run(served, request(PROMPTS[0], sender=sender, max_tokens=230, stream=stream))
    assert sender.sent == [(None, FINAL)] and sender.polls >= 1
    assert "request cancelled by the client; decoding stopped" in logs[-1]
    ok = run(served, request(PROMPTS[0], max_tokens=4))
    assert ok.sent[0][0].error is None


@pytest.mark.slow  # several seconds of child processes: in `make test`, not `make test-fast`
def test_instances_have_their_own_worker_and_a_dead_worker_is_replaced(model_module, tiny, reference):
    a, b = model_module.TritonPythonModel(), model_module.TritonPythonModel()
    a.initialize(model_args(tiny))
    b.initialize(model_args(tiny))
    try:
        assert a.worker.proc.pid != b.worker.proc.pid
        os.kill(a.worker.proc.pid, signal.SIGKILL)
        a.worker.proc.wait()
        old = a.worker.proc.pid
        sender = run(a, request(PROMPTS[2], max_tokens=12, exclude_input_in_output=True))
        assert sender.sent[0][0].text() == reference.generate(PROMPTS[2], max_new_tokens=12).text
        assert a.worker.proc.pid != old
    finally:
        a.finalize()
        b.finalize()
    assert a.worker is None and b.worker is None


def test_worker_that_cannot_load_fails_initialize(model_module, tmp_path):
    model = model_module.TritonPythonModel()
    with pytest.raises(model_module.WorkerGone, match="failed to load: ManifestError: .*missing-export does not exist"):
        model.initialize(model_args(tmp_path / "missing-export"))


def test_runtime_parameters_reach_the_workers_runtime_options(model_module, tiny, tmp_path):
    from eagle_deploy.triton.worker import load_runtime

    model = model_module.TritonPythonModel()
    with pytest.raises(model_module.WorkerGone):  # argv is built before the worker starts
        model.initialize(model_args(tmp_path / "missing-export", prefill_graph="target", prefix_cache_mb="8"))
    config = json.loads(model.argv[model.argv.index("--config") + 1])
    assert config["prefill_graph"] == "target" and config["prefix_cache_mb"] == 8.0
    rt, _, _ = load_runtime({**config, "engines": str(tiny)})
    assert rt.options.prefill_graph == "target" and rt.options.prefix_cache_mb == 8.0
    assert rt.prefix_cache is not None
    rt, _, _ = load_runtime({"engines": str(tiny), "threads": 1})  # absent: RuntimeOptions' defaults
    assert rt.options.prefill_graph == "auto" and rt.prefix_cache is None


def test_per_request_errors_do_not_leak_between_requests(served):
    """A request id answered with an error never receives the next request's messages."""
    senders = [run(served, request("hi", max_tokens=n)) for n in (0, 3, -1, 3)]
    assert [s.finals for s in senders] == [1, 1, 1, 1]
    assert [s.sent[0][0].error is None for s in senders] == [False, True, False, True]
    assert np.array_equal(senders[1].sent[0][0].outputs["new_tokens"], senders[3].sent[0][0].outputs["new_tokens"])
