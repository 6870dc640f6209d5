"""A classifier behind `radixrt serve`: SGLang's /classify (the scores at each prompt's last token) and vLLM's
/v1/classify (probabilities, the likeliest label), equal to transformers' ``*ForSequenceClassification``; both
routes absent on a model that is not a classifier; generation refused. Scores through the scheduler:
tests/test_embedding_models.py."""

from __future__ import annotations

import math

import pytest
import torch

from tiny_models import save_classifier_model

IDS = [[5, 9, 3, 77, 12, 40, 8], [17, 2, 3]]
LABELS = ["negative", "neutral", "positive"]


@pytest.fixture(scope="module")
def scores(tmp_path_factory, default_model_path):
    import shutil

    path = tmp_path_factory.mktemp("classifier")
    model = save_classifier_model("qwen3", path, LABELS)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_path / name, path / name)
    with torch.no_grad():
        return path, [model(torch.tensor([ids])).logits[0].tolist() for ids in IDS]


@pytest.fixture(scope="module")
def http(scores):
    import httpx

    from radixrt.server.server_process import ServerProcess

    srv = ServerProcess(["--model-path", str(scores[0]), "--dtype", "float32", "--kv-memory-gb", "0.05",
                         "--log-interval", "0", "--debug-checks", "--served-model-name", "tiny-classifier"]).start()
    with httpx.Client(base_url=srv.url, timeout=120) as client:
        yield client
    srv.stop()


def _close(got: list[float], want: list[float]) -> bool:
    return len(got) == len(want) and all(math.isclose(a, b, abs_tol=1e-5) for a, b in zip(got, want))


def test_native_classify_returns_the_scores(http, scores):
    res = http.post("/classify", json={"input_ids": IDS})
    assert res.status_code == 200, res.text
    assert [_close(r["embedding"], s) for r, s in zip(res.json(), scores[1])] == [True, True]


def test_v1_classify_returns_probabilities_and_the_likeliest_label(http, scores):
    res = http.post("/v1/classify", json={"model": "tiny-classifier", "input": IDS})
    assert res.status_code == 200, res.text
    body = res.json()
    assert body["object"] == "list" and body["usage"]["prompt_tokens"] == sum(map(len, IDS))
    for item, want in zip(body["data"], scores[1]):
        probs = torch.softmax(torch.tensor(want), -1).tolist()
        assert _close(item["probs"], probs) and item["num_classes"] == 3
        assert item["label"] == LABELS[max(range(3), key=probs.__getitem__)]
    assert http.post("/v1/classify", json={"input": []}).status_code == 400
    assert http.post("/generate", json={"input_ids": IDS[0]}).status_code == 400
    paths = http.get("/openapi.json").json()["paths"]
    assert "/v1/classify" in paths and "/classify" in paths


def test_a_model_that_is_not_a_classifier_serves_no_classify_route(shared_server):
    import httpx

    assert httpx.post(shared_server.url + "/v1/classify", json={"input": "hi"}).status_code == 404
    assert "/v1/classify" not in httpx.get(shared_server.url + "/openapi.json").json()["paths"]


def test_probabilities_are_a_softmax_or_for_one_label_a_sigmoid():
    from radixrt.server.classify_routes import probabilities

    assert probabilities([0.0]) == [0.5] and probabilities([2.0])[0] == pytest.approx(1 / (1 + math.exp(-2)))
    assert probabilities([1000.0, 0.0]) == pytest.approx([1.0, 0.0])  # no overflow
    assert sum(probabilities([0.3, -1.2, 2.0])) == pytest.approx(1.0)
