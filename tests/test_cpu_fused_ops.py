"""The fused C++ element-wise ops (RMSNorm with residual add, SiLU-and-mul, rotary, rotary with the K/V store)
against the torch path and their torch twins (kernels/torch_fused), which round where transformers rounds.

Sizes mix whole vectors (16 lanes with AVX-512, 8 with AVX2) with scalar tails, so both run in every dtype.
"""

import pytest
import torch
import torch.nn.functional as F

from radixrt.kernels import cpu_kernels, torch_fused
from radixrt.model import layers
from radixrt.model.layers import RMSNorm, RotaryEmbedding, gelu_tanh_and_mul, silu_and_mul

# Skipped only where the kernels are off by design; a failed build with a compiler present errors.
# Alone after the parallel part of `make test`, on every core: the C++ kernels split their work over threads.
pytestmark = [pytest.mark.usefixtures("cpu_kernel_module"), pytest.mark.serial]

# fp32 differs from the torch ops only in summation order and FMA contraction; bf16/fp16 round at the same points,
# so they differ where the two exp implementations or the two orders of summing squares differ in fp32's last bit:
# one ulp of an intermediate (2^-7 / 2^-10 relative), which RMSNorm's second rounding, after the weight's product,
# may carry into two ulps of its output (bf16: 9 rows in 20,000 random 13 x 96 inputs, up to 1.3e-2 relative).
TOLERANCE = {torch.float32: (2e-5, 1e-5), torch.bfloat16: (0, 1.6e-2), torch.float16: (0, 4e-3)}


@pytest.fixture(autouse=True)
def seeded():
    """Each test's random inputs are its own, whatever ran before it in the session."""
    torch.manual_seed(0)


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
@pytest.mark.parametrize("hidden", [96, 37, 576])  # 37: a scalar tail after whole vectors; 576: the default model's
def test_rms_norm_matches_torch(dtype, hidden, torch_path):
    norm = norm_of(dtype, hidden)
    x = (torch.randn(13, hidden) * 3).to(dtype)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(norm(x), torch_path(norm, x), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [96, 37, 576])
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [96, 37, 256])  # 256: Gemma 3's head_dim (its q/k norms)
@pytest.mark.parametrize("weight_offset", [1.0, 0.0])  # Gemma's, OLMo 2's
def test_round_once_norms_match_their_torch_twin(dtype, hidden, weight_offset):
    """Gemma's and OLMo 2's RMSNorm: ``norm(x) * (weight_offset + weight)`` in fp32, rounded once; a projection's
    strided columns and q/k heads ``[T, heads, D]`` (rows not evenly strided) are normalised too."""
    from radixrt.model.layers import RoundOnceRMSNorm

    norm = RoundOnceRMSNorm(hidden, 1e-6, weight_offset)
    norm.weight.data = torch.randn(hidden, generator=torch.Generator().manual_seed(1)) * 0.5 + (1 - weight_offset)
    norm = norm.to(dtype)
    wide = (torch.randn(9, 3 * hidden + 5) * 3).to(dtype)
    heads = wide[:, 5:].view(9, 3, hidden)
    atol, rtol = TOLERANCE[dtype]
    for x in (wide[:, 5 : 5 + hidden], heads):
        expected = torch_fused.rms_norm_round_once(x, norm.weight, 1e-6, weight_offset)
        got = norm(x)
        assert got.shape == x.shape
        torch.testing.assert_close(got, expected, atol=atol, rtol=rtol)
    if weight_offset:  # without the offset the weights would scale by w, not 1 + w
        plain = cpu_kernels.rms_norm(wide[:, :hidden], norm.weight, 1e-6)
        assert not torch.allclose(plain.float(), norm(wide[:, :hidden]).float(), atol=1e-2)
    if dtype != torch.float32:  # Llama's two roundings differ from one in some elements
        llama = cpu_kernels.rms_norm(wide[:, :hidden], norm.weight + weight_offset, 1e-6)
        assert not torch.equal(llama, norm(wide[:, :hidden]))


def test_rms_norm_of_strided_rows(torch_path):
    """Rows that are slices of a wider tensor (a split projection) are read in place."""
    norm = norm_of(torch.float32, hidden=32)
    wide = torch.randn(5, 80)
    x = wide[:, 16:48]
    assert x.stride(0) == 80
    torch.testing.assert_close(norm(x), torch_path(norm, x.contiguous()), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("inter", [37, 1536])  # 37: a scalar tail after whole vectors
def test_silu_and_mul_matches_torch(dtype, inter):
    gate_up = (torch.randn(11, 2 * inter) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(silu_and_mul(gate_up), F.silu(gate) * up, atol=max(atol, 1e-6), rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("inter", [37, 1536])
def test_gelu_tanh_and_mul_matches_torch(dtype, inter):
    """Where the gate is far below zero, 1 + tanh(...) cancels: a last-bit difference between two tanh
    implementations (ATen's portable build calls std::tanh, torch's own kernels Sleef's) shows there as up to
    |gate * up| 2^-23 of absolute error (a few millionths here), which the bound allows elementwise."""
    gate_up = (torch.randn(11, 2 * inter) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    atol, rtol = TOLERANCE[dtype]
    expected = (F.gelu(gate, approximate="tanh") * up).float()
    got = gelu_tanh_and_mul(gate_up).float()
    cancellation = (gate.float() * up.float()).abs() * 2.0**-23
    bound = max(atol, 1e-6) + rtol * expected.abs() + cancellation
    assert ((got - expected).abs() <= bound).all(), float(((got - expected).abs() - bound).max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_ops_round_where_the_reference_rounds(dtype):
    """Against the torch twins bit for bit but for exp's last bit: an op that skipped a rounding step (kept
    an fp32 intermediate) would differ in about a third of the elements, one that rounded twice likewise."""
    gen = torch.Generator().manual_seed(4)
    x, residual = (torch.randn(64, 576, generator=gen) * 3).to(dtype), torch.randn(64, 576, generator=gen).to(dtype)
    weight = (torch.randn(576, generator=gen) + 1).to(dtype)
    expected_residual = residual.clone()
    expected = torch_fused.rms_norm(x, weight, 1e-5, expected_residual)
    got = cpu_kernels.rms_norm(x, weight, 1e-5, residual)
    assert torch.equal(residual, expected_residual)
    assert (got != expected).float().mean() < 0.01
    gate_up = (torch.randn(64, 2 * 1536, generator=gen) * 4).to(dtype)
    assert (cpu_kernels.silu_and_mul(gate_up) != torch_fused.silu_and_mul(gate_up)).float().mean() < 0.01
    assert (cpu_kernels.gelu_tanh_and_mul(gate_up) != torch_fused.gelu_tanh_and_mul(gate_up)).float().mean() < 0.01


class _Config:
    rope_theta = 10000.0

    def __init__(self, partial_rotary_factor: float = 1.0) -> None:
        self.partial_rotary_factor = partial_rotary_factor


# 16: halves of 8 (a tail with AVX-512), 48: a vector and a tail, 64: whole vectors (the default model's);
# partial 0.75: each head's first 3/4 rotated (Phi-4-mini's), the rest passed through
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [16, 48, 64])
@pytest.mark.parametrize("partial", [1.0, 0.75])
def test_rotary_in_place_on_views_of_the_qkv_projection(dtype, head_dim, partial, torch_path):
    d = head_dim
    rotary = RotaryEmbedding(_Config(partial), head_dim=d, max_positions=256).to(dtype)
    assert rotary.cos_cache.shape == (256, int(d * partial))
    qkv = torch.randn(9, 6 * d + 2 * 2 * d).to(dtype)
    q, k, _ = qkv.split([6 * d, 2 * d, 2 * d], dim=-1)
    q, k = q.view(9, 6, d), k.view(9, 2, d)
    positions = torch.tensor([0, 1, 2, 200, 255, 7, 7, 31, 64])
    expected_q, expected_k = torch_path(rotary, positions, q.clone(), k.clone())
    out_q, out_k = rotary(positions, q, k)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(out_q, expected_q, atol=max(atol, 1e-6), rtol=rtol)
    torch.testing.assert_close(out_k, expected_k, atol=max(atol, 1e-6), rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("partial", [1.0, 0.75])
def test_rope_and_store_matches_its_torch_twin(dtype, head_dim, partial):
    """q rotated in place, k rotated into its slots with v beside it, k itself untouched, negative slots skipped;
    bf16/fp16 bit for bit (the same rounding points, no exp). A partial rotary stores each k head's unrotated rest
    as it is."""
    d, page_size = head_dim, 4
    rotary = RotaryEmbedding(_Config(partial), head_dim=d, max_positions=128).to(dtype)
    gen = torch.Generator().manual_seed(d)
    qkv = torch.randn(7, 6 * d + 2 * 2 * d, generator=gen).to(dtype)
    q, k, v = (t.view(7, -1, d) for t in qkv.split([6 * d, 2 * d, 2 * d], dim=-1))
    positions = torch.tensor([0, 5, 9, 100, 127, 3, 3])
    slots = torch.tensor([3, 17, -1, 8, 0, 22, 11])
    caches = [torch.randn(6, page_size, 2, d, generator=gen).to(dtype) for _ in range(2)]
    expected_caches = [c.clone() for c in caches]
    expected_q = torch_fused.rope_and_store(positions, q.clone(), k, v, rotary.cos_cache, rotary.sin_cache, slots,
                                            *expected_caches)
    k_before = k.clone()
    out = cpu_kernels.rope_and_store(positions, q, k, v, *rotary.fp32_caches(), slots, *caches)
    assert out is None and torch.equal(k, k_before)
    exact = dtype != torch.float32
    for got, want in [(q, expected_q), *zip(caches, expected_caches)]:
        if exact:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_partial_rotary_torch_twin_is_transformers_phi3_formula():
    """Rotating the first 3/4 of each head as transformers' Phi-3 (Phi-4-mini) does: ``cat(rotated, rest)``."""
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    rotary = RotaryEmbedding(_Config(0.75), head_dim=32, max_positions=64)
    q, k = torch.randn(5, 4, 32), torch.randn(5, 2, 32)
    positions = torch.tensor([0, 3, 17, 40, 63])
    cos, sin = rotary.cos_cache[positions][None], rotary.sin_cache[positions][None]  # [1, T, 24]
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    got_q, got_k = torch_fused.rotary(positions, q, k, rotary.cos_cache, rotary.sin_cache)
    torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_k, want_k[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
    assert torch.equal(got_q[..., 24:], q[..., 24:])


def test_rope_and_store_refuses_slots_outside_the_caches():
    q, k, v = torch.randn(2, 3, 16), torch.randn(2, 1, 16), torch.randn(2, 1, 16)
    cos = sin = torch.randn(8, 16)
    caches = [torch.zeros(2, 4, 1, 16) for _ in range(2)]
    with pytest.raises(RuntimeError, match="slots"):
        cpu_kernels.rope_and_store(torch.tensor([0, 1]), q, k, v, cos, sin, torch.tensor([0, 8]), *caches)
    with pytest.raises(RuntimeError, match="dtype"):
        cpu_kernels.rope_and_store(torch.tensor([0, 1]), q, k, v, cos, sin, torch.tensor([0, 1]),
                                   *(c.bfloat16() for c in caches))


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
    with pytest.raises(RuntimeError, match="rotary dim even and at most D"):  # wider than the heads
        cpu_kernels.rotary_embedding(torch.tensor([0, 1]), q, k, torch.randn(8, 18), torch.randn(8, 18))
    with pytest.raises(RuntimeError, match="rotary dim even and at most D"):  # odd
        cpu_kernels.rotary_embedding(torch.tensor([0, 1]), q, k, torch.randn(8, 7), torch.randn(8, 7))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_backend_rope_and_store_equals_the_default_hook(dtype):
    """The CPU backend's one-kernel rope_and_store leaves q and the pages as rotary-then-store_kv does."""
    from radixrt.memory.page_pool import KVLayout, PagePool
    from radixrt.model.attention import AttentionBackend
    from radixrt.model.forward_batch import ForwardBatch, SeqChunk
    from radixrt.model.torch_attention import TorchAttention

    d, page_size = 64, 4
    rotary = RotaryEmbedding(_Config(), head_dim=d, max_positions=64).to(dtype)
    batch = ForwardBatch.build([SeqChunk([1, 2, 3, 4, 5], 0, [2, 5]), SeqChunk([6, 7], 9, [1, 3, 4])], page_size)
    qkv = torch.randn(batch.positions.numel(), 9 * d + 2 * 3 * d).to(dtype)
    results = []
    for fused in (True, False):
        backend = TorchAttention(PagePool(KVLayout(2, 3, d, page_size, dtype), num_pages=8))
        q, k, v = (t.view(-1, n, d) for t, n in zip(qkv.clone().split([9 * d, 3 * d, 3 * d], dim=-1), (9, 3, 3)))
        hook = backend.rope_and_store if fused else lambda *args: AttentionBackend.rope_and_store(backend, *args)
        q = hook(1, rotary, batch.positions, q, k, v, batch)
        results.append((q, backend.pool.k_caches[1], backend.pool.v_caches[1], backend.pool.k_caches[0]))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert results[0][1].abs().sum() > 0 and results[0][3].abs().sum() == 0  # layer 1's pages written, not 0's
