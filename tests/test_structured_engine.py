"""Structured generation end to end on the default model (Engine, float32): JSON schemas, regexes and
choices, greedy and seeded sampling, batched with unconstrained requests; jump-forward on vs off; bad
grammars rejected with a clear ValueError while the engine keeps serving.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

import radixrt

pytestmark = pytest.mark.model

NAME = {"type": "string", "maxLength": 12}
SCHEMAS = {
    "person": {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
               "required": ["name", "age"]},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9999},
                                                  "admin": {"type": "boolean"}}, "required": ["id", "admin"]},
        "team": NAME}, "required": ["user", "team"]},
    "array": {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                               "minItems": 1, "maxItems": 3}}, "required": ["tags"]},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                              "size": {"type": "string", "enum": ["S", "M", "L", "XL"]}},
             "required": ["color", "size"]},
    "bounded_number": {"type": "object", "properties": {"price": {"type": "number", "minimum": 0, "maximum": 1000},
                                                        "qty": {"type": "integer", "minimum": 1, "maximum": 50}},
                       "required": ["price", "qty"]},
    "optional": {"type": "object", "properties": {"title": NAME, "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
                                                  "note": {"type": "string", "maxLength": 6}}, "required": ["title"]},
    "pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["code", "zip"]},
    "array_of_objects": {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"sku": {"type": "string", "pattern": "^[a-z]{2,4}$"},
                                         "n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["sku", "n"]}}}, "required": ["items"]},
    "booleans_and_null": {"type": "object", "properties": {"ok": {"type": "boolean"}, "err": {"type": "null"},
                                                           "level": {"enum": [1, 2, 3]}},
                          "required": ["ok", "err", "level"]},
    "const_and_integer_array": {"type": "object", "properties": {"kind": {"const": "point"}, "xy": {
        "type": "array", "items": {"type": "integer", "minimum": -100, "maximum": 100}, "minItems": 2, "maxItems": 2}},
        "required": ["kind", "xy"]},
}
REGEXES = {
    "int": r"-?(0|[1-9][0-9]{0,5})",
    "float": r"-?[0-9]{1,4}\.[0-9]{1,3}",
    "date": r"[12][0-9]{3}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
    "email": r"[a-z]{1,10}@[a-z]{2,8}\.(com|org|net)",
    "ipv4": r"((25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])",
    "phone": r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}",
    "time": r"([01][0-9]|2[0-3]):[0-5][0-9]",
    "hex_color": r"#[0-9a-f]{6}",
    "yes_no": r"(yes|no)",
    "word_list": r"[a-z]{2,6}(, [a-z]{2,6}){1,2}",
}
FREE = ["The capital of France is", "List three colors:"]
MAX_NEW = 96


def schema_prompt(name: str, schema: dict) -> str:
    return f"Write one JSON object ({name}) matching this schema: {json.dumps(schema)}\nJSON:"


def regex_prompt(name: str) -> str:
    return f"Write an example {name.replace('_', ' ')}.\nAnswer:"


def check_schema(name: str, text: str) -> None:
    jsonschema.validate(json.loads(text), SCHEMAS[name])


def check_regex(name: str, text: str) -> None:
    assert re.fullmatch(REGEXES[name], text), (name, text)


@pytest.fixture(scope="module")
def engine(default_model_path):
    with radixrt.Engine(dtype="float32", kv_memory_gb=0.1, log_interval=0, debug_checks=True) as eng:
        yield eng


def constrained_batch(temperature: float | None):
    """(prompts, params, checks) for every schema and regex; seeded sampling when ``temperature``."""
    prompts, params, checks = [], [], []
    extra = {"temperature": 0.0} if temperature is None else {"temperature": temperature, "top_p": 0.95}
    for i, (name, schema) in enumerate(SCHEMAS.items()):
        prompts.append(schema_prompt(name, schema))
        p = {"json_schema": json.dumps(schema), "max_new_tokens": MAX_NEW, **extra}
        params.append(p if temperature is None else {**p, "seed": 100 + i})
        checks.append((check_schema, name))
    for i, name in enumerate(REGEXES):
        prompts.append(regex_prompt(name))
        p = {"regex": REGEXES[name], "max_new_tokens": MAX_NEW, **extra}
        params.append(p if temperature is None else {**p, "seed": 200 + i})
        checks.append((check_regex, name))
    return prompts, params, checks


def test_schemas_and_regexes_greedy_and_sampled_batched_with_free_requests(engine):
    greedy = constrained_batch(None)
    sampled = constrained_batch(0.9)
    free_params = [{"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}] * len(FREE)
    prompts = greedy[0] + sampled[0] + FREE
    params = greedy[1] + sampled[1] + free_params
    outs = engine.generate(prompts, params)
    assert len(outs) == len(prompts)
    for out, (check, name) in zip(outs, greedy[2] + sampled[2]):
        assert out["meta_info"]["finish_reason"]["type"] == "stop", (name, out["text"], out["meta_info"])
        check(name, out["text"])
    # unconstrained rows are untouched by their constrained neighbours: the same tokens as alone
    alone = engine.generate(FREE, free_params)
    for got, want in zip(outs[-len(FREE):], alone):
        assert got["output_ids"] == want["output_ids"]
    # seeded sampling is reproducible (same seed, same output) and still valid
    again = engine.generate(sampled[0][:3], sampled[1][:3])
    assert [o["text"] for o in again] == [o["text"] for o in outs[len(greedy[0]): len(greedy[0]) + 3]]


def test_choices(engine):
    choices = ["Paris", "London", "Berlin", "a very long answer that never ends"]
    outs = engine.generate(["The capital of France is", "The capital of Germany is"],
                           {"choices": choices, "temperature": 0.0, "max_new_tokens": 32})
    assert outs[0]["text"] == "Paris" and outs[1]["text"] in choices  # (the 135M model says London)
    assert all(o["meta_info"]["finish_reason"]["type"] == "stop" for o in outs)
    for seed in range(3):
        out = engine.generate("Pick one:", {"choices": choices, "temperature": 1.0, "seed": seed, "max_new_tokens": 32})
        assert out["text"] in choices and out["meta_info"]["finish_reason"]["type"] == "stop"


def run_counting_steps(engine, prompts, params, jump_forward: bool):
    engine.grammars.jump_forward_enabled = jump_forward
    try:
        before = engine.get_stats()
        outs = engine.generate(prompts, params)
        after = engine.get_stats()
    finally:
        engine.grammars.jump_forward_enabled = True
    return outs, after["steps"] - before["steps"], after["jump_forward_tokens"] - before["jump_forward_tokens"]


def test_jump_forward_on_vs_off(engine):
    # Schemas whose greedy text is the same either way. Jump-forward appends the forced text re-tokenised
    # with the tail (`{"` as one token where the model wrote `{` then `"`), and elsewhere ("nested",
    # "optional", "pattern" ...) that different context changes the model's later greedy choices: still valid
    # (tested above), not the same text.
    names = ["person", "bounded_number", "enum", "booleans_and_null", "const_and_integer_array"]
    prompts = [schema_prompt(n, SCHEMAS[n]) for n in names]
    params = [{"json_schema": json.dumps(SCHEMAS[n]), "temperature": 0.0, "max_new_tokens": MAX_NEW} for n in names]
    on, steps_on, saved = run_counting_steps(engine, prompts, params, True)
    off, steps_off, saved_off = run_counting_steps(engine, prompts, params, False)
    for name, a, b in zip(names, on, off):
        check_schema(name, a["text"])
        check_schema(name, b["text"])
        assert a["text"] == b["text"], name  # the token ids differ: forced text merges into fewer tokens
        assert len(a["output_ids"]) <= len(b["output_ids"])
    assert saved_off == 0 and saved > 0
    assert steps_on < steps_off, (steps_on, steps_off)


def test_jump_forward_streaming_stop_strings_and_budget(engine):
    schema = json.dumps(SCHEMAS["person"])
    prompt = schema_prompt("person", SCHEMAS["person"])
    full = engine.generate(prompt, {"json_schema": schema, "temperature": 0.0, "max_new_tokens": MAX_NEW})
    # streaming: cumulative chunks only ever grow (jump-forward never drops a token already sent)
    texts = [c["text"] for c in engine.generate(prompt, {"json_schema": schema, "temperature": 0.0,
                                                          "max_new_tokens": MAX_NEW}, stream=True)]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:])) and texts[-1] == full["text"]
    # a stop string inside jump-forwarded text ends the output before it, as without jump-forward
    stop = {"json_schema": schema, "temperature": 0.0, "max_new_tokens": MAX_NEW, "stop": ['"age"']}
    with_jf, _, _ = run_counting_steps(engine, [prompt], [stop], True)
    without, _, _ = run_counting_steps(engine, [prompt], [stop], False)
    assert with_jf[0]["text"] == without[0]["text"] == full["text"][: full["text"].index('"age"')]
    assert with_jf[0]["meta_info"]["finish_reason"] == {"type": "stop", "matched": '"age"'}
    # max_new_tokens caps appended tokens too
    for budget in (1, 3, 6):
        out = engine.generate(prompt, {"json_schema": schema, "temperature": 0.0, "max_new_tokens": budget})
        assert len(out["output_ids"]) <= budget and out["meta_info"]["finish_reason"]["type"] == "length"


def test_a_match_closes_when_the_budget_runs_out(engine):
    """A JSON string the model would go on writing past max_new_tokens is closed in time: the output parses."""
    schema = {"type": "object", "properties": {"story": {"type": "string"}, "rating": {"type": "integer"}},
              "required": ["story", "rating"]}
    prompt = "Write a very long story about a dragon, as JSON with a story and a rating:"
    free = engine.generate(prompt, {"temperature": 0.0, "max_new_tokens": 40, "ignore_eos": True})
    assert len(free["output_ids"]) == 40
    for budget in (24, 40):
        out = engine.generate(prompt, {"json_schema": json.dumps(schema), "temperature": 0.0,
                                       "max_new_tokens": budget})
        assert len(out["output_ids"]) <= budget
        jsonschema.validate(json.loads(out["text"]), schema)


@pytest.mark.parametrize("params, problem", [
    ({"regex": "(unclosed"}, "regex"),
    ({"regex": "a{3,1}"}, "regex"),
    ({"json_schema": "{not json"}, "json"),
    ({"json_schema": json.dumps({"type": "object", "properties": {"x": {"type": "integer", "minimum": 5, "maximum": 1}}})},
     "bounds"),
])
def test_invalid_grammar_is_a_clear_value_error_and_engine_keeps_serving(engine, params, problem):
    with pytest.raises(ValueError) as info:
        engine.generate("Hello", {**params, "max_new_tokens": 4})
    assert problem in str(info.value).lower(), str(info.value)
    out = engine.generate("Hello", {"regex": "[0-9]{3}", "temperature": 0.0, "max_new_tokens": 8})
    assert re.fullmatch("[0-9]{3}", out["text"])
