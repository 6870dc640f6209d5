"""Memory given back between uses and taken again (SGLang's ``release_memory_occupation`` /
``resume_memory_occupation``, vLLM's ``sleep`` / ``wake_up`` / ``is_sleeping``): the KV pool's memory
(radixrt/memory/page_pool.py), the runner's weights (built again from the checkpoint), the scheduler's gate that
holds requests meanwhile (radixrt/scheduler/occupation.py), the Engine's calls and the HTTP routes. The oracle of
the tokens is the same engine's greedy tokens before the release (equal to transformers' in
tests/test_default_model.py). The decode graphs' capture again: tests/test_cuda_graph.py."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import radixrt
from radixrt.memory.page_pool import KVLayout, PagePool
from radixrt.model.forward_batch import ForwardBatch, SeqChunk
from radixrt.model.runner import ModelRunner
from tiny_models import save_tiny_model

LAYOUT = KVLayout(num_layers=2, kv_heads=2, head_dim=64, page_size=16, dtype=torch.float32)
PROMPTS = ["The capital of Italy is Rome. The capital of Germany is Berlin. The capital of France is",
           "Once upon a time, there"]
GREEDY = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}


def resident_mb(field: str) -> float:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field} in /proc/self/status")


def wait_until(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout} s for {what}"
        time.sleep(0.005)


# ----- the pool ---------------------------------------------------------------------------------------------


def test_a_cpu_pool_gives_its_map_back_and_reads_zero_after():
    pool = PagePool(LAYOUT, 256)  # 8 MB in one shared anonymous map
    pages = pool.alloc(256)
    for cache in pool.k_caches + pool.v_caches:
        cache.fill_(1.5)
    written = resident_mb("RssShmem")
    with pytest.raises(RuntimeError, match="in use"):
        pool.release_memory()
    pool.decref(pages)
    addresses = [c.data_ptr() for c in pool.k_caches + pool.v_caches]
    pool.release_memory()
    assert written - resident_mb("RssShmem") >= 7.5
    assert pool.released and all(torch.count_nonzero(c) == 0 for c in pool.k_caches + pool.v_caches)
    pool.restore_memory()
    assert not pool.released and [c.data_ptr() for c in pool.k_caches + pool.v_caches] == addresses
    pool.k_caches[1][3, 2] = 4.0  # usable again
    assert float(pool.k_caches[1][3, 2].sum()) == 4.0 * LAYOUT.kv_heads * LAYOUT.head_dim


def test_a_pool_outside_a_map_frees_its_storage_and_comes_back_zeroed():
    """The GPU's way (tensors of their own), on the CPU: storage shrunk to nothing, allocated again, zeroed."""
    pool = PagePool(LAYOUT, 8, lazy=False)
    for cache in pool.k_caches + pool.v_caches:
        cache.fill_(2.0)
    shapes = [c.shape for c in pool.k_caches]
    pool.release_memory()
    pool.release_memory()  # twice: nothing more
    assert all(c.untyped_storage().nbytes() == 0 for c in pool.k_caches + pool.v_caches)
    pool.restore_memory()
    assert [c.shape for c in pool.k_caches] == shapes
    for cache in pool.k_caches + pool.v_caches:
        assert cache.untyped_storage().nbytes() == cache.numel() * 4 and torch.count_nonzero(cache) == 0
    assert sorted(pool.alloc(8)) == list(range(8))


# ----- the runner -------------------------------------------------------------------------------------------


def _logits(runner: ModelRunner) -> torch.Tensor:
    prompts = [[3, 9, 27, 81, 5, 15], [7, 14, 28, 56]]
    batch = ForwardBatch.build([SeqChunk(p, 0, pg) for p, pg in zip(prompts, [[0, 1], [2]])], 4)
    return runner.forward(batch).clone()


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "plain"])
def test_runner_releases_its_weights_and_builds_them_again(tmp_path, monkeypatch, packed):
    if not packed:
        monkeypatch.setenv("RADIXRT_DISABLE_PACKED_LINEAR", "1")
    save_tiny_model("qwen3", tmp_path / "m", seed=0)
    runner = ModelRunner(tmp_path / "m", dtype="float32", page_size=4, num_pages=16)
    before = _logits(runner)
    runner.release_memory({"weights", "kv_cache"})
    assert runner.model is None and runner.released == {"weights", "kv_cache"} and runner.pool.released
    assert runner.resume_memory({"weights"}) is False
    assert runner.model is not None and runner.released == {"kv_cache"}
    runner.resume_memory({"kv_cache"})
    assert runner.released == set() and not runner.pool.released
    assert torch.equal(_logits(runner), before)


def test_resumed_weights_are_the_checkpoints_without_the_tensors_sent_since(tmp_path):
    from safetensors.torch import load_file

    save_tiny_model("llama", tmp_path / "old", seed=0)
    save_tiny_model("llama", tmp_path / "new", seed=1)
    runner = ModelRunner(tmp_path / "old", dtype="float32", page_size=4, num_pages=16)
    checkpoint = _logits(runner)
    runner.update_tensors(load_file(tmp_path / "new" / "model.safetensors"))
    assert runner.weights_diverged and not torch.equal(_logits(runner), checkpoint)
    runner.release_memory({"weights"})
    assert runner.resume_memory({"weights"}) is True  # the updates are gone
    assert not runner.weights_diverged and torch.equal(_logits(runner), checkpoint)


# ----- the Engine -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(default_model_path):
    with radixrt.Engine(dtype="float32", log_interval=0, debug_checks=True, kv_memory_gb=0.3) as eng:
        yield eng


@pytest.fixture(scope="module")
def before(engine) -> list[list[int]]:
    return _tokens(engine)


def _tokens(engine) -> list[list[int]]:
    return [o["output_ids"] for o in engine.generate(PROMPTS, GREEDY)]


def _in_background(engine, results: dict, prompt: str = PROMPTS[0], params: dict = GREEDY) -> threading.Thread:
    thread = threading.Thread(target=lambda: results.update(out=engine.generate(prompt, params)))
    thread.start()
    return thread


@pytest.mark.model
def test_release_gives_the_memory_back_and_resume_serves_the_same_tokens(engine, before):
    """Through the benchmark's own measure (radixrt/bench/memory_release.py): the pool filled, everything released,
    at least half the weights' bytes leave the process, and the tokens after the resume are those of before."""
    from radixrt.bench.memory_release import measure

    weights_mb = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters()) / 2**20
    figures = measure(engine, None)
    assert figures["before_mb"] - figures["released_mb"] >= 0.5 * weights_mb, (figures, weights_mb)
    assert figures["same_tokens"] and not engine.is_sleeping() and engine.runner.released == set()
    engine.release_memory_occupation(["kv_cache"])
    assert engine.is_sleeping() and engine.scheduler.cache.cached_pages == 0
    engine.resume_memory_occupation()
    assert _tokens(engine) == before


@pytest.mark.model
def test_requests_wait_while_memory_is_released(engine, before):
    engine.release_memory_occupation(["weights", "kv_cache"])
    results: dict = {}
    waiting = _in_background(engine, results)
    wait_until(lambda: len(engine.scheduler.gate.held) == 1, "the request held")
    engine.wake_up(["weights"])  # vLLM's: the pool is still released
    waiting.join(timeout=0.5)
    assert waiting.is_alive() and engine.is_sleeping()
    engine.wake_up(["kv_cache"])
    waiting.join(timeout=60)
    assert results["out"]["output_ids"] == before[0] and not engine.is_sleeping()


@pytest.mark.model
def test_release_is_refused_while_requests_hold_pages(engine):
    results: dict = {}
    running = _in_background(engine, results, params={**GREEDY, "max_new_tokens": 200})
    wait_until(lambda: engine.scheduler.running, "a running request")
    with pytest.raises(ValueError, match="hold KV pages"):
        engine.release_memory_occupation(["kv_cache"])
    engine.pause_generation("in_place")  # paused in place: the request keeps its pages
    with pytest.raises(ValueError, match="hold KV pages"):
        engine.release_memory_occupation(["weights"])
    engine.pause_generation("retract")  # its pages freed: it runs again after the resume
    engine.release_memory_occupation()
    engine.resume_memory_occupation()
    engine.continue_generation()
    running.join(timeout=120)
    out = results["out"]
    assert out["meta_info"]["finish_reason"]["type"] == "length" and len(out["output_ids"]) == 200
    assert not engine.is_sleeping()
    engine.scheduler.check()


@pytest.mark.model
def test_updates_and_reads_of_released_weights_are_refused(engine, default_model_path, before):
    from safetensors.torch import load_file

    tensors = load_file(default_model_path / "model.safetensors")
    name = "model.norm.weight"
    engine.release_memory_occupation(["weights"])
    ok, message = engine.update_weights_from_tensor([(name, tensors[name])])
    assert not ok and "released" in message
    with pytest.raises(ValueError, match="released"):
        engine.get_weights_by_name(name)
    engine.resume_memory_occupation(["weights"])
    engine.release_memory_occupation(["kv_cache"])  # the KV cache only: the weights can still be updated
    ok, message = engine.update_weights_from_tensor([(name, tensors[name])])
    assert ok, message
    engine.wake_up()
    assert _tokens(engine) == before


@pytest.mark.model
def test_resumed_weights_are_the_checkpoints_under_its_version(engine, before):
    name = "model.norm.weight"
    served = torch.tensor(engine.get_weights_by_name(name, truncate_size=10**6))
    ok, message = engine.update_weights_from_tensor([(name, served.flip(0))], weight_version="step-1")
    assert ok, message
    assert engine.get_weight_version() == "step-1" and _tokens(engine) != before
    engine.release_memory_occupation(["weights"])
    engine.resume_memory_occupation(["weights"])
    assert engine.get_weight_version() == "default"
    assert torch.equal(torch.tensor(engine.get_weights_by_name(name, truncate_size=10**6)), served)
    assert _tokens(engine) == before


@pytest.mark.model
def test_weights_kept_in_host_memory_come_back_as_they_were(engine, default_model_path, before):
    """vLLM's sleep level 1 (SGLang's --enable-weights-cpu-backup): the weights move to host memory, where a CPU's
    are already, so they stay; the tensors sent before come back with them, under their version."""
    name = "model.norm.weight"
    served = torch.tensor(engine.get_weights_by_name(name, truncate_size=10**6))
    ok, message = engine.update_weights_from_tensor([(name, served.flip(0))], weight_version="step-2")
    assert ok, message
    updated = _tokens(engine)
    model = engine.runner.model
    engine.sleep(level=1)
    assert engine.is_sleeping() and engine.runner.released == {"weights", "kv_cache"}
    assert engine.runner.model is model  # nothing to move on a CPU
    engine.wake_up()
    assert engine.get_weight_version() == "step-2" and _tokens(engine) == updated
    ok, message, _ = engine.update_weights_from_disk(str(default_model_path), weight_version="default")
    assert ok, message
    assert _tokens(engine) == before


def test_offloaded_parameters_free_their_storage_and_come_back_bit_for_bit(tmp_path, monkeypatch):
    """The backup's move (radixrt/model/offload.py), which a GPU's weights take, on a CPU model of plain tensors:
    every parameter storage emptied, tied ones once, then the same bytes back in the same tensors."""
    from radixrt.model.offload import offload, restore

    monkeypatch.setenv("RADIXRT_DISABLE_PACKED_LINEAR", "1")
    save_tiny_model("llama", tmp_path / "m", seed=0)
    runner = ModelRunner(tmp_path / "m", dtype="float32", page_size=4, num_pages=16)
    before = _logits(runner)
    params = list(runner.model.parameters())
    storages = {p.untyped_storage().data_ptr() for p in params}
    saved = offload(runner.model)
    assert all(p.untyped_storage().nbytes() == 0 for p in params) and len(saved) == len(storages)
    restore(saved)
    assert list(runner.model.parameters()) == params and torch.equal(_logits(runner), before)


@pytest.mark.model
def test_bad_tags_and_levels_are_refused_and_serving_goes_on(engine, before):
    with pytest.raises(ValueError, match="unknown memory tag"):
        engine.release_memory_occupation(["weights", "optimizer"])
    with pytest.raises(ValueError, match="sleep level"):
        engine.sleep(level=3)
    engine.resume_memory_occupation(["kv_cache"])  # nothing released: nothing to do
    assert not engine.is_sleeping() and _tokens(engine) == before


# ----- HTTP -------------------------------------------------------------------------------------------------

SERVER_ARGS = __import__("shared_server").ARGS  # the shared server: every test leaves its memory resumed


@pytest.mark.model
def test_http_routes_release_resume_sleep_and_wake_up(http):
    def generate() -> list[int]:
        res = http.post("/generate", json={"text": PROMPTS[1], "sampling_params": GREEDY})
        assert res.status_code == 200, res.text
        return res.json()["output_ids"]

    expected = generate()
    try:
        res = http.post("/release_memory_occupation", json={"tags": ["kv_cache"]})
        assert res.status_code == 200, res.text
        assert res.json() == {"success": True, "message": "Memory released.", "released": ["kv_cache"]}
        assert http.get("/is_sleeping").json() == {"is_sleeping": True}
        assert http.get("/health_generate").json() == {"status": "ok", "released": ["kv_cache"]}
        results: dict = {}
        waiting = threading.Thread(target=lambda: results.update(out=generate()))
        waiting.start()
        waiting.join(timeout=1.0)
        assert waiting.is_alive()
        res = http.get("/resume_memory_occupation")  # SGLang's routes take GET too, without a body
        assert res.status_code == 200 and res.json()["released"] == []
        waiting.join(timeout=60)
        assert results["out"] == expected
        # vLLM's
        assert http.post("/sleep", params={"level": "2"}).status_code == 200
        assert http.post("/wake_up", params={"tags": "weights"}).status_code == 200
        assert http.get("/is_sleeping").json() == {"is_sleeping": True}
        assert http.post("/wake_up").status_code == 200
        assert http.get("/is_sleeping").json() == {"is_sleeping": False}
        assert http.post("/sleep").status_code == 200  # level 1: the weights kept in host memory
        assert http.get("/health_generate").json() == {"status": "ok", "released": ["kv_cache", "weights"]}
        assert http.post("/wake_up").status_code == 200
        assert http.get("/is_sleeping").json() == {"is_sleeping": False}
        for path, kwargs in [("/release_memory_occupation", {"json": {"tags": ["optimizer"]}}),
                             ("/release_memory_occupation", {"json": {"tag": ["weights"]}}),
                             ("/sleep", {"params": {"level": "3"}}),
                             ("/wake_up", {"params": {"tags": "optimizer"}})]:
            res = http.post(path, **kwargs)
            assert res.status_code == 400, (path, res.text)
        assert http.get("/is_sleeping").json() == {"is_sleeping": False}
        assert generate() == expected
    finally:
        http.post("/resume_memory_occupation")
