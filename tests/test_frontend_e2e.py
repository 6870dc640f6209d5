"""The SGLang-style program set end to end on the default model: through the in-process engine
(EngineBackend) and through RuntimeEndpoint against a real `radixrt serve` subprocess; plus the
run_batch prefix check (64 few-shot programs over a ~1,000-token header compute the header once).

Both runtimes use float32 and greedy decoding, so the two transports must give the same text."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import tempfile
import time

import pytest

import radixrt as sgl

pytestmark = [pytest.mark.model, pytest.mark.slow]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def engine(default_model_path):
    eng = sgl.Engine(dtype="float32")
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(default_model_path):
    """One `radixrt serve` for the module, on a free loopback port; ready when /health says so."""
    import httpx

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "radixrt.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
         "--dtype", "float32"],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                log.seek(0)
                pytest.fail(f"radixrt serve exited with {proc.returncode}:\n{log.read()[-4000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("radixrt serve did not become healthy in 300 s")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture(scope="module", params=["engine", "http"])
def backend(request, engine):
    if request.param == "engine":
        yield sgl.EngineBackend(engine)
    else:
        endpoint = sgl.RuntimeEndpoint(request.getfixturevalue("server"), timeout=300)
        yield endpoint
        endpoint.shutdown()


# ----- the programs ------------------------------------------------------------------------------------


@sgl.function
def few_shot_qa(s, question):
    s += "The following are questions with answers.\n\n"
    s += "Q: What is the capital of France?\nA: Paris\n\n"
    s += "Q: What is the capital of Germany?\nA: Berlin\n\n"
    s += "Q: What is the capital of Italy?\nA: Rome\n\n"
    s += "Q: " + question + "\n"
    s += "A:" + sgl.gen("answer", max_tokens=6, stop="\n")


@sgl.function
def multi_turn(s, q1, q2):
    s += sgl.system("You are a helpful assistant. Answer in one short sentence.")
    s += sgl.user(q1)
    s += sgl.assistant(sgl.gen("a1", max_tokens=10, stop="\n"))
    s += sgl.user(q2)
    s += sgl.assistant(sgl.gen("a2", max_tokens=10, stop="\n"))


@sgl.function
def select_capital(s):
    s += "The capital of France is" + sgl.select("city", [" Paris", " London", " Berlin"])
    s += "\nQ: Is Paris in France? Answer yes or no.\nA: " + sgl.select("yn", ["yes", "no"])


IPV4 = r"((25[0-5]|2[0-4]\d|[01]?\d\d?)\.){3}(25[0-5]|2[0-4]\d|[01]?\d\d?)"


@sgl.function
def regex_gen(s):
    s += "Q: What is the IP address of the Google DNS servers?\nA: "
    s += sgl.gen("ip", max_tokens=16, regex=IPV4)
    s += "\nQ: How old is a typical college student?\nA: " + sgl.gen_int("age", max_tokens=4)


@sgl.function
def parallel_tips(s, topic):
    s += sgl.system("You are a helpful assistant. Answer in one short sentence.")
    s += sgl.user(f"I want advice about {topic}.")
    s += sgl.assistant("Sure. What would you like to know?")
    forks = s.fork(2)
    forks += [sgl.user(f"Give me one tip about {x}.") + sgl.assistant(sgl.gen("tip", max_tokens=10, stop="\n"))
              for x in ("sleep", "food")]
    forks.join()
    return forks


def _ok(state):
    assert state.error() is None, repr(state.error())
    return state


# ----- both transports ----------------------------------------------------------------------------------


def test_few_shot_qa_and_run_batch(backend, engine):
    questions = ["What is the capital of Spain?", "What is the capital of Japan?",
                 "What is the capital of Egypt?", "What is the capital of Russia?"]
    states = few_shot_qa.run_batch([{"question": q} for q in questions], backend=backend, temperature=0)
    answers = [_ok(s)["answer"].strip() for s in states]
    assert sum(w in a for w, a in zip(["Madrid", "Tokyo", "Cairo", "Moscow"], answers)) >= 3, answers
    # in input order; the header (hinted once by run_batch) served from the cache for each program
    assert [s.text().split("Q: ")[-1].split("\n")[0] for s in states] == questions
    assert all(s.get_meta_info("answer")["cached_tokens"] >= 48 for s in states)
    # both transports, same float32 greedy runtime: the same text
    single = few_shot_qa.run(question=questions[0], backend=sgl.EngineBackend(engine), temperature=0)
    assert single["answer"] == states[0]["answer"]


def test_multi_turn_chat_roles(backend):
    state = _ok(multi_turn.run(q1="What is the capital of France?", q2="And of Italy?", backend=backend,
                               temperature=0))
    messages = state.messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    assert messages[2]["content"] == state["a1"] and messages[4]["content"] == state["a2"]
    assert "Paris" in state["a1"] and "\n" not in state["a2"]
    assert state.text().startswith("<|im_start|>system\n")  # the served model's own template
    meta = state.get_meta_info("a2")
    assert meta["cached_tokens"] >= state.get_meta_info("a1")["prompt_tokens"] - 16


def test_select(backend):
    state = _ok(select_capital.run(backend=backend))
    assert state["city"] == " Paris" and state["yn"] in ("yes", "no")
    meta = state.get_meta_info("city")
    assert len(meta["normalized_prompt_logprobs"]) == 3
    assert max(meta["normalized_prompt_logprobs"]) == meta["normalized_prompt_logprobs"][0]


def test_regex_decoding(backend):
    state = _ok(regex_gen.run(backend=backend, temperature=0))
    assert re.fullmatch(IPV4, state["ip"]), state["ip"]
    assert re.fullmatch(r"-?\d+", state["age"]), state["age"]


def test_fork_parallel_decoding(backend, engine):
    state = _ok(parallel_tips.run(topic="staying healthy", backend=backend, temperature=0))
    tips = state["tip"]
    assert len(tips) == 2 and all(t.strip() for t in tips) and tips[0] != tips[1]
    parent_tokens = len(engine.tokenizer.encode(state.text()))
    page = engine.get_model_info()["page_size"]
    for fork in state.ret_value:  # the parent's text, prefilled once by fork(), served from the cache
        assert fork.get_meta_info("tip")["cached_tokens"] >= parent_tokens - page
    for fork, tip in zip(state.ret_value, tips):
        assert fork.messages()[-1] == {"role": "assistant", "content": tip}
    assert len(state.messages()) == 3  # the branches' turns stay in the branches


def test_streaming(backend):
    plain = _ok(multi_turn.run(q1="Name a color.", q2="Another one?", backend=backend, temperature=0))
    streamed = multi_turn.run(q1="Name a color.", q2="Another one?", backend=backend, temperature=0, stream=True)
    pieces = list(streamed.text_iter("a1"))
    assert len(pieces) > 1 and "".join(pieces) == plain["a1"]
    whole = list(streamed.text_iter())
    assert "".join(whole) == plain.text()
    assert _ok(streamed)["a2"] == plain["a2"]


# ----- the run_batch prefix check: 64 programs, a ~1,000-token header -----------------------------------

COUNTRIES = ["France", "Germany", "Italy", "Spain", "Japan", "Egypt", "Canada", "Brazil", "Kenya", "India",
             "Chile", "Norway", "Peru", "Greece", "Turkey", "Poland", "Cuba", "Iran", "Iraq", "Mexico"]
CAPITALS = ["Paris", "Berlin", "Rome", "Madrid", "Tokyo", "Cairo", "Ottawa", "Brasilia", "Nairobi", "New Delhi",
            "Santiago", "Oslo", "Lima", "Athens", "Ankara", "Warsaw", "Havana", "Tehran", "Baghdad", "Mexico City"]


def long_header(repeat: int = 3) -> str:
    lines = ["You answer questions about geography with one word.\n\n"]
    for r in range(repeat):
        for country, capital in zip(COUNTRIES, CAPITALS):
            lines.append(f"Question: What is the capital city of {country}?\nAnswer: {capital}\n\n")
    return "".join(lines)


def test_run_batch_64_programs_compute_the_header_once(engine):
    header = long_header()
    header_tokens = len(engine.tokenizer.encode(header))
    assert 900 <= header_tokens <= 1200, header_tokens

    @sgl.function
    def qa(s, question):
        s += header
        s += "Question: " + question + "\nAnswer:" + sgl.gen("answer", max_tokens=2, stop="\n")

    args = [{"question": f"What is the capital city of country number {i}?"} for i in range(64)]
    assert engine.flush_cache()
    before = engine.get_stats()
    states = qa.run_batch(args, backend=engine, temperature=0)
    after = engine.get_stats()
    metas = [_ok(s).get_meta_info("answer") for s in states]
    prompt = sum(m["prompt_tokens"] for m in metas)
    cached = sum(m["cached_tokens"] for m in metas)
    own = prompt - 64 * header_tokens  # the programs' own tokens (question, answer cue)
    # each program found the header in the cache (prefilled once by the run_batch hint), all but the last
    # page or two: cached_tokens counts whole pages, and the header's last token may merge with the question
    page = engine.get_model_info()["page_size"]
    assert all(m["cached_tokens"] >= header_tokens - 2 * page for m in metas), [m["cached_tokens"] for m in metas]
    ideal = 64 * header_tokens / prompt
    assert cached / prompt >= ideal - 0.01, (cached, prompt, ideal)
    # the engine computed the header once: what missed the cache is one header plus each program's own tokens
    missed = after["cache_miss_tokens"] - before["cache_miss_tokens"]
    assert missed <= header_tokens + own + 64 * page, (missed, header_tokens, own)
    assert missed < 2 * header_tokens
