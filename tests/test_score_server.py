"""Scoring and reranking behind `radixrt serve`: SGLang's /v1/score and /generate's ``token_ids_logprob`` on the
default model, equal to transformers; SGLang's /v1/rerank, vLLM's (Cohere's) /rerank and /v2/rerank and vLLM's /score
on a cross-encoder, equal to transformers' sigmoid; each route only where the model serves it (and in the OpenAPI
document only then); bad bodies a 400 and the server keeps serving. Through the Engine: tests/test_scoring.py."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from shared_server import ARGS

pytestmark = pytest.mark.model

SERVER_ARGS = ARGS
QUERY = "What do pandas eat?"
DOCUMENTS = ["Pandas eat bamboo shoots and leaves.", "The stock market closed higher today.",
             "Giant pandas live in the mountains of China."]


def _still_serving(http) -> None:
    res = http.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 2}})
    assert res.status_code == 200, res.text


def test_v1_score_equals_transformers(http, hf_model, tokenizer):
    labels = [tokenizer.encode(w, add_special_tokens=False)[0] for w in (" Paris", " London", " Berlin")]
    body = {"query": "The capital of France is", "items": ["", " the city of"], "label_token_ids": labels,
            "apply_softmax": True}
    res = http.post("/v1/score", json=body)
    assert res.status_code == 200, res.text
    answer = res.json()
    assert answer["object"] == "scoring" and len(answer["scores"]) == 2
    for item, scores in zip(body["items"], answer["scores"]):
        ids = tokenizer.encode(body["query"] + item)
        with torch.no_grad():
            want = torch.softmax(hf_model(torch.tensor([ids])).logits[0, -1, labels].float(), -1).tolist()
        assert all(math.isclose(a, b, rel_tol=1e-3) for a, b in zip(scores, want))
    assert answer["usage"]["prompt_tokens"] == sum(len(tokenizer.encode(body["query"] + i)) for i in body["items"])


def test_generate_returns_token_ids_logprobs_with_their_text(http, tokenizer):
    body = {"input_ids": tokenizer.encode("Hello there"), "sampling_params": {"max_new_tokens": 2, "temperature": 0},
            "return_logprob": True, "token_ids_logprob": [11, 42], "return_text_in_logprobs": True}
    res = http.post("/generate", json=body)
    assert res.status_code == 200, res.text
    rows = res.json()["meta_info"]["output_token_ids_logprobs"]
    assert len(rows) == 2 and [[t for _, t, _ in row] for row in rows] == [[11, 42], [11, 42]]
    assert rows[0][0][2] == tokenizer.decode([11]) and all(lp <= 0 for row in rows for lp, _, _ in row)


@pytest.mark.parametrize("path,body,words", [
    ("/v1/score", {"query": "q", "items": [[1, 2]], "label_token_ids": [5]}, "both text"),
    ("/v1/score", {"query": "q", "items": ["a"], "label_token_ids": [10**6]}, "outside the vocabulary"),
    ("/v1/score", {"query": "q", "items": ["a"], "label_token_ids": [5], "temperature": 1}, "temperature"),
    ("/generate", {"text": "q", "token_ids_logprob": [5]}, "return_logprob"),
])
def test_bad_scoring_bodies_get_a_400(http, path, body, words):
    res = http.post(path, json=body)
    assert res.status_code == 400 and words in res.text, res.text
    _still_serving(http)


def test_no_rerank_route_on_a_model_that_does_not_rerank(http):
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        assert http.post(path, json={"query": QUERY, "documents": DOCUMENTS}).status_code == 404
    assert http.post("/score", json={"text_1": QUERY, "text_2": DOCUMENTS}).status_code == 404
    paths = http.get("/openapi.json").json()["paths"]
    assert "/v1/score" in paths and "/v1/rerank" not in paths


# ----- a cross-encoder ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory, default_model_path, tokenizer):
    import httpx

    from tiny_models import save_classifier_model

    from radixrt.server.server_process import ServerProcess

    path = tmp_path_factory.mktemp("cross-encoder")
    model = save_classifier_model("qwen3", path, ["relevance"], vocab_size=49152)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_path / name, path / name)
    with torch.no_grad():
        scores = [torch.sigmoid(model(torch.tensor([tokenizer(QUERY, doc)["input_ids"]])).logits[0, 0]).item()
                  for doc in DOCUMENTS]
    srv = ServerProcess(["--model-path", str(path), "--dtype", "float32", "--kv-memory-gb", "0.05",
                         "--log-interval", "0", "--debug-checks", "--served-model-name", "tiny-reranker"]).start()
    with httpx.Client(base_url=srv.url, timeout=120) as client:
        yield client, scores
    srv.stop()


def test_v1_rerank_answers_as_sglang(cross_encoder):
    http, want = cross_encoder
    res = http.post("/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS, "model": "tiny-reranker"})
    assert res.status_code == 200, res.text
    answer = res.json()
    assert [r["index"] for r in answer] == sorted(range(3), key=lambda i: -want[i])
    for r in answer:
        assert math.isclose(r["score"], want[r["index"]], rel_tol=1e-4)
        assert r["document"] == DOCUMENTS[r["index"]] and r["meta_info"]["prompt_tokens"] > 0
    top = http.post("/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS, "top_n": 2,
                                        "return_documents": False}).json()
    assert [r["index"] for r in top] == [r["index"] for r in answer[:2]] and top[0]["document"] is None


@pytest.mark.parametrize("path", ["/rerank", "/v2/rerank"])
def test_cohere_rerank_answers_as_vllm(cross_encoder, path):
    http, want = cross_encoder
    res = http.post(path, json={"query": QUERY, "documents": DOCUMENTS, "top_n": 2})
    assert res.status_code == 200, res.text
    answer = res.json()
    assert answer["model"] == "tiny-reranker" and answer["usage"]["total_tokens"] > 0
    best = sorted(range(3), key=lambda i: -want[i])[:2]
    assert [r["index"] for r in answer["results"]] == best
    for r in answer["results"]:
        assert math.isclose(r["relevance_score"], want[r["index"]], rel_tol=1e-4)
        assert r["document"] == {"text": DOCUMENTS[r["index"]]}


def test_vllm_score_scores_pairs_in_order(cross_encoder, tokenizer):
    http, want = cross_encoder
    res = http.post("/score", json={"text_1": QUERY, "text_2": DOCUMENTS, "model": "tiny-reranker"})
    assert res.status_code == 200, res.text
    answer = res.json()
    assert answer["object"] == "list" and [d["index"] for d in answer["data"]] == [0, 1, 2]
    assert all(math.isclose(d["score"], w, rel_tol=1e-4) for d, w in zip(answer["data"], want))
    assert answer["usage"]["prompt_tokens"] == sum(len(tokenizer(QUERY, d)["input_ids"]) for d in DOCUMENTS)
    zipped = http.post("/score", json={"text_1": [QUERY, QUERY], "text_2": DOCUMENTS[1:]}).json()
    assert all(math.isclose(d["score"], w, rel_tol=1e-4) for d, w in zip(zipped["data"], want[1:]))
    res = http.post("/score", json={"text_1": [QUERY, QUERY], "text_2": DOCUMENTS})
    assert res.status_code == 400 and "as many" in res.text


def test_a_cross_encoder_serves_rerank_not_score(cross_encoder):
    http, _ = cross_encoder
    assert http.post("/v1/score", json={"query": "q", "items": ["a"], "label_token_ids": [1]}).status_code == 404
    paths = http.get("/openapi.json").json()["paths"]
    assert {"/v1/rerank", "/rerank", "/v2/rerank", "/score"} <= set(paths) and "/v1/score" not in paths
    for body in ({"query": QUERY, "documents": []}, {"query": "", "documents": DOCUMENTS},
                 {"query": QUERY, "documents": DOCUMENTS, "top_n": -1}, {"query": QUERY}):
        assert http.post("/v1/rerank", json=body).status_code == 400
    assert http.post("/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS[:1]}).status_code == 200
