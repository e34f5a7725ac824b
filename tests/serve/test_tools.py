"""Tool calls over HTTP with the official openai client: a template that renders tools, a
forced call returned as tool_calls (streamed and not), the tool's answer sent back, and a 400
naming the model whose template has no tools."""
from __future__ import annotations

import json

import httpx2
import openai
import pytest

from eagle_deploy.contract.verify import rerecord_files
from tests.runtime.test_tools import CLOCK, TOOLS_TEMPLATE, WEATHER
from tests.serve.conftest import make_server
from tests.tiny_export import copy_export

MODEL = "tiny"


@pytest.fixture(scope="module")
def tools_server(serve_export, tmp_path_factory):
    from transformers import AutoTokenizer

    folder = copy_export(serve_export, tmp_path_factory.mktemp("tools") / "tiny")
    tok = AutoTokenizer.from_pretrained(str(folder / "tokenizer"))
    tok.chat_template = TOOLS_TEMPLATE
    tok.save_pretrained(str(folder / "tokenizer"))
    rerecord_files(folder)
    srv = make_server(folder)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(tools_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=tools_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_a_named_call_comes_back_as_tool_calls_and_its_answer_goes_back_in(client):
    messages = [{"role": "user", "content": "weather in Oslo?"}]
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, CLOCK], tool_choice=choice,
                                       max_tokens=160, temperature=0)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None and len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert args["city"] in ("Paris", "Oslo") and args["unit"] in ("C", "F")
    streamed = [c for c in client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, CLOCK],
                                                          tool_choice=choice, max_tokens=160, temperature=0,
                                                          stream=True) if c.choices]
    deltas = [tc for c in streamed for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == [
        (0, "get_weather", call.function.arguments)]
    assert streamed[-1].choices[0].finish_reason == "tool_calls"
    back = messages + [msg.model_dump(exclude_none=True),
                       {"role": "tool", "tool_call_id": call.id, "content": "-3 C"}]
    again = client.chat.completions.create(model=MODEL, messages=back, tools=[WEATHER, CLOCK], max_tokens=8,
                                           temperature=0)
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_bad_tools_get_one_400_naming_the_field(tools_server):
    base = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for body, param in (({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
                        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
                        ({"tool_choice": "required"}, "tool_choice")):
        r = httpx2.post(tools_server.url + "/v1/chat/completions", json={**base, **body}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_template_without_tools_gets_a_400_naming_the_model(server):
    r = httpx2.post(server.url + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "tools": [WEATHER]})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "tools" and "tools are not supported by the model" in err["message"]
