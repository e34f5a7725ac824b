"""logprobs, logit_bias and the penalties over HTTP (one slot and four batched slots): the
official openai client gets the runtime's answer, EAGLE's equals vanilla's, and bad values get
one 400 naming the field."""
from __future__ import annotations

import json

import httpx2
import openai
import pytest

from tests.serve.conftest import ORACLE_PROMPTS

MODEL = "tiny"
SHAPING = dict(presence_penalty=0.5, frequency_penalty=0.8, logit_bias={"101": 3.0, "32": -100})
EXTRA = dict(repetition_penalty=1.2, min_p=0.0)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.mark.parametrize("mode", ["eagle", "vanilla"])
def test_completions_with_penalties_and_bias_equal_the_runtimes_answer(client, reference, mode):
    prompt = ORACLE_PROMPTS[1]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, logprobs=3,
                                  extra_body={"mode": mode, **EXTRA}, **SHAPING)
    want = reference.generate(prompt, 24, chat=False, mode="vanilla", logprobs=3, **SHAPING, **EXTRA)
    assert r.choices[0].text == want.text
    lp = r.choices[0].logprobs
    assert lp.tokens == [reference.tokenizer.decode([t]) for t in want.token_ids]
    assert lp.token_logprobs == pytest.approx([e.logprob for e in want.logprobs], abs=1e-5)
    tops = [{reference.tokenizer.decode([i]): v for i, v in e.top} for e in want.logprobs]  # OpenAI's {text: lp}
    assert [sorted(t) for t in lp.top_logprobs] == [sorted(t) for t in tops]
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    plain = reference.generate(prompt, 24, chat=False, mode="vanilla")
    assert plain.token_ids != want.token_ids  # the settings changed the answer


def test_chat_logprobs_streamed_and_not_match(client, reference):
    messages = [{"role": "user", "content": ORACLE_PROMPTS[2]}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                           logprobs=True, top_logprobs=2, **SHAPING)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 for c in content)
    # each entry's bytes are its token's own byte (the byte tokenizer: id = byte), also where the
    # byte alone is no UTF-8 character and its text is U+FFFD (a breaker's report)
    want = reference.generate(messages, 20, logprobs=2, **SHAPING)
    ids = want.token_ids
    assert len(ids) == len(content)
    assert [c.bytes for c, t in zip(content, ids) if t != 0] == [[t] for t in ids if t != 0]  # 0: the EOS
    assert any(c.token == "\ufffd" for c in content)  # the case that used to give U+FFFD's bytes
    streamed = []
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                                logprobs=True, top_logprobs=2, stream=True, **SHAPING):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize("body, param", [
    ({"presence_penalty": 3}, "presence_penalty"), ({"frequency_penalty": "1"}, "frequency_penalty"),
    ({"logit_bias": {"5": 200}}, "logit_bias[5]"), ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"), ({"logit_bias": [1]}, "logit_bias"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_p": -0.1}, "min_p"),
    ({"logprobs": 21}, "logprobs"),
])
def test_bad_controls_get_one_400_naming_the_field(server, body, param):
    r = httpx2.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2, **body},
                    timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(param), err


def test_chat_top_logprobs_are_capped_and_need_logprobs(server):
    base = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = httpx2.post(server.url + "/v1/chat/completions", json={**base, "logprobs": True, "top_logprobs": 21})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    r = httpx2.post(server.url + "/v1/chat/completions", json={**base, "top_logprobs": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["label", "score"],
          "properties": {"label": {"type": "string", "enum": ["yes", "no"]},
                         "score": {"type": "integer", "minimum": 0, "maximum": 9}}}


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_output_is_the_runtimes_and_parses(client, reference, stream):
    messages = [{"role": "user", "content": ORACLE_PROMPTS[0]}]
    rf = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA, "strict": True}}
    want = reference.generate(messages, 64, mode="vanilla", response_format=rf)
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=64, temperature=0, response_format=rf, stream=True)
            if c.choices)
    else:
        text = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=64, temperature=0,
                                              response_format=rf).choices[0].message.content
    assert text == want.text and want.finish_reason == "stop"
    obj = json.loads(text)
    assert obj["label"] in ("yes", "no") and 0 <= obj["score"] <= 9


def test_the_openai_clients_parse_with_a_pydantic_model(client):
    from typing import Annotated, Literal

    from pydantic import BaseModel, Field

    class Verdict(BaseModel):
        label: Literal["yes", "no"]
        score: Annotated[int, Field(ge=0, le=9)]

    r = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": ORACLE_PROMPTS[1]}],
                                      max_tokens=64, temperature=0, response_format=Verdict)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Verdict) and parsed.label in ("yes", "no")


@pytest.mark.parametrize("rf, param", [
    ({"type": "xml"}, "response_format.type"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}},
     "response_format.json_schema.schema"),
])
def test_a_bad_response_format_gets_one_400_naming_it(server, rf, param):
    r = httpx2.post(server.url + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "response_format": rf})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("field, value", [("guided_json", {"type": "object"}), ("ignore_eos", True),
                                          ("min_tokens", 50), ("stop_token_ids", [2]),
                                          ("parallel_tool_calls", False), ("modalities", ["audio"])])
def test_vllm_and_openai_fields_not_served_are_refused_not_ignored(server, field, value):
    r = httpx2.post(server.url + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
