"""CPU linear layers with oneDNN-prepacked weights must compute what F.linear computes."""

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from radixrt.model import cpu_linear
from radixrt.model.forward_batch import ForwardBatch, SeqChunk
from radixrt.model.parallel import ColumnParallelLinear, RowParallelLinear
from radixrt.model.runner import ModelRunner
from tiny_models import save_tiny_model

needs_mkldnn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@needs_mkldnn
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_packed_linear_equals_f_linear(rows):
    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(96, 40, generator=gen), torch.randn(96, generator=gen)
    x = torch.randn(rows, 40, generator=gen)
    packed = cpu_linear.pack_weight(weight)
    assert packed is not None and packed.is_mkldnn
    torch.testing.assert_close(cpu_linear.packed_linear(x, packed, bias), F.linear(x, weight, bias), atol=1e-4, rtol=1e-5)


@needs_mkldnn
@pytest.mark.parametrize("layer_cls", [ColumnParallelLinear, RowParallelLinear])
def test_layer_packs_and_frees_its_plain_weight(layer_cls):
    layer = layer_cls(40, [96], bias=True) if layer_cls is ColumnParallelLinear else layer_cls(40, 96, bias=True)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    x = torch.randn(5, 40)
    expected = layer(x)
    assert layer.pack() is True
    assert layer.weight is None and layer.packed is not None
    torch.testing.assert_close(layer(x), expected, atol=1e-4, rtol=1e-5)


def test_bf16_packs_only_where_onednn_has_a_kernel():
    """On CPUs without AVX512-BF16/AVX-NE-CONVERT the reorder fails: the layer must keep the plain path."""
    layer = ColumnParallelLinear(32, [48], bias=False).to(torch.bfloat16)
    torch.nn.init.normal_(layer.weight)
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    expected = layer(x).float()
    packed = layer.pack()
    assert (layer.packed is not None) == packed and (layer.weight is None) == packed
    torch.testing.assert_close(layer(x).float(), expected, atol=0.1, rtol=0.02)


def test_env_var_keeps_f_linear():
    code = "import torch; from radixrt.model.cpu_linear import pack_weight; print(pack_weight(torch.ones(4, 4)))"
    out = subprocess.run(
        [sys.executable, "-c", code], env={"RADIXRT_DISABLE_PACKED_LINEAR": "1", "PATH": ""},
        capture_output=True, text=True, check=True,
    )
    assert out.stdout.strip() == "None"


@needs_mkldnn
@pytest.mark.parametrize("family", ["llama", "untied-gqa1"])
def test_runner_logits_same_packed_or_not(tmp_path, monkeypatch, family):
    save_tiny_model(family, tmp_path)
    packed = ModelRunner(tmp_path, dtype="float32", num_pages=16, page_size=4)
    monkeypatch.setenv("RADIXRT_DISABLE_PACKED_LINEAR", "1")
    plain = ModelRunner(tmp_path, dtype="float32", num_pages=16, page_size=4)
    assert packed.packed_linears == 2 * 4 + 1 and plain.packed_linears == 0
    assert packed.model.packed_head is not None
    batch = [SeqChunk([1, 5, 9, 30, 2], 0, [1, 2], logits_from=0), SeqChunk([7, 3], 0, [3])]
    torch.testing.assert_close(
        packed.forward(ForwardBatch.build(batch, 4)), plain.forward(ForwardBatch.build(batch, 4)), atol=1e-4, rtol=1e-4
    )
