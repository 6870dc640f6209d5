"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE, Granite-MoE) through the scheduler: the greedy tokens of several
requests batched together equal transformers' for each alone; experts stored as 3-D tensors load as per-expert
ones do; under deterministic inference a request's logprobs keep their bits whatever shares its batch (each
row's experts run on radixrt's row-invariant kernels and are summed in a fixed order); what does not run with
experts yet is refused. Logits of every mode against transformers: tests/test_model_exact.py."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from radixrt.model.forward_batch import ForwardBatch, SeqChunk
from radixrt.model.moe import SparseMoeBlock
from radixrt.model.runner import ModelRunner, graph_refusal
from radixrt.sampling.params import SamplingParams
from exact_runs import logprob_runs
from tiny_models import MOE_FAMILIES, save_tiny_model, tiny_config

PROMPTS = [[5, 9, 3, 77, 12, 40, 8, 1, 99, 23, 64, 7], [17, 2, 3], [100, 42, 42, 42, 8, 9, 61, 30, 31]]
NEW_TOKENS = 12
GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def moe_model(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return folder, save_tiny_model(request.param, folder)


def test_batched_greedy_tokens_equal_transformers_for_each_request_alone(moe_model):
    folder, hf_model = moe_model
    runner_blocks = [m for m in ModelRunner(folder, num_pages=8).model.modules() if isinstance(m, SparseMoeBlock)]
    assert runner_blocks, "the model must hold expert blocks for this test to mean anything"
    outputs, _ = logprob_runs(folder, "float32", [[(p, GREEDY) for p in PROMPTS]])
    for prompt, output in zip(PROMPTS, outputs):
        with torch.no_grad():
            expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                         min_new_tokens=NEW_TOKENS)[0, len(prompt):].tolist()
        assert [token for token, _, _ in output] == expected


def test_experts_stored_as_stacked_tensors_load_as_per_expert_tensors(tmp_path):
    save_tiny_model("qwen3-moe", tmp_path / "per_expert")
    tensors = load_file(tmp_path / "per_expert" / "model.safetensors")
    config = tiny_config("qwen3-moe")
    stacked = {}
    for name, tensor in tensors.items():
        if ".experts." not in name:
            stacked[name] = tensor
    layers = {name.split(".mlp.experts.")[0] for name in tensors if ".mlp.experts." in name}
    assert layers, "the tiny model must have expert layers"
    for layer in layers:
        experts = range(config.num_experts)
        stacked[f"{layer}.mlp.experts.gate_up_proj"] = torch.stack([
            torch.cat([tensors[f"{layer}.mlp.experts.{e}.gate_proj.weight"],
                       tensors[f"{layer}.mlp.experts.{e}.up_proj.weight"]]) for e in experts])
        stacked[f"{layer}.mlp.experts.down_proj"] = torch.stack(
            [tensors[f"{layer}.mlp.experts.{e}.down_proj.weight"] for e in experts])
    (tmp_path / "stacked").mkdir()
    save_file(stacked, tmp_path / "stacked" / "model.safetensors")
    (tmp_path / "stacked" / "config.json").write_text((tmp_path / "per_expert" / "config.json").read_text())

    def logits(folder):
        runner = ModelRunner(folder, dtype="float32", page_size=4, num_pages=16)
        pages = runner.pool.alloc(4)
        return runner.forward(ForwardBatch.build([SeqChunk(PROMPTS[0], 0, pages, logits_from=0)], 4))

    assert torch.equal(logits(tmp_path / "stacked"), logits(tmp_path / "per_expert"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_deterministic_inference_keeps_a_rows_bits_whatever_shares_its_batch(moe_model, dtype):
    from test_deterministic import bf16_supported

    folder, _ = moe_model
    if dtype == "bfloat16" and not bf16_supported():
        pytest.skip("bf16 deterministic inference needs AVX512-BF16 or AMX (its refusal: test_deterministic.py)")
    prompt = PROMPTS[0] + PROMPTS[2]
    others = [([11, 12, 13] * 9, GREEDY), (list(range(40, 70)), GREEDY), ([4, 2] * 20, GREEDY)]
    alone, _ = logprob_runs(folder, dtype, [[(prompt, GREEDY)]], deterministic=True)
    beside, _ = logprob_runs(folder, dtype, [[*others[:2], (prompt, GREEDY), others[2]]], deterministic=True)
    assert beside[2] == alone[0]


def test_the_shared_experts_gate_keeps_a_rows_bits_whatever_shares_its_batch(tmp_path):
    """Qwen2-MoE's shared-expert gate (a sigmoid) under deterministic inference, on weights large enough for its
    last bit to matter: torch computes a tensor's last elements past its vector pairs with its scalar exp, whose
    last bit differs from the vectorized one's for a few values in a hundred, so a row's gate (and its logprobs)
    would depend on where its row falls in the batch."""
    save_tiny_model("qwen2-moe", tmp_path)
    prompt = PROMPTS[0] + PROMPTS[2]
    others = [([11, 12, 13] * 9, GREEDY), (list(range(40, 70)), GREEDY), ([4, 2] * 20, GREEDY)]
    alone, _ = logprob_runs(tmp_path, "float32", [[(prompt, GREEDY)]], deterministic=True)
    beside, _ = logprob_runs(tmp_path, "float32", [[*others[:2], (prompt, GREEDY), others[2]]], deterministic=True)
    assert beside[2] == alone[0]


def test_what_does_not_run_with_experts_yet_is_refused(moe_model):
    from transformers import AutoConfig

    folder, _ = moe_model
    with pytest.raises(ValueError, match="LoRA adapters do not run on mixture-of-experts models"):
        ModelRunner(folder, num_pages=8, enable_lora=True)
    assert "mixture-of-experts" in graph_refusal(AutoConfig.from_pretrained(folder))
    assert graph_refusal(tiny_config("llama")) is None


def test_tensor_parallel_sizes_the_expert_widths_do_not_divide_by_are_refused():
    from radixrt.model.llama import check_tensor_parallel

    config = tiny_config("qwen2-moe")  # routed experts of width 32, a shared one of 48, a dense layer of 96
    check_tensor_parallel(config, 2)
    with pytest.raises(ValueError, match="an expert's intermediate size 32 does not divide by tp_size 3"):
        check_tensor_parallel(config, 3)
    with pytest.raises(ValueError, match="the shared expert's intermediate size 48 does not divide by tp_size 32"):
        check_tensor_parallel(config, 32)
    config = tiny_config("qwen3-moe")
    config.intermediate_size = 97  # the dense layers' width: checked only while a layer is dense
    with pytest.raises(ValueError, match="the MLP's intermediate size 97"):
        check_tensor_parallel(config, 2)
    config.decoder_sparse_step = 1
    check_tensor_parallel(config, 2)


def test_a_config_choosing_more_experts_than_it_has_is_refused(tmp_path):
    from transformers import AutoConfig

    save_tiny_model("qwen3-moe", tmp_path)
    config = AutoConfig.from_pretrained(tmp_path)
    config.num_experts_per_tok = config.num_experts + 1
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="num_experts_per_tok 9 must be between 1 and the 8 experts"):
        ModelRunner(tmp_path, num_pages=4)
