"""The Engine with its scheduler and detokenizer in processes of their own (``engine_scheduler="process"``):
the same answers as the scheduler on a thread, the same errors, and a runtime that dies or shuts down as a
clear EngineDead instead of a hang."""

import asyncio
import os
import signal
import threading
import time

import pytest

import radixrt
from radixrt.engine import EngineDead, runs_detached
from radixrt.server_args import ServerArgs

pytestmark = pytest.mark.model

OPTIONS = {"dtype": "float32", "log_interval": 0, "kv_memory_gb": 0.3}
GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Three primary colors are"]


@pytest.fixture(scope="module")
def detached(default_model_path):
    with radixrt.Engine(engine_scheduler="process", **OPTIONS) as engine:
        yield engine


def test_auto_keeps_the_scheduler_on_a_thread_on_a_cpu_and_detaches_it_on_cuda(default_model_path):
    with radixrt.Engine(**OPTIONS) as engine:
        assert engine.scheduler is not None and engine.runner is not None
    assert runs_detached(ServerArgs(device="cuda"))
    assert not runs_detached(ServerArgs(device="cuda", engine_scheduler="thread"))
    assert not runs_detached(ServerArgs()) and runs_detached(ServerArgs(engine_scheduler="process"))


def test_the_environment_picks_where_an_auto_engine_runs_its_scheduler(monkeypatch):
    monkeypatch.setenv("RADIXRT_ENGINE_SCHEDULER", "thread")
    assert not runs_detached(ServerArgs(device="cuda"))
    assert runs_detached(ServerArgs(device="cuda", engine_scheduler="process"))  # an explicit choice wins
    monkeypatch.setenv("RADIXRT_ENGINE_SCHEDULER", "process")
    assert runs_detached(ServerArgs())
    monkeypatch.setenv("RADIXRT_ENGINE_SCHEDULER", "elsewhere")
    with pytest.raises(ValueError, match="RADIXRT_ENGINE_SCHEDULER='elsewhere'"):
        runs_detached(ServerArgs())


def test_the_same_greedy_tokens_text_and_meta_as_the_threaded_engine(detached, default_model_path):
    with radixrt.Engine(engine_scheduler="thread", **OPTIONS) as threaded:
        expected = threaded.generate(PROMPTS, GREEDY)
        info = threaded.get_model_info()
    got = detached.generate(PROMPTS, GREEDY)
    assert [r["output_ids"] for r in got] == [r["output_ids"] for r in expected]
    assert [r["text"] for r in got] == [r["text"] for r in expected]
    assert [r["meta_info"]["finish_reason"] for r in got] == [r["meta_info"]["finish_reason"] for r in expected]
    assert detached.get_model_info() == info
    for name in ("scheduler", "runner", "loaded", "grammars"):
        with pytest.raises(AttributeError, match="engine_scheduler='thread'"):
            getattr(detached, name)
    assert detached.eos_ids == set(info["eos_token_ids"])


def test_streams_and_async_calls(detached):
    whole = detached.generate(PROMPTS[0], GREEDY)
    chunks = list(detached.generate(PROMPTS[0], GREEDY, stream=True))
    assert chunks[-1]["text"] == whole["text"] and chunks[-1]["output_ids"] == whole["output_ids"]
    assert len(chunks) > 1

    async def both():
        return await asyncio.gather(detached.async_generate(PROMPTS[0], GREEDY),
                                    detached.async_generate(PROMPTS[1], GREEDY))

    first, second = asyncio.run(both())
    assert first["output_ids"] == whole["output_ids"]
    assert second["output_ids"] == detached.generate(PROMPTS[1], GREEDY)["output_ids"]


def test_calls_from_many_threads_batch_together(detached):
    expected = detached.generate(PROMPTS, GREEDY)
    results: dict[int, dict] = {}

    def call(i: int) -> None:
        results[i] = detached.generate(PROMPTS[i % 3], GREEDY)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[i]["output_ids"] for i in range(9)] == [expected[i % 3]["output_ids"] for i in range(9)]


def test_control_calls_and_a_bad_request(detached):
    stats = detached.get_stats()
    assert stats["pages_total"] > 0
    session = detached.open_session()
    detached.close_session(session)
    assert detached.flush_cache() is True
    with pytest.raises(ValueError, match="max_new_tokens"):
        detached.generate("x", {"max_new_tokens": -1})
    assert detached.generate("still serving", {"max_new_tokens": 2, "temperature": 0})["output_ids"]


def test_a_helper_that_dies_ends_every_call_with_engine_dead(default_model_path):
    engine = radixrt.Engine(engine_scheduler="process", **OPTIONS)
    try:
        outcome: list[BaseException] = []

        def long_call() -> None:
            try:
                engine.generate("a long wait", {"max_new_tokens": 4000, "ignore_eos": True})
            except BaseException as exc:  # noqa: BLE001 - the outcome is checked below
                outcome.append(exc)

        waiter = threading.Thread(target=long_call)
        waiter.start()
        time.sleep(1.0)
        os.kill(engine._detached.ready.pid, signal.SIGKILL)
        waiter.join(timeout=30)
        assert not waiter.is_alive(), "a caller waited on a runtime that had died"
        assert outcome and isinstance(outcome[0], (EngineDead, RuntimeError))
        assert "scheduler process exited" in str(outcome[0])
        with pytest.raises(EngineDead, match="scheduler process exited"):
            engine.generate("again", {"max_new_tokens": 2})
    finally:
        engine.shutdown()


def test_shutdown_stops_the_helpers_and_later_calls_raise(default_model_path):
    engine = radixrt.Engine(engine_scheduler="process", **OPTIONS)
    pid = engine._detached.ready.pid
    ipc_dir = engine._detached._ipc_dir
    engine.shutdown()
    with pytest.raises(EngineDead):
        engine.generate("after", {"max_new_tokens": 2})
    engine.shutdown()  # a second shutdown does nothing
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not os.path.exists(ipc_dir)


def test_a_scheduler_that_fails_to_start_raises_in_the_callers_thread(default_model_path):
    # the default model's 9 heads do not split over 2 ranks: the scheduler process refuses to load it
    with pytest.raises(RuntimeError, match="scheduler process exited with code 1"):
        radixrt.Engine(engine_scheduler="process", dtype="float32", tp_size=2)


def test_the_scheduler_loads_while_the_tokenizer_does_and_stops_when_that_fails(default_model_path, monkeypatch):
    """The scheduler process is spawned before the caller loads its tokenizer (the model loads meanwhile); a
    tokenizer that fails to load raises in the caller's thread, with the scheduler process stopped."""
    import radixrt.server.detached as detached_module
    import radixrt.tokenizer

    events, spawned = [], []

    def spawn_scheduler(*args, **kwargs):
        events.append("scheduler")
        spawned.append(real_spawn(*args, **kwargs))
        return spawned[-1]

    def load_tokenizer(*args, **kwargs):
        events.append("tokenizer")
        raise ValueError("injected: the tokenizer cannot be read")

    real_spawn = detached_module.spawn_scheduler
    monkeypatch.setattr(detached_module, "spawn_scheduler", spawn_scheduler)
    monkeypatch.setattr(radixrt.tokenizer, "load_tokenizer", load_tokenizer)
    with pytest.raises(ValueError, match="injected"):
        radixrt.Engine(engine_scheduler="process", **OPTIONS)
    assert events == ["scheduler", "tokenizer"]
    assert spawned[0].poll() is not None  # stopped, not left loading the model


def test_a_stream_left_early_aborts_its_request(detached):
    stream = detached.generate("count slowly:", {"max_new_tokens": 2000, "ignore_eos": True, "temperature": 0},
                               stream=True)
    next(stream)
    next(stream)
    stream.close()  # the caller walks away: the request is aborted, its pages freed
    deadline = time.monotonic() + 30
    while detached.get_stats()["num_running"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert detached.get_stats()["num_running"] == 0
    after = detached.generate("after", {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True})
    assert after["meta_info"]["completion_tokens"] == 2


def test_weights_and_pauses_cross_the_process_boundary(detached, default_model_path):
    """Tensors sent to the scheduler's process (SGLang's update_weights_from_tensor) as bytes, then the checkpoint
    read again from disk; a pause and a continue; the weight version in the answers."""
    from safetensors import safe_open

    name = "model.layers.0.mlp.down_proj.weight"
    with safe_open(default_model_path / "model.safetensors", framework="pt") as handle:
        served = handle.get_tensor(name)
    before = detached.generate(PROMPTS[0], GREEDY)["output_ids"]
    try:
        ok, message = detached.update_weights_from_tensor([(name, (served * -3).bfloat16())], weight_version="w1")
        assert ok, message
        changed = detached.generate(PROMPTS[0], GREEDY)
        assert changed["output_ids"] != before and changed["meta_info"]["weight_version"] == "w1"
        detached.pause_generation("retract")
        detached.continue_generation()
    finally:
        ok, message, _ = detached.update_weights_from_disk(str(default_model_path), weight_version="default")
        assert ok, message
    assert detached.generate(PROMPTS[0], GREEDY)["output_ids"] == before
    assert detached.get_model_info()["weight_version"] == "default"


def test_memory_released_and_resumed_across_the_process_boundary(detached):
    """SGLang's release / resume and vLLM's sleep / wake_up reach the scheduler's process; a request made while
    released waits for the resume, then gets the tokens of before."""
    import threading

    before = detached.generate(PROMPTS[0], GREEDY)["output_ids"]
    detached.sleep(level=2)
    try:
        assert detached.is_sleeping()
        results: dict = {}
        waiting = threading.Thread(target=lambda: results.update(out=detached.generate(PROMPTS[0], GREEDY)))
        waiting.start()
        waiting.join(timeout=1.0)
        assert waiting.is_alive()
    finally:
        detached.wake_up()
    waiting.join(timeout=60)
    assert not detached.is_sleeping() and results["out"]["output_ids"] == before
    detached.release_memory_occupation(["kv_cache"])
    detached.resume_memory_occupation()
    assert detached.generate(PROMPTS[0], GREEDY)["output_ids"] == before
