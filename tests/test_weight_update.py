"""Updates of weights without a restart, pauses and weight versions (SGLang's ``update_weights_from_disk``,
``pause_generation`` / ``continue_generation``, ``update_weight_version``) through the runner and the Engine: the new
weights give transformers' tokens on them, the cache computed with the old ones is dropped, requests in flight
finish on the weights they started with while later ones wait, a failed update leaves the served weights serving.
The HTTP routes: tests/test_weight_update_server.py."""

from __future__ import annotations

import shutil
import threading
import time

import pytest
import torch

import radixrt
from radixrt.model.forward_batch import ForwardBatch, SeqChunk
from radixrt.model.runner import ModelRunner
from tiny_models import save_tiny_model

PROMPTS = ["The capital of Italy is Rome. The capital of Germany is Berlin. The capital of Japan is Tokyo. The "
           "capital of France is", "Once upon a time, there"]
GREEDY = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}


def perturbed_checkpoint(source, folder, scale: float = 0.1, seed: int = 0):
    """``source``'s checkpoint with every tensor moved by seeded noise of ``scale`` times its spread, in bf16: the
    same model with other weights, as a fine-tuning step leaves it."""
    from safetensors.torch import load_file, save_file

    folder.mkdir(parents=True, exist_ok=True)
    for file in source.iterdir():
        if file.suffix != ".safetensors":
            shutil.copy(file, folder)
    generator = torch.Generator().manual_seed(seed)
    for file in source.glob("*.safetensors"):
        tensors = load_file(file)
        moved = {name: (t.float() + scale * t.float().std() * torch.randn(t.shape, generator=generator))
                 .to(torch.bfloat16) for name, t in tensors.items()}  # stored in bf16, as trainers save them
        save_file(moved, folder / file.name, metadata={"format": "pt"})
    return folder


def wait_until(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout} s for {what}"
        time.sleep(0.005)


def running_in_background(engine, results: dict, params: dict) -> threading.Thread:
    """``engine.generate(PROMPTS[0], params)`` on a thread of its own (its answer in ``results["first"]``), returned
    once the scheduler runs it."""
    thread = threading.Thread(target=lambda: results.update(first=engine.generate(PROMPTS[0], params)))
    thread.start()
    wait_until(lambda: engine.scheduler.running, "a running request")
    return thread


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """transformers' greedy tokens (its KV cache on; eos does not stop it, as under ``ignore_eos``)."""
    out, cache, step = [], None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            result = model(step, cache=cache, use_cache=True)
            cache = result.past_key_values
            out.append(int(result.logits[0, -1].argmax()))
            step = torch.tensor([[out[-1]]])
    return out


# ----- the runner -----------------------------------------------------------------------------------------


def _logits(runner: ModelRunner) -> torch.Tensor:
    prompts = [[3, 9, 27, 81, 5, 15], [7, 14, 28, 56]]
    pages = [[0, 1], [2]]
    batch = ForwardBatch.build([SeqChunk(p, 0, pg) for p, pg in zip(prompts, pages)], 4)
    return runner.forward(batch).clone()


@pytest.mark.parametrize("packed", [True, False], ids=["packed-swapped", "plain-in-place"])
@pytest.mark.parametrize("family", ["llama", "phi3", "qwen3-moe"])
def test_runner_update_equals_a_runner_loaded_from_the_new_weights(tmp_path, monkeypatch, family, packed):
    """Packed linear layers: the new model replaces the old. Plain tensors (CUDA; packing off): the new values are
    copied into the served tensors, which keep their addresses (the decode graphs replay them)."""
    if not packed:
        monkeypatch.setenv("RADIXRT_DISABLE_PACKED_LINEAR", "1")
    save_tiny_model(family, tmp_path / "old", seed=0)
    save_tiny_model(family, tmp_path / "new", seed=1)
    runner = ModelRunner(tmp_path / "old", dtype="float32", page_size=4, num_pages=16)
    fresh = ModelRunner(tmp_path / "new", dtype="float32", page_size=4, num_pages=16)
    assert (runner.packed_linears > 0) == packed
    before = _logits(runner)
    served = runner.model
    addresses = {name: p.data_ptr() for name, p in served.named_parameters()}
    runner.update_weights(tmp_path / "new")
    after = _logits(runner)
    assert not torch.allclose(before, after)
    assert torch.equal(after, _logits(fresh))
    assert runner.model_path == tmp_path / "new"
    if packed:
        assert runner.model is not served
    else:
        assert runner.model is served
        assert {name: p.data_ptr() for name, p in served.named_parameters()} == addresses


@pytest.mark.parametrize("layout", ["packed", "plain", "fp8"])
@pytest.mark.parametrize("family", ["qwen3", "phi3"])
def test_runner_update_tensors_in_buckets_equals_the_new_checkpoint(tmp_path, monkeypatch, family, layout):
    """SGLang's update from tensors, a trainer's buckets: each call replaces some tensors and keeps the rest (the
    earlier buckets' included); a tensor the checkpoint lacks, or of another shape, changes nothing. Plain tensors
    (CUDA's layout) and packed layers: each tensor is copied into its place (a fused q/k/v or gate/up too; a packed
    layer read back, loaded and packed again) and no checkpoint file is read. fp8 weights: the model is built again
    from the checkpoint and the tensors sent."""
    from safetensors.torch import load_file

    import radixrt.model.runner as runner_module

    if layout == "plain":
        monkeypatch.setenv("RADIXRT_DISABLE_PACKED_LINEAR", "1")
    quantization = "fp8" if layout == "fp8" else None
    save_tiny_model(family, tmp_path / "old", seed=0)
    save_tiny_model(family, tmp_path / "new", seed=1)
    runner = ModelRunner(tmp_path / "old", dtype="float32", page_size=4, num_pages=16, quantization=quantization)
    fresh = _logits(ModelRunner(tmp_path / "new", dtype="float32", page_size=4, num_pages=16,
                                quantization=quantization))
    assert (runner.packed_linears > 0) == (layout != "plain")
    before = _logits(runner)
    addresses = {name: p.data_ptr() for name, p in runner.model.named_parameters()}
    new = sorted(load_file(tmp_path / "new" / "model.safetensors").items())
    with pytest.raises(ValueError, match="not a tensor of the served checkpoint"):
        runner.update_tensors({new[1][0]: new[1][1], "model.layers.9.mlp.up_proj.weight": new[0][1]})
    with pytest.raises(ValueError, match="shape"):
        runner.update_tensors({new[1][0]: new[1][1], new[0][0]: new[0][1][:1]})
    assert torch.equal(_logits(runner), before)
    packed_layers = sum(getattr(m, "packed", None) is not None for m in runner.model.modules())
    if layout != "fp8":
        def no_reading(path):
            raise AssertionError(f"read {path} for an update in place")
        monkeypatch.setattr(runner_module, "iterate_safetensors", no_reading)
    if layout != "fp8":  # one shard of a merged q/k/v: the others keep their values
        old = load_file(tmp_path / "old" / "model.safetensors")
        q = next(name for name, _ in new if name.endswith("layers.0.self_attn.q_proj.weight")
                 or name.endswith("layers.0.self_attn.qkv_proj.weight"))
        if q.endswith("q_proj.weight"):
            runner.update_tensors({q: dict(new)[q]})
            assert torch.equal(runner.read_weight(q), dict(new)[q])
            k = q.replace("q_proj", "k_proj")
            assert torch.equal(runner.read_weight(k), old[k])
    runner.update_tensors(dict(new[: len(new) // 2]))
    half = _logits(runner)
    assert not torch.equal(half, before) and not torch.equal(half, fresh)
    runner.update_tensors(dict(new[len(new) // 2:]))
    assert torch.equal(_logits(runner), fresh)
    if layout == "fp8":
        assert len(runner.overlay) == len(new)
        runner.update_weights(tmp_path / "old")  # from disk: the tensors sent are dropped
        assert runner.overlay == {} and torch.equal(_logits(runner), before)
        return
    for name, tensor in new:
        assert torch.equal(runner.read_weight(name), tensor), name
    assert runner.overlay == {}
    assert {name: p.data_ptr() for name, p in runner.model.named_parameters()} == addresses
    assert sum(getattr(m, "packed", None) is not None for m in runner.model.modules()) == packed_layers


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "plain"])
@pytest.mark.parametrize("family", ["llama", "phi3", "qwen3-moe"])
def test_read_weight_gives_the_served_values_in_the_checkpoint_layout(tmp_path, monkeypatch, family, packed, dtype):
    """SGLang's get_weights_by_name: every checkpoint tensor read back from the served model (a packed weight
    through its kernel; a fused q/k/v or gate/up, an expert, a tied head) equals the checkpoint's, rounded to the
    served dtype."""
    from safetensors.torch import load_file

    if not packed:
        monkeypatch.setenv("RADIXRT_DISABLE_PACKED_LINEAR", "1")
    save_tiny_model(family, tmp_path, seed=0)
    runner = ModelRunner(tmp_path, dtype=dtype, page_size=4, num_pages=16)
    if packed and dtype == "float32":
        assert runner.packed_linears > 0
    tensors = load_file(tmp_path / "model.safetensors")
    for name, tensor in tensors.items():
        assert torch.equal(runner.read_weight(name), tensor.to(getattr(torch, dtype))), name
    head = "lm_head.weight" if "lm_head.weight" in tensors else "model.embed_tokens.weight"
    assert torch.equal(runner.read_weight("lm_head.weight"), tensors[head].to(getattr(torch, dtype)))
    with pytest.raises(KeyError, match="not a tensor of the served checkpoint"):
        runner.read_weight("model.layers.0.mlp.nothing.weight")


def test_runner_refuses_another_model_and_keeps_its_weights(tmp_path):
    save_tiny_model("llama", tmp_path / "old", seed=0)
    save_tiny_model("qwen3", tmp_path / "other", seed=0)
    runner = ModelRunner(tmp_path / "old", dtype="float32", page_size=4, num_pages=16)
    before = _logits(runner)
    with pytest.raises(ValueError, match="not the served model with other weights.*(model_type|architectures)"):
        runner.update_weights(tmp_path / "other")
    # the same config, a tensor missing: the loader's error, raised before anything changed
    shutil.copytree(tmp_path / "old", tmp_path / "partial")
    from safetensors.torch import load_file, save_file

    tensors = load_file(tmp_path / "old" / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, tmp_path / "partial" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="filled"):
        runner.update_weights(tmp_path / "partial")
    with pytest.raises(OSError):
        runner.update_weights(tmp_path / "nowhere")
    assert torch.equal(_logits(runner), before)
    assert runner.model_path == tmp_path / "old"


# ----- the Engine -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tuned_path(tmp_path_factory, default_model_path):
    return perturbed_checkpoint(default_model_path, tmp_path_factory.mktemp("tuned"))


@pytest.fixture(scope="module")
def references(hf_model, tuned_path, tokenizer):
    """transformers' greedy tokens for each prompt on the served weights and on the tuned ones."""
    from transformers import AutoModelForCausalLM

    tuned = AutoModelForCausalLM.from_pretrained(tuned_path, dtype=torch.float32).eval()
    ids = [tokenizer.encode(p) for p in PROMPTS]
    n = GREEDY["max_new_tokens"]
    long_old = hf_greedy(hf_model, ids[0], 24)  # greedy: its first n tokens are the short run's
    old = [long_old[:n]] + [hf_greedy(hf_model, i, n) for i in ids[1:]]
    new = [hf_greedy(tuned, i, n) for i in ids]
    assert old != new  # the update must show in the tokens
    return {"old": old, "new": new, "long_old": long_old}


@pytest.fixture
def engine(default_model_path):
    with radixrt.Engine(dtype="float32", log_interval=0, debug_checks=True, kv_memory_gb=0.3) as eng:
        yield eng


def _tokens(engine) -> list[list[int]]:
    return [o["output_ids"] for o in engine.generate(PROMPTS, GREEDY)]


@pytest.mark.model
def test_update_serves_the_new_weights_and_drops_the_cache(engine, tuned_path, default_model_path, references):
    assert _tokens(engine) == references["old"]
    assert engine.generate(PROMPTS[0], GREEDY)["meta_info"]["cached_tokens"] > 0
    ok, message, paused = engine.update_weights_from_disk(str(tuned_path), weight_version="step-1")
    assert ok, message
    assert "Succeeded" in message and paused == 0
    first = engine.generate(PROMPTS[0], GREEDY)
    assert first["meta_info"]["cached_tokens"] == 0  # the old weights' pages were dropped
    assert first["meta_info"]["weight_version"] == "step-1"
    assert _tokens(engine) == references["new"]
    info = engine.get_model_info()
    assert info["model_path"] == str(tuned_path) and info["weight_version"] == "step-1"
    assert engine.get_weight_version() == "step-1"
    # and back, keeping the cache as asked: the first prompt's pages, computed with the tuned weights, are read
    ok, message, _ = engine.update_weights_from_disk(str(default_model_path), flush_cache=False)
    assert ok and "Cache flushed" not in message
    assert engine.get_weight_version() == "step-1"  # no version given: it stays
    stale, fresh = engine.generate(PROMPTS, GREEDY)
    assert stale["meta_info"]["cached_tokens"] > 0
    assert fresh["output_ids"] == references["old"][1]  # shorter than a page: never cached
    assert engine.flush_cache()
    assert _tokens(engine) == references["old"]
    engine.scheduler.check()


@pytest.mark.model
def test_update_from_tensors_in_buckets(engine, tuned_path, references):
    from safetensors.torch import load_file

    tensors = sorted(load_file(tuned_path / "model.safetensors").items())
    buckets = [tensors[: len(tensors) // 3], tensors[len(tensors) // 3:]]
    ok, message = engine.update_weights_from_tensor(buckets[0], flush_cache=False)
    assert ok, message
    ok, message = engine.update_weights_from_tensor(buckets[1], weight_version="tensors-1")
    assert ok, message
    assert _tokens(engine) == references["new"]
    assert engine.get_weight_version() == "tensors-1"
    ok, message = engine.update_weights_from_tensor([("model.no_such.weight", tensors[0][1])])
    assert not ok and "not a tensor of the served checkpoint" in message
    assert _tokens(engine) == references["new"]


@pytest.mark.model
def test_requests_in_flight_finish_on_their_weights_and_later_ones_wait(engine, tuned_path, references):
    """SGLang's order: the update waits for the requests already sent; requests sent after it wait for it."""
    long = {**GREEDY, "max_new_tokens": 24}
    results: dict[str, object] = {}
    first = running_in_background(engine, results, long)
    update = threading.Thread(target=lambda: results.update(update=engine.update_weights_from_disk(str(tuned_path))))
    update.start()
    wait_until(lambda: engine.scheduler.gate.pending is not None, "the update to wait")
    later = engine.generate(PROMPTS[1], GREEDY)  # held until the update is done
    first.join()
    update.join()
    assert results["update"][0], results["update"]
    assert results["first"]["output_ids"] == references["long_old"]
    assert later["output_ids"] == references["new"][1]
    engine.scheduler.check()


@pytest.mark.model
def test_abort_all_requests_ends_the_requests_in_flight(engine, tuned_path, references):
    results: dict[str, object] = {}
    long = {**GREEDY, "max_new_tokens": 200}
    first = running_in_background(engine, results, long)
    ok, message, _ = engine.update_weights_from_disk(str(tuned_path), abort_all_requests=True)
    first.join()
    assert ok, message
    assert results["first"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert _tokens(engine) == references["new"]


@pytest.mark.model
def test_a_failed_update_keeps_serving_the_old_weights(engine, tmp_path, references):
    save_tiny_model("llama", tmp_path / "tiny")
    for path, load_format, expected in [(str(tmp_path / "nowhere"), None, "nowhere"),
                                        (str(tmp_path / "tiny"), None, "not the served model"),
                                        (str(tmp_path / "tiny"), "pt", "load_format")]:
        ok, message, _ = engine.update_weights_from_disk(path, load_format=load_format)
        assert not ok and expected in message, message
    assert _tokens(engine) == references["old"]
    assert engine.get_model_info()["weight_version"] == "default"


@pytest.mark.model
def test_pause_abort_holds_later_requests_until_continue(engine, references):
    results: dict[str, object] = {}
    first = running_in_background(engine, results, {**GREEDY, "max_new_tokens": 200})
    engine.pause_generation("abort")
    first.join()
    assert results["first"]["meta_info"]["finish_reason"]["type"] == "abort"
    later = threading.Thread(target=lambda: results.update(later=engine.generate(PROMPTS[1], GREEDY)))
    later.start()
    later.join(timeout=1.0)
    assert later.is_alive() and len(engine.scheduler.gate.held) == 1  # paused: it waits
    engine.continue_generation()
    later.join()
    assert results["later"]["output_ids"] == references["old"][1]
    with pytest.raises(ValueError, match="pause mode"):
        engine.pause_generation("sideways")


@pytest.mark.model
def test_pause_retract_frees_the_pages_and_continues(engine):
    results: dict[str, object] = {}
    params = {**GREEDY, "max_new_tokens": 40}
    first = running_in_background(engine, results, params)
    engine.pause_generation("retract")
    scheduler = engine.scheduler
    assert not scheduler.running and len(scheduler.waiting) == 1
    assert scheduler.waiting[0].pages == [] and scheduler.waiting[0].num_retractions == 1
    engine.continue_generation()
    first.join()
    out = results["first"]
    assert out["meta_info"]["finish_reason"]["type"] == "length" and len(out["output_ids"]) == 40
    scheduler.check()


@pytest.mark.model
def test_pause_wait_returns_once_the_requests_in_flight_finished(engine, references):
    """vLLM's mode: the request in flight finishes with its own tokens before the pause is answered; one sent
    while paused waits for the continue; clear_cache drops the pages the finished request left."""
    results: dict[str, object] = {}
    first = running_in_background(engine, results, {**GREEDY, "max_new_tokens": 24})
    assert not engine.is_paused()
    engine.pause_generation("wait", clear_cache=True)
    # the request finished before the pause was answered; its answer may still be on its way to its caller
    assert not engine.scheduler.running and not engine.scheduler.waiting
    first.join()
    assert results["first"]["output_ids"] == references["long_old"]
    assert engine.is_paused() and engine.scheduler.cache.cached_pages == 0
    second = threading.Thread(target=lambda: results.update(second=engine.generate(PROMPTS[0], GREEDY)))
    second.start()
    second.join(timeout=1.0)
    assert second.is_alive()
    engine.continue_generation()
    second.join()
    assert not engine.is_paused()
    assert results["second"]["output_ids"] == references["old"][0]
    assert results["second"]["meta_info"]["cached_tokens"] == 0
    with pytest.raises(ValueError, match="in_place"):
        engine.pause_generation("in_place", clear_cache=True)
    engine.scheduler.check()


@pytest.mark.model
def test_a_continue_calls_off_a_pause_still_waiting(engine):
    results: dict[str, object] = {}
    first = running_in_background(engine, results, {**GREEDY, "max_new_tokens": 40})
    pausing = threading.Thread(target=lambda: results.update(pause=engine.pause_generation("wait")))
    pausing.start()
    wait_until(lambda: engine.scheduler.gate.pending is not None, "the pause waiting")
    engine.continue_generation()
    pausing.join(timeout=30)
    assert not pausing.is_alive() and not engine.is_paused()
    first.join()
    assert len(results["first"]["output_ids"]) == 40
    assert engine.generate(PROMPTS[1], GREEDY)["meta_info"]["finish_reason"]["type"] == "length"


@pytest.mark.model
def test_pause_in_place_keeps_pages_and_an_update_must_keep_the_cache(engine, tuned_path):
    results: dict[str, object] = {}
    params = {**GREEDY, "max_new_tokens": 40}
    first = running_in_background(engine, results, params)
    engine.pause_generation("in_place")
    req = engine.scheduler.running[0]
    computed, pages = req.num_computed, list(req.pages)
    ok, message, _ = engine.update_weights_from_disk(str(tuned_path))  # would flush pages a request holds: 409
    assert not ok and "paused in place" in message
    assert engine.get_model_info()["model_path"] != str(tuned_path)
    ok, message, _ = engine.update_weights_from_disk(str(tuned_path), flush_cache=False)
    assert ok, message
    assert req.num_computed == computed and req.pages == pages  # it waited where it was
    engine.continue_generation()
    first.join()
    assert len(results["first"]["output_ids"]) == 40
    engine.scheduler.check()


@pytest.mark.model
def test_weight_version_names_the_served_weights(engine):
    assert engine.get_weight_version() == "default"
    assert engine.generate(PROMPTS[0], GREEDY)["meta_info"]["weight_version"] == "default"
    assert engine.update_weight_version("rollout-7") == "rollout-7"
    assert engine.generate(PROMPTS[0], GREEDY)["meta_info"]["weight_version"] == "rollout-7"
    assert engine.get_model_info()["weight_version"] == "rollout-7"


# ----- the HTTP routes ------------------------------------------------------------------------------------

# A server of its own, not the session's shared one (an equal list is not shared): these tests change its weights.
SERVER_ARGS = ["--dtype", "float32", "--kv-memory-gb", "0.2", "--log-interval", "0", "--debug-checks"]


def _generate(http, prompt: str) -> dict:
    res = http.post("/generate", json={"text": prompt, "sampling_params": GREEDY})
    assert res.status_code == 200, res.text
    return res.json()


@pytest.mark.model
def test_http_routes_update_pause_and_name_the_weights(http, tuned_path, references):
    assert http.get("/get_weight_version").json() == {"weight_version": "default"}
    res = http.post("/update_weights_from_disk", json={"model_path": str(tuned_path), "weight_version": "v1"})
    assert res.status_code == 200, res.text
    answer = res.json()
    assert answer["success"] is True and answer["num_paused_requests"] == 0 and "Succeeded" in answer["message"]
    out = [_generate(http, p) for p in PROMPTS]
    assert [o["output_ids"] for o in out] == references["new"]
    assert out[0]["meta_info"]["weight_version"] == "v1"
    info = http.get("/model_info").json()
    assert info["model_path"] == str(tuned_path) and info["weight_version"] == "v1"
    # refusals: SGLang's answer with success false, and the server keeps serving the weights it has
    for body, status, words in [({"model_path": "/nowhere/at/all"}, 400, "nowhere"),
                                ({"model_path": str(tuned_path), "is_async": True}, 400, "synchronously")]:
        res = http.post("/update_weights_from_disk", json=body)
        assert res.status_code == status and res.json()["success"] is False and words in res.json()["message"]
    assert http.post("/update_weights_from_disk", json={"model_path": str(tuned_path),
                                                        "load_format": "pt"}).status_code == 400
    assert http.post("/pause_generation", json={"mode": "sideways"}).status_code == 400
    # a pause holds a request until /continue_generation
    assert http.post("/pause_generation", json={"mode": "abort"}).json() == {
        "message": "Generation paused successfully.", "status": "ok"}
    results: dict[str, dict] = {}
    waiting = threading.Thread(target=lambda: results.update(out=_generate(http, PROMPTS[1])))
    waiting.start()
    waiting.join(timeout=1.0)
    assert waiting.is_alive()
    assert http.get("/health_generate").json() == {"status": "ok", "paused": True}  # alive, paused on purpose
    assert http.post("/continue_generation").json()["status"] == "ok"
    waiting.join()
    assert results["out"]["output_ids"] == references["new"][1]
    # vLLM's pause routes
    assert http.get("/is_paused").json() == {"is_paused": False}
    assert http.post("/pause", params={"mode": "keep"}).json() == {"status": "paused"}
    assert http.get("/is_paused").json() == {"is_paused": True}
    assert http.post("/resume").json() == {"status": "resumed"}
    assert http.post("/pause", params={"mode": "wait", "clear_cache": "true"}).json() == {"status": "paused"}
    assert http.post("/resume").json() == {"status": "resumed"} and http.get("/is_paused").json()["is_paused"] is False
    for params in ({"mode": "sideways"}, {"clear_cache": "maybe"}):
        assert http.post("/pause", params=params).status_code == 400
    assert http.get("/is_paused").json() == {"is_paused": False}
    res = http.post("/update_weight_version", json={"new_version": "v2"})
    assert res.json() == {"success": True, "message": "Weight version updated to v2", "new_version": "v2"}
    assert http.get("/get_weight_version").json() == {"weight_version": "v2"}
    assert _generate(http, PROMPTS[1])["meta_info"]["weight_version"] == "v2"


@pytest.mark.model
def test_http_routes_join_a_trainer_take_its_broadcast_and_read_the_weights_back(http, tuned_path, references,
                                                                                default_model_path, tmp_path):
    """SGLang's /init_weights_update_group, /update_weights_from_distributed, /destroy_weights_update_group and
    /get_weights_by_name, a trainer in a process of its own (tests/weight_trainer.py)."""
    from safetensors.torch import load_file

    from weight_trainer import GROUP, announce, start_trainer

    assert http.post("/update_weights_from_disk", json={"model_path": str(default_model_path)}).status_code == 200
    tensors = sorted(load_file(tuned_path / "model.safetensors").items())
    name, value = tensors[-1]
    served = http.post("/get_weights_by_name", json={"name": name, "truncate_size": 3})
    assert served.status_code == 200, served.text
    assert served.json() != value[:3].float().tolist()
    trainer, port = start_trainer(tmp_path, tuned_path, [[n for n, _ in tensors]])
    try:
        res = http.post("/init_weights_update_group", json={"master_address": "127.0.0.1", "master_port": port,
                                                            "rank_offset": 1, "world_size": 2, "backend": "gloo"})
        assert res.json() == {"success": True, "message": f"Succeeded to initialize group {GROUP}."}
        res = http.post("/update_weights_from_distributed", json={**announce(tensors), "weight_version": "rl-1"})
        assert res.status_code == 200 and res.json()["success"] is True, res.text
        assert trainer.wait(timeout=60) == 0
    finally:
        trainer.kill()
    assert [_generate(http, p)["output_ids"] for p in PROMPTS] == references["new"]
    assert http.get("/get_weight_version").json() == {"weight_version": "rl-1"}
    served = http.request("GET", "/get_weights_by_name", json={"name": name, "truncate_size": 3}).json()
    assert served == value[:3].float().tolist()
    assert http.post("/destroy_weights_update_group", json={}).json()["success"] is True
    for path, body, status, words in [
        ("/destroy_weights_update_group", {"group_name": GROUP}, 404, "no weight group"),
        ("/update_weights_from_distributed", announce(tensors[:1]), 404, "no weight group"),
        ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
                                        "world_size": 2}, 400, "backend nccl needs a runtime on CUDA"),
        ("/get_weights_by_name", {"name": "model.nothing.weight"}, 404, "not a tensor of the served checkpoint"),
    ]:
        res = http.post(path, json=body)
        assert res.status_code == status and words in res.text, (path, res.text)

