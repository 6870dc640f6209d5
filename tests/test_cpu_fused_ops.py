"""The fused C++ element-wise ops (RMSNorm with residual add, SiLU-and-mul, rotary) against the torch path."""

import pytest
import torch
import torch.nn.functional as F

from radixrt.kernels import cpu_kernels
from radixrt.model import layers
from radixrt.model.layers import RMSNorm, RotaryEmbedding, silu_and_mul

# Skipped only where the kernels are off by design; a failed build with a compiler present errors.
pytestmark = pytest.mark.usefixtures("cpu_kernel_module")

# fp32 differs from the torch ops only in summation order and FMA contraction; bf16/fp16 round identically
# except where the two exp implementations differ in the last bit.
TOLERANCE = {torch.float32: (2e-5, 1e-5), torch.bfloat16: (0, 8e-3), torch.float16: (0, 1e-3)}


@pytest.fixture
def torch_path(monkeypatch):
    """Runs a callable with the layers' C++ ops turned off."""

    def run(fn, *args):
        with monkeypatch.context() as m:
            m.setattr(layers.cpu_kernels, "load", lambda: None)
            return fn(*args)

    return run


def norm_of(dtype, hidden=96):
    norm = RMSNorm(hidden, 1e-6)
    norm.weight.data = torch.randn(hidden, generator=torch.Generator().manual_seed(1)) + 1
    return norm.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [96, 37])  # 37: a scalar tail after whole vectors
def test_rms_norm_matches_torch(dtype, hidden, torch_path):
    norm = norm_of(dtype, hidden)
    x = (torch.randn(13, hidden) * 3).to(dtype)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(norm(x), torch_path(norm, x), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [96, 37])
def test_add_rms_norm_updates_the_residual_in_place(dtype, hidden, torch_path):
    norm = norm_of(dtype, hidden)
    x, residual = torch.randn(7, hidden).to(dtype), torch.randn(7, hidden).to(dtype)
    expected_out, expected_sum = torch_path(norm.add_forward, x, residual.clone())
    fused_residual = residual.clone()
    out, returned = norm.add_forward(x, fused_residual)
    assert returned is fused_residual
    assert torch.equal(fused_residual, expected_sum)  # one rounding of x + residual, same as torch
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(out, expected_out, atol=atol, rtol=rtol)


def test_rms_norm_of_strided_rows(torch_path):
    """Rows that are slices of a wider tensor (a split projection) are read in place."""
    norm = norm_of(torch.float32, hidden=32)
    wide = torch.randn(5, 80)
    x = wide[:, 16:48]
    assert x.stride(0) == 80
    torch.testing.assert_close(norm(x), torch_path(norm, x.contiguous()), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_silu_and_mul_matches_torch(dtype):
    gate_up = (torch.randn(11, 2 * 37) * 4).to(dtype)  # 37: a vector tail after whole 8-wide vectors
    gate, up = gate_up.chunk(2, dim=-1)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(silu_and_mul(gate_up), F.silu(gate) * up, atol=max(atol, 1e-6), rtol=rtol)


class _Config:
    rope_theta = 10000.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_place_on_views_of_the_qkv_projection(dtype, torch_path):
    rotary = RotaryEmbedding(_Config(), head_dim=16, max_positions=256).to(dtype)
    qkv = torch.randn(9, 6 * 16 + 2 * 2 * 16).to(dtype)
    q, k, _ = qkv.split([6 * 16, 2 * 16, 2 * 16], dim=-1)
    q, k = q.view(9, 6, 16), k.view(9, 2, 16)
    positions = torch.tensor([0, 1, 2, 200, 255, 7, 7, 31, 64])
    expected_q, expected_k = torch_path(rotary, positions, q.clone(), k.clone())
    out_q, out_k = rotary(positions, q, k)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(out_q, expected_q, atol=max(atol, 1e-6), rtol=rtol)
    torch.testing.assert_close(out_k, expected_k, atol=max(atol, 1e-6), rtol=rtol)


def test_rotary_of_non_contiguous_heads_takes_the_torch_path(torch_path):
    rotary = RotaryEmbedding(_Config(), head_dim=16, max_positions=64)
    q = torch.randn(6, 4, 16).transpose(0, 1)  # heads not contiguous within a token
    k = torch.randn(4, 2, 16)
    positions = torch.arange(4)
    expected = torch_path(rotary, positions, q, k)
    for got, want in zip(rotary(positions, q, k), expected):
        torch.testing.assert_close(got, want)


def test_bad_inputs_raise():
    x = torch.randn(4, 32)
    with pytest.raises(RuntimeError, match="weight"):
        cpu_kernels.rms_norm(x, torch.ones(31), 1e-6)
    with pytest.raises(RuntimeError, match="residual"):
        cpu_kernels.rms_norm(x, torch.ones(32), 1e-6, torch.randn(4, 31))
    with pytest.raises(RuntimeError, match="two halves"):
        cpu_kernels.silu_and_mul(torch.randn(3, 7))
    cos = sin = torch.randn(8, 16)
    q, k = torch.randn(2, 3, 16), torch.randn(2, 1, 16)
    with pytest.raises(RuntimeError, match="positions"):
        cpu_kernels.rotary_embedding(torch.tensor([0, 8]), q, k, cos, sin)
    with pytest.raises(RuntimeError, match="positions"):
        cpu_kernels.rotary_embedding(torch.tensor([-1, 0]), q, k, cos, sin)
    with pytest.raises(RuntimeError, match="fp32"):
        cpu_kernels.rotary_embedding(torch.tensor([0, 1]), q, k, cos.double(), sin.double())
