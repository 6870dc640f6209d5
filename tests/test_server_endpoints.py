"""The endpoints SGLang's and vLLM's clients call beyond generation, through a real `radixrt serve`: /tokenize and
/detokenize (also under /v1/), GET /v1/models/{model}, /health_generate, /v1/embeddings (the openai client's
call, float and base64); each bad input gets a clear 4xx and the server keeps serving."""

from __future__ import annotations

import base64
import math
import struct

import openai
import pytest

pytestmark = pytest.mark.model

SERVER_ARGS = ["--dtype", "float32", "--kv-memory-gb", "0.1", "--log-interval", "0", "--debug-checks",
               "--served-model-name", "tiny-chat", "--max-prompt-chars", "2000", "--context-length", "512"]
TEXT = "The capital of France is"


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _still_serving(http) -> None:
    res = http.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 2}})
    assert res.status_code == 200, res.text


# ----- /tokenize and /detokenize --------------------------------------------------------------------------


@pytest.mark.parametrize("prefix", ["", "/v1"])
def test_tokenize_and_detokenize_round_trip(http, tokenizer, prefix):
    res = http.post(f"{prefix}/tokenize", json={"model": "tiny-chat", "prompt": TEXT})
    assert res.status_code == 200, res.text
    body = res.json()
    ids = tokenizer.encode(TEXT)
    assert body == {"tokens": ids, "count": len(ids), "max_model_len": http.get("/get_model_info").json()[
        "context_length"]}
    many = http.post(f"{prefix}/tokenize", json={"prompt": [TEXT, "Hello"]}).json()
    assert many["tokens"] == [ids, tokenizer.encode("Hello")] and many["count"] == [len(ids), len(many["tokens"][1])]
    back = http.post(f"{prefix}/detokenize", json={"model": "tiny-chat", "tokens": ids}).json()
    assert back["text"] == TEXT and back["prompt"] == TEXT  # SGLang's name and vLLM's
    both = http.post(f"{prefix}/detokenize", json={"tokens": [ids, many["tokens"][1]]}).json()
    assert both["text"] == [TEXT, "Hello"]


def test_tokenize_chat_messages_gives_the_chat_prompt(http, oai):
    messages = [{"role": "user", "content": "Say hi"}]
    counted = http.post("/tokenize", json={"messages": messages}).json()
    answer = oai.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=1, temperature=0)
    assert counted["count"] == answer.usage.prompt_tokens
    special = http.post("/detokenize", json={"tokens": counted["tokens"], "skip_special_tokens": False}).json()
    assert "Say hi" in special["text"] and "<|im_start|>" in special["text"]


@pytest.mark.parametrize("path,body,status,words", [
    ("/tokenize", {"prompt": TEXT, "model": "other"}, 404, "does not exist"),
    ("/tokenize", {}, 400, "exactly one of prompt and messages"),
    ("/tokenize", {"prompt": TEXT, "messages": [{"role": "user", "content": "x"}]}, 400, "exactly one"),
    ("/tokenize", {"prompt": "x" * 2001}, 400, "at most 2000"),
    ("/tokenize", {"prompt": 3}, 400, "invalid request"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x", "name": []}]}, 400, "name must be a string"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "name": 0.5}], "max_tokens": 1}, 400,
     "name must be a string"),
    ("/tokenize", {"prompt": TEXT, "extra": 1}, 400, "extra"),
    ("/detokenize", {"tokens": [10**9]}, 400, "outside the vocabulary"),
    ("/detokenize", {"tokens": [[1, 2], 3]}, 400, "list of token ids"),
    ("/detokenize", {"tokens": "abc"}, 400, "invalid request"),
    ("/v1/detokenize", {"tokens": [1], "model": "other"}, 404, "does not exist"),
    ("/detokenize", {}, 400, "tokens"),
])
def test_bad_tokenizer_requests_get_a_clear_4xx(http, path, body, status, words):
    res = http.post(path, json=body)
    assert res.status_code == status, res.text
    assert words in res.json()["error"]["message"]
    _still_serving(http)


# ----- /v1/models/{model} ---------------------------------------------------------------------------------


def test_retrieve_a_model_by_any_of_its_names(http, oai):
    model = oai.models.retrieve("tiny-chat")
    assert model.id == "tiny-chat" and model.object == "model"
    by_path = http.get("/v1/models/" + http.get("/get_model_info").json()["model_path"])
    assert by_path.status_code == 200 and by_path.json()["id"] == "tiny-chat"
    listed = http.get("/v1/models").json()["data"][0]
    assert {k: v for k, v in listed.items() if k != "created"} == {k: v for k, v in by_path.json().items()
                                                                   if k != "created"}
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("no-such-model")
    _still_serving(http)


# ----- /health_generate -----------------------------------------------------------------------------------


def test_health_generate_runs_a_real_generation(http):
    before = http.get("/get_server_info").json()["stats"]["steps"]
    res = http.get("/health_generate")
    assert res.status_code == 200, res.text
    assert http.get("/get_server_info").json()["stats"]["steps"] > before  # the scheduler ran a step for it


# ----- /v1/embeddings -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference_vector(default_model_path):
    """The default model's last hidden state of TEXT by transformers, unit length: what SGLang's pooling gives."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32)
    ids = AutoTokenizer.from_pretrained(default_model_path)(TEXT, return_tensors="pt").input_ids
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states[-1][0, -1]
    return torch.nn.functional.normalize(hidden, dim=-1).tolist()


def _cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def test_openai_client_embeddings_match_the_model(oai, reference_vector):
    res = oai.embeddings.create(model="tiny-chat", input=TEXT)  # the client asks for base64 and decodes it
    vector = res.data[0].embedding
    assert len(vector) == len(reference_vector)
    assert abs(sum(x * x for x in vector) - 1) < 1e-4
    assert _cosine(vector, reference_vector) > 0.9999
    assert res.model == "tiny-chat" and res.usage.prompt_tokens == res.usage.total_tokens > 0


def test_every_input_shape_and_both_encodings(http, oai, tokenizer):
    ids = tokenizer.encode(TEXT)
    single = oai.embeddings.create(model="tiny-chat", input=TEXT, encoding_format="float").data[0].embedding
    shapes = [TEXT, [TEXT, "Hello"], ids, [ids, tokenizer.encode("Hello")]]
    for given in shapes:
        res = http.post("/v1/embeddings", json={"input": given, "encoding_format": "float"})
        assert res.status_code == 200, res.text
        body = res.json()
        assert body["object"] == "list" and [d["index"] for d in body["data"]] == list(range(len(body["data"])))
        assert all(d["object"] == "embedding" for d in body["data"])
        assert _cosine(body["data"][0]["embedding"], single) > 0.99999
    b64 = http.post("/v1/embeddings", json={"input": [TEXT, "Hello"], "encoding_format": "base64"}).json()
    decoded = list(struct.unpack(f"<{len(single)}f", base64.b64decode(b64["data"][0]["embedding"])))
    assert _cosine(decoded, single) > 0.99999 and len(b64["data"]) == 2
    assert b64["usage"]["prompt_tokens"] == len(ids) + len(tokenizer.encode("Hello"))


@pytest.mark.parametrize("body,status,words", [
    ({"input": ""}, 400, "empty"),
    ({"input": []}, 400, "prompt must be"),
    ({"input": [1, "a"]}, 400, "prompt must be"),
    ({"input": [10**9]}, 400, "outside the vocabulary"),
    ({"input": [[1, 2], [-1]]}, 400, "outside the vocabulary"),
    ({"input": "x" * 2001}, 400, "at most 2000"),
    ({"input": TEXT, "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": TEXT, "dimensions": 64}, 400, "dimensions"),
    ({"input": TEXT, "model": "other"}, 404, "does not exist"),
    ({"model": "tiny-chat"}, 400, "input"),
    ({"input": [TEXT] * 2049}, 400, "at most 2048"),
    ({"input": list(range(1, 600))}, 400, "context length"),
])
def test_bad_embedding_requests_get_a_clear_4xx(http, body, status, words):
    res = http.post("/v1/embeddings", json=body)
    assert res.status_code == status, res.text
    assert words in res.json()["error"]["message"]
    _still_serving(http)


def test_the_engine_encodes_as_sglang_s(default_model_path):
    import radixrt

    with radixrt.Engine(model_path="smollm2-135m", dtype="float32", kv_memory_gb=0.05, log_interval=0) as engine:
        one = engine.encode(TEXT)
        many = engine.encode([TEXT, "Hello"])
        with pytest.raises(ValueError, match="empty"):
            engine.encode("")
        generated = engine.generate(TEXT, {"max_new_tokens": 2, "temperature": 0})
    assert set(one) == {"embedding", "meta_info"} and one["meta_info"]["prompt_tokens"] == 5
    assert isinstance(many, list) and _cosine(many[0]["embedding"], one["embedding"]) > 0.99999
    assert generated["text"]  # the same engine generates after encoding
