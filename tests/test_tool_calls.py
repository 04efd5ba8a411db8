"""Tool calls parsed from completion text in the model's own format (megatron_grpo/chat/tool_calls.py)."""

import json

import pytest

from megatron_grpo.chat.tool_calls import MAX_CALLS, TOOL_CALL_FORMATS, parse_tool_calls


def test_hermes_calls_and_content():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name":"add","arguments":{"a":1,"b":2}}</tool_call>')
    turn = parse_tool_calls(text, "hermes", id_prefix="call_3")
    assert turn.content == "Let me check."
    assert turn.errors == []
    assert [c["id"] for c in turn.tool_calls] == ["call_3_0", "call_3_1"]
    assert [c["type"] for c in turn.tool_calls] == ["function", "function"]
    assert turn.tool_calls[0]["function"]["name"] == "get_weather"
    # arguments are OpenAI's JSON string, whatever spacing the model wrote
    assert json.loads(turn.tool_calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert json.loads(turn.tool_calls[1]["function"]["arguments"]) == {"a": 1, "b": 2}


def test_hermes_plain_answer_has_no_calls():
    turn = parse_tool_calls("The answer is 4.", "hermes")
    assert (turn.content, turn.tool_calls, turn.errors) == ("The answer is 4.", [], [])


def test_hermes_arguments_given_as_a_json_string_or_parameters():
    turn = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>', "hermes")
    assert json.loads(turn.tool_calls[0]["function"]["arguments"]) == {"x": 1}
    turn = parse_tool_calls('<tool_call>{"name": "f", "parameters": {"y": 2}}</tool_call>', "hermes")
    assert json.loads(turn.tool_calls[0]["function"]["arguments"]) == {"y": 2}
    assert parse_tool_calls('<tool_call>{"name": "f"}</tool_call>', "hermes").tool_calls[0]["function"][
        "arguments"] == "{}"


@pytest.mark.parametrize("text, problem", [
    ('<tool_call>{"name": "f", "arguments": {}}', "without its closing"),  # cut by max_tokens
    ('<tool_call>{"name": "f", "arguments": {</tool_call>', "not JSON"),
    ('<tool_call>["f"]</tool_call>', 'without a "name"'),
    ('<tool_call>{"name": "", "arguments": {}}</tool_call>', 'without a "name"'),
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', "is not an object"),
    ('<tool_call>{"name": "f", "arguments": "not json"}</tool_call>', "is not an object"),
])
def test_hermes_malformed_calls_are_errors_not_exceptions(text, problem):
    turn = parse_tool_calls("before " + text, "hermes")
    assert turn.tool_calls == []
    assert len(turn.errors) == 1 and problem in turn.errors[0]
    assert turn.content.startswith("before <tool_call>")  # the model's text stays visible


def test_hermes_one_bad_call_among_good_ones():
    good = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    turn = parse_tool_calls(good + '<tool_call>{oops}</tool_call>' + good, "hermes")
    assert [c["id"] for c in turn.tool_calls] == ["call_0", "call_1"]
    assert len(turn.errors) == 1 and turn.content == "<tool_call>{oops}</tool_call>"


def test_hermes_calls_are_bounded():
    one = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    turn = parse_tool_calls(one * (MAX_CALLS + 2), "hermes")
    assert len(turn.tool_calls) == MAX_CALLS and len(turn.errors) == 2


def test_compute_format_of_the_tool_demo():
    turn = parse_tool_calls("compute 12 + 30", "compute")
    assert turn.content is None and turn.errors == []
    assert turn.tool_calls[0]["function"] == {"name": "compute", "arguments": json.dumps({"expression": "12 + 30"})}
    assert parse_tool_calls("42", "compute").tool_calls == []
    # as the calculator environment reads it: an empty expression is still a call (answered "?")
    assert json.loads(parse_tool_calls("compute", "compute").tool_calls[0]["function"]["arguments"]) == {
        "expression": ""}


def test_unknown_format_names_the_known_ones():
    with pytest.raises(KeyError, match="hermes, compute"):
        parse_tool_calls("x", "nope")
    assert set(TOOL_CALL_FORMATS) == {"hermes", "compute"}
