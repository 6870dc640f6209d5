"""A real `radixrt serve` on a free loopback port, driven by the openai client and httpx.

One server for the module (started once; the last test shuts it down with SIGTERM and checks the cleanup).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import openai
import pytest

import radixrt
from radixrt.bench.workers import parse_prometheus
from radixrt.tokenizer import apply_chat_template

pytestmark = pytest.mark.model

SERVER_ARGS = ["--dtype", "float32", "--kv-memory-gb", "0.15", "--log-interval", "0", "--debug-checks"]
GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three colors:"]


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def engine(server):  # after the server, so both never load the model at the same time
    with radixrt.Engine(model_path="smollm2-135m", dtype="float32", kv_memory_gb=0.1, log_interval=0) as eng:
        yield eng


def server_info(http) -> dict:
    res = http.get("/get_server_info")
    assert res.status_code == 200, res.text
    return res.json()


def wait_idle(http, timeout=30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        info = server_info(http)
        stats = info["stats"]
        if info["requests_in_flight"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0:
            return info
        assert time.monotonic() < deadline, info
        time.sleep(0.1)


# ----- native API ---------------------------------------------------------------------------------------


def test_health_models_and_model_info(http, engine):
    assert http.get("/health").status_code == 200
    info = http.get("/get_model_info").json()
    assert info == engine.get_model_info()
    models = http.get("/v1/models").json()
    assert models["data"][0]["id"] == info["served_model_name"]


def test_generate_matches_engine(http, engine):
    expected = engine.generate(PROMPTS, GREEDY)
    batch = http.post("/generate", json={"text": PROMPTS, "sampling_params": GREEDY}).json()
    assert isinstance(batch, list) and len(batch) == len(PROMPTS)
    for got, want in zip(batch, expected):
        assert got["output_ids"] == want["output_ids"]
        assert got["text"] == want["text"]
        assert set(got["meta_info"]) == set(want["meta_info"])
        assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]
    one = http.post("/generate", json={"text": PROMPTS[0], "sampling_params": GREEDY}).json()
    assert isinstance(one, dict) and one["output_ids"] == expected[0]["output_ids"]
    ids = engine.tokenizer.encode(PROMPTS[1])
    by_ids = http.post("/generate", json={"input_ids": ids, "sampling_params": GREEDY}).json()
    assert by_ids["output_ids"] == expected[1]["output_ids"]


def test_generate_streams_cumulative_text(http, engine):
    want = engine.generate(PROMPTS[2], GREEDY)
    chunks, done = [], False
    with http.stream("POST", "/generate", json={"text": PROMPTS[2], "sampling_params": GREEDY, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line:
                continue
            assert line.startswith("data: ")
            if line == "data: [DONE]":
                done = True
                break
            chunks.append(json.loads(line[6:]))
    assert done and len(chunks) >= 2
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # cumulative, SGLang semantics
    assert chunks[-1]["text"] == want["text"] and chunks[-1]["output_ids"] == want["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "matched": None}


def test_generate_logprobs(http, engine):
    body = {"text": PROMPTS[0], "sampling_params": {**GREEDY, "max_new_tokens": 3}, "return_logprob": True,
            "logprob_start_len": 0, "top_logprobs_num": 2}
    got = http.post("/generate", json=body).json()
    want = engine.generate(PROMPTS[0], body["sampling_params"], return_logprob=True, logprob_start_len=0,
                           top_logprobs_num=2)
    meta = got["meta_info"]
    n_prompt = meta["prompt_tokens"]
    assert len(meta["input_token_logprobs"]) == n_prompt and meta["input_token_logprobs"][0][0] is None
    assert len(meta["output_token_logprobs"]) == 3 and len(meta["output_top_logprobs"][0]) == 2
    assert [e[1] for e in meta["output_token_logprobs"]] == got["output_ids"]
    for a, b in zip(meta["output_token_logprobs"], want["meta_info"]["output_token_logprobs"]):
        assert a[1] == b[1] and a[0] == pytest.approx(b[0], abs=1e-4)


# ----- OpenAI API ---------------------------------------------------------------------------------------


def chat_ids(engine, text):
    return apply_chat_template(engine.tokenizer, [{"role": "user", "content": text}])


def test_chat_completion_matches_engine(oai, engine):
    question = "What is the capital of France?"
    res = oai.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": question}],
                                      max_tokens=6, temperature=0)
    want = engine.generate(input_ids=chat_ids(engine, question), sampling_params={"max_new_tokens": 6,
                                                                                 "temperature": 0})
    assert res.choices[0].message.content == want["text"]
    assert res.choices[0].message.role == "assistant"
    assert res.usage.prompt_tokens == len(chat_ids(engine, question))
    assert res.usage.completion_tokens == len(want["output_ids"])
    assert res.object == "chat.completion"


def test_chat_stream_with_usage(oai):
    kwargs = dict(model="smollm2-135m", messages=[{"role": "user", "content": "Name a fruit."}], max_tokens=6,
                  temperature=0)
    full = oai.chat.completions.create(**kwargs)
    stream = oai.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    pieces, usage, reasons = [], None, []
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    assert "".join(pieces) == full.choices[0].message.content
    assert reasons == [full.choices[0].finish_reason]
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens


def test_completions_n_and_logprobs(oai):
    res = oai.completions.create(model="smollm2-135m", prompt="Once upon a time", max_tokens=4, n=2,
                                 temperature=1.0, seed=3, logprobs=2, extra_body={"ignore_eos": True})
    assert len(res.choices) == 2 and [c.index for c in res.choices] == [0, 1]
    for c in res.choices:
        assert len(c.logprobs.tokens) == 4 and len(c.logprobs.token_logprobs) == 4
        assert all(len(top) <= 2 for top in c.logprobs.top_logprobs)
        assert "".join(c.logprobs.tokens) == c.text
    assert res.choices[0].text != res.choices[1].text
    assert res.usage.completion_tokens == 8
    again = oai.completions.create(model="smollm2-135m", prompt="Once upon a time", max_tokens=4, n=2,
                                   temperature=1.0, seed=3, extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in res.choices]  # seeded


def test_completions_echo_with_logprobs_scores_the_prompt(oai, http):
    """Evaluation harnesses score a text with echo, logprobs and max_tokens 0: the prompt's tokens and logprobs
    (the first has none), equal to /generate's prompt logprobs; with new tokens they follow the prompt's."""
    prompt = "The capital of France is Paris"
    native = http.post("/generate", json={"text": prompt, "sampling_params": {**GREEDY, "max_new_tokens": 2},
                                          "return_logprob": True, "logprob_start_len": 0}).json()
    want = native["meta_info"]["input_token_logprobs"]
    scored = oai.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    choice = scored.choices[0]
    assert choice.text == prompt and "".join(choice.logprobs.tokens) == prompt
    assert choice.logprobs.token_logprobs[0] is None and len(choice.logprobs.token_logprobs) == len(want)
    for got, (logprob, _, _) in zip(choice.logprobs.token_logprobs[1:], want[1:]):
        assert got == pytest.approx(logprob, abs=1e-4)
    assert choice.logprobs.text_offset[:2] == [0, len(choice.logprobs.tokens[0])]
    more = oai.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=2, echo=True, logprobs=1,
                                  temperature=0)
    c = more.choices[0]
    assert c.text == prompt + native["text"] and "".join(c.logprobs.tokens) == c.text
    assert len(c.logprobs.token_logprobs) == len(want) + 2 and all(len(t) <= 1 for t in c.logprobs.top_logprobs[1:])
    streamed = oai.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=2, echo=True, logprobs=1,
                                      temperature=0, stream=True)
    tokens = [t for chunk in streamed for ch in chunk.choices if ch.logprobs for t in ch.logprobs.tokens]
    assert tokens == c.logprobs.tokens


def test_chat_logprobs(oai):
    res = oai.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "Hi"}],
                                      max_tokens=4, temperature=0, logprobs=True, top_logprobs=3)
    content = res.choices[0].logprobs.content
    assert len(content) == res.usage.completion_tokens
    assert all(len(c.top_logprobs) == 3 for c in content)
    assert content[0].logprob == pytest.approx(content[0].top_logprobs[0].logprob, abs=1e-5)  # greedy = top-1


def test_cached_tokens_on_repeated_prompt(oai):
    system = "You are a helpful assistant who answers questions about geography in one short sentence. " * 4
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Capital of Spain?"}]
    first = oai.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=2, temperature=0)
    second = oai.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=2, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens >= 64
    assert second.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens_details.cached_tokens


# ----- aborts and accounting ----------------------------------------------------------------------------


def test_disconnect_aborts_and_releases_pages(http, server):
    aborted_before = metric(http, "sglang:num_aborted_requests_total")
    body = {"text": "Tell me a very long story.", "sampling_params": {"max_new_tokens": 400, "ignore_eos": True},
            "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as client:
        with client.stream("POST", "/generate", json=body) as r:
            seen = 0
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    seen += 1
                    if seen == 2:
                        break
    info = wait_idle(http)
    stats = info["stats"]
    assert stats["pages_private"] == 0 and stats["pages_protected"] == 0
    assert stats["pages_free"] + stats["pages_evictable"] == stats["pages_total"]
    assert metric(http, "radixrt_pages_held") == 0
    assert metric(http, "sglang:num_aborted_requests_total") == aborted_before + 1


def metric(http, name: str) -> float:
    samples = parse_prometheus(http.get("/metrics").text)
    assert name in samples, f"{name} not in /metrics"
    return samples[name]


def test_metrics_and_flush_cache(http):
    text = http.get("/metrics").text
    for name in ("sglang:num_requests_total", "sglang:generation_tokens_total", "sglang:cache_hit_rate",
                 "radixrt_pages_used", "radixrt_pages_free", "sglang:num_queue_reqs",
                 "radixrt_step_latency_seconds_bucket", "sglang:time_to_first_token_seconds_count",
                 "sglang:inter_token_latency_seconds_sum", "radixrt_retractions_total",
                 "radixrt_preemptions_total", "radixrt_long_rope_restarts_total"):
        assert name in text, name
    assert metric(http, "sglang:generation_tokens_total") > 0
    wait_idle(http)
    res = http.post("/flush_cache")
    assert res.status_code == 200, res.text
    stats = server_info(http)["stats"]
    assert stats["pages_free"] == stats["pages_total"]


def test_abort_request_endpoint(http, server):
    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            body = {"text": "Count to one hundred:", "rid": "abort-me",
                    "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}}
            task = asyncio.create_task(client.post("/generate", json=body))
            for _ in range(200):
                await asyncio.sleep(0.1)
                if (await client.get("/get_server_info")).json()["requests_in_flight"]:
                    break
            res = await client.post("/abort_request", json={"rid": "abort-me"})
            assert res.json()["aborted"] == 1
            return (await task).json()

    out = asyncio.run(run())
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(out["output_ids"]) < 300
    wait_idle(http)


# ----- bad input ----------------------------------------------------------------------------------------

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]

BAD = [
    ("generate: malformed JSON", "/generate", b'{"text": "hi",', 400),
    ("chat: malformed JSON", CHAT, b'{"messages": [', 400),
    ("empty body", "/generate", b"", 400),
    ("body is not an object", "/generate", [1, 2], 400),
    ("unknown top-level field", "/generate", {"text": "hi", "sampling_parms": {}}, 400),
    ("unknown sampling field", "/generate", {"text": "hi", "sampling_params": {"max_new_tokenz": 4}}, 400),
    ("mistyped sampling field", "/generate", {"text": "hi", "sampling_params": {"temperature": "hot"}}, 400),
    ("negative temperature", "/generate", {"text": "hi", "sampling_params": {"temperature": -1}}, 400),
    ("top_p zero", "/generate", {"text": "hi", "sampling_params": {"top_p": 0}}, 400),
    ("absurd max_new_tokens", "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 10**7}}, 400),
    ("empty prompt", "/generate", {"text": "", "sampling_params": {"max_new_tokens": 2}}, 400),
    ("token id outside the vocabulary", "/generate", {"input_ids": [10**9]}, 400),
    ("text and input_ids", "/generate", {"text": "hi", "input_ids": [1, 2]}, 400),
    ("stream with a batch", "/generate", {"text": ["a", "b"], "stream": True}, 400),
    ("unknown model", CHAT, {"model": "gpt-9", "messages": MSG}, 404),
    ("empty messages", CHAT, {"messages": []}, 400),
    ("bad role", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400),
    ("n zero", CHAT, {"messages": MSG, "n": 0}, 400),
    ("negative max_tokens", CHAT, {"messages": MSG, "max_tokens": -5}, 400),
    ("max_tokens beyond the context", CHAT, {"messages": MSG, "max_tokens": 10**6}, 400),
    ("top_logprobs too large", CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 50}, 400),
    ("unknown chat field", CHAT, {"messages": MSG, "frobnicate": True}, 400),
    ("mistyped chat field", CHAT, {"messages": MSG, "temperature": "warm"}, 400),
    ("completions: empty prompt", "/v1/completions", {"prompt": ""}, 400),
    ("completions: penalty out of range", "/v1/completions", {"prompt": "hi", "frequency_penalty": 5}, 400),
    ("completions: stop is a number", "/v1/completions", {"prompt": "hi", "stop": 5}, 400),
    ("stream_options without stream", "/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}},
     400),
    ("abort without rid", "/abort_request", {}, 400),
]


@pytest.mark.parametrize("name,path,body,status", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_4xx(http, name, path, body, status):
    if isinstance(body, bytes):
        res = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        res = http.post(path, json=body)
    assert res.status_code == status, res.text
    error = res.json()["error"]
    assert error["message"] and error["code"] == status


def test_context_overflow_and_engine_messages(http, engine):
    ctx = http.get("/get_model_info").json()["context_length"]
    res = http.post("/generate", json={"input_ids": [1] * (ctx + 1), "sampling_params": {"max_new_tokens": 1}})
    assert res.status_code == 400 and "context length" in res.json()["error"]["message"]
    for params in ({"temperature": -1}, {"max_new_tokens": 10**7}, {"top_k": 0}):
        res = http.post("/generate", json={"text": "hi", "sampling_params": params})
        with pytest.raises(ValueError) as exc:
            engine.generate("hi", params)
        assert res.status_code == 400 and res.json()["error"]["message"] == str(exc.value)


def test_still_serving_after_bad_input(http, oai):
    assert http.get("/health").status_code == 200
    res = http.post("/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 2}})
    assert res.status_code == 200 and res.json()["meta_info"]["completion_tokens"] >= 1
    chat = oai.chat.completions.create(model="smollm2-135m", messages=MSG, max_tokens=2)
    assert chat.choices[0].finish_reason in ("stop", "length")


# ----- a short load: 40 requests from 8 concurrent clients -----------------------------------------------


def test_short_load(http, server):
    from radixrt.bench.load_test import run_load

    report = run_load(server.url, num_requests=40, concurrency=8, max_input=32, max_output=6, seed=1)
    assert report["failed"] == 0, report
    assert report["completed"] == 40
    assert http.get("/health").status_code == 200
    wait_idle(http)


# ----- shutdown (last: it stops the module's server) ----------------------------------------------------


def test_sigterm_shuts_down_cleanly(http, server):
    info = server_info(http)
    pids = [info["pids"]["scheduler"], info["pids"]["detokenizer"]]
    started = time.monotonic()
    code = server.stop(signal.SIGTERM, timeout=30)
    assert code == 0, server.output[-3000:]
    assert time.monotonic() - started < 15
    for pid in pids:
        assert not alive(pid), f"process {pid} outlived the server"
    assert not os.path.exists(info["ipc_dir"])


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
