"""radixrt.tools: the request's tools and tool_choice, the format choice, and messages for the chat template
(every bad shape is a RequestError naming the problem). Fast; no model."""

from __future__ import annotations

import json

import pytest

from radixrt.protocol.errors import RequestError
from radixrt.tools.formats import FORMATS, choose_format, messages_for_template, template_supports_tools
from radixrt.tools.parser import parse_tool_calls
from radixrt.tools.spec import Tool, ToolChoice, parse_tool_choice, parse_tools

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
PING = {"type": "function", "function": {"name": "ping"}}


def test_tools_are_parsed_with_defaults():
    tools = parse_tools([WEATHER, PING, {"type": "function", "function": {"name": "a-b_9", "strict": True}}])
    assert [t.name for t in tools] == ["get_weather", "ping", "a-b_9"]
    assert tools[0].description == "Current weather"
    assert tools[1] == Tool("ping", "", {"type": "object", "properties": {}})
    assert tools[0].to_openai() == {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather", "parameters": WEATHER["function"]["parameters"]}}
    assert parse_tools(None) == [] and parse_tools([]) == []


BAD_TOOLS = [
    ({"type": "function"}, "tools must be a list"),
    ("ping", "tools must be a list"),
    (["ping"], "tools[0] must be an object"),
    ([{"type": "code_interpreter"}], 'tools[0].type must be "function"'),
    ([{"function": {"name": "f"}}], 'tools[0].type must be "function"'),
    ([{"type": "function"}], "tools[0].function must be an object"),
    ([{"type": "function", "function": {}}], "tools[0].function.name is required"),
    ([PING, {"type": "function", "function": {"name": 7}}], "tools[1].function.name is required"),
    ([{"type": "function", "function": {"name": "has space"}}], "tools[0].function.name 'has space' must be"),
    ([{"type": "function", "function": {"name": "x" * 65}}], "must be 1 to 64"),
    ([{"type": "function", "function": {"name": ""}}], "must be 1 to 64"),
    ([PING, WEATHER, PING], "tools[2]: the function name 'ping' is already used by tools[0]"),
    ([{"type": "function", "function": {"name": "f", "description": 3}}], "tools[0].function.description"),
    ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}], "tools[0].function.parameters must be"),
    ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], "tools[0].function.parameters must be"),
    ([{"type": "function", "function": {"name": "f", "strict": "yes"}}], "tools[0].function.strict"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
     "tools[0].function.parameters must describe a JSON object"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": ["object", "null"]}}}],
     "must describe a JSON object"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "anyOf": [
        {"type": "object"}, {"type": "string"}]}}}], "must describe a JSON object"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"enum": [{"a": 1}, 2]}}}],
     "must describe a JSON object"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"const": "x"}}}], "must describe a JSON object"),
    ([{"type": "function", "function": {"name": "f", "parameters": {
        "$ref": "#/$defs/a", "$defs": {"a": {"type": "integer"}}}}}], "must describe a JSON object"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "no-such-type"}}}}}], "tools[0].function.parameters cannot be used for function 'f'"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"$ref": "#/$defs/missing"}}}}}], "tools[0].function.parameters cannot be used"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 5, "maximum": 1}}}}}], "no integer satisfies"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "string", "pattern": "(?=x)y"}}}}}], "the grammar engine cannot compile"),
]


@pytest.mark.parametrize("tools,message", BAD_TOOLS, ids=range(len(BAD_TOOLS)))
def test_bad_tools_are_refused_with_a_clear_message(tools, message):
    with pytest.raises(RequestError) as info:
        parse_tools(tools)
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


TOOLS = parse_tools([WEATHER, PING])


@pytest.mark.parametrize("choice,tools,expected", [
    (None, TOOLS, ToolChoice("auto")),
    (None, [], ToolChoice("none")),
    ("none", TOOLS, ToolChoice("none")),
    ("auto", TOOLS, ToolChoice("auto")),
    ("auto", [], ToolChoice("none")),
    ("required", TOOLS, ToolChoice("required")),
    ({"type": "function", "function": {"name": "ping"}}, TOOLS, ToolChoice("named", "ping")),
])
def test_tool_choice(choice, tools, expected):
    assert parse_tool_choice(choice, tools) == expected


@pytest.mark.parametrize("choice,tools,message", [
    ("required", [], '"required" needs at least one tool'),
    ({"type": "function", "function": {"name": "ping"}}, [], "the request has no tools"),
    ({"type": "function", "function": {"name": "nope"}}, TOOLS, "'nope', which is not among the tools"),
    ({"type": "function", "function": {}}, TOOLS, "tool_choice as an object must be"),
    ({"type": "function"}, TOOLS, "tool_choice as an object must be"),
    ({"type": "other", "function": {"name": "ping"}}, TOOLS, "tool_choice as an object must be"),
    ({"function": {"name": "ping"}}, TOOLS, "tool_choice as an object must be"),
    ("any", TOOLS, 'tool_choice must be "none", "auto", "required" or a function object'),
    (3, TOOLS, "tool_choice must be a string or an object"),
    (["auto"], TOOLS, "tool_choice must be a string or an object"),
])
def test_bad_tool_choice(choice, tools, message):
    with pytest.raises(RequestError) as info:
        parse_tool_choice(choice, tools)
    assert message in str(info.value)


# -- format choice

CHATML = "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"


@pytest.mark.parametrize("parser,template,family", [
    (None, None, "hermes"),
    ("auto", CHATML, "hermes"),
    (None, "{% if tools %}<tool_call>{% endif %}", "hermes"),
    (None, "{{ '[TOOL_CALLS]' }}{{ tools }}", "mistral"),
    ("auto", "{{ '<|python_tag|>' }}", "llama3"),
    (None, "<|start_header_id|>ipython<|end_header_id|>", "llama3"),
    ("mistral", CHATML, "mistral"),
    ("llama3", None, "llama3"),
    ("hermes", "[TOOL_CALLS]", "hermes"),
    ("qwen25", None, "hermes"),
    ("llama3_json", None, "llama3"),
    ("llama4", None, "pythonic"),
    ("auto", "{{ '<|python_start|>' }}{% if tools %}{{ '[TOOL_CALLS]' }}{% endif %}", "pythonic"),
])
def test_choose_format(parser, template, family):
    assert choose_format(parser, template).name == family


def test_unknown_parser_lists_the_formats():
    with pytest.raises(ValueError) as info:
        choose_format("deepseekv3", None)
    assert all(name in str(info.value) for name in ("hermes", "llama3", "mistral", "pythonic"))


def test_template_supports_tools():
    assert not template_supports_tools(None)
    assert not template_supports_tools(CHATML)
    assert template_supports_tools("{%- if tools %}{{ tools | tojson }}{% endif %}")
    assert not template_supports_tools("{{ toolset }}")


# -- messages for the chat template

CONVERSATION = [
    {"role": "user", "content": "Weather in Paris and Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "9C"},
]


def test_native_messages_keep_calls_with_parsed_arguments():
    before = json.dumps(CONVERSATION)
    out = messages_for_template(CONVERSATION, TOOLS, FORMATS["hermes"], native=True)
    assert json.dumps(CONVERSATION) == before, "the input is not changed"
    assert out[1]["content"] == ""
    assert out[1]["tool_calls"][0] == {"id": "call_1", "type": "function",
                                       "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    assert [m["role"] for m in out] == ["user", "assistant", "tool", "tool"]
    assert out[2]["tool_call_id"] == "call_1" and out[2]["content"] == "18C"


@pytest.mark.parametrize("family", sorted(FORMATS))
def test_fallback_messages_write_tools_calls_and_results_as_text(family):
    fmt = FORMATS[family]
    out = messages_for_template(CONVERSATION, TOOLS, fmt, native=False)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert "get_weather" in out[0]["content"] and "Current weather" in out[0]["content"]
    assert "tool_calls" not in out[2]
    content, calls = parse_tool_calls(fmt, out[2]["content"])
    assert content.strip() == ""
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                 ("get_weather", {"city": "Oslo"})]
    assert "18C" in out[3]["content"] and "9C" in out[3]["content"]


def test_fallback_appends_to_an_existing_system_message():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    out = messages_for_template(messages, TOOLS, FORMATS["hermes"], native=False)
    assert len(out) == 2 and out[0]["content"].startswith("Be brief.\n\n") and "<tools>" in out[0]["content"]
    assert messages[0]["content"] == "Be brief."
    assert messages_for_template(messages, [], FORMATS["hermes"], native=False) == messages


def test_fallback_keeps_assistant_text_before_its_calls():
    messages = [{"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "ping", "arguments": "{}"}}]}]
    out = messages_for_template(messages, [], FORMATS["hermes"], native=False)
    assert out[0]["content"].startswith("Checking.\n<tool_call>")


@pytest.mark.parametrize("messages,message", [
    ([{"role": "tool", "content": "x"}], "messages[0]: a tool message needs a string tool_call_id"),
    ([{"role": "tool", "content": "x", "tool_call_id": 5}], "needs a string tool_call_id"),
    ([{"role": "assistant", "tool_calls": {"id": "x"}}], "messages[0].tool_calls must be a list"),
    ([{"role": "assistant", "tool_calls": ["x"]}], "messages[0].tool_calls[0] must be an object"),
    ([{"role": "assistant", "tool_calls": [{"type": "function"}]}], "tool_calls[0].function must be an object"),
    ([{"role": "assistant", "tool_calls": [{"type": "web", "function": {"name": "f"}}]}], 'type must be "function"'),
    ([{"role": "assistant", "tool_calls": [{"id": 1, "function": {"name": "f"}}]}], "tool_calls[0].id must be"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}],
     "tool_calls[0].function.arguments is not valid JSON"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]}],
     "arguments must be a JSON string or an object"),
])
@pytest.mark.parametrize("native", [False, True])
def test_bad_tool_messages(messages, message, native):
    with pytest.raises(RequestError) as info:
        messages_for_template(messages, TOOLS, FORMATS["hermes"], native)
    assert message in str(info.value)


def test_constraint_regex_named_tool_must_exist():
    with pytest.raises(ValueError):
        FORMATS["hermes"].constraint_regex(TOOLS, ToolChoice("named", "nope"), False)


@pytest.mark.parametrize("parameters,accepted,refused", [
    ({}, ['{}', '{"a":1}'], ['"x"', '1', '[1]', 'null']),
    ({"properties": {"a": {"type": "integer"}}, "required": ["a"]}, ['{"a":1}'], ['1', '{}', '"a"']),
])
def test_a_schema_without_a_type_still_constrains_the_arguments_to_an_object(parameters, accepted, refused):
    import re

    from radixrt.tools.regex import arguments_regex

    tool = parse_tools([{"type": "function", "function": {"name": "f", "parameters": parameters}}])[0]
    assert tool.parameters == parameters  # the prompt shows the schema as the client wrote it
    regex = arguments_regex(tool)
    assert all(re.fullmatch(regex, text) for text in accepted), regex
    assert not any(re.fullmatch(regex, text) for text in refused), regex


@pytest.mark.parametrize("parameters", [
    {"anyOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"properties": {"b": {}}}]},
    {"oneOf": [{"$ref": "#/$defs/point"}], "$defs": {"point": {"type": "object", "properties": {
        "x": {"type": "number"}}}}},
    {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}]},
    {"enum": [{"a": 1}, {"a": 2}]},
    {"type": "object", "properties": {"node": {"$ref": "#/$defs/n"}}, "$defs": {"n": {"type": "object", "properties": {
        "child": {"$ref": "#/$defs/n"}}}}},
])
def test_object_schemas_built_from_combinators_and_refs_are_accepted(parameters):
    import re

    from radixrt.tools.regex import arguments_regex

    tool = parse_tools([{"type": "function", "function": {"name": "f", "parameters": parameters}}])[0]
    regex = arguments_regex(tool)
    for text in ('"x"', "1", "[1]", "null", "true"):
        assert not re.fullmatch(regex, text), (text, regex)
