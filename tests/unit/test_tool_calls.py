"""services/coordinator/tools.py: tools checked, a reply's calls parsed in the model's own format
(the whole reply and streamed alike), and anything that is not a valid call kept as text."""
from __future__ import annotations

import json

import pytest

from services.coordinator.errors import InvalidParam
from services.coordinator.tools import ToolStream, parse_tools, split_calls, template_calls

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def tools(**body):
    return parse_tools({"tools": [WEATHER, TIME], **body})


def test_parse_tools_reads_choice_and_parallel():
    assert parse_tools({}) is None and parse_tools({"tools": [], "tool_choice": "none"}) is None
    t = tools()
    assert (t.choice, t.name, t.parallel, t.names) == ("auto", None, True, ["get_weather", "get_time"])
    assert tools(tool_choice="none").rendered is None and tools().rendered == [WEATHER, TIME]
    t = tools(tool_choice={"type": "function", "function": {"name": "get_time"}}, parallel_tool_calls=False)
    assert (t.choice, t.name, t.parallel) == ("function", "get_time", False)
    assert t.schema("get_time") == {"type": "object"} and t.schema("get_weather")["required"] == ["city"]


@pytest.mark.parametrize("body, needle", [
    ({"tools": {"a": 1}}, "tools must be a list"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0] must be"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools[0].function.name"),
    ({"tools": [TIME, TIME]}, "given twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "JSON schema of an object"),
    ({"tools": [TIME], "tool_choice": "sometimes"}, "tool_choice must be"),
    ({"tools": [TIME], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": [TIME], "parallel_tool_calls": "yes"}, "parallel_tool_calls must be a boolean"),
])
def test_malformed_tools_are_a_400_naming_the_field(body, needle):
    with pytest.raises(InvalidParam, match=needle.replace("[", r"\[").replace("]", r"\]")):
        parse_tools(body)


def test_an_earlier_call_reaches_the_template_with_object_arguments():
    m = {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                                              "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}]}
    assert template_calls(m, 3) == [{"type": "function", "function": {"name": "get_time", "arguments": {"tz": "UTC"}}}]
    for bad in ('{"tz": ', "[1]"):
        m["tool_calls"][0]["function"]["arguments"] = bad
        with pytest.raises(InvalidParam, match=r"messages\[3\].tool_calls\[0\].function.arguments"):
            template_calls(m, 3)


def call_text(*calls) -> str:
    return "".join(f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls)


def test_a_reply_of_calls_parses_into_openai_calls():
    content, calls = split_calls("Let me look.\n" + call_text(("get_weather", {"city": "Paris"}),
                                                                ("get_time", {})), tools())
    assert content == "Let me look."
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("function", "get_weather", {"city": "Paris"}), ("function", "get_time", {})]
    assert len({c["id"] for c in calls}) == 2 and all(c["id"].startswith("call_") for c in calls)


@pytest.mark.parametrize("text", [
    "no call at all",
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Pa",  # cut off by max_tokens
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n",  # no </tool_call>
    "<tool_call>\n{not json}\n</tool_call>",
    call_text(("rm_rf", {})),  # not one of the tools
    call_text(("get_time", [1])),  # arguments not an object
    call_text(("get_time", {})) + "and then some prose",
])
def test_what_is_not_a_valid_call_stays_text(text):
    assert split_calls(text, tools()) is None


def test_parallel_false_and_choice_none_keep_several_calls_as_text():
    two = call_text(("get_time", {}), ("get_time", {"tz": "UTC"}))
    assert split_calls(two, tools(parallel_tool_calls=False)) is None
    assert len(split_calls(two, tools())[1]) == 2
    assert split_calls(call_text(("get_time", {})), tools(tool_choice="none")) is None


@pytest.mark.parametrize("cut", [1, 3, 7])
def test_a_stream_sends_content_then_holds_the_calls(cut):
    text = "Sure.\n" + call_text(("get_weather", {"city": "Oslo"}))
    pieces = [text[i:i + cut] for i in range(0, len(text), cut)]
    s = ToolStream(tools())
    sent = "".join(s.feed(p) for p in pieces[:-1])
    rest, calls = s.finish_with(pieces[-1])
    assert sent + rest == "Sure.\n" and json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}


def test_a_stream_whose_call_does_not_parse_sends_all_of_it_as_text():
    text = "<tool_call>\n{\"name\": \"nope\"}\n</tool_call>"
    s = ToolStream(tools())
    sent = s.feed(text[:15]) + s.feed(text[15:])
    rest, calls = s.finish_with("")
    assert sent + rest == text and calls == []


@pytest.mark.parametrize("text", [
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',  # the 0.5B's reply, greedy
    '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```',  # the 1.5B's
    '\n[{"name": "get_weather", "arguments": {"city": "Paris"}}]\n',
])
def test_a_reply_of_bare_call_objects_is_calls(text):
    content, calls = split_calls(text, tools())
    assert content == "" and [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"}]
    s = ToolStream(tools())
    sent = "".join(s.feed(text[i:i + 2]) for i in range(0, len(text), 2))
    rest, streamed = s.finish_with("")
    assert sent + rest == "" and [c["function"] for c in streamed] == [c["function"] for c in calls]


@pytest.mark.parametrize("text", ['{"a": 1}', "```python\nprint(1)\n```", '{"name": "get_weather"} and more',
                                  "```json\n[1, 2]\n```", "[]"])
def test_json_that_is_not_calls_stays_text_and_a_code_reply_streams(text):
    assert split_calls(text, tools()) is None
    s = ToolStream(tools())
    sent = "".join(s.feed(text[i:i + 3]) for i in range(0, len(text), 3))
    rest, calls = s.finish_with("")
    assert sent + rest == text and calls == []
    if text.startswith("```python"):
        assert sent.startswith("```python"), "a code reply is not held to its end"
