"""The Engine stays up: one request's failure is that request's error, and calls never hang.

Each test injects a fault where the runtime meets it (a bad input, a forward that raises, a stop-string
renderer or a detokenizer that raises for one request) and checks that the request fails with a clear error,
its pages are freed, the other requests are served, and a new request is served afterwards.
"""

import subprocess
import sys
import textwrap
import time

import pytest

import radixrt
from radixrt.engine import EngineDead

pytestmark = pytest.mark.model

GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(default_model_path):
    with radixrt.Engine(dtype="float32", log_interval=0, debug_checks=True, kv_memory_gb=0.2) as eng:
        yield eng


def assert_idle_and_clean(engine):
    stats = engine.get_stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["pages_private"] == 0 and stats["pages_protected"] == 0
    assert stats["pages_free"] + stats["pages_evictable"] == stats["pages_total"]


@pytest.mark.parametrize("options, message", [
    ({"return_logprob": True, "top_logprobs_num": 10**6}, "top_logprobs_num must be in"),
    ({"return_logprob": True, "top_logprobs_num": -1}, "top_logprobs_num must be in"),
    ({"return_logprob": True, "logprob_start_len": -5}, "logprob_start_len must be >= -1"),
])
def test_bad_logprob_options_are_refused_before_queueing(engine, options, message):
    with pytest.raises(ValueError, match=message):
        engine.generate("Hello", GREEDY, **options)
    assert engine.generate("Hello", GREEDY)["meta_info"]["completion_tokens"] == 6
    assert_idle_and_clean(engine)


def test_bad_seed_is_refused(engine):
    with pytest.raises(ValueError, match="seed must be in"):
        engine.generate("Hello", {**GREEDY, "temperature": 1.0, "seed": -3})


def test_stream_with_several_prompts_is_refused_before_anything_runs(engine):
    with pytest.raises(ValueError, match="stream=True takes one prompt"):
        engine.generate(["a", "b"], GREEDY, stream=True)
    assert_idle_and_clean(engine)


def test_a_forward_that_fails_once_fails_its_batch_only(engine, monkeypatch):
    real = engine.runner.forward
    calls = {"n": 0}

    def flaky(batch):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected forward failure")
        return real(batch)

    monkeypatch.setattr(engine.runner, "forward", flaky)
    with pytest.raises(RuntimeError, match="injected forward failure"):
        engine.generate("The sky is", GREEDY)
    assert engine.generate("The sky is", GREEDY)["meta_info"]["completion_tokens"] == 6
    assert_idle_and_clean(engine)


def test_one_requests_stop_string_error_fails_that_request_only(engine, monkeypatch):
    from radixrt.detokenize import TextStream

    real_add = TextStream.add

    def add(self, new_ids):
        if "POISON" in self.stop:
            raise UnicodeError("injected renderer failure")
        return real_add(self, new_ids)

    monkeypatch.setattr(TextStream, "add", add)
    params = [{**GREEDY, "stop": ["POISON"]}, {**GREEDY, "stop": ["\n\n\n"]}]
    results = []
    for p in params:
        try:
            results.append(engine.generate("Once upon a time", p))
        except RuntimeError as exc:
            results.append(exc)
    assert isinstance(results[0], RuntimeError) and "injected renderer failure" in str(results[0])
    assert results[1]["meta_info"]["completion_tokens"] == 6
    assert_idle_and_clean(engine)


def test_one_requests_sampling_error_fails_that_request_only(engine, monkeypatch):
    import radixrt.scheduler.logits as logits_module

    real = logits_module.apply_penalties

    def penalties(logits, params, prompts, outputs):
        if any(p.frequency_penalty == 1.5 for p in params):
            raise FloatingPointError("injected penalty failure")
        return real(logits, params, prompts, outputs)

    monkeypatch.setattr(logits_module, "apply_penalties", penalties)
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        bad = pool.submit(engine.generate, "Tell me a story", {**GREEDY, "max_new_tokens": 12,
                                                                "frequency_penalty": 1.5})
        good = [pool.submit(engine.generate, "Tell me a story", {**GREEDY, "max_new_tokens": 12})
                for _ in range(2)]
        with pytest.raises(RuntimeError, match="injected penalty failure"):
            bad.result()
        assert [f.result()["meta_info"]["completion_tokens"] for f in good] == [12, 12]
    assert_idle_and_clean(engine)


def test_one_requests_detokenizer_error_fails_that_request_only(engine, monkeypatch):
    from radixrt.detokenize import Detokenizer

    real = Detokenizer._finish_one

    def finish_one(self, delta, stream):
        if delta.stop == ["POISON"]:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return real(self, delta, stream)

    monkeypatch.setattr(Detokenizer, "_finish_one", finish_one)
    with pytest.raises(RuntimeError, match="detokenizing"):
        engine.generate("Hello there", {**GREEDY, "max_new_tokens": 64, "stop": ["POISON"]})
    assert engine.generate("Hello there", GREEDY)["meta_info"]["completion_tokens"] == 6
    time.sleep(0.2)  # the abort of the failed request reaches the scheduler on its next step
    assert_idle_and_clean(engine)


def test_a_model_that_cannot_run_stops_the_engine_and_calls_raise_at_once(default_model_path, monkeypatch):
    engine = radixrt.Engine(dtype="float32", log_interval=0, kv_memory_gb=0.1)
    try:
        def broken(batch):
            raise RuntimeError("injected: the device is gone")

        monkeypatch.setattr(engine.runner, "forward", broken)
        for _ in range(2):  # below the limit: each failing batch fails its own requests
            with pytest.raises(RuntimeError, match="the device is gone"):
                engine.generate("Hi", GREEDY)
        with pytest.raises(EngineDead, match="failed 3 times in a row"):
            engine.generate("Hi", GREEDY)
        started = time.monotonic()
        with pytest.raises(EngineDead, match="scheduler thread died"):
            engine.get_stats()
        with pytest.raises(EngineDead):
            engine.generate("Hi", GREEDY)
        assert time.monotonic() - started < 2.0
    finally:
        engine.shutdown()


def test_calls_after_shutdown_raise_instead_of_hanging(default_model_path):
    engine = radixrt.Engine(dtype="float32", log_interval=0, kv_memory_gb=0.1)
    engine.shutdown()
    started = time.monotonic()
    with pytest.raises(EngineDead, match="shut down"):
        engine.get_stats()
    with pytest.raises(EngineDead, match="shut down"):
        engine.generate("Hi", GREEDY)
    assert time.monotonic() - started < 2.0


def test_random_seed_makes_unseeded_sampling_reproducible(default_model_path):
    prompts = [f"Write a word about {topic}:" for topic in ("cats", "rain", "trains", "salt")]
    params = {"max_new_tokens": 10, "temperature": 1.0, "ignore_eos": True}
    runs = []
    for seed in (7, 7, 8):
        with radixrt.Engine(dtype="float32", log_interval=0, kv_memory_gb=0.1, random_seed=seed) as eng:
            runs.append([r["output_ids"] for r in eng.generate(prompts, params)])
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


EXIT_SCRIPT = textwrap.dedent("""
    import radixrt
    engine = radixrt.Engine(dtype="{dtype}", log_interval=0, kv_memory_gb=0.1)
    out = engine.generate([f"Tell me about number {{i}}" for i in range(32)],
                          {{"max_new_tokens": 8, "temperature": 0}})
    assert len(out) == 32
    stream = engine.generate("Write a long story.", {{"max_new_tokens": 400, "ignore_eos": True}}, stream=True)
    next(stream)  # the script ends while the scheduler thread is mid-generation
    print("done", flush=True)
""")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_script_that_never_calls_shutdown_exits_cleanly(default_model_path, dtype):
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", EXIT_SCRIPT.format(dtype=dtype)], capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "done" in proc.stdout


def test_the_model_loads_on_the_thread_that_runs_its_forwards(default_model_path, monkeypatch):
    """OpenMP gives each thread that starts parallel work a pool of its own; a model loaded on the caller's
    thread and run on the scheduler's made two pools on 2 CPUs, and libgomp then put idle workers to sleep at
    once (a batch-1 decode step 1.5x slower)."""
    import threading

    from radixrt.loaded_model import LoadedModel
    from radixrt.model.runner import ModelRunner

    threads = {}
    load, forward = LoadedModel.load, ModelRunner.forward

    def recording_load(*args, **kwargs):
        threads["load"] = threading.current_thread()
        return load(*args, **kwargs)

    def recording_forward(self, *args, **kwargs):
        threads["forward"] = threading.current_thread()
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(LoadedModel, "load", staticmethod(recording_load))
    monkeypatch.setattr(ModelRunner, "forward", recording_forward)
    with radixrt.Engine(dtype="float32", log_interval=0, kv_memory_gb=0.1) as engine:
        assert engine.generate("Hi", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2
        assert threads["load"] is threads["forward"] is engine._thread is not threading.current_thread()


def test_a_model_that_fails_to_load_raises_in_the_callers_thread(tmp_path):
    """Loading happens on the scheduler thread; its failure is the constructor's, and no thread is left."""
    import threading

    from radixrt.model.weights import ModelNotFoundError

    before = set(threading.enumerate())
    with pytest.raises(ModelNotFoundError, match="neither a folder nor a .gguf file"):
        radixrt.Engine(model_path=str(tmp_path / "missing"), dtype="float32")
    time.sleep(0.1)
    assert not [t for t in threading.enumerate() if t not in before and t.name == "radixrt-scheduler"]
