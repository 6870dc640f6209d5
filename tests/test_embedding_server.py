"""An embedding model behind `radixrt serve` and the Engine: /v1/embeddings through the `openai` client (Matryoshka
``dimensions``, base64), SGLang's native /encode, /health_generate as a one-token embedding, /model_info's
``is_generation``; every generation route refuses with a 400 and the server keeps serving. Vectors against
sentence-transformers and the scheduler's paths: tests/test_embedding_models.py."""

from __future__ import annotations

import math

import pytest
import torch

from tiny_models import save_embedding_model

IDS = [[5, 9, 3, 77, 12, 40, 8], [17, 2, 3]]
DIMS = [16, 32]


@pytest.fixture(scope="module")
def folder(tmp_path_factory, default_model_path):
    path = tmp_path_factory.mktemp("embedding-model")
    base = save_embedding_model("qwen3", path, "mean", tokenizer_from=default_model_path, matryoshka_dimensions=DIMS)
    with torch.no_grad():
        states = [base(torch.tensor([ids])).last_hidden_state[0].mean(0) for ids in IDS]
    return path, states


@pytest.fixture(scope="module")
def server(folder):
    from radixrt.server.server_process import ServerProcess

    srv = ServerProcess(["--model-path", str(folder[0]), "--dtype", "float32", "--kv-memory-gb", "0.05",
                         "--log-interval", "0", "--debug-checks", "--served-model-name", "tiny-embed"]).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    import httpx

    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def _unit(vector: torch.Tensor) -> list[float]:
    return torch.nn.functional.normalize(vector, dim=-1).tolist()


def _close(got: list[float], want: list[float]) -> bool:
    return len(got) == len(want) and all(math.isclose(a, b, abs_tol=1e-5) for a, b in zip(got, want))


def test_openai_client_gets_the_pooled_vectors_and_matryoshka_cuts(server, folder):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    res = client.embeddings.create(model="tiny-embed", input=IDS)  # base64 on the wire, decoded by the client
    assert [d.index for d in res.data] == [0, 1] and res.usage.prompt_tokens == sum(map(len, IDS))
    for data, state in zip(res.data, folder[1]):
        assert _close(data.embedding, _unit(state))
    cut = client.embeddings.create(model="tiny-embed", input=IDS[0], dimensions=16, encoding_format="float")
    assert _close(cut.data[0].embedding, _unit(folder[1][0][:16]))
    with pytest.raises(openai.BadRequestError, match="matryoshka_dimensions"):
        client.embeddings.create(model="tiny-embed", input=IDS[0], dimensions=20)


def test_native_encode_answers_as_the_engine(http, folder):
    one = http.post("/encode", json={"input_ids": IDS[0]})
    assert one.status_code == 200, one.text
    assert set(one.json()) == {"embedding", "meta_info"} and _close(one.json()["embedding"], _unit(folder[1][0]))
    many = http.put("/encode", json={"input_ids": IDS, "dimensions": 32})
    assert many.status_code == 200, many.text
    assert [_close(r["embedding"], _unit(s[:32])) for r, s in zip(many.json(), folder[1])] == [True, True]
    bad = http.post("/encode", json={"input_ids": IDS[0], "sampling_params": {}})
    assert bad.status_code == 400


@pytest.mark.parametrize("path,body", [
    ("/generate", {"input_ids": IDS[0], "sampling_params": {"max_new_tokens": 2}}),
    ("/v1/completions", {"prompt": IDS[0], "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
])
def test_generation_is_refused_and_the_server_keeps_serving(http, path, body):
    res = http.post(path, json=body)
    assert res.status_code == 400, res.text
    assert "embeddings only" in res.json()["error"]["message"]
    assert http.post("/encode", json={"input_ids": IDS[1]}).status_code == 200


@pytest.mark.parametrize("body,words", [
    ({"input_ids": IDS[0], "text": "x"}, "exactly one of text and input_ids"),
    ({"input_ids": []}, "empty"),
    ({"input_ids": [10**6]}, "outside the vocabulary"),
    ({"input_ids": IDS[0], "dimensions": 8}, "matryoshka_dimensions"),
    ({"input_ids": IDS[0], "dimensions": True}, "dimensions"),
    ({"input_ids": IDS[0], "stream": True}, "stream"),
])
def test_bad_encode_requests_get_a_clear_400(http, body, words):
    res = http.post("/encode", json=body)
    assert res.status_code == 400, res.text
    assert words in res.json()["error"]["message"]
    assert http.post("/encode", json={"input_ids": IDS[1]}).status_code == 200


def test_health_generate_model_info_and_openapi_know_an_embedding_model(http):
    assert http.get("/health_generate").status_code == 200
    info = http.get("/model_info").json()
    assert info["is_generation"] is False and info["architectures"] == ["Qwen3Model"]
    schemas = http.get("/openapi.json").json()["components"]["schemas"]
    assert schemas["EmbeddingRequest"]["properties"]["dimensions"]["anyOf"][0] == {"enum": DIMS}


@pytest.mark.parametrize("engine_scheduler", ["thread", "process"])
def test_the_engine_encodes_and_refuses_to_generate(folder, engine_scheduler):
    import radixrt

    with radixrt.Engine(model_path=str(folder[0]), dtype="float32", kv_memory_gb=0.05, log_interval=0,
                        engine_scheduler=engine_scheduler) as engine:
        assert engine.get_model_info()["is_generation"] is False
        vectors = engine.encode(input_ids=IDS, dimensions=16)
        with pytest.raises(ValueError, match="embeddings only"):
            engine.generate(input_ids=IDS[0], sampling_params={"max_new_tokens": 2})
    assert [_close(v["embedding"], _unit(s[:16])) for v, s in zip(vectors, folder[1])] == [True, True]
