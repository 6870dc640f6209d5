"""radixrt.tools parsers and constraint regexes (no model needed but for one compile test on the default model's
vocabulary): whole outputs, every split into two pieces, char by char, random splits (hypothesis), malformed and
unterminated calls, marker-like text; and every string each constraint regex accepts parses into calls whose
arguments validate against their tool's schema."""

from __future__ import annotations

import itertools
import json
import re
import time

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixrt.tools.formats import FORMATS
from radixrt.tools.markers import MarkerMatcher
from radixrt.tools.parser import ToolCallStreamParser, parse_tool_calls
from radixrt.tools.regex import not_starting_with, text_without
from radixrt.tools.spec import ToolChoice, parse_tools

CALL_ID = re.compile(r"call_[0-9a-f]{24}")


def fold(parser: ToolCallStreamParser, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """Feed ``pieces``, finish, fold the deltas; checks the streaming order of each call on the way."""
    content: list[str] = []
    calls: dict[int, list] = {}
    for delta in [parser.feed(p) for p in pieces] + [parser.finish()]:
        content.append(delta.content)
        for call in delta.calls:
            if call.index not in calls:
                assert call.index == len(calls), "calls start in order"
                assert call.id is not None and CALL_ID.fullmatch(call.id) and call.name
                calls[call.index] = [call.name, call.arguments]
            else:
                assert call.id is None and call.name is None, "id and name only on a call's first delta"
                calls[call.index][1] += call.arguments
    return "".join(content), [tuple(c) for c in calls.values()]


def parsed(fmt, text: str) -> tuple[str, list[tuple[str, str]]]:
    content, calls = parse_tool_calls(fmt, text)
    for call in calls:
        assert CALL_ID.fullmatch(call.id)
    return content, [(c.name, c.arguments) for c in calls]


def check_all_splits(fmt, text: str) -> tuple[str, list[tuple[str, str]]]:
    whole = parsed(fmt, text)
    assert fold(fmt.parser(), [text]) == whole
    assert fold(fmt.parser(), list(text)) == whole, "char by char"
    for cut in range(len(text) + 1):
        assert fold(fmt.parser(), [text[:cut], text[cut:]]) == whole, f"split at {cut}: {text[:cut]!r} | {text[cut:]!r}"
    return whole


W = '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}'
A = '{"name": "add", "arguments": {"a": 1, "b": 2}}'
WA = ("get_weather", '{"city": "Paris", "days": [1, 2]}')
AA = ("add", '{"a": 1, "b": 2}')

HERMES_CASES = [
    (f"<tool_call>\n{W}\n</tool_call>", "", [WA]),
    (f"<tool_call>\n{W}\n</tool_call>\n<tool_call>\n{A}\n</tool_call>", "\n", [WA, AA]),
    (f"Let me look.\n<tool_call>\n{W}\n</tool_call> Done.", "Let me look.\n Done.", [WA]),
    (f"<tool_call>{W}</tool_call><tool_call>{A}</tool_call>", "", [WA, AA]),
    ("a <tool is here", "a <tool is here", []),
    ("<tool", "<tool", []),
    ("<tool_cal", "<tool_cal", []),
    (f"<<tool_call>\n{A}\n</tool_call>", "<", [AA]),
    ("<tool_call>", "<tool_call>", []),
    ("<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),
    ('<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>', '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>', []),
    ('<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>', '<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>', []),
    ('<tool_call>{"name": "f"', "", [("f", "")]),  # the name closed: the call started, cut before its arguments
    ('<tool_call>{"name": "f', '<tool_call>{"name": "f', []),  # cut inside the name: not a call
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', "", [("get_weather", '{"city": "Par')]),
    ('<tool_call>\n{"name": "add"}\n</tool_call>', "", [("add", "{}")]),
    ('<tool_call>\n{"arguments": {"a": 1}, "name": "add"}\n</tool_call>', "", [("add", '{"a": 1}')]),
    ('<tool_call>\n{"name": "f", "arguments": {"s": "</tool_call> {}"}}\n</tool_call>x', "x",
     [("f", '{"s": "</tool_call> {}"}')]),
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>after', "after", [("f", '{"a": 1}')]),
    ('<tool_call>\n{"name": "f", "arguments": {}}\nthen text', "\nthen text", [("f", "{}")]),
    ('<tool_call><tool_call>\n{"name": "f", "arguments": {}}</tool_call>', "<tool_call>", [("f", "{}")]),
    ('<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>', "", [("f", '"{\\"a\\": 1}"')]),
    ("", "", []),
]

LLAMA3_CASES = [
    ('{"name": "add", "parameters": {"a": 1, "b": 2}}', "", [AA]),
    ('{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "get_weather", "parameters": {"city": "Paris", '
     '"days": [1, 2]}}', "", [AA, WA]),
    ('<|python_tag|>{"name": "add", "arguments": {"a": 1, "b": 2}}', "", [AA]),
    ('\n{"name": "add", "parameters": {"a": 1, "b": 2}}', "\n", [AA]),
    ("The answer is {not a call}", "The answer is {not a call}", []),
    ('{"answer": 42}', '{"answer": 42}', []),
    ("{not json", "{not json", []),
    ("<|python_tag|>print(1)", "<|python_tag|>print(1)", []),
    ("<|python", "<|python", []),
    ('{"name": "add", "parameters": {"a": 1', "", [("add", '{"a": 1')]),
    ('{"name": "add", "parameters": {"a": 1, "b": 2}} and text', " and text", [AA]),
    ('{"name": "add", "parameters": {"a": 1, "b": 2}}; oops', "; oops", [AA]),
    ('{"name": "add", "parameters": {"a": 1, "b": 2}}; {"x": 1}', '; {"x": 1}', [AA]),
    ('{"parameters": {"a": 1, "b": 2}, "name": "add"}', "", [AA]),
    ("", "", []),
]

MISTRAL_CASES = [
    ('[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}]', "", [AA]),
    (f"[TOOL_CALLS] [{A}, {W}]", "", [AA, WA]),
    (f"Sure. [TOOL_CALLS]{A} Anything else?", "Sure.  Anything else?", [AA]),
    ("a [TOOL is here", "a [TOOL is here", []),
    ("[TOOL_CALLS", "[TOOL_CALLS", []),
    ("[TOOL_CALLS]", "[TOOL_CALLS]", []),
    ("[TOOL_CALLS] hello", "[TOOL_CALLS] hello", []),
    ('[TOOL_CALLS][{"oops": 1}]', '[TOOL_CALLS][{"oops": 1}]', []),
    (f"[TOOL_CALLS][{A}, nonsense]", ", nonsense]", [AA]),
    ('[TOOL_CALLS][{"name": "add", "arguments": {"a": ', "", [("add", '{"a": ')]),
    (f"[TOOL_CALLS][{A}, ", "", [AA]),
    (f"[[TOOL_CALLS][{A}]", "[", [AA]),
    ("", "", []),
]

PYTHONIC_CASES = [
    ('[get_weather(city="Paris", days=[1, 2])]', "", [WA]),
    ("[add(a=1, b=2), get_weather(city='Paris', days=(1, 2))]", "", [AA, WA]),
    ('\n [ add( a = 1 , b=2 ,) ]', "\n ", [AA]),
    ("[f(x=True, y=None, z=false, w={'k': -1.5})]", "", [("f", '{"x": true, "y": null, "z": false, "w": {"k": -1.5}}')]),
    ("[f(s=\"a, b) [c]\", t='it\\'s')] after", " after", [("f", '{"s": "a, b) [c]", "t": "it\'s"}')]),
    ("[ping()]", "", [("ping", "{}")]),
    ("Sure: [add(a=1, b=2)]", "Sure: [add(a=1, b=2)]", []),
    ("[1, 2]", "[1, 2]", []),
    ("[x]", "[x]", []),
    ("[ad", "[ad", []),
    ("[", "[", []),
    ("[add(a=1, b=foo)]", ")]", [("add", '{"a": 1}')]),  # not a literal: the call ends, the rest is content
    ("[add(1, 2)]", "1, 2)]", [("add", "{}")]),
    ("[add(a=1, b=2", "", [("add", '{"a": 1}')]),  # cut inside a value: its whole arguments only
    ("[add(a=1, b=2), ", "", [AA]),
    ("[add(a=1, b=2)] [ping()]", " [ping()]", [AA]),
    ("[add(a=1, b=2)]; more", "; more", [AA]),
    ("[add(a=1, b=2) oops", " oops", [AA]),
    ("[f(a=1.5e3, b=-2, c=[[]], d={})]", "", [("f", '{"a": 1500.0, "b": -2, "c": [[]], "d": {}}')]),
    ("[f(a=float('nan'))]", ")]", [("f", "{}")]),
    ("", "", []),
]

CASES = [("hermes", c) for c in HERMES_CASES] + [("llama3", c) for c in LLAMA3_CASES] + \
        [("mistral", c) for c in MISTRAL_CASES] + [("pythonic", c) for c in PYTHONIC_CASES]


@pytest.mark.parametrize("family,case", CASES, ids=[f"{f}-{i}" for i, (f, _) in enumerate(CASES)])
def test_outputs_parse_the_same_however_they_are_split(family, case):
    text, content, calls = case
    assert check_all_splits(FORMATS[family], text) == (content, calls)


@pytest.mark.parametrize("family", sorted(FORMATS))
def test_several_whole_calls_in_one_piece_then_more(family):
    fmt = FORMATS[family]
    text = fmt.render_calls([("add", '{"a": 1, "b": 2}'), ("get_weather", '{"city": "Paris"}')])
    parser = fmt.parser()
    first = parser.feed(text)
    assert [(d.index, d.name, d.arguments) for d in first.calls] == [
        (0, "add", '{"a": 1, "b": 2}'), (1, "get_weather", '{"city": "Paris"}')]
    assert all(d.id for d in first.calls)
    assert first.content == ("\n" if family == "hermes" else "")  # hermes: the newline between calls is content
    assert parser.finish().calls == []


@pytest.mark.parametrize("family", sorted(set(FORMATS) - {"pythonic"}))
def test_arguments_stream_before_the_call_ends(family):
    fmt = FORMATS[family]
    text = fmt.render_call("get_weather", '{"city": "Paris", "unit": "celsius"}')
    cut = text.index("Paris") + 3
    parser = fmt.parser()
    head = parser.feed(text[:cut])
    assert head.calls[0].name == "get_weather"
    assert head.calls[0].arguments == '{"city": "Par'
    tail = parser.feed(text[cut:])
    assert [(d.index, d.id, d.name, d.arguments) for d in tail.calls] == [(0, None, None, 'is", "unit": "celsius"}')]


def test_pythonic_arguments_stream_one_keyword_argument_at_a_time():
    """A Python literal becomes JSON once it is whole: the name comes at "(", each argument as its value ends."""
    parser = FORMATS["pythonic"].parser()
    assert parser.feed("[get_weat").calls == []
    assert [(d.name, d.arguments) for d in parser.feed("her(").calls] == [("get_weather", "")]
    assert parser.feed("city='Par").calls == []
    assert [(d.index, d.name, d.arguments) for d in parser.feed("is', ").calls] == [(0, None, '{"city": "Paris"')]
    tail = parser.feed('unit="celsius")]').calls
    assert [(d.index, d.id, d.arguments) for d in tail] == [(0, None, ', "unit": "celsius"}')]


def test_pythonic_literals_become_json():
    from radixrt.tools.pythonic import literal_value

    assert literal_value("{'a': (1, -2.5), \"b\": [True, None, 'x']}") == {"a": [1, -2.5], "b": [True, None, "x"]}
    assert literal_value("true") is True and literal_value("null") is None
    assert literal_value("'a' 'b'") == "ab"
    for bad in ("foo", "f(1)", "{1: 2}", "{**x}", "1 + 2", "float('inf')", "1e999", "[" * 5000, "{1, 2}", ""):
        with pytest.raises(ValueError):
            literal_value(bad)


def test_the_name_waits_for_its_closing_quote():
    parser = FORMATS["hermes"].parser()
    assert parser.feed('<tool_call>\n{"name": "get_wea') .calls == []
    out = parser.feed('ther", ')
    assert [(d.name, d.arguments) for d in out.calls] == [("get_weather", "")]


def test_a_partial_marker_is_held_then_released():
    parser = FORMATS["hermes"].parser()
    assert parser.feed("Hello <tool_").content == "Hello "
    assert parser.feed("box>").content == "<tool_box>"
    assert parser.finish().content == ""


# -- random splits and random outputs (never raise; split-invariant)

FRAGMENTS = {
    "hermes": ["<tool_call>", "</tool_call>", "<tool", "<", "\n", " ", '{"name": "f"', '"arguments": ', '{"a": [1, "}"]}',
               "}", "{", ",", '"', "\\", "text", ":", "]"],
    "llama3": ["<|python_tag|>", "<|py", '{"name": "f"', '"parameters": ', '{"a": [1, "}"]}', "}", "{", "; ", ";",
               ",", '"', "\\", " ", "\n", "text", ":"],
    "mistral": ["[TOOL_CALLS]", "[TOOL", "[", "]", '{"name": "f"', '"arguments": ', '{"a": [1, "}"]}', "}", "{",
                ", ", '"', "\\", " ", "text", ":"],
    "pythonic": ["[", "]", "f(", "g", "(", ")", "a=", "=", "1", "'x, )'", '"', "'", "\\", "[1, {'k': ()}]",
                 ", ", ",", " ", "\n", "True", "foo", "text"],
}


@pytest.mark.parametrize("family", sorted(FORMATS))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_outputs_random_splits(family, data):
    fmt = FORMATS[family]
    parts = data.draw(st.lists(st.sampled_from(FRAGMENTS[family]) | st.text(max_size=3), max_size=25))
    text = "".join(parts)
    whole = parsed(fmt, text)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    assert fold(fmt.parser(), pieces) == whole
    assert fold(fmt.parser(), list(text)) == whole


# -- the regex pieces

@pytest.mark.parametrize("marker", ["<tool_call>", "[TOOL_CALLS]", "aab", "abab", "aa"])
@pytest.mark.parametrize("before_marker", [False, True])
def test_text_without_a_marker_exhaustively(marker, before_marker):
    pattern = re.compile(text_without(marker, before_marker))
    alphabet = sorted(set(marker)) + ["x", "\n"]
    longest = 7 if len(alphabet) <= 5 else 4
    for n in range(longest + 1):
        for chars in itertools.product(alphabet, repeat=n):
            s = "".join(chars)
            want = marker not in s and (not before_marker or (s + marker).find(marker) == len(s))
            assert bool(pattern.fullmatch(s)) == want, repr(s)


@pytest.mark.parametrize("text,ok", [("", True), ("hello", True), ("<tool", True), ("<tool_cal", True),
                                     ("a <tool_call", True), ("<tool_call>", False), ("<<tool_call>", False),
                                     ("x<tool_call>y", False), ("<tool_call<tool_call>", False)])
def test_text_without_tool_call(text, ok):
    assert bool(re.fullmatch(text_without("<tool_call>"), text)) == ok


def test_the_marker_matcher_releases_what_cannot_start_the_marker():
    matcher = MarkerMatcher("<tool_call>")
    out = [matcher.step(c) for c in "a<t<tool_call>"]
    assert "".join(r for r, _ in out) == "a<t"
    assert out[-1][1] and matcher.held == ""


@pytest.mark.parametrize("text,ok", [("", True), ("  ", True), ("hi {", True), ("{", False), ("  {}", False),
                                     ("<|python_tag|>{", False), ("<|python", False), ("<a", False),
                                     ("a <b", True)])
def test_llama3_free_text(text, ok):
    """Free text may not start with a call word's first character (after whitespace)."""
    assert bool(re.fullmatch(not_starting_with(["{", "<|python_tag|>"]), text)) == ok


# -- the constraint regexes: what they accept parses into valid calls

TOOLS = parse_tools([
    {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "maxLength": 8},
                                          "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": -5, "maximum": 99},
                                         "b": {"type": "boolean"}}, "required": ["a", "b"]}}},
    {"type": "function", "function": {"name": "ping"}},
])
SCHEMAS = {t.name: t.parameters for t in TOOLS}
MODES = [("named", False), ("required", False), ("required", True), ("auto", False), ("auto", True)]


def check_accepted(fmt, choice: ToolChoice, parallel: bool, text: str) -> None:
    content, calls = parse_tool_calls(fmt, text)
    if choice.mode != "auto":
        assert content == "" or (fmt.name == "hermes" and content.strip() == ""), repr(text)
        assert calls
    if choice.mode == "auto" and calls:
        assert content.strip() == "" or fmt.name == "hermes"
    if not parallel:
        assert len(calls) <= 1
    for call in calls:
        if choice.mode == "named":
            assert call.name == choice.name
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


@pytest.mark.parametrize("family", sorted(FORMATS))
@pytest.mark.parametrize("mode,parallel", MODES)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(data=st.data())
def test_strings_the_constraint_accepts_parse_into_valid_calls(family, mode, parallel, data):
    fmt = FORMATS[family]
    choice = ToolChoice(mode, "add" if mode == "named" else None)
    regex = fmt.constraint_regex(TOOLS, choice, parallel)
    text = data.draw(st.from_regex(regex, fullmatch=True))
    check_accepted(fmt, choice, parallel, text)


@pytest.mark.parametrize("family", sorted(FORMATS))
def test_canonical_calls_match_the_constraint(family):
    fmt = FORMATS[family]
    one = fmt.render_call("add", '{"a":3,"b":true}')
    two = fmt.render_calls([("add", '{"a":3,"b":true}'), ("get_weather", '{"city":"Oslo"}'), ("ping", "{}")])
    for mode, parallel in MODES:
        choice = ToolChoice(mode, "add" if mode == "named" else None)
        regex = re.compile(fmt.constraint_regex(TOOLS, choice, parallel))
        assert regex.fullmatch(one), (mode, parallel)
        assert bool(regex.fullmatch(two)) == parallel, (mode, parallel)
        assert bool(regex.fullmatch("Just text.")) == (mode == "auto")
        bad = fmt.render_call("add", '{"a":300,"b":true}')
        assert not regex.fullmatch(bad)
    assert fmt.constraint_regex(TOOLS, ToolChoice("none"), True) is None


def test_pythonic_constraint_writes_python_literals_and_refuses_what_it_cannot_express():
    from radixrt.protocol.errors import RequestError

    fmt = FORMATS["pythonic"]
    tools = parse_tools([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {
            "flag": {"type": ["boolean", "null"]}, "mode": {"enum": ["a", True, None]},
            "opts": {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"]},
            "any": {}}, "required": ["flag", "mode", "opts"]}}}])
    regex = re.compile(fmt.constraint_regex(tools, ToolChoice("required"), False))
    assert regex.fullmatch('[f(flag=None, mode=True, opts={"on":False})]')
    assert regex.fullmatch('[f(flag=True, mode="a", opts={"on":True}, any=[1,None])]')
    assert not regex.fullmatch('[f(flag=null, mode=true, opts={"on":false})]')
    assert not regex.fullmatch('[f(mode=None, flag=None, opts={"on":False})]')  # the schema's order
    for parameters, needle in [({"type": "object", "properties": {"a": {"type": "string"}}, "minProperties": 1},
                                "minProperties"),
                               ({"type": "object", "properties": {"a-b": {"type": "string"}}}, "a-b")]:
        bad = parse_tools([{"type": "function", "function": {"name": "g", "parameters": parameters}}])
        with pytest.raises(RequestError, match=needle):
            fmt.constraint_regex(bad, ToolChoice("auto"), True)


def test_hermes_auto_allows_text_then_calls_but_no_marker_in_text():
    regex = re.compile(FORMATS["hermes"].constraint_regex(TOOLS, ToolChoice("auto"), True))
    call = FORMATS["hermes"].render_call("ping", "{}")
    assert regex.fullmatch("Let me check <tool_cal.\n" + call)
    assert not regex.fullmatch("<tool_call> in text")
    assert not regex.fullmatch("text " + call + " more text")


@pytest.mark.model
def test_compiled_constraints_write_every_call_layout_byte_by_byte(default_model_path):
    """Through radixrt's grammar (outlines-core's index on the default vocabulary), one call, two calls, and
    (auto) text alone or text before calls can all be written one byte at a time, and then end."""
    from radixrt.constrained.grammar import GrammarCompiler
    from radixrt.constrained.matcher import GrammarMatcher
    from radixrt.tokenizer import eos_token_ids, load_tokenizer

    tokenizer = load_tokenizer(default_model_path)
    compiler = GrammarCompiler(tokenizer, eos_token_ids(default_model_path, tokenizer))
    one = [("ping", "{}")]
    two = [("ping", "{}"), ("add", '{"a":5,"b":true}')]
    for family in sorted(FORMATS):
        fmt = FORMATS[family]
        for mode in ("auto", "required"):
            start = time.perf_counter()
            grammar = compiler.compile("regex", fmt.constraint_regex(TOOLS, ToolChoice(mode), True))
            assert time.perf_counter() - start < 20, (family, mode)
            texts = [fmt.render_calls(one), fmt.render_calls(two)]
            if mode == "auto":
                texts += ["Hello there."] + (["Let me see.\n" + fmt.render_calls(two)] if family == "hermes" else [])
            for text in texts:
                matcher = GrammarMatcher(grammar)
                for byte in text.encode():
                    assert matcher.accept_token(grammar.info.byte_tokens[byte]), (family, mode, text)
                assert matcher.can_terminate(), (family, mode, text)
    compiler.shutdown()


@pytest.mark.parametrize("family,unit", [("hermes", '<tool_call>{"'), ("mistral", '[TOOL_CALLS][{"'), ("llama3", '{"')])
def test_nested_false_starts_neither_raise_nor_recurse(family, unit):
    text = unit * 3000  # each false start is read again inside the previous one
    assert parsed(FORMATS[family], text) == (text, [])
    assert fold(FORMATS[family].parser(), [text[i:i + 7] for i in range(0, len(text), 7)]) == (text, [])


@pytest.mark.parametrize("family", sorted(FORMATS))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(data=st.data())
def test_constraint_with_json_whitespace(family, data):
    fmt = FORMATS[family]
    regex = fmt.constraint_regex(TOOLS, ToolChoice("required"), True, json_whitespace="[ \\n]?")
    text = data.draw(st.from_regex(regex, fullmatch=True))
    check_accepted(fmt, ToolChoice("required"), True, text)
