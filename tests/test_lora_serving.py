"""LoRA adapters served: the Engine and `radixrt serve` give each adapter's greedy tokens as PEFT's model does on
the default model (fp32); requests for different adapters share batches and never each other's cache; adapters
load and unload while the runtime serves; a request or load it cannot serve is that call's error only."""

import pytest
import torch

import radixrt
from lora_adapters import peft_model, save_adapter
from shared_server import ARGS

pytestmark = pytest.mark.model
SERVER_ARGS = ARGS  # the session's shared server, which serves no adapters (the last test)

PROMPTS = [
    "Write one sentence about the sea, the sky and the ships that sail between them, slowly, one word at a time:",
    "List the numbers from one to ten, then say which of them are prime numbers and which are even ones:",
]
MAX_NEW = 10
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0}


@pytest.fixture(scope="module")
def adapters(default_model_path, tmp_path_factory):
    """Two adapters of the default model, and PEFT's greedy tokens for each prompt under each (None: the base)."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("adapters")
    paths = {
        "a": save_adapter(default_model_path, root / "a", r=8, alpha=16, seed=1, std=0.04),
        "b": save_adapter(default_model_path, root / "b", r=16, alpha=16, seed=2, std=0.03,
                          targets=("q_proj", "v_proj", "o_proj", "down_proj")),
    }
    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    expected = {}
    with torch.no_grad():
        for name, path in [(None, None), *paths.items()]:
            model = peft_model(default_model_path, path)
            expected[name] = []
            for prompt in PROMPTS:
                ids = tokenizer(prompt, return_tensors="pt").input_ids
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                                     do_sample=False, pad_token_id=tokenizer.eos_token_id)
                expected[name].append(out[0, ids.shape[1]:].tolist())
    for name in paths:
        assert expected[name] != expected[None], name  # else the comparisons below prove nothing
    return paths, expected


@pytest.fixture(scope="module")
def engine(adapters):
    """One adapter per batch at most, with n-gram speculation on (its verify rows go through the adapters too)."""
    paths, _ = adapters
    engine = radixrt.Engine(dtype="float32", kv_memory_gb=0.2, lora_paths=[f"{n}={p}" for n, p in paths.items()],
                            max_loras_per_batch=1, speculative_algorithm="NGRAM", log_interval=0, debug_checks=True)
    yield engine
    engine.shutdown()


def _ids(results) -> list[list[int]]:
    return [r["output_ids"] for r in results]


def test_each_request_gets_its_adapters_tokens_with_one_adapter_a_batch(engine, adapters):
    _, expected = adapters
    runner = engine.scheduler.runner
    seen: list[set[int]] = []
    forward = runner.forward

    def spy(batch):
        seen.append({uid for uid, _, _ in batch.lora_spans or ()})
        return forward(batch)

    runner.forward = spy
    try:
        names = [None, "a", "b", "a", None, "b"]
        prompts = [PROMPTS[i % 2] for i in range(len(names))]
        results = engine.generate(prompts, GREEDY, lora_path=names)
    finally:
        runner.forward = forward
    assert _ids(results) == [expected[n][i % 2] for i, n in enumerate(names)]
    assert max(len(s) for s in seen) == 1  # --max-loras-per-batch 1: the other adapter's requests waited
    assert {frozenset(s) for s in seen} >= {frozenset({1}), frozenset({2})}


def test_an_adapters_requests_never_read_the_base_models_cache(engine, adapters):
    _, expected = adapters
    assert engine.flush_cache()
    first = engine.generate(PROMPTS[0], GREEDY)
    assert first["output_ids"] == expected[None][0]
    other = engine.generate(PROMPTS[0], GREEDY, lora_path="a")
    assert other["meta_info"]["cached_tokens"] == 0  # the same prompt is cached, but for the base model
    assert other["output_ids"] == expected["a"][0]
    again = engine.generate(PROMPTS[0], GREEDY, lora_path="a")
    assert again["meta_info"]["cached_tokens"] > 0
    assert again["output_ids"] == expected["a"][0]


def test_adapters_load_and_unload_while_serving(engine, adapters):
    paths, expected = adapters
    loaded = engine.load_lora_adapter("c", str(paths["b"]))
    assert set(loaded) == {"a", "b", "c"}
    assert engine.generate(PROMPTS[1], GREEDY, lora_path="c")["output_ids"] == expected["b"][1]
    stream = engine.generate(PROMPTS[1], {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True},
                             lora_path="c", stream=True)
    next(stream)
    with pytest.raises(ValueError, match="in use by 1 request"):
        engine.unload_lora_adapter("c")
    for _ in stream:
        pass
    assert set(engine.unload_lora_adapter("c")) == {"a", "b"}
    with pytest.raises(ValueError, match="unknown LoRA adapter 'c'"):
        engine.generate(PROMPTS[1], GREEDY, lora_path="c")
    # the name again, other weights: the prompt cached under the old "c" is not theirs
    engine.load_lora_adapter("c", str(paths["a"]))
    result = engine.generate(PROMPTS[1], GREEDY, lora_path="c")
    assert result["output_ids"] == expected["a"][1] and result["meta_info"]["cached_tokens"] == 0
    engine.unload_lora_adapter("c")


def test_a_hub_adapter_is_fetched_on_the_callers_thread(engine, adapters, monkeypatch):
    """A download never runs on the scheduler's thread, where it would hold up every request being served."""
    import threading

    import huggingface_hub

    paths, expected = adapters
    calls = []

    def snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, threading.current_thread()))
        return str(paths["a"])

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    loaded = engine.load_lora_adapter("hub", "someone/sql-adapter")
    assert loaded["hub"] == "someone/sql-adapter"
    assert calls == [("someone/sql-adapter", threading.current_thread())]
    assert engine.generate(PROMPTS[0], GREEDY, lora_path="hub")["output_ids"] == expected["a"][0]
    engine.unload_lora_adapter("hub")


@pytest.mark.parametrize("call,message", [
    (lambda e, p: e.load_lora_adapter("a", str(p["b"])), "already loaded"),
    (lambda e, p: e.load_lora_adapter("d", "/no/such/adapter"), "is not a folder"),
    (lambda e, p: e.load_lora_adapter("d", str(p["a"].parent)), "no adapter_config.json"),
    (lambda e, p: e.unload_lora_adapter("d"), "no LoRA adapter named 'd'"),
    (lambda e, p: e.generate(PROMPTS[0], GREEDY, lora_path="d"), "unknown LoRA adapter 'd' \\(loaded: a, b\\)"),
    (lambda e, p: e.generate(PROMPTS, GREEDY, lora_path=["a"]), "lora_path must be"),
])
def test_what_cannot_be_served_is_that_calls_error(engine, adapters, call, message):
    paths, expected = adapters
    with pytest.raises(ValueError, match=message):
        call(engine, paths)
    assert engine.generate(PROMPTS[0], GREEDY, lora_path="b")["output_ids"] == expected["b"][0]


def test_overlap_scheduling_serves_adapters(adapters):
    """Decode steps launched before the previous step's tokens are read back carry each row's adapter too."""
    paths, expected = adapters
    engine = radixrt.Engine(dtype="float32", kv_memory_gb=0.1, lora_paths=[f"a={paths['a']}"],
                            enable_overlap_schedule=True, log_interval=0, debug_checks=True)
    try:
        names = ["a", None, "a", None]
        results = engine.generate([PROMPTS[i % 2] for i in range(4)], GREEDY, lora_path=names)
        assert _ids(results) == [expected[n][i % 2] for i, n in enumerate(names)]
        assert engine.scheduler.launched_steps > 0
    finally:
        engine.shutdown()


# ----- the server ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lora_server(adapters):
    from radixrt.server.server_process import ServerProcess

    paths, _ = adapters
    srv = ServerProcess(["--dtype", "float32", "--kv-memory-gb", "0.2", "--log-interval", "0", "--debug-checks",
                         "--lora-paths", f"a={paths['a']}", f'{{"lora_name": "b", "lora_path": "{paths["b"]}"}}'])
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(lora_server):
    import httpx

    with httpx.Client(base_url=lora_server.url, timeout=120) as http:
        yield http


def _completion(client, **body):
    return client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": MAX_NEW, "temperature": 0,
                                                **body})


def test_the_server_serves_each_adapter_by_every_name(client, adapters):
    from transformers import AutoTokenizer

    paths, expected = adapters
    res = client.post("/generate", json={"text": PROMPTS, "sampling_params": GREEDY, "lora_path": ["b", None]})
    assert res.status_code == 200, res.text
    assert _ids(res.json()) == [expected["b"][0], expected[None][1]]
    models = client.get("/v1/models").json()["data"]
    base = models[0]["id"]
    assert [(m["id"], m.get("parent"), m["root"]) for m in models[1:]] == [("a", base, str(paths["a"])),
                                                                            ("b", base, str(paths["b"]))]
    assert client.get("/v1/models/a").json()["parent"] == base
    tokenizer = AutoTokenizer.from_pretrained(models[0]["root"])
    want = tokenizer.decode(expected["a"][0])
    for body in ({"model": "a"}, {"model": f"{base}:a"}, {"model": base, "lora_path": "a"}, {"lora_path": "a"}):
        res = _completion(client, **body)
        assert res.status_code == 200, (body, res.text)
        assert res.json()["choices"][0]["text"] == want, body
        assert res.json()["model"] == body.get("model", base)
    # an embedding through an adapter is the adapter's
    vectors = {}
    for model in (base, "a"):
        res = client.post("/v1/embeddings", json={"model": model, "input": PROMPTS[0]})
        assert res.status_code == 200 and res.json()["model"] == model, res.text
        vectors[model] = res.json()["data"][0]["embedding"]
    assert vectors["a"] != vectors[base]


def test_the_server_refuses_what_it_cannot_serve_and_keeps_serving(client, adapters):
    _, expected = adapters
    res = _completion(client, model="zz")
    assert res.status_code == 404 and "`a`, `b`" in res.json()["error"]["message"]
    res = _completion(client, model="a", lora_path="b")
    assert res.status_code == 400 and "name two LoRA adapters" in res.json()["error"]["message"]
    res = client.post("/generate", json={"text": PROMPTS[0], "sampling_params": GREEDY, "lora_path": "zz"})
    assert res.status_code == 404 and "unknown LoRA adapter 'zz'" in res.json()["error"]["message"]
    res = client.post("/generate", json={"text": PROMPTS[0], "sampling_params": GREEDY, "lora_path": "a"})
    assert res.json()["output_ids"] == expected["a"][0]


def test_the_server_loads_and_unloads_adapters(client, adapters):
    paths, expected = adapters
    res = client.post("/load_lora_adapter", json={"lora_name": "c", "lora_path": str(paths["a"])})
    assert res.status_code == 200, res.text
    assert res.json()["success"] and set(res.json()["loaded_adapters"]) == {"a", "b", "c"}
    assert "c" in [m["id"] for m in client.get("/v1/models").json()["data"]]
    chat = client.post("/v1/chat/completions", json={"model": "c", "messages": [{"role": "user", "content": "Hi"}],
                                                     "max_tokens": 4})
    assert chat.status_code == 200 and chat.json()["model"] == "c"
    res = client.post("/generate", json={"text": PROMPTS[0], "sampling_params": GREEDY, "lora_path": "c"})
    assert res.json()["output_ids"] == expected["a"][0]
    for body, status, message in (({"lora_name": "c", "lora_path": str(paths["b"])}, 409, "already loaded"),
                                  ({"lora_name": "d", "lora_path": "/no/such/adapter"}, 400, "is not a folder")):
        res = client.post("/load_lora_adapter", json=body)
        assert res.status_code == status and not res.json()["success"] and message in res.json()["error_message"]
    res = client.post("/unload_lora_adapter", json={"lora_name": "c"})
    assert res.status_code == 200 and set(res.json()["loaded_adapters"]) == {"a", "b"}
    res = client.post("/unload_lora_adapter", json={"lora_name": "c"})
    assert res.status_code == 404 and not res.json()["success"]
    assert _completion(client, model="c").status_code == 404
    assert client.post("/load_lora_adapter", json={"lora_name": ""}).status_code == 400


def test_a_server_without_adapters_refuses_them(http):
    res = http.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 2}, "lora_path": "a"})
    assert res.status_code == 404 and "serves no LoRA adapters" in res.json()["error"]["message"]
    res = http.post("/load_lora_adapter", json={"lora_name": "a", "lora_path": "/tmp"})
    assert res.status_code == 400 and "serves no LoRA adapters" in res.json()["error_message"]

