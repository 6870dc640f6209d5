"""Sessions (SGLang's /open_session, /close_session, session_params): a session's context stays pinned in the
radix cache, so its next turn is served from the cache under memory pressure; rid continuation, offset,
drop_previous_output; caps, LRU unpinning, timeouts; pins never starve a request; page accounting back to idle.

Most tests drive the scheduler directly on a tiny random Llama (no tokenizer, a few ms a step); the Engine, HTTP
and DSL tests use the default model."""

from __future__ import annotations

import time

import pytest

from radixrt.protocol.messages import BatchTokenOut, GenerateReq, SessionParams
from radixrt.sampling.params import SamplingParams
from radixrt.server_args import ServerArgs
from tiny_models import save_tiny_model

P = 4  # page size


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    save_tiny_model("llama", folder)
    return folder


class Harness:
    """A scheduler over the tiny model with a sink that collects each request's outputs."""

    def __init__(self, folder, num_pages: int, **args) -> None:
        from radixrt.model.runner import ModelRunner
        from radixrt.scheduler.scheduler import Scheduler

        self.out: dict[str, dict] = {}
        runner = ModelRunner(folder, dtype="float32", page_size=P, num_pages=num_pages)
        self.sched = Scheduler(ServerArgs(log_interval=0, page_size=P, debug_checks=True, **args), runner, None,
                               {0}, self._sink)
        self._n = 0

    def _sink(self, batch: BatchTokenOut) -> None:
        for d in batch.deltas:
            e = self.out.setdefault(d.rid, {"ids": [], "finish": None})
            e["ids"] += d.new_ids
            e["finish"] = d.finish_reason or e["finish"]
            e["prompt_tokens"], e["cached_tokens"] = d.prompt_tokens, d.cached_tokens

    def submit(self, ids, max_new=6, session=None, rid=None, **sp) -> str:
        self._n += 1
        rid = rid or f"r{self._n}"
        params = SamplingParams(max_new_tokens=max_new, temperature=0, ignore_eos=True, **sp)
        self.sched.submit(GenerateReq(rid, list(ids), params, session=session))
        return rid

    def run(self) -> None:
        for _ in range(10_000):
            if not self.sched.step() and self.sched.idle:
                return
        raise AssertionError("the scheduler did not go idle")

    def gen(self, ids, max_new=6, session=None, **sp) -> dict:
        rid = self.submit(ids, max_new, session, **sp)
        self.run()
        return {**self.out[rid], "rid": rid}

    def assert_idle_pages(self) -> None:
        """Every page is free or evictable cache: nothing pinned, held or private."""
        s = self.sched
        s.check()
        assert s.cache.protected_pages == 0
        assert s.pool.num_free + s.cache.evictable_pages == s.pool.num_pages


def prompt(seed: int, n: int) -> list[int]:
    return [1 + (seed * 37 + i * 11) % 120 for i in range(n)]


def sid(session_id: str, **kw) -> SessionParams:
    return SessionParams(id=session_id, **kw)


# ----- the pin under memory pressure ------------------------------------------------------------------------

def _conversation(h: Harness, session_id: str | None) -> tuple[dict, dict]:
    """Turn 1 (31 prompt tokens + 6 outputs: a 37-token context, 36 of them computed = 9 whole pages), three
    unrelated requests that need the room, then turn 2 = the whole context + 3 new tokens."""
    first_prompt = prompt(1, 31)
    params = sid(session_id) if session_id else None
    first = h.gen(first_prompt, 6, params)
    for k in range(3):  # 41 + 4 tokens each: 12 pages of a 24-page pool, one after the other
        h.gen(prompt(100 + k, 41), 4)
    second = h.gen(first_prompt + first["ids"] + [7, 8, 9], 4, params)
    return first, second


def test_without_a_session_the_next_turn_is_evicted(tiny_llama):
    h = Harness(tiny_llama, num_pages=24)
    _, second = _conversation(h, None)
    assert second["cached_tokens"] < 36
    h.assert_idle_pages()


def test_a_session_keeps_its_context_pinned_under_pressure_and_close_frees_it(tiny_llama):
    h = Harness(tiny_llama, num_pages=24)
    session_id = h.sched.open_session()
    first, second = _conversation(h, session_id)
    context = 31 + len(first["ids"])
    assert second["cached_tokens"] == context // P * P == 36  # the whole page-aligned context, from the cache
    stats = h.sched.stats()
    assert stats.sessions_open == 1 and stats.pages_pinned == (context + 3 + 4 - 1) // P  # now turn 2's context
    assert h.sched.cache.protected_pages == stats.pages_pinned
    assert h.sched.close_session(session_id) and not h.sched.close_session(session_id)
    assert h.sched.stats().sessions_open == 0 and h.sched.stats().pages_pinned == 0
    h.assert_idle_pages()
    assert h.sched.flush_cache()
    assert h.sched.pool.num_free == h.sched.pool.num_pages


# ----- rid continuation ------------------------------------------------------------------------------------

def test_rid_continuation_offset_and_drop_previous_output_build_the_prompt(tiny_llama):
    h = Harness(tiny_llama, num_pages=64)
    s = h.sched.open_session(session_id="chat")
    assert s == "chat"
    first = h.gen(prompt(2, 13), 5, sid(s))
    new = [5, 6, 7]
    context = prompt(2, 13) + first["ids"]
    cases = [
        (sid(s, rid=first["rid"]), context + new),
        (sid(s, rid=first["rid"], offset=10), context[:10] + new),
        (sid(s, rid=first["rid"], drop_previous_output=True), prompt(2, 13) + new),
        (sid(s, rid=first["rid"], replace=True), context + new),  # accepted, changes nothing
    ]
    for params, explicit in cases:
        cont = h.gen(new, 5, params)
        alone = h.gen(explicit, 5)
        assert cont["finish"].type == "length"
        assert cont["prompt_tokens"] == len(explicit)
        assert cont["ids"] == alone["ids"]
    # a continuation of a continuation
    second = h.gen(new, 5, sid(s, rid=first["rid"]))
    third = h.gen([9], 3, sid(s, rid=second["rid"]))
    assert third["ids"] == h.gen(context + new + second["ids"] + [9], 3)["ids"]
    # an appended turn that starts with BOS loses it, as in SGLang
    h.sched.sessions.bos_token_id = 1
    with_bos = h.gen([1] + new, 5, sid(s, rid=first["rid"]))
    assert with_bos["prompt_tokens"] == len(context + new)
    assert with_bos["ids"] == h.gen(context + new, 5)["ids"]
    h.sched.close_session(s)
    h.assert_idle_pages()


def test_unknown_session_or_rid_is_that_requests_4xx(tiny_llama):
    h = Harness(tiny_llama, num_pages=32)
    bad = h.gen([1, 2, 3], 3, sid("nope"))
    assert bad["finish"].type == "abort" and bad["finish"].status_code == 404  # a session that is not there
    assert "unknown session" in bad["finish"].message
    s = h.sched.open_session(capacity_of_str_len=20)
    bad_rid = h.gen([1, 2, 3], 3, sid(s, rid="never"))
    assert bad_rid["finish"].status_code == 400 and "never" in bad_rid["finish"].message
    too_long = h.gen(prompt(3, 21), 3, sid(s))
    assert too_long["finish"].status_code == 400 and "capacity_of_str_len" in too_long["finish"].message
    with pytest.raises(ValueError, match="already open"):
        h.sched.open_session(session_id=s)
    with pytest.raises(ValueError, match="capacity_of_str_len"):
        h.sched.open_session(capacity_of_str_len=0)
    ok = h.gen([1, 2, 3], 3, sid(s))  # the runtime keeps serving
    assert ok["finish"].type == "length" and len(ok["ids"]) == 3
    h.sched.close_session(s)
    closed = h.gen([1, 2, 3], 3, sid(s))
    assert closed["finish"].status_code == 404
    h.assert_idle_pages()


def test_closing_a_session_with_a_request_in_flight(tiny_llama):
    h = Harness(tiny_llama, num_pages=32)
    s = h.sched.open_session()
    rid = h.submit(prompt(4, 9), 8, sid(s))
    h.sched.step()
    h.sched.step()
    assert h.sched.close_session(s)
    assert h.sched.open_session(session_id=s) == s  # the same id again: a new session
    h.run()
    assert h.out[rid]["finish"].type == "length" and len(h.out[rid]["ids"]) == 8
    assert h.sched.stats().pages_pinned == 0  # the old session's request pins nothing in the new one
    assert h.sched.sessions.table[s].in_flight == 0 and not h.sched.sessions.table[s].records
    h.sched.close_session(s)
    h.assert_idle_pages()


# ----- bounds ----------------------------------------------------------------------------------------------

def test_per_session_cap_pins_only_the_first_pages(tiny_llama):
    h = Harness(tiny_llama, num_pages=32, session_max_pages=3)
    s = h.sched.open_session()
    h.gen(prompt(5, 20), 4, sid(s))
    assert h.sched.stats().pages_pinned == 3 == h.sched.cache.protected_pages
    h.sched.close_session(s)
    h2 = Harness(tiny_llama, num_pages=32, session_max_pages=0)
    s2 = h2.sched.open_session()
    h2.gen(prompt(5, 20), 4, sid(s2))
    assert h2.sched.stats().pages_pinned == 0 and h2.sched.cache.protected_pages == 0
    h.assert_idle_pages()


def test_total_cap_unpins_the_least_recently_used_session(tiny_llama):
    h = Harness(tiny_llama, num_pages=48, sessions_max_pages=8)
    a, b = h.sched.open_session(), h.sched.open_session()
    h.gen(prompt(6, 18), 4, sid(a))  # 21 computed tokens: 5 pages
    assert h.sched.sessions.table[a].pinned == 5
    h.gen(prompt(7, 18), 4, sid(b))
    table = h.sched.sessions.table
    assert table[a].node is None and table[b].pinned == 5  # a, the older, lost its pin; it stays open
    assert h.sched.stats().sessions_open == 2 and h.sched.stats().pages_pinned == 5
    assert h.gen(prompt(6, 18) + [1], 2, sid(a))["finish"].type == "length"  # a still serves
    assert table[b].node is None and table[a].pinned == 5
    h.sched.close_session(a)
    h.sched.close_session(b)
    h.assert_idle_pages()


def test_idle_sessions_time_out(tiny_llama):
    h = Harness(tiny_llama, num_pages=32, session_timeout=0.05)
    s = h.sched.open_session()
    h.gen(prompt(8, 10), 3, sid(s))
    assert h.sched.stats().pages_pinned > 0
    time.sleep(0.12)
    h.sched.step()
    assert h.sched.stats().sessions_open == 0 and h.sched.stats().pages_pinned == 0
    assert h.gen([1, 2], 2, sid(s))["finish"].status_code == 404
    h.assert_idle_pages()


@pytest.mark.parametrize("alone", [True, False])
def test_pins_never_starve_a_request(tiny_llama, alone):
    """A 20-page pool; two sessions pin 16 pages; a request needing 12 pages is still served (pins released)."""
    h = Harness(tiny_llama, num_pages=20)
    a, b = h.sched.open_session(), h.sched.open_session()
    h.gen(prompt(9, 30), 3, sid(a))  # 32 computed: 8 pages
    h.gen(prompt(10, 30), 3, sid(b))
    assert h.sched.stats().pages_pinned == 16
    if not alone:  # a small request runs while the large one arrives: admission must unpin, not wait
        small = h.submit([3, 4, 5], 30)
    big = h.submit(prompt(11, 40), 8)
    h.run()
    assert h.out[big]["finish"].type == "length" and len(h.out[big]["ids"]) == 8
    if not alone:
        assert len(h.out[small]["ids"]) == 30
    assert h.sched.stats().pages_pinned < 16
    h.sched.close_session(a)
    h.sched.close_session(b)
    h.assert_idle_pages()


def test_flush_releases_pins_and_sessions_stay_open(tiny_llama):
    h = Harness(tiny_llama, num_pages=32)
    s = h.sched.open_session()
    h.gen(prompt(12, 10), 3, sid(s))
    assert h.sched.flush_cache()
    assert h.sched.pool.num_free == h.sched.pool.num_pages and h.sched.stats().sessions_open == 1
    assert h.gen(prompt(12, 10), 3, sid(s))["finish"].type == "length"
    h.sched.close_session(s)
    h.assert_idle_pages()


# ----- the Engine, the DSL, the HTTP routes (the default model) ----------------------------------------------

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(default_model_path):
    import radixrt

    with radixrt.Engine(dtype="float32", log_interval=0, debug_checks=True, kv_memory_gb=0.05) as eng:
        yield eng


def _idle(stats: dict) -> bool:
    return (stats["sessions_open"] == 0 and stats["pages_pinned"] == 0 and stats["pages_protected"] == 0
            and stats["pages_private"] == 0 and stats["pages_free"] + stats["pages_evictable"] == stats["pages_total"])


def test_engine_open_generate_continue_close(engine):
    session_id = engine.open_session(capacity_of_str_len=4096)
    assert engine.open_session(session_id="mine") == "mine"
    with pytest.raises(ValueError, match="already open"):
        engine.open_session(session_id="mine")
    first_prompt = "Question: what is the capital of France? Answer:"
    first = engine.generate(first_prompt, GREEDY, session_params={"id": session_id})
    follow = engine.tokenizer.encode(" And the capital of Italy? Answer:", add_special_tokens=False)
    cont = engine.generate(input_ids=follow, sampling_params=GREEDY,
                           session_params={"id": session_id, "rid": first["meta_info"]["id"]})
    context = engine.tokenizer.encode(first_prompt) + first["output_ids"]
    explicit = engine.generate(input_ids=context + follow, sampling_params=GREEDY)
    assert cont["output_ids"] == explicit["output_ids"]
    assert cont["meta_info"]["prompt_tokens"] == len(context) + len(follow)
    page = engine.get_model_info()["page_size"]
    assert cont["meta_info"]["cached_tokens"] >= (len(context) - 1) // page * page
    with pytest.raises(ValueError, match="unknown session"):
        engine.generate("hi", GREEDY, session_params={"id": "nope"})
    with pytest.raises(ValueError, match="session_params"):
        engine.generate("hi", GREEDY, session_params={"rid": "x"})  # no id
    assert engine.get_stats()["sessions_open"] == 2 and engine.get_stats()["pages_pinned"] > 0
    engine.close_session(session_id)
    engine.close_session("mine")
    engine.close_session("mine")  # closing an unknown session does nothing, as in SGLang
    assert engine.generate("hi", GREEDY)["meta_info"]["completion_tokens"] == 8  # still serving
    assert _idle(engine.get_stats())
    assert engine.flush_cache()


def _chat_program():
    import radixrt as sgl

    @sgl.function
    def chat(s, topic):
        s += "Let us talk about " + topic + ".\nQ: Name one fact.\nA:"
        s += sgl.gen("fact", max_tokens=8, stop="\n")
        s += "\nQ: Name another.\nA:"
        s += sgl.gen("another", max_tokens=8, stop="\n")
        return s["another"]

    return chat


def test_dsl_sessions_same_output_and_closed_afterwards(engine, monkeypatch):
    import radixrt as sgl

    opened, closed = [], []
    real_open, real_close = engine.open_session, engine.close_session
    monkeypatch.setattr(engine, "open_session", lambda *a, **k: opened.append(real_open(*a, **k)) or opened[-1])
    monkeypatch.setattr(engine, "close_session", lambda sid: closed.append(sid) or real_close(sid))
    chat = _chat_program()
    plain = sgl.EngineBackend(engine)
    with_sessions = sgl.EngineBackend(engine, use_sessions=True)
    want = chat.run(topic="Paris", backend=plain, temperature=0)
    got = chat.run(topic="Paris", backend=with_sessions, temperature=0)
    assert got.text() == want.text() and got.error() is None
    assert with_sessions.wait_sessions_closed(timeout=30)
    assert len(opened) == 1 and closed == opened  # one session for the state, closed when it ended
    assert got.get_meta_info("another")["cached_tokens"] > 0
    # a batch, and a view of a backend, and a program that fails: every session is closed
    view = plain.with_sessions()
    states = chat.run_batch([{"topic": "Rome"}, {"topic": "Oslo"}], backend=view, temperature=0)
    assert all(st.error() is None for st in states)

    @sgl.function
    def broken(s):
        s += "Hello" + sgl.gen("x", max_tokens=2)
        assert s["x"] is not None  # waits for the model: the session is open
        raise RuntimeError("the program fails")

    with pytest.raises(RuntimeError, match="the program fails"):
        broken.run(backend=view)
    assert view.wait_sessions_closed(timeout=30)
    assert len(opened) == 4 and sorted(closed) == sorted(opened)
    assert _idle(engine.get_stats())
    assert not plain.use_sessions and plain.open_sessions == 0


def test_http_session_routes(default_model_path):
    import httpx

    import radixrt as sgl
    from radixrt.server.server_process import ServerProcess

    with ServerProcess(["--dtype", "float32", "--kv-memory-gb", "0.05", "--log-interval", "0",
                        "--debug-checks"]) as server, httpx.Client(base_url=server.url, timeout=120) as http:
        res = http.post("/open_session", json={"capacity_of_str_len": 1000})
        assert res.status_code == 200, res.text
        session_id = res.json()
        assert isinstance(session_id, str) and session_id
        assert http.post("/open_session", json={"capacity_of_str_len": 1000, "session_id": "s1"}).json() == "s1"
        dup = http.post("/open_session", json={"capacity_of_str_len": 1000, "session_id": "s1"})
        assert dup.status_code == 409 and "already open" in dup.text  # a clash with the server's state
        assert http.post("/open_session", json={"capacity_of_str_len": 0}).status_code == 400
        assert http.post("/open_session", json={"bogus": 1}).status_code == 400
        unknown = http.post("/generate", json={"text": "Hi", "sampling_params": GREEDY,
                                               "session_params": {"id": "nope"}})
        assert unknown.status_code == 404 and "unknown session" in unknown.text  # names what is not there
        first = http.post("/generate", json={"text": "Once upon a time", "sampling_params": GREEDY,
                                             "session_params": {"id": session_id}})
        assert first.status_code == 200, first.text
        cont = http.post("/generate", json={"input_ids": [13], "sampling_params": GREEDY, "session_params": {
            "id": session_id, "rid": first.json()["meta_info"]["id"]}})
        assert cont.status_code == 200, cont.text
        assert cont.json()["meta_info"]["prompt_tokens"] == first.json()["meta_info"]["prompt_tokens"] + 9
        metrics = http.get("/metrics").text
        samples = {line.split("{")[0]: line.split()[-1] for line in metrics.splitlines() if not line.startswith("#")}
        assert samples["radixrt_sessions_open"] == "2" and "radixrt_pages_pinned" in samples
        assert http.post("/close_session", json={"session_id": session_id}).status_code == 200
        assert http.post("/close_session", json={"session_id": "s1"}).status_code == 200
        assert http.post("/close_session", json={"session_id": "s1"}).status_code == 200  # unknown: as SGLang
        assert http.post("/close_session", json={}).status_code == 400
        after = http.post("/generate", json={"text": "Hi", "sampling_params": GREEDY,
                                             "session_params": {"id": session_id}})
        assert after.status_code == 404
        paths = http.get("/openapi.json").json()["paths"]
        assert "/open_session" in paths and "/close_session" in paths
        # the DSL over HTTP: same output with sessions, and the session closed afterwards

        @sgl.function
        def hello(s):
            s += "Hello, my name is" + sgl.gen("name", max_tokens=4)

        plain = sgl.RuntimeEndpoint(server.url)
        with_sessions = plain.with_sessions()
        opened = []
        real_open = with_sessions._open_session
        with_sessions._open_session = lambda: opened.append(real_open()) or opened[-1]
        want = hello.run(backend=plain, temperature=0)
        got = hello.run(backend=with_sessions, temperature=0)
        assert got.text() == want.text() and got.error() is None
        assert with_sessions.wait_sessions_closed(timeout=60) and len(opened) == 1
        stats = http.get("/get_server_info").json()["stats"]
        assert _idle(stats)
        plain.shutdown()


def test_openai_chat_agent_keeps_its_conversation_in_a_session(default_model_path):
    """An agent on the official openai client passes SGLang's ``session_params`` (extra_body) and resends the
    whole conversation each turn. Between its turns other requests fill the pool: without a session its turn 2
    is computed again; with one, turn 2 reads turn 1's whole pages from the cache. Closing frees the pin."""
    import httpx
    import openai

    from radixrt.server.server_process import ServerProcess

    with ServerProcess(["--dtype", "float32", "--kv-memory-gb", "0.05", "--log-interval", "0",
                        "--debug-checks"]) as server, httpx.Client(base_url=server.url, timeout=120) as http:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        pages = http.get("/get_server_info").json()["stats"]["pages_total"]
        page_size = 16

        def conversation(session: dict | None, topic: str) -> tuple[int, int]:
            extra = {"session_params": session} if session else None
            messages = [{"role": "system", "content": f"You are an expert on {topic}. " * 12},
                        {"role": "user", "content": f"Tell me one fact about {topic}."}]
            first = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0,
                                                   extra_body=extra)
            for k in range(3):  # unrelated prompts that need most of the pool, one after the other
                filler = [100 + (k * 131 + i * 7) % 9000 for i in range(pages * page_size // 2)]
                res = http.post("/generate", json={"input_ids": filler, "sampling_params": {"max_new_tokens": 1}})
                assert res.status_code == 200, res.text
            messages += [{"role": "assistant", "content": first.choices[0].message.content},
                         {"role": "user", "content": "And another one?"}]
            second = client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0,
                                                    extra_body=extra)
            return first.usage.prompt_tokens, second.usage.prompt_tokens_details.cached_tokens

        prompt, cached = conversation(None, "volcanoes")
        assert cached < prompt // page_size * page_size  # evicted
        session_id = http.post("/open_session", json={}).json()
        prompt, cached = conversation({"id": session_id}, "glaciers")
        assert cached >= prompt // page_size * page_size  # turn 1's prompt and more, from the pinned pages
        assert http.get("/get_server_info").json()["stats"]["pages_pinned"] > 0
        unknown = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                          "max_tokens": 2, "session_params": {"id": "nope"}})
        assert unknown.status_code == 404 and "unknown session" in unknown.text
        completion = http.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 2,
                                                        "session_params": {"id": session_id}})
        assert completion.status_code == 200, completion.text
        assert http.post("/close_session", json={"session_id": session_id}).status_code == 200
        assert _idle(http.get("/get_server_info").json()["stats"])


# ----- with speculative decoding ------------------------------------------------------------------------------

def test_speculative_decoding_keeps_a_sessions_tokens_and_its_pin(tiny_llama):
    """With ``--speculative-algorithm NGRAM`` a session's turns (a continuation by rid, memory pressure between
    them) give the tokens they give without it; drafts are verified on the way, the pin still serves the next
    turn from the cache, and closing the session returns every page."""
    runs = []
    for extra in ({}, {"speculative_algorithm": "NGRAM"}):
        h = Harness(tiny_llama, num_pages=32, **extra)
        s = h.sched.open_session()
        first = h.gen(prompt(3, 12) * 3, 16, sid(s))  # a text that repeats itself: something to draft from
        for k in range(3):  # 41 + 4 tokens each: 12 pages, which the 13 pinned ones must not give up
            h.gen(prompt(100 + k, 41), 4)
        second = h.gen([7, 8, 9], 16, sid(s, rid=first["rid"]))
        assert second["cached_tokens"] == (36 + 16 - 1) // P * P  # the first turn's computed context, cached
        third = h.gen(prompt(3, 12), 16, sid(s, rid=second["rid"]))
        runs.append([first["ids"], second["ids"], third["ids"]])
        assert h.sched.close_session(s)
        h.assert_idle_pages()
        if extra:
            spec = h.sched.speculator
            assert spec.verify_steps > 0 and spec.accepted > 0, (spec.drafted, spec.accepted)
    assert runs[1] == runs[0]
