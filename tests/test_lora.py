"""LoRA adapters: PEFT's format loaded, each adapter's rows of a mixed batch against PEFT's model on tiny
checkpoints (fp32), the cache namespaces, the options and the refusals."""

import json
import re

import pytest
import torch

from radixrt.memory.page_pool import KVLayout, PagePool
from radixrt.memory.radix_cache import RadixCache
from radixrt.model import lora_batch
from radixrt.model.lora import AdapterError
from radixrt.model.runner import ModelRunner
from radixrt.protocol.errors import RequestError
from radixrt.protocol.request import lora_paths_from
from radixrt.server_args import ServerArgs
from lora_adapters import peft_model, save_adapter
from test_model_exact import PROMPTS, run_ours
from tiny_models import save_tiny_model


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "gemma3"])
def family(request, tmp_path_factory):
    """A tiny model and three adapters of it: every projection; a few projections in one layer with a rank per
    module; rsLoRA scaling on the MLP. With PEFT's logits of each prompt under each (None: the base model)."""
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    folder = root / "model"
    save_tiny_model(request.param, folder)
    adapters = {
        "all": save_adapter(folder, root / "all", r=4, alpha=8, seed=1, std=0.15),
        "some": save_adapter(folder, root / "some", r=8, alpha=16, seed=2, std=0.15,
                             targets=("q_proj", "v_proj", "down_proj"), layers=[1], rank_pattern={"v_proj": 2}),
        "mlp": save_adapter(folder, root / "mlp", r=6, alpha=12, seed=3, std=0.2, use_rslora=True,
                            targets=("gate_proj", "up_proj", "down_proj")),
    }
    expected = {}
    with torch.no_grad():
        for name, path in [(None, None), *adapters.items()]:
            model = peft_model(folder, path)
            expected[name] = [model(torch.tensor([p])).logits[0] for p in PROMPTS]
    return folder, adapters, expected


def _runner(folder, adapters, **kwargs) -> ModelRunner:
    return ModelRunner(folder, dtype="float32", page_size=4, num_pages=64, enable_lora=True,
                       lora_adapters=[(n, str(p)) for n, p in adapters.items()], **kwargs)


@pytest.mark.parametrize("way", ["stacked", "grouped"])
@pytest.mark.parametrize("mode", ["one_extend", "decode_steps", "mixed"])
def test_each_adapters_rows_of_a_mixed_batch_equal_peft(family, mode, way, monkeypatch):
    """Every row through all the batch's adapters, masked (the way of decode steps), or each adapter's rows
    through its own (prefill chunks): the same logits."""
    monkeypatch.setattr(lora_batch, "STACKED_MAX_ROWS", 10**9 if way == "stacked" else 0)
    folder, adapters, expected = family
    runner = _runner(folder, adapters)
    # the three prompts in one batch, each through another adapter (or none), in every rotation
    names = [None, *adapters]
    for shift in range(len(names)):
        chosen = [names[(i + shift) % len(names)] for i in range(len(PROMPTS))]
        uids = [0 if n is None else runner.adapters.uid_of(n) for n in chosen]
        got = run_ours(runner, PROMPTS, mode, lora_uids=uids)
        for i, (ours, name) in enumerate(zip(got, chosen)):
            ref = expected[name][i]
            assert (ours - ref).abs().max().item() <= 1e-4, (name, i)
    # the adapters change the logits (else the comparison above proves nothing)
    for name in adapters:
        assert (expected[name][0] - expected[None][0]).abs().max().item() > 1e-2, name


def test_bf16_adapter_rows_stay_close_to_peft(family):
    """bf16 (the dtype `auto` picks on AVX512-BF16 and AMX CPUs): each adapter's rows within bf16's error of PEFT's
    fp32 logits, by the bound the base model's bf16 test uses."""
    folder, adapters, expected = family
    runner = ModelRunner(folder, dtype="bfloat16", page_size=4, num_pages=64, enable_lora=True,
                         lora_adapters=[(n, str(p)) for n, p in adapters.items()])
    names = list(adapters)
    got = run_ours(runner, PROMPTS, "prefix_then_rest", lora_uids=[runner.adapters.uid_of(n) for n in names])
    for i, (ours, name) in enumerate(zip(got, names)):
        ref = expected[name][i]
        assert (ours - ref).abs().max().item() <= 0.05 * ref.abs().max().item() + 0.02, name


def test_adapters_load_as_peft_saved_them(family):
    folder, adapters, _ = family
    runner = _runner(folder, adapters)
    some = runner.adapters.by_name["some"]
    assert some.targets == ("q_proj", "v_proj", "down_proj") and some.rank == 8
    assert {layer for layer, _ in some.updates} == {1}
    assert runner.adapters.by_name["all"].targets == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                      "down_proj")
    uids = {a.uid for a in runner.adapters.by_name.values()}
    assert len(uids) == 3 and 0 not in uids


def test_an_adapter_loaded_again_gets_a_new_uid(family, tmp_path):
    folder, adapters, _ = family
    runner = _runner(folder, {"all": adapters["all"]})
    first = runner.adapters.uid_of("all")
    runner.adapters.unload("all")
    with pytest.raises(AdapterError, match="unknown LoRA adapter 'all'"):
        runner.adapters.uid_of("all")
    runner.adapters.load("all", str(adapters["mlp"]))
    assert runner.adapters.uid_of("all") != first
    with pytest.raises(AdapterError, match="already loaded"):
        runner.adapters.load("all", str(adapters["mlp"]))
    with pytest.raises(AdapterError, match="no LoRA adapter named 'none'"):
        runner.adapters.unload("none")


def _edit_adapter(src, dst, config_changes=None, tensors=None):
    """A copy of adapter ``src`` with its config changed and its tensors replaced by ``tensors(dict)``."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    config = json.loads((src / "adapter_config.json").read_text())
    config.update(config_changes or {})
    (dst / "adapter_config.json").write_text(json.dumps(config))
    weights = load_file(src / "adapter_model.safetensors")
    save_file(tensors(weights) if tensors else weights, dst / "adapter_model.safetensors")
    return dst


def _first_key(weights, part):
    return next(k for k in sorted(weights) if part in k)


@pytest.mark.parametrize("case,message", [
    ("dora", "DoRA"), ("bias", "trained biases"), ("modules_to_save", "modules_to_save"),
    ("alpha_pattern", "alpha_pattern"), ("prompt_tuning", "PROMPT_TUNING adapter"),
    ("embedding", "targets no projection"), ("layer_out_of_range", "has no place in this model"),
    ("missing_b", "lora_B missing"), ("wrong_shape", "do not fit"), ("no_config", "no adapter_config.json"),
    ("not_a_folder", "is not a folder"), ("no_weights", "neither adapter_model.safetensors"),
])
def test_adapters_radixrt_cannot_serve_are_refused_by_what_they_are(family, tmp_path, case, message):
    folder, adapters, _ = family
    src = adapters["all"]
    dst = tmp_path / case
    if case == "dora":
        _edit_adapter(src, dst, {"use_dora": True})
    elif case == "bias":
        _edit_adapter(src, dst, {"bias": "lora_only"})
    elif case == "modules_to_save":
        _edit_adapter(src, dst, {"modules_to_save": ["lm_head"]})
    elif case == "alpha_pattern":
        _edit_adapter(src, dst, {"alpha_pattern": {"q_proj": 4}})
    elif case == "prompt_tuning":
        _edit_adapter(src, dst, {"peft_type": "PROMPT_TUNING"})
    elif case == "embedding":
        _edit_adapter(src, dst, tensors=lambda w: {**w, "base_model.model.model.embed_tokens.lora_embedding_A":
                                                   torch.zeros(4, 128)})
    elif case == "layer_out_of_range":
        _edit_adapter(src, dst, tensors=lambda w: {k.replace("layers.1.", "layers.7."): v for k, v in w.items()})
    elif case == "missing_b":
        _edit_adapter(src, dst, tensors=lambda w: {k: v for k, v in w.items() if k != _first_key(w, "lora_B")})
    elif case == "wrong_shape":
        _edit_adapter(src, dst, tensors=lambda w: {k: (v[:, :-1].contiguous() if k == _first_key(w, "lora_A") else v)
                                                   for k, v in w.items()})
    elif case == "no_config":
        dst.mkdir()
    elif case == "not_a_folder":
        dst = tmp_path / "missing" / "adapter"
    elif case == "no_weights":
        dst.mkdir()
        (dst / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    runner = _runner(folder, {})
    with pytest.raises(AdapterError, match=message):
        runner.adapters.load("bad", str(dst))
    assert runner.adapters.by_name == {}


def test_an_adapter_above_the_rank_limit_is_refused(family):
    folder, adapters, _ = family
    runner = _runner(folder, {}, max_lora_rank=4)
    runner.adapters.load("all", str(adapters["all"]))  # rank 4
    with pytest.raises(AdapterError, match="rank 8 is above --max-lora-rank 4"):
        runner.adapters.load("some", str(adapters["some"]))


# ----- the cache's namespaces ---------------------------------------------------------------------------


def _cache(pages: int = 16) -> RadixCache:
    layout = KVLayout(num_layers=1, kv_heads=1, head_dim=4, page_size=2, dtype=torch.float32)
    return RadixCache(PagePool(layout, pages, "cpu"))


def test_the_same_tokens_in_two_namespaces_share_no_pages():
    cache = _cache()
    tokens = [5, 6, 7, 8, 9, 10]
    base_pages = cache.pool.alloc(3)
    cache.insert(tokens, base_pages)
    assert cache.match_prefix(tokens, namespace=1).num_tokens == 0
    assert cache.match_prefix(tokens).pages == base_pages
    adapter_pages = cache.pool.alloc(3)
    result = cache.insert(tokens, adapter_pages, namespace=1)
    assert result.tree_pages == adapter_pages and result.duplicates == []
    assert cache.match_prefix(tokens, namespace=1).pages == adapter_pages
    assert cache.match_prefix(tokens, namespace=2).num_tokens == 0
    assert cache.match_prefix(tokens[:4]).pages == base_pages[:2]
    cache.check()
    assert cache.evict(6) == 6
    cache.check()


# ----- options and request fields ----------------------------------------------------------------------


def test_lora_paths_take_sglangs_three_forms():
    args = ServerArgs(lora_paths=["/adapters/a", "b=/adapters/b", '{"lora_name": "c", "lora_path": "hub/c"}'])
    assert args.enable_lora
    assert args.lora_adapters() == [("/adapters/a", "/adapters/a"), ("b", "/adapters/b"), ("c", "hub/c")]
    assert ServerArgs(lora_paths="x=/y").lora_adapters() == [("x", "/y")]  # one path as a string, as SGLang's Runtime


def test_lora_options_parse_from_the_command_line():
    import argparse

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(["--lora-paths", "a=/x", "b=/y", "--max-loras-per-batch", "2", "--max-lora-rank", "16",
                            "--lora-target-modules", "q_proj", "v_proj", "--lora-backend", "csgmv"])
    args = ServerArgs.from_cli_args(ns)
    assert args.lora_adapters() == [("a", "/x"), ("b", "/y")]
    assert (args.max_loras_per_batch, args.max_lora_rank, args.enable_lora) == (2, 16, True)


@pytest.mark.parametrize("options,message", [
    ({"lora_paths": ["a=/x", "a=/y"]}, "names an adapter twice: a"),
    ({"lora_paths": ["{not json"]}, "the JSON form"),
    ({"lora_paths": ["=/x"]}, "NAME=PATH needs both"),
    ({"lora_paths": ["a=/x", "b=/y"], "max_loaded_loras": 1}, "2 lora_paths for max_loaded_loras 1"),
    ({"lora_paths": ["a=/x"], "tp_size": 2}, "tensor parallelism"),
    ({"lora_paths": ["a=/x"], "max_loras_per_batch": 0}, "max_loras_per_batch must be >= 1"),
    ({"enable_lora": True, "enable_deterministic_inference": True}, "does not run with LoRA adapters"),
])
def test_bad_lora_options_are_refused(options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ServerArgs(**options)


def test_lora_path_names_one_adapter_or_one_per_prompt():
    assert lora_paths_from(None, 2) is None
    assert lora_paths_from("a", 2) == ["a", "a"]
    assert lora_paths_from(["a", None], 2) == ["a", None]
    assert lora_paths_from(["", None], 2) is None  # no adapter at all: the base model
    for bad in (["a"], 3, ["a", 4], {"a": 1}):
        with pytest.raises(RequestError, match="lora_path must be"):
            lora_paths_from(bad, 2)


def test_decode_batches_with_adapter_rows_run_eagerly_beside_graphs(family):
    """Graphs hold the base model: a decode batch with adapter rows runs eagerly (PEFT's logits), one without
    replays its graph (the CPU stand-in for CUDA graphs, with the GPU attention backend in triton's interpreter)."""
    from radixrt.model.cuda_graph import ReplayByCall
    from radixrt.model.forward_batch import ForwardBatch, SeqChunk

    folder, adapters, expected = family
    runner = _runner(folder, {"all": adapters["all"]}, attention_backend="triton", graph_factory=ReplayByCall(),
                     cuda_graph_max_bs=2)
    uid = runner.adapters.uid_of("all")
    prompt = PROMPTS[2]
    pages = runner.pool.alloc(2)
    for lora_uid, name in ((uid, "all"), (0, None)):
        runner.forward(ForwardBatch.build([SeqChunk(prompt[:-1], 0, pages, lora_uid=lora_uid)], 4))
        replays = runner.graphs.replays
        logits = runner.forward(ForwardBatch.build([SeqChunk(prompt[-1:], len(prompt) - 1, pages,
                                                             lora_uid=lora_uid)], 4))
        assert runner.graphs.replays == replays + (name is None), name
        assert (logits[0] - expected[name][2][-1]).abs().max().item() <= 1e-4, name


def test_adapters_on_fp8_weights_give_the_dequantized_models_logits(family, tmp_path, monkeypatch):
    # the base model's projections in fp8 (on the fp8 kernel in bf16 where it runs), adapters as usual: each
    # adapter's rows the bits they get over the weights the fp8 ones dequantize to
    from test_fp8 import same_bf16_kernel
    from tiny_models import dequantized, save_fp8_checkpoint

    same_bf16_kernel(monkeypatch)
    folder, adapters, _ = family
    save_fp8_checkpoint(folder, tmp_path / "fp8", (16, 16), quantizer="radixrt")
    dequantized(tmp_path / "fp8", tmp_path / "dequantized", (16, 16))
    uids = None
    runs = []
    for model in (tmp_path / "fp8", tmp_path / "dequantized"):
        runner = ModelRunner(model, dtype="bfloat16", page_size=4, num_pages=64, enable_lora=True,
                             lora_adapters=[(n, str(p)) for n, p in adapters.items()])
        uids = [0, *(runner.adapters.uid_of(n) for n in ("all", "some"))]
        runs.append(run_ours(runner, PROMPTS, "mixed", lora_uids=uids))
    for ours, ref in zip(*runs):
        assert torch.equal(ours, ref)
