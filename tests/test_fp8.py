"""FP8 (e4m3) weights: the kernel, the quantizer, checkpoints quantized by transformers, --quantization fp8, and the
refusals (radixrt/model/fp8.py, kernels/csrc/linear_fp8.cpp)."""

from __future__ import annotations

import json
import types

import pytest
import torch

from radixrt.kernels import cpu_kernels
from radixrt.model.cpu_linear import KERNEL_ENV
from radixrt.model.fp8 import Fp8Scheme, fp8_scheme, quantize
from radixrt.model.runner import ModelRunner
from test_model_exact import PROMPTS, run_ours
from tiny_models import dequantized, save_compressed_tensors_checkpoint, save_fp8_checkpoint, save_tiny_model

needs_kernels = pytest.mark.skipif(cpu_kernels.load() is None, reason="the C++ CPU kernels did not build")


def same_bf16_kernel(monkeypatch) -> None:
    """bf16 weights on the bf16 panel kernel where it runs, so that a model's fp8 weights and their dequantized copy
    run the same tiles: an AMX CPU would put the copy on its AMX kernel, whose sums are ordered otherwise (without
    AVX512-BF16 both are dequantized and run alike)."""
    if cpu_kernels.load() is not None:
        monkeypatch.setenv(KERNEL_ENV, "bf16")


def reference_weight(bits: torch.Tensor, row_scales: torch.Tensor, block_k: int, k_offset: int = 0) -> torch.Tensor:
    blocks = (torch.arange(bits.shape[1]) + k_offset) // block_k
    return (bits.view(torch.float8_e4m3fn).float() * row_scales[:, blocks]).to(torch.bfloat16)


def random_bits(rows: int, cols: int) -> torch.Tensor:
    bits = torch.randint(0, 256, (rows, cols), dtype=torch.uint8)
    return torch.where((bits & 0x7F) == 0x7F, bits ^ 1, bits)  # no NaN codes


@needs_kernels
@pytest.mark.parametrize("out_features,in_features,block_k,k_offset,rows", [
    (50, 64, 32, 0, 1), (33, 96, 16, 32, 5), (100, 130, 128, 0, 17), (40, 64, 64, 0, 300), (16, 32, 8, 6, 9),
])
def test_the_kernel_gives_the_bf16_kernels_bits_over_the_dequantized_weight(out_features, in_features, block_k,
                                                                             k_offset, rows):
    # every code but NaN, scales per row and block (subnormal codes and partial panels and blocks included), a
    # bias, rows past a 256-row block: the same bits as linear_bf16 over the weight transformers would dequantize
    torch.manual_seed(0)
    bits = random_bits(out_features, in_features)
    blocks = (k_offset + in_features - 1) // block_k + 1
    scales = torch.rand(out_features, blocks) * 0.02 + 1e-4
    x = torch.randn(rows, in_features).to(torch.bfloat16)
    bias = torch.randn(out_features)
    panels, panel_scales = cpu_kernels.pack_linear_fp8(bits, scales)
    got = cpu_kernels.linear_fp8(x, panels, panel_scales, block_k, k_offset, out_features, bias)
    weight = reference_weight(bits, scales, block_k, k_offset)
    want = cpu_kernels.linear_bf16(x, cpu_kernels.pack_linear_bf16(weight), out_features, bias)
    assert torch.equal(got, want)


@needs_kernels
@pytest.mark.parametrize("in_features,block_k,k_offset", [(576, 128, 0), (150, 36, 10), (64, 64, 0), (100, 14, 4)])
def test_blocks_whose_columns_share_a_scale_give_the_same_bits(in_features, block_k, k_offset):
    # one scale for every 16 outputs of a block (as 128-row blocks and per-tensor scales give): such blocks of 8
    # k-pairs or more are looked up in a table of their 128 products, two k-pairs at a time, an odd last one and
    # shorter blocks computed the other way; a panel with a column of another scale takes the other way too
    torch.manual_seed(4)
    out_features = 48
    bits = random_bits(out_features, in_features)
    blocks = (k_offset + in_features - 1) // block_k + 1
    scales = (torch.rand(out_features // 16, blocks) * 0.02 + 1e-4).repeat_interleave(16, 0)
    scales[40, 0] *= 1.5  # the third panel's first block is not shared
    x = torch.randn(5, in_features).to(torch.bfloat16)
    panels, panel_scales = cpu_kernels.pack_linear_fp8(bits, scales)
    got = cpu_kernels.linear_fp8(x, panels, panel_scales, block_k, k_offset, out_features)
    weight = reference_weight(bits, scales, block_k, k_offset)
    assert torch.equal(got, cpu_kernels.linear_bf16(x, cpu_kernels.pack_linear_bf16(weight), out_features))
    eye = torch.eye(in_features).to(torch.bfloat16)  # each weight on its own: the dequantized values themselves
    assert torch.equal(cpu_kernels.linear_fp8(eye, panels, panel_scales, block_k, k_offset, out_features), weight.T)


@needs_kernels
def test_scales_of_256_and_more_take_the_exact_table():
    # the fast conversion folds 2^120 into the scale, which would overflow from 2^8 on: those blocks look values up
    torch.manual_seed(1)
    bits = random_bits(32, 64)
    scales = torch.tensor([[3.0e3, 0.5]]).repeat(32, 1)
    panels, panel_scales = cpu_kernels.pack_linear_fp8(bits, scales)
    x = torch.randn(3, 64).to(torch.bfloat16)
    got = cpu_kernels.linear_fp8(x, panels, panel_scales, 32, 0, 32)
    want = cpu_kernels.linear_bf16(x, cpu_kernels.pack_linear_bf16(reference_weight(bits, scales, 32)), 32)
    assert torch.equal(got, want)


@needs_kernels
def test_the_kernel_refuses_what_it_cannot_compute():
    bits = random_bits(16, 32)
    panels, scales = cpu_kernels.pack_linear_fp8(bits, torch.ones(16, 1))
    x = torch.randn(2, 32).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="must be even"):
        cpu_kernels.linear_fp8(x, panels, scales, 7, 0, 16)
    with pytest.raises(RuntimeError, match="fewer inputs"):
        cpu_kernels.linear_fp8(x, panels, scales, 16, 0, 16)  # one block of 16 for 32 inputs
    with pytest.raises(RuntimeError, match="features"):
        cpu_kernels.linear_fp8(torch.randn(2, 30).to(torch.bfloat16), panels, scales, 32, 0, 16)
    with pytest.raises(ValueError, match="even number"):
        cpu_kernels.pack_linear_fp8(random_bits(16, 31), torch.ones(16, 1))


def test_quantize_gives_transformers_fp8_bits_and_scales():
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    torch.manual_seed(2)
    weight = torch.randn(256, 384) * torch.rand(256, 1) * 3
    weight[:128, 128:256] = 0  # a block of zeros keeps scale 1
    hf = Fp8Quantize(types.SimpleNamespace(quantization_config=FineGrainedFP8Config(weight_block_size=[128, 128])))
    want = hf._quantize_one("w.weight", weight)
    bits, scales = quantize(weight, (128, 128))
    assert torch.equal(bits, want["w.weight"].view(torch.uint8))
    assert torch.equal(scales, want["w.weight_scale_inv"])


def test_quantize_takes_partial_blocks():
    weight = torch.randn(70, 50)
    bits, scales = quantize(weight, (32, 16))
    assert bits.shape == (70, 50) and scales.shape == (3, 4)
    grid = scales.repeat_interleave(32, 0)[:70].repeat_interleave(16, 1)[:, :50]
    back = bits.view(torch.float8_e4m3fn).float() * grid
    assert (back - weight).abs().max() <= weight.abs().max() / 16  # e4m3 keeps 3 mantissa bits


@pytest.fixture(scope="module", params=["llama", "qwen3-moe", "phi3", "gemma3"])
def fp8_model(request, tmp_path_factory):
    """A tiny checkpoint quantized by transformers' FP8 quantizer in blocks of 32 x 32, and transformers' fp32
    logits of it (transformers dequantizes an FP8 checkpoint it loads on a CPU)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp(f"fp8-{request.param}")
    save_tiny_model(request.param, root / "float")
    save_fp8_checkpoint(root / "float", root / "fp8", (32, 32))
    hf_model = AutoModelForCausalLM.from_pretrained(root / "fp8", dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        expected = [hf_model.eval()(torch.tensor([p])).logits[0] for p in PROMPTS]
    return root, expected


@pytest.mark.parametrize("mode", ["one_extend", "decode_steps", "mixed"])
def test_an_fp8_checkpoint_gives_transformers_logits_in_fp32(fp8_model, mode):
    root, expected = fp8_model
    runner = ModelRunner(root / "fp8", dtype="float32", page_size=4, num_pages=64)
    for ours, ref in zip(run_ours(runner, PROMPTS, mode), expected):
        assert (ours - ref).abs().max().item() <= 1e-4


def test_an_fp8_checkpoint_in_bf16_gives_the_dequantized_checkpoints_bits(fp8_model, monkeypatch):
    # on AVX512-BF16 CPUs the weights stay fp8 (one byte each) on radixrt's fp8 kernel; elsewhere they are
    # dequantized at load: either way the logits are those of the checkpoint transformers' dequantization gives
    root, _ = fp8_model
    same_bf16_kernel(monkeypatch)
    dequantized(root / "fp8", root / "dequantized", (32, 32))
    runner = ModelRunner(root / "fp8", dtype="bfloat16", page_size=4, num_pages=64)
    plain = ModelRunner(root / "dequantized", dtype="bfloat16", page_size=4, num_pages=64)
    if cpu_kernels.linear_bf16_built():
        assert {m.packed.kernel for m in runner.model.modules() if getattr(m, "packed", None) is not None} >= {"fp8"}
    for ours, ref in zip(run_ours(runner, PROMPTS, "prefix_then_rest"), run_ours(plain, PROMPTS, "prefix_then_rest")):
        assert torch.equal(ours, ref)


def test_quantization_fp8_at_load_equals_the_checkpoint_it_would_make(tmp_path):
    # --quantization fp8: 128 x 128 blocks, partial where the tiny model's 64- and 96-wide projections end; the
    # same logits as an FP8 checkpoint written by the same quantizer, and that checkpoint's as its plain-torch
    # dequantization's (fp32, transformers' arithmetic)
    save_tiny_model("qwen2", tmp_path / "float")
    save_fp8_checkpoint(tmp_path / "float", tmp_path / "fp8", (128, 128), quantizer="radixrt")
    dequantized(tmp_path / "fp8", tmp_path / "dequantized", (128, 128))
    runs = {}
    for dtype in ("float32", "bfloat16"):
        online = ModelRunner(tmp_path / "float", dtype=dtype, page_size=4, num_pages=64, quantization="fp8")
        offline = ModelRunner(tmp_path / "fp8", dtype=dtype, page_size=4, num_pages=64)
        runs[dtype] = [run_ours(r, PROMPTS, "one_extend") for r in (online, offline)]
        assert all(torch.equal(a, b) for a, b in zip(*runs[dtype]))
    plain = ModelRunner(tmp_path / "dequantized", dtype="float32", page_size=4, num_pages=64)
    for ours, ref in zip(runs["float32"][0], run_ours(plain, PROMPTS, "one_extend")):
        assert torch.equal(ours, ref)
    unquantized = ModelRunner(tmp_path / "float", dtype="float32", page_size=4, num_pages=64)
    assert any(not torch.equal(a, b) for a, b in zip(runs["float32"][0], run_ours(unquantized, PROMPTS, "one_extend")))


def test_fp8_schemes_and_refusals():
    config = types.SimpleNamespace(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128],
                                                        "activation_scheme": "dynamic"})
    assert fp8_scheme(config) == Fp8Scheme((128, 128))
    assert fp8_scheme(config, "fp8") == Fp8Scheme((128, 128))  # the checkpoint's own blocks
    assert fp8_scheme(types.SimpleNamespace(quantization_config={"quant_method": "fp8"})).block is None
    assert fp8_scheme(types.SimpleNamespace(), "fp8") == Fp8Scheme((128, 128), online=True)
    assert fp8_scheme(types.SimpleNamespace()) is None
    for qc, message in (({"quant_method": "awq"}, "quantized with 'awq'"),
                        ({"quant_method": "fp8", "fmt": "e5m2"}, "format 'e5m2'"),
                        ({"quant_method": "fp8", "weight_block_size": [128, 3]}, "must be even")):
        with pytest.raises(ValueError, match=message):
            fp8_scheme(types.SimpleNamespace(quantization_config=qc))
    with pytest.raises(ValueError, match="'gptq' is not supported"):
        fp8_scheme(types.SimpleNamespace(), "gptq")


def _rewrite(folder, change) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("change,message", [
    (lambda t: t.pop("model.layers.0.mlp.up_proj.weight_scale_inv"), "do not pair up"),
    (lambda t: t.__setitem__("model.layers.1.self_attn.o_proj.weight_scale_inv", torch.ones(3, 3)),
     "fp8 scales of shape"),
    (lambda t: t["model.layers.0.self_attn.q_proj.weight"].view(torch.uint8).__setitem__((0, 0), 0x7F), "NaN"),
    (lambda t: (t.pop("model.layers.0.self_attn.k_proj.weight_scale_inv"),
                t.__setitem__("model.layers.0.self_attn.k_proj.weight", torch.randn(32, 64))), "mixes fp8"),
    (lambda t: t.__setitem__("model.layers.0.mlp.experts.gate_up_proj",
                             torch.zeros(2, 8, 64).to(torch.float8_e4m3fn)), "3 dimensions"),
])
def test_a_broken_fp8_checkpoint_is_refused_with_the_reason(tmp_path, change, message):
    save_tiny_model("llama", tmp_path / "float")
    save_fp8_checkpoint(tmp_path / "float", tmp_path / "fp8", (32, 32))
    _rewrite(tmp_path / "fp8", change)
    with pytest.raises(ValueError, match=message):
        ModelRunner(tmp_path / "fp8", dtype="float32", page_size=4, num_pages=16)


def test_a_checkpoint_of_another_quantization_is_refused(tmp_path):
    save_tiny_model("llama", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantized with 'gptq' are not supported"):
        ModelRunner(tmp_path, dtype="float32", page_size=4, num_pages=16)


def test_static_activation_scales_are_read_and_ignored(tmp_path):
    # weight-only: a checkpoint quantized for static fp8 activations gives the same logits as without its scales,
    # as transformers' dequantized CPU model does
    save_tiny_model("llama", tmp_path / "float")
    save_fp8_checkpoint(tmp_path / "float", tmp_path / "fp8", (32, 32))
    want = run_ours(ModelRunner(tmp_path / "fp8", dtype="float32", page_size=4, num_pages=64), PROMPTS, "one_extend")
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    config["quantization_config"]["activation_scheme"] = "static"
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    scales = {"model.layers.0.self_attn.q_proj.activation_scale": torch.tensor(2.0),
              "model.layers.1.mlp.down_proj.input_scale": torch.tensor(3.0)}
    _rewrite(tmp_path / "fp8", lambda t: t.update(scales))
    got = run_ours(ModelRunner(tmp_path / "fp8", dtype="float32", page_size=4, num_pages=64), PROMPTS, "one_extend")
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@needs_kernels
def test_grouped_products_give_each_rows_linear_fp8_bits():
    # a mixture-of-experts layer's fp8 experts in one call: empty ranges, one row, and a range past a 256-row block
    torch.manual_seed(3)
    weights = []
    for _ in range(4):
        scales = torch.rand(40, 3) * 0.01 + 1e-4
        weights.append(cpu_kernels.pack_linear_fp8(random_bits(40, 96), scales))
    bounds = [0, 0, 1, 300, 305]
    x = torch.randn(bounds[-1], 96).to(torch.bfloat16)
    got = cpu_kernels.linear_fp8_grouped(x, [w[0] for w in weights], [w[1] for w in weights], bounds, 32, 0, 40)
    want = torch.cat([cpu_kernels.linear_fp8(x[a:b], panels, scales, 32, 0, 40)
                      for (panels, scales), a, b in zip(weights, bounds, bounds[1:])])
    assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="same shape"):
        cpu_kernels.linear_fp8_grouped(x[:2], [weights[0][0], cpu_kernels.pack_linear_fp8(random_bits(40, 64),
                                                                                          torch.ones(40, 2))[0]],
                                       [weights[0][1], weights[1][1]], [0, 1, 2], 32, 0, 40)


@pytest.mark.parametrize("strategy", ["tensor", "channel", "block"])
def test_a_compressed_tensors_fp8_checkpoint_gives_its_dequantized_checkpoints_logits(tmp_path, strategy, monkeypatch):
    # llm-compressor's FP8 layouts, bf16 scales: fp32 logits equal those of the weights dequantized in plain torch,
    # and so do bf16 ones (on the fp8 kernel where it runs)
    same_bf16_kernel(monkeypatch)
    save_tiny_model("qwen3", tmp_path / "float")
    save_compressed_tensors_checkpoint(tmp_path / "float", tmp_path / "fp8", strategy)
    dequantized(tmp_path / "fp8", tmp_path / "dequantized", (32, 32) if strategy == "block" else None)
    for dtype in ("float32", "bfloat16"):
        ours = ModelRunner(tmp_path / "fp8", dtype=dtype, page_size=4, num_pages=64)
        plain = ModelRunner(tmp_path / "dequantized", dtype=dtype, page_size=4, num_pages=64)
        for a, b in zip(run_ours(ours, PROMPTS, "prefix_then_rest"), run_ours(plain, PROMPTS, "prefix_then_rest")):
            assert torch.equal(a, b)


@pytest.mark.parametrize("weights,message", [
    ({"num_bits": 8, "type": "int", "strategy": "channel"}, "8-bit int weights"),
    ({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}, "4-bit int weights"),
    ({"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128}, "by 'group'"),
    ({"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": False}, "asymmetric"),
])
def test_compressed_tensors_schemes_radixrt_does_not_run_are_refused(weights, message):
    config = types.SimpleNamespace(quantization_config={"quant_method": "compressed-tensors",
                                                        "config_groups": {"group_0": {"weights": weights}}})
    with pytest.raises(ValueError, match=message):
        fp8_scheme(config)
