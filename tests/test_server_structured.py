"""Structured output over HTTP on a real `radixrt serve` (one per module, free loopback port): regex and
json_schema in /generate's sampling_params, OpenAI response_format (json_schema, json_object) on
/v1/chat/completions and /v1/completions, streaming, and bad grammars -> 400 while the server keeps serving.
"""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
import shared_server

pytestmark = pytest.mark.model

SERVER_ARGS = shared_server.ARGS  # the session's shared server (tests/shared_server.py)
MODEL = "smollm2-135m"
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}
DATE = r"[12][0-9]{3}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
ASK = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_generate_regex_and_json_schema(http):
    body = {"text": ["Today's date is", "A person as JSON:"], "sampling_params": [
        {"regex": DATE, "temperature": 0, "max_new_tokens": 32},
        {"json_schema": json.dumps(PERSON), "temperature": 0.8, "seed": 1, "max_new_tokens": 64}]}
    res = http.post("/generate", json=body)
    assert res.status_code == 200, res.text
    date, person = res.json()
    assert re.fullmatch(DATE, date["text"]), date["text"]
    jsonschema.validate(json.loads(person["text"]), PERSON)
    assert person["meta_info"]["finish_reason"]["type"] == "stop"


def test_generate_stream_constrained(http):
    body = {"text": "A person as JSON:", "stream": True,
            "sampling_params": {"json_schema": json.dumps(PERSON), "temperature": 0, "max_new_tokens": 64}}
    texts = []
    with http.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                texts.append(json.loads(line[6:])["text"])
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # jump-forward never retracts sent text
    jsonschema.validate(json.loads(texts[-1]), PERSON)


def test_chat_response_format_json_schema(oai):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    res = oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=64, temperature=0, response_format=fmt)
    jsonschema.validate(json.loads(res.choices[0].message.content), PERSON)
    assert res.choices[0].finish_reason == "stop"
    stream = oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=64, temperature=0, response_format=fmt,
                                         stream=True)
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(pieces) == res.choices[0].message.content


def test_chat_response_format_json_object(oai):
    res = oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=96, temperature=0,
                                      response_format={"type": "json_object"})
    assert res.choices[0].finish_reason == "stop", res.choices[0].message.content
    assert isinstance(json.loads(res.choices[0].message.content), dict)


def test_completions_response_format_and_regex(oai):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    res = oai.completions.create(model=MODEL, prompt="A person as JSON:", max_tokens=64, temperature=0,
                                 extra_body={"response_format": fmt})
    jsonschema.validate(json.loads(res.choices[0].text), PERSON)
    res = oai.completions.create(model=MODEL, prompt="Today's date is", max_tokens=32, temperature=0.7, seed=2,
                                 n=2, extra_body={"regex": DATE})
    assert all(re.fullmatch(DATE, c.text) for c in res.choices), [c.text for c in res.choices]


CHAT = "/v1/chat/completions"
BAD = [
    ("generate: bad regex", "/generate", {"text": "hi", "sampling_params": {"regex": "(unclosed"}}, "regex"),
    ("generate: schema not JSON", "/generate", {"text": "hi", "sampling_params": {"json_schema": "{oops"}}, "json"),
    ("generate: impossible bounds", "/generate", {"text": "hi", "sampling_params": {"json_schema": json.dumps(
        {"type": "object", "properties": {"x": {"type": "integer", "minimum": 5, "maximum": 1}}})}}, "bounds"),
    ("chat: bad schema in response_format", CHAT, {"messages": ASK, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}}, "objekt"),
    ("chat: unknown response_format type", CHAT, {"messages": ASK, "response_format": {"type": "yaml"}}, "yaml"),
    ("chat: response_format without schema object", CHAT, {"messages": ASK, "response_format": {
        "type": "json_schema", "json_schema": "x"}}, "json_schema"),
    ("completions: bad regex", "/v1/completions", {"prompt": "hi", "regex": "a{3,1}"}, "regex"),
    ("completions: response_format and regex", "/v1/completions", {"prompt": "hi", "regex": "a", "response_format": {
        "type": "json_object"}}, "response_format"),
]


@pytest.mark.parametrize("name,path,body,problem", BAD, ids=[b[0] for b in BAD])
def test_bad_grammar_gets_400(http, name, path, body, problem):
    res = http.post(path, json=body)
    assert res.status_code == 400, res.text
    message = res.json()["error"]["message"]
    assert problem in message.lower(), message


def test_bad_grammar_while_streaming_gets_400_and_server_keeps_serving(http, oai):
    body = {"messages": ASK, "stream": True, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "string", "pattern": "(["}}}}}}
    res = http.post(CHAT, json=body)
    assert res.status_code == 400, res.text
    assert http.get("/health").status_code == 200
    ok = oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=32, temperature=0,
                                     extra_body={"regex": "(yes|no)"})
    assert ok.choices[0].message.content in ("yes", "no")
