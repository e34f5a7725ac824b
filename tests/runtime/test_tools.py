"""Tool calls (runtime/tools.py): the tools reach a template that renders them, "required" and
a named function constrain the output to calls whose arguments follow the function's schema
(greedy EAGLE == vanilla under that grammar), and a finished output splits into text and
OpenAI-shaped calls."""
from __future__ import annotations

import json

import pytest

from eagle_deploy.contract.errors import SettingError
from eagle_deploy.runtime.request import Request
from eagle_deploy.runtime.tools import check_tool_choice, check_tools, parse_tool_calls, tool_grammar
from tests.conftest import PROMPTS
from tests.helpers import export_with_template

TOOLS_TEMPLATE = (  # hermes-style, as Qwen2.5's: tools listed in a system turn, calls in <tool_call> tags
    "{% if tools %}<|system|>Tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% if m['tool_calls'] %}{% for c in m['tool_calls'] %}<tool_call>{{ c['function'] | tojson }}</tool_call>"
    "{% endfor %}{% endif %}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "additionalProperties": False,
                                                           "required": ["city", "unit"],
                                                           "properties": {"city": {"type": "string", "enum": [
                                                               "Paris", "Oslo"]},
                                                               "unit": {"type": "string", "enum": ["C", "F"]}}}}}
CLOCK = {"type": "function", "function": {"name": "now", "parameters": {
    "type": "object", "properties": {"tz": {"type": "integer", "minimum": -12, "maximum": 12}}, "required": ["tz"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module")
def tools_export(mha, tmp_path_factory):
    return export_with_template(mha.export_dir, tmp_path_factory.mktemp("tools") / "mha-tools", TOOLS_TEMPLATE)


def test_parse_splits_text_and_calls_and_leaves_broken_blocks_as_text():
    text, calls = parse_tool_calls('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
                                   '"Oslo", "unit": "C"}}\n</tool_call>\n<tool_call>{"name": "now", "arguments": '
                                   '{"tz": 1}}</tool_call><tool_call>{not json}</tool_call>')
    assert text == "Let me check.\n\n<tool_call>{not json}</tool_call>"
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("function", "get_weather", {"city": "Oslo", "unit": "C"}), ("function", "now", {"tz": 1})]
    assert all(c["id"].startswith("call_") for c in calls) and len({c["id"] for c in calls}) == 2
    assert parse_tool_calls("plain answer") == ("plain answer", [])


@pytest.mark.parametrize("tools, choice, field", [
    ([{"type": "function", "function": {"name": "bad name"}}], None, "tools[0].function.name"),
    ([WEATHER, WEATHER], None, "tools[1].function.name"), ("x", None, "tools"),
    ([{"type": "retrieval"}], None, "tools[0]"), ([WEATHER], "sometimes", "tool_choice"),
    ([], "required", "tool_choice"), ([WEATHER], {"type": "function", "function": {"name": "now"}},
                                      "tool_choice.function.name"),
])
def test_bad_tools_and_choices_are_one_error_naming_the_field(tools, choice, field):
    with pytest.raises(SettingError) as err:
        Request("hi", tools=tools, tool_choice=choice)
    assert err.value.field == field


def test_choices_and_their_grammars():
    tools = check_tools([WEATHER, CLOCK])
    assert check_tool_choice(None, tools) == "auto" and check_tool_choice(None, ()) == "none"
    assert tool_grammar(tools, "auto") is None and tool_grammar(tools, "none") is None
    named = tool_grammar(tools, check_tool_choice({"type": "function", "function": {"name": "now"}}, tools))
    assert '"const": "now"' in named and "get_weather" not in named and "call)*" not in named
    assert "anyOf" in tool_grammar(tools, "required") and "call)*" in tool_grammar(tools, "required")
    with pytest.raises(SettingError, match="cannot be combined"):
        Request("hi", tools=tools, tool_choice="required", response_format={"type": "json_object"})


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_call_is_valid_and_greedy_eagle_equals_vanilla(mha, tools_export, choice):
    rt = mha.runtime(tools_export)
    finished = 0
    for content in ("weather?", "time please", "hello there"):
        messages = [{"role": "user", "content": content}]
        v = rt.generate(messages, 160, tools=[WEATHER, CLOCK], tool_choice=choice, mode="vanilla")
        e = rt.generate(messages, 160, tools=[WEATHER, CLOCK], tool_choice=choice)
        assert e.token_ids == v.token_ids
        assert e.tool_calls, e.text  # the grammar makes the answer a call; the first completes within 160 tokens
        finished += e.stats.finish_reason == "stop"  # ended by EOS once the grammar allowed it
        assert e.finish_reason == ("tool_calls" if e.stats.finish_reason == "stop" else "length")
        for call in e.tool_calls:
            args = json.loads(call["function"]["arguments"])
            if call["function"]["name"] == "get_weather":
                assert args["city"] in ("Paris", "Oslo") and args["unit"] in ("C", "F")
            else:
                assert call["function"]["name"] == "now" and -12 <= args["tz"] <= 12
            if isinstance(choice, dict):
                assert call["function"]["name"] == "get_weather"
    if isinstance(choice, dict):  # one call exactly: the grammar then forces EOS
        assert finished == 3


def test_tools_reach_the_template_and_a_tool_answer_goes_back_in(mha, tools_export):
    rt = mha.runtime(tools_export)
    plain = rt.encode([{"role": "user", "content": "hi"}])
    with_tools = rt.encode(Request([{"role": "user", "content": "hi"}], tools=[WEATHER]))
    assert rt.tokenizer.decode(with_tools).startswith("<|system|>Tools: get_weather")
    assert rt.encode(Request([{"role": "user", "content": "hi"}], tools=[WEATHER], tool_choice="none")) == plain
    turn = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "C"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"}]
    text = rt.tokenizer.decode(rt.encode(Request(turn, tools=[WEATHER])))
    assert '<tool_call>{"arguments": {"city": "Oslo", "unit": "C"}, "name": "get_weather"}</tool_call>' in text \
        or '"arguments": {"city": "Oslo"' in text  # the arguments reach the template as an object
    assert "<|tool|>-3 C" in text


def test_a_template_without_tools_is_one_error_naming_the_model(mha, tmp_path):
    folder = export_with_template(mha.export_dir, tmp_path / "plain-chat",
                                  "{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    rt = mha.runtime(folder)
    with pytest.raises(SettingError, match=f"^tools are not supported by the model {rt.manifest.name}: its chat"):
        rt.generate([{"role": "user", "content": "hi"}], 4, tools=[WEATHER])
    ids = rt.generate(PROMPTS[0], 120, tools=[WEATHER], tool_choice="required", mode="vanilla")  # ids as they are
    assert ids.tool_calls and ids.tool_calls[0]["function"]["name"] == "get_weather"
    assert rt.generate([{"role": "user", "content": "hi"}], 4, tools=[WEATHER], tool_choice="none").token_ids


def test_a_string_argument_may_hold_the_closing_tag():
    text = '<tool_call>\n{"name": "echo", "arguments": {"s": "}</tool_call>"}}\n</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"s": "}</tool_call>"}
    assert parse_tool_calls('<tool_call>{"name": "a", "arguments": "[1, 2]"}</tool_call>')[1] == []  # not an object
