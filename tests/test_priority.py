"""Request priorities (SGLang's ``priority``): admission takes the most urgent first and, within one priority, the
policy's order; memory pressure retracts the least urgent first; a request that finds no slot or pages preempts
running requests it outranks by more than the threshold (only when that makes room);
``--schedule-low-priority-values-first`` flips which end is urgent; bad values are refused (ValueError in
process, 400 over HTTP) and the runtime goes on.

The scheduler tests run a real Scheduler over the simulation's FakeRunner (no model, no tokenizer); the Engine
and server tests use the default model.
"""

from __future__ import annotations

import httpx
import pytest

from radixrt.bench.sim.fake_runner import FakeRunner
from radixrt.bench.sim.oracle import DeltaSink
from radixrt.protocol.messages import GenerateReq
from radixrt.sampling.params import SamplingParams
from radixrt.scheduler.policy import LPM_MAX_QUEUE, order_waiting
from radixrt.scheduler.request import Req
from radixrt.scheduler.scheduler import Scheduler
from radixrt.server_args import ServerArgs

VOCAB, EOS = 64, 1
WORDS = list(range(2, 60))
PAGE = 4


def make_scheduler(num_pages: int = 256, **options) -> tuple[Scheduler, DeltaSink]:
    runner = FakeRunner(VOCAB, WORDS, EOS, PAGE, num_pages)
    args = ServerArgs(page_size=PAGE, max_total_pages=num_pages, log_interval=0, debug_checks=True, **options)
    sink = DeltaSink()
    return Scheduler(args, runner, None, {EOS}, sink), sink


def message(rid: str, prompt: list[int], max_new_tokens: int, priority: int | None = None) -> GenerateReq:
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    return GenerateReq(rid=rid, input_ids=list(prompt), params=params, priority=priority)


def prompt(start: int, length: int = 8) -> list[int]:
    return [WORDS[(start + i) % len(WORDS)] for i in range(length)]


def run_until(scheduler: Scheduler, done, max_steps: int = 2_000) -> None:
    for _ in range(max_steps):
        scheduler.step()
        if done():
            return
    raise AssertionError("the scheduler made no progress")


def solo_output(msg: GenerateReq) -> list[int]:
    scheduler, sink = make_scheduler()
    scheduler.submit(msg)
    run_until(scheduler, lambda: scheduler.idle)
    return sink.output(msg.rid)


def run_all(scheduler: Scheduler, msgs: list[GenerateReq], first_outputs: int = 4) -> dict[str, Req]:
    """Submit ``msgs[0]``, step until it has ``first_outputs`` outputs, submit the rest, run until idle; the
    Req of every request by rid."""
    reqs: dict[str, Req] = {}

    def remember() -> None:
        for r in scheduler.running:
            reqs.setdefault(r.rid, r)

    scheduler.submit(msgs[0])
    run_until(scheduler, lambda: bool(scheduler.running) and len(scheduler.running[0].output_ids) >= first_outputs)
    remember()
    for msg in msgs[1:]:
        scheduler.submit(msg)
    for _ in range(2_000):
        scheduler.step()
        remember()
        if scheduler.idle:
            break
    assert scheduler.idle
    return reqs


def assert_solo_outputs_and_idle_pages(scheduler: Scheduler, sink: DeltaSink, msgs: list[GenerateReq]) -> None:
    for msg in msgs:
        assert sink.finished[msg.rid].type == "length"
        assert sink.output(msg.rid) == solo_output(msg), msg.rid
    assert not sink.problems
    assert scheduler.pool.num_free + scheduler.cache.evictable_pages == scheduler.pool.num_pages
    assert scheduler.cache.protected_pages == 0


def finish_order_behind_a_blocker(requests: list[tuple[str, list[int], int | None]], **options) -> list[str]:
    """One request at a time (max_running_requests=1): a long one runs while ``requests`` queue up behind it;
    the order they finish in is the order they were admitted in."""
    scheduler, sink = make_scheduler(max_running_requests=1, **options)
    scheduler.submit(message("blocker", prompt(40), 12))
    run_until(scheduler, lambda: bool(scheduler.running))
    for rid, ids, priority in requests:
        scheduler.submit(message(rid, ids, 3, priority))
    run_until(scheduler, lambda: scheduler.idle)
    assert all(sink.finished[rid].type == "length" for rid in sink.finished)
    assert sink.newly_finished[0] == "blocker"
    return sink.newly_finished[1:]


# ----- admission order ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy, waiting, matches_all", [
    ("lpm", 40, True), ("dfs-weight", 40, True), ("fcfs", 40, False), ("lpm", LPM_MAX_QUEUE + 40, False)])
def test_admission_matches_the_whole_queue_only_for_an_order_that_reads_matches(policy, waiting, matches_all):
    """LPM and DFS-weight order the queue by each request's match, so every waiting request is matched; FCFS (and
    LPM past LPM_MAX_QUEUE waiting requests) orders by arrival, so only the requests admission reaches are: a step
    behind a long queue costs what it admits, not the queue's length."""
    scheduler, _ = make_scheduler(max_running_requests=2, schedule_policy=policy)
    for i in range(waiting):
        scheduler.submit(message(f"r{i}", prompt(i), 4))
    match, calls = scheduler.cache.match_prefix, []
    scheduler.cache.match_prefix = lambda *a, **kw: calls.append(1) or match(*a, **kw)
    scheduler.step()
    assert len(scheduler.running) == 2
    assert (len(calls) >= waiting) if matches_all else (len(calls) <= 6), len(calls)


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight", "fcfs"])
def test_the_most_urgent_priority_is_admitted_first(policy):
    queued = [("low", prompt(0), 1), ("high", prompt(10), 9), ("middle", prompt(20), 5)]
    assert finish_order_behind_a_blocker(queued, schedule_policy=policy) == ["high", "middle", "low"]


def test_low_priority_values_first_flips_the_order():
    queued = [("low", prompt(0), 1), ("high", prompt(10), 9), ("middle", prompt(20), 5)]
    order = finish_order_behind_a_blocker(queued, schedule_policy="fcfs", schedule_low_priority_values_first=True)
    assert order == ["low", "middle", "high"]


def test_no_priority_is_priority_zero():
    queued = [("none", prompt(0), None), ("minus", prompt(10), -1), ("plus", prompt(20), 1)]
    assert finish_order_behind_a_blocker(queued, schedule_policy="fcfs") == ["plus", "none", "minus"]


def test_equal_priorities_keep_arrival_order_under_fcfs():
    queued = [(f"r{i}", prompt(7 * i), 2) for i in range(5)]
    assert finish_order_behind_a_blocker(queued, schedule_policy="fcfs") == [f"r{i}" for i in range(5)]


def test_within_a_priority_the_longest_prefix_match_goes_first():
    """lpm orders within one priority level, never across: the cached prefix's request passes its equal, not a
    more urgent request."""
    scheduler, sink = make_scheduler(max_running_requests=1, schedule_policy="lpm")
    document = prompt(3, 24)
    scheduler.submit(message("doc", document, 1))
    run_until(scheduler, lambda: scheduler.idle)
    scheduler.submit(message("blocker", prompt(40), 12))
    run_until(scheduler, lambda: bool(scheduler.running))
    for rid, ids, priority in [("cold", prompt(30), 0), ("warm", document + prompt(50, 4), 0),
                               ("urgent-cold", prompt(17), 1)]:
        scheduler.submit(message(rid, ids, 3, priority))
    run_until(scheduler, lambda: scheduler.idle)
    assert sink.newly_finished == ["doc", "blocker", "urgent-cold", "warm", "cold"]


def test_retracted_requests_lead_only_their_own_priority():
    """take_back puts a retracted request at the head of the queue; ordering keeps it there within its
    priority, but behind every more urgent one."""
    def req(rid: str, priority: int) -> Req:
        return Req(rid=rid, prompt_ids=[2, 3], params=SamplingParams(), priority=priority)

    waiting = [req("retracted-low", 0), req("high", 5), req("low", 0), req("retracted-high", 5)]
    matches = {r.rid: (0, None) for r in waiting}
    assert [r.rid for r in order_waiting("fcfs", waiting, matches)] == ["high", "retracted-high", "retracted-low",
                                                                      "low"]
    flipped = order_waiting("fcfs", waiting, matches, low_priority_first=True)
    assert [r.rid for r in flipped] == ["retracted-low", "low", "high", "retracted-high"]


# ----- retraction under memory pressure ----------------------------------------------------------------------


@pytest.mark.parametrize("first_priority,second_priority,low_values_first,retracted", [
    (1, 5, False, "first"),  # the second is more urgent
    (5, 1, True, "first"),  # the same, with small values urgent
    (None, None, False, "second"),  # equal: the fewest outputs go first
    (5, 1, False, "second"),
])
def test_memory_pressure_retracts_the_least_urgent_request(first_priority, second_priority, low_values_first,
                                                           retracted):
    """Two requests outgrow a 16-page pool together. The first started earlier and has more outputs, so the old
    rule alone (fewest outputs first) retracts the second; priority decides before it. The second was admitted
    steps before the retraction: "admitted this step" must not stick to it. Outputs equal their solo runs."""
    scheduler, sink = make_scheduler(num_pages=16, schedule_policy="fcfs",
                                     schedule_low_priority_values_first=low_values_first)
    msgs = [message("first", prompt(0), 40, first_priority), message("second", prompt(25), 40, second_priority)]
    reqs = run_all(scheduler, msgs, first_outputs=6)
    kept = "second" if retracted == "first" else "first"
    assert reqs[retracted].num_retractions > 0
    assert reqs[kept].num_retractions == 0
    assert scheduler.stats().num_preemptions == 0  # a retraction for memory, not a preemption
    assert_solo_outputs_and_idle_pages(scheduler, sink, msgs)


# ----- priority preemption -----------------------------------------------------------------------------------


@pytest.mark.parametrize("low_values_first", [False, True])
def test_an_urgent_request_preempts_for_a_slot(low_values_first):
    """One slot, a long batch request in it: a request more than the threshold more urgent takes the slot at
    once and finishes first; the batch request resumes where it was and its output equals its solo run."""
    sign = -1 if low_values_first else 1
    scheduler, sink = make_scheduler(max_running_requests=1, schedule_low_priority_values_first=low_values_first)
    msgs = [message("batch", prompt(0), 30, 0), message("urgent", prompt(20), 3, sign * 11)]
    reqs = run_all(scheduler, msgs)
    assert sink.newly_finished == ["urgent", "batch"]
    assert reqs["batch"].num_retractions == 1 and reqs["urgent"].num_retractions == 0
    stats = scheduler.stats()
    assert stats.num_preemptions == 1 and stats.num_retractions == 0
    assert_solo_outputs_and_idle_pages(scheduler, sink, msgs)


@pytest.mark.parametrize("urgent_priority,options", [
    (10, {}),  # a gap of exactly the threshold is not enough
    (3, {"priority_scheduling_preemption_threshold": 3}),
    (50, {"disable_priority_preemption": True}),
    (-50, {}),  # less urgent
])
def test_no_preemption_below_the_threshold_or_when_disabled(urgent_priority, options):
    scheduler, sink = make_scheduler(max_running_requests=1, **options)
    msgs = [message("batch", prompt(0), 30, 0), message("urgent", prompt(20), 3, urgent_priority)]
    reqs = run_all(scheduler, msgs)
    assert sink.newly_finished == ["batch", "urgent"]
    assert reqs["batch"].num_retractions == 0 and scheduler.stats().num_preemptions == 0


def test_a_gap_above_a_custom_threshold_preempts():
    scheduler, sink = make_scheduler(max_running_requests=1, priority_scheduling_preemption_threshold=3)
    run_all(scheduler, [message("batch", prompt(0), 30, 0), message("urgent", prompt(20), 3, 4)])
    assert sink.newly_finished == ["urgent", "batch"]


def test_the_least_urgent_and_latest_running_request_is_the_victim():
    """Three slots: a priority-5 request and two priority-0 ones run; an urgent one (30) preempts exactly one,
    the latest of the two priority-0 requests."""
    scheduler, sink = make_scheduler(max_running_requests=3, schedule_policy="fcfs")
    msgs = [message("old-low", prompt(0), 30, 0), message("mid", prompt(10), 30, 5),
            message("new-low", prompt(20), 30, 0)]
    for msg in msgs:
        scheduler.submit(msg)
    run_until(scheduler, lambda: len(scheduler.running) == 3 and all(r.output_ids for r in scheduler.running))
    reqs = {r.rid: r for r in scheduler.running}
    urgent = message("urgent", prompt(30), 3, 30)
    scheduler.submit(urgent)
    run_until(scheduler, lambda: scheduler.idle)
    assert [rid for rid, r in reqs.items() if r.num_retractions] == ["new-low"]
    assert sink.newly_finished[0] == "urgent"
    assert scheduler.stats().num_preemptions == 1
    assert_solo_outputs_and_idle_pages(scheduler, sink, [*msgs, urgent])


def test_an_urgent_request_preempts_for_pages():
    """A 16-page pool: a batch request holds most of it; an urgent request whose pages do not fit beside it
    preempts it although a slot is free."""
    scheduler, sink = make_scheduler(num_pages=16, schedule_policy="fcfs")
    msgs = [message("batch", prompt(0, 30), 26, 0), message("urgent", prompt(25, 20), 8, 20)]
    reqs = run_all(scheduler, msgs, first_outputs=8)
    assert sink.newly_finished == ["urgent", "batch"]
    assert reqs["batch"].num_retractions == 1
    assert scheduler.stats().num_preemptions == 1
    assert_solo_outputs_and_idle_pages(scheduler, sink, msgs)


def test_no_victims_that_could_not_make_room():
    """A 16-page pool, two requests running and only the small one outranked: its pages would not make room for
    the urgent request, so neither is touched and the urgent request waits for the big one to finish."""
    scheduler, sink = make_scheduler(num_pages=16, schedule_policy="fcfs")
    big_high = message("big-high", prompt(10, 24), 12, 50)  # 9 pages at the end
    small_low = message("small-low", prompt(0, 6), 10, 0)  # 4 pages at the end
    urgent = message("urgent", prompt(30, 28), 8, 20)  # 8 pages to start, 9 at the end
    scheduler.submit(big_high)
    run_until(scheduler, lambda: bool(scheduler.running))
    scheduler.submit(small_low)
    run_until(scheduler, lambda: len(scheduler.running) == 2 and all(r.output_ids for r in scheduler.running))
    reqs = {r.rid: r for r in scheduler.running}
    scheduler.submit(urgent)
    scheduler.step()
    assert [r.rid for r in scheduler.waiting] == ["urgent"]
    run_until(scheduler, lambda: scheduler.idle)
    assert scheduler.stats().num_preemptions == 0 and reqs["small-low"].num_retractions == 0
    assert_solo_outputs_and_idle_pages(scheduler, sink, [small_low, big_high, urgent])


def test_a_negative_threshold_is_refused():
    with pytest.raises(ValueError, match="priority_scheduling_preemption_threshold"):
        make_scheduler(priority_scheduling_preemption_threshold=-1)


# ----- the Engine and the server -------------------------------------------------------------------------------

BAD_PRIORITIES = ["high", 1.5, True, 2**31, -(2**31)]


@pytest.fixture(scope="module")
def engine(default_model_path):
    import radixrt

    with radixrt.Engine(dtype="float32", log_interval=0, max_total_pages=64) as eng:
        yield eng


@pytest.mark.model
def test_engine_takes_priorities_and_refuses_bad_ones(engine):
    params = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    plain = engine.generate("The capital of France is", params)["output_ids"]
    for priority in BAD_PRIORITIES:
        with pytest.raises(ValueError, match="priority must be an integer"):
            engine.generate("The capital of France is", params, priority=priority)
    for priority in (-3, 0, 7, None):
        assert engine.generate("The capital of France is", params, priority=priority)["output_ids"] == plain
    many = engine.generate(["a", "b"], [params, params], priority=2)
    assert len(many) == 2


@pytest.mark.model
def test_engine_admits_by_priority(default_model_path):
    """Through the Engine: one request at a time, a long one running, three queued behind it."""
    import threading
    import time

    import radixrt

    with radixrt.Engine(dtype="float32", log_interval=0, max_total_pages=64, max_running_requests=1,
                        schedule_policy="fcfs") as eng:
        admitted: list[int] = []
        take_match = eng.scheduler.memory.take_match

        def recording(req, match):
            admitted.append(req.priority)
            take_match(req, match)

        eng.scheduler.memory.take_match = recording
        params = {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}
        blocker = threading.Thread(target=eng.generate, args=("Once upon a time", {**params, "max_new_tokens": 48}))
        blocker.start()
        deadline = time.monotonic() + 60
        while not admitted and time.monotonic() < deadline:
            time.sleep(0.005)
        queued = [threading.Thread(target=eng.generate, args=(f"Prompt {p}", params), kwargs={"priority": p})
                  for p in (1, 9, 5)]
        for t in queued:
            t.start()
        for t in [blocker, *queued]:
            t.join(120)
        assert eng.scheduler.idle
    assert admitted == [0, 9, 5, 1]


@pytest.mark.model
def test_engine_preempts_a_batch_request_for_an_urgent_one(default_model_path):
    """One slot: a long batch generation runs; an urgent request (priority 20) takes the slot, finishes first,
    and the batch request's output is the same as without the interruption."""
    import threading
    import time

    import radixrt

    batch_params = {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}
    urgent_params = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    with radixrt.Engine(dtype="float32", log_interval=0, max_total_pages=64, max_running_requests=1,
                        debug_checks=True) as eng:
        alone = eng.generate("Once upon a time", batch_params)["output_ids"]
        finished: list[str] = []
        outputs: dict[str, list[int]] = {}

        def run(name: str, prompt: str, params: dict, priority: int) -> None:
            outputs[name] = eng.generate(prompt, params, priority=priority)["output_ids"]
            finished.append(name)

        batch = threading.Thread(target=run, args=("batch", "Once upon a time", batch_params, 0))
        batch.start()
        deadline = time.monotonic() + 60
        while not (eng.scheduler.running and len(eng.scheduler.running[0].output_ids) >= 4):
            assert time.monotonic() < deadline
            time.sleep(0.005)
        run("urgent", "The capital of France is", urgent_params, 20)
        batch.join(120)
        assert finished == ["urgent", "batch"]
        assert outputs["batch"] == alone
        assert eng.scheduler.stats().num_preemptions == 1
        assert eng.scheduler.idle


@pytest.fixture(scope="module")
def http(default_model_path):
    from radixrt.server.server_process import ServerProcess

    srv = ServerProcess(["--dtype", "float32", "--kv-memory-gb", "0.05", "--log-interval", "0",
                         "--schedule-low-priority-values-first"]).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=120) as client:
            yield client
    finally:
        srv.stop()


@pytest.mark.model
def test_server_takes_priorities_on_every_route_and_refuses_bad_ones(http):
    params = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
    chat = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 3, "temperature": 0}
    completion = {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}
    routes = [("/generate", {"text": "The capital of France is", "sampling_params": params}),
              ("/v1/chat/completions", chat), ("/v1/completions", completion)]
    for path, body in routes:
        for priority in BAD_PRIORITIES:
            res = http.post(path, json={**body, "priority": priority})
            assert res.status_code == 400, (path, priority, res.text)
            assert "priority" in res.text, res.text
        for priority in (-2, 0, 3, None):
            res = http.post(path, json={**body, "priority": priority})
            assert res.status_code == 200, (path, priority, res.text)
    assert http.get("/health").status_code == 200


def test_the_openapi_document_states_the_priority_range():
    from radixrt.protocol.request import priority_from
    from radixrt.server.openapi import BOUNDS, ApiLimits, build_openapi

    bound = BOUNDS["priority"]
    for value in (bound["minimum"], bound["maximum"]):
        assert priority_from(value) == value
    for value in (bound["minimum"] - 1, bound["maximum"] + 1):
        with pytest.raises(ValueError):
            priority_from(value)
    schemas = build_openapi(ApiLimits(context_length=512, vocab_size=1000), "0")["components"]["schemas"]
    for struct in ("GenerateBody", "ChatCompletionRequest", "CompletionRequest"):
        prop = schemas[struct]["properties"]["priority"]
        assert {"type": "integer", **bound} in prop["anyOf"], (struct, prop)
