"""Structural tags (SGLang's and vLLM's ``structural_tag``): free text in which each trigger opens one of its
structures (begin, JSON under the schema, end). What the regex admits, checked by an independent reading of the
output (every trigger occurrence starts a whole structure whose JSON validates); the refusals; generation under
a tag through /generate and the OpenAI chat route with the default model (a bad tag is a 400, the server keeps
serving)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import shared_server
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixrt.constrained.patterns import engine_accepts_regex
from radixrt.constrained.structural_tag import structural_tag_regex

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"]}
TAG = {"type": "structural_tag", "triggers": ["<function="],
       "structures": [{"begin": "<function=get_weather>", "schema": WEATHER, "end": "</function>"},
                      {"begin": "<function=add>", "schema": ADD, "end": "</function>"}]}
SCHEMAS = {"<function=get_weather>": WEATHER, "<function=add>": ADD}


def read(tag: dict, text: str) -> list[tuple[str, dict]]:
    """The structures in ``text``, read without the regex: each trigger must open a whole structure."""
    found, pos = [], 0
    triggers = tag["triggers"]
    while True:
        starts = [(text.find(t, pos), t) for t in triggers if text.find(t, pos) >= 0]
        if not starts:
            return found
        at = min(starts)[0]
        for s in tag["structures"]:
            if text.startswith(s["begin"], at):
                body_start = at + len(s["begin"])
                end = text.find(s["end"], body_start)
                assert end >= 0, (text, "a structure is not closed")
                value = json.loads(text[body_start:end])
                jsonschema.validate(value, s["schema"])
                found.append((s["begin"], value))
                pos = end + len(s["end"])
                break
        else:
            raise AssertionError(f"a trigger that opens no structure at {at}: {text!r}")


def test_the_regex_admits_text_and_structures():
    pattern = re.compile(structural_tag_regex(TAG))
    good = ["", "Just text.", '<function=add>{"a":3}</function>',
            'Let me see. <function=get_weather>{"city":"Oslo"}</function> and <function=add>{"a":0}</function> ok',
            "<functio", "a <function is not the trigger"]
    bad = ["<function=", "<function=sub>{}</function>", '<function=add>{"a":30}</function>',
           '<function=add>{"a":3}', '<function=get_weather>{"city":"Reykjavik"}</function>', "x<function=add>"]
    for text in good:
        assert pattern.fullmatch(text), text
    for text in bad:
        assert not pattern.fullmatch(text), text
    assert engine_accepts_regex(pattern.pattern)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_what_the_regex_admits_reads_back_as_valid_structures(data):
    text = data.draw(st.from_regex(structural_tag_regex(TAG), fullmatch=True))
    read(TAG, text)


def test_nested_triggers_open_at_the_shorter_one():
    tag = {"triggers": ["<f", "<func"], "structures": [{"begin": "<func>", "schema": ADD, "end": "</func>"}]}
    pattern = re.compile(structural_tag_regex(tag))
    assert pattern.fullmatch('hi <func>{"a":1}</func>')
    assert not pattern.fullmatch("hi <f")


def test_text_before_a_structure_cannot_start_its_trigger_sooner():
    """A trigger that overlaps itself: text ending in ":" before "::call" would make "::" start a character early."""
    tag = {"triggers": ["::"], "structures": [{"begin": "::call", "schema": ADD, "end": ";"}]}
    pattern = re.compile(structural_tag_regex(tag))
    assert pattern.fullmatch('a ::call{"a":1}; b')
    assert not pattern.fullmatch(':::call{"a":1};')
    with pytest.raises(AssertionError):
        read(tag, ':::call{"a":1};')


@pytest.mark.parametrize("spec,needle", [
    ("not json", "not valid JSON"),
    ([], "must be an object"),
    ({"type": "structural_tag", "format": {"type": "triggered_tags"}}, "'format' form"),
    ({"structures": [], "triggers": ["<"]}, "structures must be a non-empty list"),
    ({"structures": [{"begin": "<a>", "schema": ADD, "end": "</a>"}], "triggers": []}, "triggers must be"),
    ({"structures": [{"begin": "<a>", "end": "</a>"}], "triggers": ["<a"]}, "structures[0] must have"),
    ({"structures": [{"begin": "[a]", "schema": ADD, "end": "</a>"}], "triggers": ["<a"]}, "none of the triggers"),
    ({"structures": [{"begin": "<a>", "schema": {"type": "integer", "minimum": 5, "maximum": 1}, "end": "</a>"}],
      "triggers": ["<a"]}, "structures[0].schema"),
])
def test_bad_tags_are_refused_with_the_reason(spec, needle):
    with pytest.raises(ValueError) as info:
        structural_tag_regex(spec)
    assert needle in str(info.value)


SERVER_ARGS = shared_server.ARGS  # the session's shared server (tests/shared_server.py)
# the default model goes on with the pattern: 8, 9, then (10 being past the schema's maximum) 0
PROMPT = '<function=add>{"a": 3}</function>\n<function=add>{"a": 5}</function>\n<function=add>{"a": 7}</function>\n'



@pytest.mark.model
def test_generation_under_a_tag_through_the_server(http):
    tag_json = json.dumps(TAG)
    res = http.post("/generate", json={"text": PROMPT, "sampling_params": {
        "max_new_tokens": 40, "temperature": 0, "structural_tag": tag_json}})
    assert res.status_code == 200, res.text
    text = res.json()["text"]
    found = read(TAG, text)
    assert len(found) >= 2 and all(0 <= value["a"] <= 9 for _, value in found), text
    res = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Add 2 and 3."}],
                                                  "max_tokens": 32, "temperature": 0, "response_format": TAG})
    assert res.status_code == 200, res.text
    read(TAG, res.json()["choices"][0]["message"]["content"])
    bad = {"text": PROMPT, "sampling_params": {"max_new_tokens": 4, "structural_tag": '{"triggers": []}'}}
    res = http.post("/generate", json=bad)
    assert res.status_code == 400 and "triggers" in res.text
    assert http.post("/generate", json={"text": PROMPT, "sampling_params": {"max_new_tokens": 2}}).status_code == 200


@pytest.mark.model
def test_no_structure_is_begun_that_the_budget_cannot_finish(http):
    """Whatever max_new_tokens cuts the output at, it matches: late in the budget the trigger cannot open a
    structure whose shortest way to its end is longer than what is left (without that, 10 of these 14 budgets
    ended inside a structure)."""
    pattern = re.compile(structural_tag_regex(TAG))
    for budget in range(8, 48, 3):
        res = http.post("/generate", json={"text": PROMPT, "sampling_params": {
            "max_new_tokens": budget, "temperature": 0, "structural_tag": json.dumps(TAG)}})
        text = res.json()["text"]
        assert pattern.fullmatch(text), (budget, text)
        read(TAG, text)


@pytest.mark.model
def test_a_matching_state_bans_only_what_cannot_end_in_time(default_model_path):
    from radixrt.constrained.grammar import GrammarCompiler
    from radixrt.constrained.matcher import GrammarMatcher
    from radixrt.tokenizer import eos_token_ids, load_tokenizer

    tokenizer = load_tokenizer(default_model_path)
    compiler = GrammarCompiler(tokenizer, eos_token_ids(default_model_path, tokenizer))
    try:
        matcher = GrammarMatcher(compiler.compile("structural_tag", json.dumps(TAG)))
        for token in tokenizer.encode("Hello <function"):
            assert matcher.accept_token(token)
        equals = tokenizer.encode("=")[-1]
        assert equals in matcher.out_of_reach(10)  # '=<function=add>{"a":0}</function>' needs more than 9 more
        assert equals not in matcher.out_of_reach(64)
        assert matcher.out_of_reach(0) == [] and matcher.out_of_reach(65) == []
    finally:
        compiler.shutdown()
