"""Updates of weights by broadcast from a trainer's process (SGLang's ``init_weights_update_group``,
``update_weights_from_distributed``, ``destroy_weights_update_group``), with a trainer in a process of its own
(tests/weight_trainer.py) joined over gloo: the broadcast tensors give transformers' tokens on the new weights; bad
calls, a tensor the checkpoint lacks and a trainer that dies mid-update are the call's error and the served weights
keep serving."""

from __future__ import annotations

import pytest
import torch

import radixrt
from test_weight_update import GREEDY, PROMPTS, _tokens, hf_greedy, perturbed_checkpoint
from weight_trainer import GROUP, announce, start_trainer


@pytest.fixture(scope="module")
def tuned(tmp_path_factory, default_model_path, hf_model, tokenizer):
    """A perturbed copy of the default model, its tensors in checkpoint order, and transformers' greedy tokens on
    the served weights and on it."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    path = perturbed_checkpoint(default_model_path, tmp_path_factory.mktemp("tuned"), seed=1)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = [tokenizer.encode(p) for p in PROMPTS]
    n = GREEDY["max_new_tokens"]
    old, new = [hf_greedy(hf_model, i, n) for i in ids], [hf_greedy(model, i, n) for i in ids]
    assert old != new
    return {"path": path, "tensors": sorted(load_file(path / "model.safetensors").items()), "old": old, "new": new}


@pytest.fixture
def engine(default_model_path):
    with radixrt.Engine(dtype="float32", log_interval=0, debug_checks=True, kv_memory_gb=0.3) as eng:
        yield eng


@pytest.mark.model
def test_broadcast_buckets_serve_the_trainers_weights(engine, tuned, tmp_path):
    tensors = tuned["tensors"]
    buckets = [tensors[:5], tensors[5:]]
    trainer, port = start_trainer(tmp_path, tuned["path"], [[name for name, _ in b] for b in [buckets[0], *buckets]])
    try:
        ok, message = engine.init_weights_update_group("127.0.0.1", port, 1, 2, GROUP, backend="gloo")
        assert ok, message
        assert _tokens(engine) == tuned["old"]
        # the first bucket announced under a name the checkpoint lacks: received, refused, nothing changes
        wrong = announce(buckets[0])
        wrong["names"][0] = "model.no_such.weight"
        ok, message = engine.update_weights_from_distributed(**wrong, group_name=GROUP)
        assert not ok and "not a tensor of the served checkpoint" in message
        assert _tokens(engine) == tuned["old"]
        ok, message = engine.update_weights_from_distributed(**announce(buckets[0]), flush_cache=False)
        assert ok, message
        ok, message = engine.update_weights_from_distributed(**announce(buckets[1]), weight_version="rl-step-1")
        assert ok, message
        assert _tokens(engine) == tuned["new"]
        assert engine.get_weight_version() == "rl-step-1"
        assert trainer.wait(timeout=60) == 0
        assert engine.destroy_weights_update_group(GROUP)[0]
        ok, message = engine.destroy_weights_update_group(GROUP)
        assert not ok and "no weight group" in message
    finally:
        trainer.kill()
    engine.scheduler.check()


@pytest.mark.model
def test_a_trainer_dying_mid_update_fails_that_update_only(engine, tuned, tmp_path):
    tensors = tuned["tensors"]
    trainer, port = start_trainer(tmp_path, tuned["path"], [[name for name, _ in tensors]], die_after=3)
    try:
        assert engine.init_weights_update_group("127.0.0.1", port, 1, 2, GROUP, backend="gloo")[0]
        ok, message = engine.update_weights_from_distributed(**announce(tensors))
        assert not ok and "the group is left" in message
        assert trainer.wait(timeout=60) == 3
    finally:
        trainer.kill()
    assert _tokens(engine) == tuned["old"]
    ok, message = engine.update_weights_from_distributed(**announce(tensors[:1]))
    assert not ok and "no weight group" in message


@pytest.mark.model
def test_bad_group_calls_are_refused_and_the_engine_keeps_serving(engine, tuned):
    port = 29555  # nothing listens: each call is refused before any rendezvous
    for kwargs, expected in [
        ({"backend": "nccl"}, "backend nccl needs a runtime on CUDA"),
        ({"backend": "mpi"}, "choose gloo or nccl"),
        ({"rank_offset": 0, "backend": "gloo"}, "the trainer is rank 0"),
        ({"world_size": 1, "rank_offset": 1, "backend": "gloo"}, "the trainer is rank 0"),
    ]:
        call = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2, **kwargs}
        ok, message = engine.init_weights_update_group(**call)
        assert not ok and expected in message, (kwargs, message)
    ok, message = engine.update_weights_from_distributed(["a"], ["bfloat16", "float32"], [[1]])
    assert not ok and "no weight group" in message
    assert _tokens(engine) == tuned["old"]


@pytest.mark.model
def test_a_stopped_engine_leaves_its_groups(engine, tuned, tmp_path):
    """The group's name is free again in this process once the Engine that joined it stops."""
    trainer, port = start_trainer(tmp_path, tuned["path"], [])
    assert engine.init_weights_update_group("127.0.0.1", port, 1, 2, GROUP, backend="gloo")[0]
    assert trainer.wait(timeout=60) == 0
    engine.shutdown()
    trainer, port = start_trainer(tmp_path, tuned["path"], [])
    with radixrt.Engine(dtype="float32", log_interval=0, kv_memory_gb=0.1) as again:
        ok, message = again.init_weights_update_group("127.0.0.1", port, 1, 2, GROUP, backend="gloo")
        assert ok, message
    assert trainer.wait(timeout=60) == 0


@pytest.mark.model
def test_get_weights_by_name_reads_rows_and_refuses_what_it_cannot(engine, hf_model):
    norm = engine.get_weights_by_name("model.norm.weight", truncate_size=5)
    assert norm == hf_model.get_parameter("model.norm.weight")[:5].tolist()
    rows = engine.get_weights_by_name("model.layers.0.self_attn.k_proj.weight", truncate_size=2)
    assert rows == hf_model.get_parameter("model.layers.0.self_attn.k_proj.weight")[:2].tolist()
    for name, size, words in [("model.nothing.weight", 1, "not a tensor of the served checkpoint"),
                              ("model.norm.weight", -1, "negative"),
                              ("model.embed_tokens.weight", 49152, "ask for fewer rows")]:
        with pytest.raises(ValueError, match=words):
            engine.get_weights_by_name(name, truncate_size=size)
    assert engine.generate(PROMPTS[1], GREEDY)["meta_info"]["finish_reason"]["type"] == "length"
