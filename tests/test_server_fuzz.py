"""/openapi.json states the bounds the server enforces, and a bounded schemathesis run from it finds no 5xx and
no hang; bad inputs that once answered 5xx answer a clear 4xx. The long run is `python -m radixrt.bench.fuzz_http`."""

from __future__ import annotations

import httpx
import pytest

# SERVER_ARGS: what conftest's `server` fixture starts the server with
from radixrt.bench.fuzz_http import SERVER_ARGS, bounded_schema, cap_cost, run_fuzz  # noqa: F401 (SERVER_ARGS)
from radixrt.sampling.params import SamplingParams
from radixrt.server.openapi import BOUNDS, ApiLimits, build_openapi

ROUTES = {"/generate": {"post"}, "/v1/completions": {"post"}, "/v1/chat/completions": {"post"},
          "/v1/models": {"get"}, "/get_model_info": {"get"}, "/get_server_info": {"get"},
          "/flush_cache": {"get", "post"}, "/abort_request": {"post"}, "/health": {"get"}, "/metrics": {"get"},
          "/open_session": {"post"}, "/close_session": {"post"}, "/tokenize": {"post"}, "/detokenize": {"post"},
          "/v1/tokenize": {"post"}, "/v1/detokenize": {"post"}, "/v1/models/{model}": {"get"},
          "/health_generate": {"get"}, "/v1/embeddings": {"post"}}


def _accepts(field: str, value) -> bool:
    try:
        SamplingParams(**{field: value}).validate()
        return True
    except ValueError:
        return False


@pytest.mark.parametrize("name", [n for n in BOUNDS if n in SamplingParams.__struct_fields__ and n != "seed"])
def test_schema_bounds_are_the_validators(name):
    bound = BOUNDS[name]
    step = 1 if isinstance(getattr(SamplingParams(), name), int) else 1e-6
    if "minimum" in bound:
        assert _accepts(name, bound["minimum"]) and not _accepts(name, bound["minimum"] - step)
    if "exclusiveMinimum" in bound:
        assert not _accepts(name, bound["exclusiveMinimum"]) and _accepts(name, bound["exclusiveMinimum"] + step)
    if "maximum" in bound:
        assert _accepts(name, bound["maximum"]) and not _accepts(name, bound["maximum"] + step)
    if "not" in bound:
        assert not _accepts(name, bound["not"]["const"])


def test_document_is_generated_from_the_request_structs():
    doc = build_openapi(ApiLimits(context_length=512, vocab_size=1000), "0")
    schemas = doc["components"]["schemas"]
    body = doc["paths"]["/generate"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/GenerateBody"}
    assert set(schemas["GenerateBody"]["properties"]) >= {"text", "input_ids", "sampling_params", "rid", "stream"}
    assert schemas["SamplingParams"]["properties"]["max_new_tokens"]["maximum"] == 512
    assert schemas["SamplingParams"]["additionalProperties"] is False
    chat_max = schemas["ChatCompletionRequest"]["properties"]["max_tokens"]["anyOf"][0]
    assert chat_max == {"type": "integer", "minimum": 0, "maximum": 512}
    ids = schemas["GenerateBody"]["properties"]["input_ids"]["anyOf"][0]
    assert ids["items"] == {"type": "integer", "minimum": 0, "maximum": 999}
    cheap = bounded_schema(doc)["components"]["schemas"]
    assert cheap["SamplingParams"]["properties"]["max_new_tokens"]["maximum"] == 4
    assert cheap["SamplingParams"]["properties"]["n"]["maximum"] == 2
    assert schemas["SamplingParams"]["properties"]["n"]["maximum"] == 128  # the original is left alone


def test_embedding_dimensions_follow_the_models_matryoshka_sizes():
    def dims(**model) -> list[dict]:
        limits = ApiLimits(context_length=512, vocab_size=1000, embedding_size=64, **model)
        schemas = build_openapi(limits, "0")["components"]["schemas"]
        return [schemas[name]["properties"]["dimensions"] for name in ("EmbeddingRequest", "EncodeBody")]

    assert all(d["type"] == "null" for d in dims())
    assert all(d["anyOf"][0] == {"type": "integer", "minimum": 1, "maximum": 64} for d in dims(matryoshka=()))
    assert all(d["anyOf"][0] == {"enum": [16, 32]} for d in dims(matryoshka=(16, 32)))


def test_document_states_the_servers_own_caps():
    class Caps:
        max_n, max_prompt_chars, max_stop_strings, max_stop_string_chars = 16, 1000, 4, 20

    schemas = build_openapi(ApiLimits.of_server(512, 1000, Caps()), "0")["components"]["schemas"]
    assert schemas["SamplingParams"]["properties"]["n"]["maximum"] == 16
    assert schemas["ChatCompletionRequest"]["properties"]["n"]["maximum"] == 16
    stop = schemas["CompletionRequest"]["properties"]["stop"]["anyOf"]
    assert stop[0]["maxLength"] == 20 and stop[1]["maxItems"] == 4 and stop[1]["items"]["maxLength"] == 20
    assert schemas["GenerateBody"]["properties"]["text"]["anyOf"][0]["maxLength"] == 1000


def test_cap_cost_bounds_only_what_the_default_would_leave_open():
    generate = {"text": "hi", "sampling_params": [{"temperature": 0}, {"max_new_tokens": 2}]}
    cap_cost("/generate", generate)
    assert generate["sampling_params"] == [{"temperature": 0, "max_new_tokens": 4}, {"max_new_tokens": 2}]
    chat = {"messages": [], "max_completion_tokens": 3}
    cap_cost("/v1/chat/completions", chat)
    assert "max_tokens" not in chat
    completion = {"prompt": "x", "max_tokens": None}
    cap_cost("/v1/completions", completion)
    assert completion["max_tokens"] == 4


@pytest.mark.model
def test_server_publishes_its_openapi_document(server):
    import schemathesis

    doc = httpx.get(server.url + "/openapi.json").json()
    assert doc["openapi"].startswith("3.1")
    for path, methods in ROUTES.items():
        assert set(doc["paths"][path]) == methods, path
    info = httpx.get(server.url + "/get_model_info").json()
    sampling = doc["components"]["schemas"]["SamplingParams"]["properties"]
    assert sampling["max_new_tokens"]["maximum"] == info["context_length"] == 512
    schemathesis.openapi.from_dict(doc).validate()  # a valid OpenAPI 3.1 document


# Inputs that once answered 500.
ONCE_5XX = [
    ("batch of token ids with a bare id", "/generate", {"input_ids": [[1, 2], 3]}),
    ("chat top_k beyond 64 bits", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "top_k": 141625136154666819842742419456}),
    ("sampling top_k beyond 64 bits", "/generate", {"text": "hi", "sampling_params": {"top_k": 2**64}}),
    ("logprob_start_len beyond 64 bits", "/generate", {"text": "hi", "logprob_start_len": 2**70}),
    ("completions seed beyond 64 bits", "/v1/completions", {"prompt": "hi", "max_tokens": 1, "seed": -(2**64)}),
    ("chat message whose role is an object", "/v1/chat/completions",
     {"messages": [{"role": {"x": 1}, "content": "hi"}], "max_tokens": 1}),
    ("session offset beyond 64 bits", "/v1/completions",
     {"prompt": "hi", "max_tokens": 1, "session_params": {"id": "s", "offset": 2**70}}),
]
# Numbers the server passes on untouched (a tool's JSON schema) or that JSON Schema counts as integers.
ACCEPTED_NUMBERS = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"n": {"type": "integer", "examples": [2**70]}}}}}]}),
    ("/generate", {"input_ids": [1.0, 2.0], "sampling_params": {"max_new_tokens": 1.0}}),
]
# Extreme values inside the 64-bit range are served (or refused with a 4xx), never a 5xx.
EXTREME_INT64 = [
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 1, "top_k": 2**63 - 1}}),
    ("/generate", {"text": "hi", "return_logprob": True, "logprob_start_len": 2**63 - 1,
                   "sampling_params": {"max_new_tokens": 1}}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "seed": 2**63 - 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                              "top_k": 2**63 - 1, "n": 1}),
]


@pytest.mark.model
@pytest.mark.parametrize("name,path,body", ONCE_5XX, ids=[c[0] for c in ONCE_5XX])
def test_once_5xx_inputs_answer_400(server, name, path, body):
    res = httpx.post(server.url + path, json=body, timeout=60)
    assert res.status_code == 400, res.text
    assert res.json()["error"]["message"]


@pytest.mark.model
@pytest.mark.parametrize("path,body", ACCEPTED_NUMBERS)
def test_free_form_big_numbers_and_integral_floats_are_accepted(server, path, body):
    res = httpx.post(server.url + path, json=body, timeout=60)
    assert res.status_code == 200, res.text


@pytest.mark.model
@pytest.mark.parametrize("path,body", EXTREME_INT64)
def test_extreme_int64_values_never_5xx(server, path, body):
    res = httpx.post(server.url + path, json=body, timeout=60)
    assert res.status_code in (200, 400), res.text


@pytest.mark.model
def test_bounded_fuzz_run_passes_every_check_with_no_hang(server):
    report = run_fuzz(server.url, max_examples=6, timeout=30.0, seed=1)
    print(report.render())
    assert report.cases >= 40 and len(report.operations) == 34
    assert report.server_errors == [] and report.hangs == []
    assert report.check_failures == []  # every schemathesis check: statuses, bodies, negative and positive data
    assert report.statuses[200] > 0 and report.statuses[400] > 0
    assert report.healthy_after and report.same_output_after
