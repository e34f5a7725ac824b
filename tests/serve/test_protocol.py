"""Request parsing and the response/chunk bodies, without a server."""
from __future__ import annotations

import json

import pytest

from eagle_deploy.serve import protocol as p
from eagle_deploy.serve.scheduler import decoding_info, fingerprint


def chat(**kw):
    return p.parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw})


def test_chat_defaults_and_fields():
    r = chat()
    assert (r.max_tokens, r.temperature, r.top_p, r.top_k, r.seed, r.stop, r.stream) == (None, 1.0, 1.0, 0, None, (),
                                                                                         False)
    r = chat(max_tokens=5, max_completion_tokens=7, temperature=0, stop="x", stream=True,
             stream_options={"include_usage": True}, top_k=3, seed=1, n=1, mode="vanilla", user="u")
    assert (r.max_tokens, r.temperature, r.stop, r.include_usage, r.top_k, r.mode, r.user) == (7, 0.0, ("x",), True, 3,
                                                                                              "vanilla", "u")
    r = p.parse_chat({"model": "m", "messages": [{"role": "developer", "content": [{"type": "text", "text": "a"},
                                                                                    {"type": "text", "text": "b"}]}]})
    assert r.messages == [{"role": "system", "content": "ab"}]


def test_completion_prompts():
    assert p.parse_completion({"model": "m", "prompt": "x"}).max_tokens == 16
    assert p.parse_completion({"model": "m", "prompt": ["x"]}).prompt == "x"
    assert p.parse_completion({"model": "m", "prompt": [[1, 2]]}).prompt == [1, 2]
    assert p.parse_completion({"model": "m", "prompt": [3, 4]}).prompt == [3, 4]


def test_a_role_of_another_type_is_a_400_not_a_crash():
    for role in ([], {"a": 1}, 3, None):
        with pytest.raises(p.ApiError) as info:
            chat(messages=[{"role": role, "content": "hi"}])
        assert info.value.status == 400 and info.value.param == "messages[0].role", role


@pytest.mark.parametrize("kw, param", [
    ({"n": 2}, "n"), ({"max_tokens": 0}, "max_tokens"), ({"max_completion_tokens": -5}, "max_completion_tokens"),
    ({"temperature": float("inf")}, "temperature"), ({"temperature": True}, "temperature"), ({"top_p": 1.5}, "top_p"),
    ({"seed": "1"}, "seed"), ({"stop": [1]}, "stop"), ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({"functions": [{"name": "f"}]}, "functions"), ({"best_of": 2}, "best_of"),
    ({"logit_bias": [1, 2]}, "logit_bias"), ({"user": 5}, "user"), ({"top_logprobs": 2}, "top_logprobs"),
])
def test_chat_errors_name_the_field(kw, param):
    with pytest.raises(p.ApiError) as info:
        chat(**kw)
    err = info.value
    assert err.status == 400 and err.param == param and err.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("kw, message, code", [
    ({"max_tokens": 0.0}, "max_tokens must be >= 1, got 0", "invalid_value"),
    ({"max_tokens": 2.5}, "max_tokens must be an integer, got 2.5", "invalid_type"),
    ({"seed": True}, "seed must be an integer, got True", "invalid_type"),
    ({"top_p": 1.5}, "top_p must be in (0.0, 1.0], got 1.5", "invalid_value"),
    ({"temperature": float("nan")}, "temperature must be a finite number, got nan", "invalid_value"),
    ({"stream": "yes"}, "stream must be true or false, got 'yes'", "invalid_type"),
    ({"mode": "turbo"}, "mode must be one of eagle, vanilla, got 'turbo'", "invalid_value"),
    ({"messages": [{"role": "user", "content": [{"type": "image"}]}]},
     'only text content parts are supported ({"type": "text", "text": ...})', "unsupported_value"),
])
def test_error_messages_and_codes(kw, message, code):
    with pytest.raises(p.ApiError) as info:
        chat(**kw)
    assert (info.value.message, info.value.code) == (message, code)


def test_null_is_absent_and_integral_floats_are_integers():
    r = chat(max_tokens=16.0, temperature=None, seed=None, stop=None, stream_options=None)
    assert (r.max_tokens, r.temperature, r.seed, r.stop) == (16, 1.0, None, ())
    assert chat(max_completion_tokens=5, max_tokens="ignored").max_tokens == 5


def test_harmless_fields_are_accepted():
    chat(logprobs=False, presence_penalty=0, frequency_penalty=0.0, logit_bias={}, response_format={"type": "text"},
         tools=[], metadata={"a": 1}, store=False)


def test_parse_json():
    assert p.parse_json(b'{"a": 1}') == {"a": 1}
    for raw in (b"", b"[]", b"nul", b"\xff"):
        with pytest.raises(p.ApiError) as info:
            p.parse_json(raw)
        assert info.value.code == "invalid_json"


@pytest.mark.parametrize("raw, param, digits", [
    (b'{"model": "m", "max_tokens": ' + b"9" * 5000 + b"}", "max_tokens", 5000),
    (b'{"model": "m", "prompt": [1, 2, -' + b"7" * 5000 + b"]}", "prompt[2]", 5000),
    (b'{"model": "m", "extra": {"deep": [' + b"1" * (p.MAX_DIGITS + 1) + b"]}}", "extra.deep[0]", p.MAX_DIGITS + 1),
])
def test_a_number_with_too_many_digits_is_a_400_naming_the_field(raw, param, digits):
    """Issue 53: a 5,000-digit number gave a 400 quoting Python's sys.set_int_max_str_digits()."""
    with pytest.raises(p.ApiError) as info:
        p.parse_json(raw)
    assert (info.value.status, info.value.param) == (400, param)
    assert info.value.message == f"{param} is a number with too many digits ({digits}; at most {p.MAX_DIGITS})"
    assert p.parse_json(b'{"a": ' + b"1" * p.MAX_DIGITS + b"}")["a"] == int("1" * p.MAX_DIGITS)


def test_envelope_shapes_and_sse():
    env = p.Envelope(p.CHAT, "m", "fp")
    assert env.id.startswith("chatcmpl-") and env.created > 0
    first = env.chunk(role=True, usage_null=True)
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"] == {"role": "assistant",
                                                                                            "content": ""}
    assert first["usage"] is None and first["system_fingerprint"] == "fp"
    assert env.chunk("hé")["choices"][0]["delta"] == {"content": "hé"} and "usage" not in env.chunk("x")
    last = env.chunk(None, "stop", extra={"eagle": {}})
    assert last["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    assert env.usage_chunk(p.usage(3, 4)) | {} == {**env.usage_chunk(p.usage(3, 4)), "choices": [],
                                                   "usage": {"prompt_tokens": 3, "completion_tokens": 4,
                                                             "total_tokens": 7}}
    body = env.response("t", "length", p.usage(1, 2))
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"] == "t"
    cenv = p.Envelope(p.COMPLETION, "m", "fp")
    assert cenv.id.startswith("cmpl-") and cenv.chunk("a")["choices"][0]["text"] == "a"
    assert cenv.response("t", "stop", p.usage(1, 1))["object"] == "text_completion"
    assert p.sse({"a": "é"}) == 'data: {"a":"é"}\n\n' and p.DONE == "data: [DONE]\n\n"
    assert json.loads(p.sse(first)[6:]) == first


def test_fingerprints():
    assert fingerprint("1.0", decoding_info("lossless", 0.0, "eagle")) == "eagle-deploy-1.0-eagle-lossless"
    info = decoding_info("threshold", 0.25, "eagle")
    assert info["lossless"] is False and fingerprint("1.0", info) == "eagle-deploy-1.0-eagle-threshold0.25-not-lossless"
    assert decoding_info("threshold", 0.25, "vanilla")["lossless"] is True
