"""bf16 linear layers on AMX tiles (kernels/csrc/linear_amx.cpp), over the bf16 panels: the products a bf16 GEMM
gives, the same bits for a row whatever shares its product, and the kernel choice on CPUs with AMX.

The kernel needs a CPU with AMX-BF16; on others these products cannot run and their tests say so."""

import pytest
import torch

from radixrt.kernels import cpu_kernels
from radixrt.model import cpu_linear
from radixrt.model.forward_batch import ForwardBatch, SeqChunk
from radixrt.model.runner import ModelRunner
from tiny_models import save_tiny_model

# Alone after the parallel part of `make test`, on every core: the C++ kernels split their work over threads.
pytestmark = pytest.mark.serial

needs_amx = pytest.mark.skipif(not cpu_kernels.linear_amx_usable(), reason="needs a CPU with AMX-BF16")


@pytest.mark.parametrize("flags, amx", [
    ({"avx2", "fma", "avx512f", "avx512_bf16"}, False),  # Zen 4: the bf16 panels on vdpbf16ps
    ({"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}, True),  # Sapphire Rapids
])
def test_the_amx_kernel_is_preferred_where_the_cpu_has_amx(flags, amx):
    assert cpu_linear.prefers_amx(frozenset(flags)) is amx


def test_the_kernel_choice_on_this_cpu(monkeypatch):
    monkeypatch.delenv(cpu_linear.KERNEL_ENV, raising=False)
    amx = cpu_linear.prefers_amx(cpu_kernels.cpu_flags()) and cpu_kernels.linear_amx_usable()
    bf16 = torch.ones(4, 64, dtype=torch.bfloat16)
    if amx:
        assert cpu_linear.choose_kernel(bf16) == "amx"
        assert cpu_linear.choose_kernel(torch.ones(4, 48, dtype=torch.bfloat16)) == "onednn"  # K not a multiple of 32
    else:
        assert cpu_linear.choose_kernel(bf16) != "amx"
    monkeypatch.setenv(cpu_linear.KERNEL_ENV, "amx")
    assert cpu_linear.choose_kernel(torch.ones(4, 64)) != "amx"  # fp32 never
    assert (cpu_linear.choose_kernel(bf16) == "amx") is cpu_kernels.linear_amx_usable()


# rows: one tile, two pairs at a time (1-16), a tile and its tail (17), two tiles (31-33), a 48-row block alone
# (40, 48) and after 32-row ones (80), a chunk of 256 and past it (from 256 rows whole pairs of aligned output rows
# are streamed; 260: a chunk of one tile, 300: of 48 rows); outputs: one panel, a partial panel, an odd number of
# panels (the last pair has one; alone in a two-pair block), several pairs a thread, rows of whole pairs (96);
# each also written as fp32 (streamed too from 256 rows where a row's fp32 outputs fill whole lines: 16, 48, 96)
@needs_amx
@pytest.mark.parametrize("rows", [1, 15, 16, 17, 32, 33, 40, 48, 80, 256, 260, 300])
@pytest.mark.parametrize("outputs", [16, 37, 48, 96, 200])
@pytest.mark.parametrize("features", [64, 96])
def test_amx_computes_what_fp32_computes_rounded_once(rows, outputs, features):
    gen = torch.Generator().manual_seed(rows * outputs + features)
    weight = torch.randn(outputs, features, generator=gen).bfloat16()
    bias = torch.randn(outputs, generator=gen).bfloat16()
    x = torch.randn(rows, features, generator=gen).bfloat16()
    panels = cpu_kernels.pack_linear_bf16(weight)
    want = x.double() @ weight.double().t()
    for b, ref in ((None, want), (bias, want + bias.double())):
        out = cpu_kernels.linear_amx(x, panels, outputs, b)
        assert out.dtype == torch.bfloat16 and out.shape == (rows, outputs)
        torch.testing.assert_close(out.double(), ref, rtol=2**-8, atol=1e-5)
        wide = cpu_kernels.linear_amx(x, panels, outputs, b, fp32_out=True)  # an LM head's logits
        assert wide.dtype == torch.float32 and torch.equal(wide, out.float())


# an output past 4 MB goes out in non-temporal stores at any row count (an LM head's logits at a verify step's rows):
# fp32 at 40 rows, bf16 at 80, a vocabulary that ends in part of a panel, and one below the size (the cached stores)
@needs_amx
@pytest.mark.parametrize("rows, outputs", [(40, 32768), (40, 32760), (80, 32768), (8, 32768)])
def test_amx_streams_an_output_larger_than_the_cache_at_any_row_count(rows, outputs):
    gen = torch.Generator().manual_seed(rows + outputs)
    weight = torch.randn(outputs, 64, generator=gen).bfloat16()
    x = torch.randn(rows, 64, generator=gen).bfloat16()
    panels = cpu_kernels.pack_linear_bf16(weight)
    out = cpu_kernels.linear_amx(x, panels, outputs)
    torch.testing.assert_close(out.double(), x.double() @ weight.double().t(), rtol=2**-8, atol=1e-5)
    assert torch.equal(cpu_kernels.linear_amx(x, panels, outputs, fp32_out=True), out.float())
    alone = torch.cat([cpu_kernels.linear_amx(x[r : r + 1], panels, outputs) for r in range(0, rows, 7)])
    assert torch.equal(alone, out[::7])


@needs_amx
def test_amx_gives_a_row_the_same_bits_whatever_rows_share_its_product():
    """A speculative verify step's rows must be its decode steps' rows: the padding of a partial tile and the
    rows beside a row may not change it."""
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(200, 96, generator=gen).bfloat16()
    x = torch.randn(300, 96, generator=gen).bfloat16()
    panels = cpu_kernels.pack_linear_bf16(weight)
    alone = torch.cat([cpu_kernels.linear_amx(x[r : r + 1], panels, 200) for r in range(100)])
    for rows in (2, 7, 15, 16, 17, 31, 33, 40, 47, 48, 49, 64, 80, 100):  # every block shape, alone and together
        assert torch.equal(cpu_kernels.linear_amx(x[:rows], panels, 200), alone[:rows]), rows
    whole = cpu_kernels.linear_amx(x, panels, 200)
    assert torch.equal(whole[:100], alone)
    for chunked in (260, 300):  # a last chunk of one tile, of 48 rows
        assert torch.equal(cpu_kernels.linear_amx(x[:chunked], panels, 200), whole[:chunked]), chunked
    assert torch.equal(cpu_kernels.linear_amx(x[256:260], panels, 200), whole[256:260])
    assert torch.equal(cpu_kernels.linear_amx(x[256:300], panels, 200), whole[256:300])
    streamed = cpu_kernels.pack_linear_bf16(weight[:96])  # whole pairs of aligned rows: streamed at 300 rows
    assert torch.equal(cpu_kernels.linear_amx(x, streamed, 96)[:100], alone[:, :96])


@needs_amx
def test_amx_takes_any_leading_shape_a_strided_input_and_refuses_bad_ones():
    weight = torch.randn(40, 32).bfloat16()
    panels = cpu_kernels.pack_linear_bf16(weight)
    x = torch.randn(3, 5, 64).bfloat16()[..., ::2]  # [3, 5, 32], not contiguous
    torch.testing.assert_close(cpu_kernels.linear_amx(x, panels, 40).double(), x.double() @ weight.double().t(),
                               rtol=2**-8, atol=1e-5)
    with pytest.raises(RuntimeError, match="x has 34 features, the weight 32"):
        cpu_kernels.linear_amx(torch.randn(2, 34).bfloat16(), panels, 40)
    with pytest.raises(RuntimeError, match="out_features"):
        cpu_kernels.linear_amx(torch.randn(2, 32).bfloat16(), panels, 60)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        cpu_kernels.linear_amx(torch.randn(2, 48).bfloat16(), cpu_kernels.pack_linear_bf16(torch.randn(8, 48).bfloat16()), 8)


@needs_amx
@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: q/k/v biases
def test_runner_logits_on_amx_match_the_plain_path(tmp_path, monkeypatch, family):
    save_tiny_model(family, tmp_path)
    monkeypatch.setenv(cpu_linear.KERNEL_ENV, "amx")
    packed = ModelRunner(tmp_path, dtype="bfloat16", num_pages=16, page_size=4)
    monkeypatch.setenv("RADIXRT_DISABLE_PACKED_LINEAR", "1")
    plain = ModelRunner(tmp_path, dtype="bfloat16", num_pages=16, page_size=4)
    kernels = {m.packed.kernel for m in packed.model.modules() if getattr(m, "packed", None) is not None}
    assert "amx" in kernels and kernels <= {"amx", "onednn"}
    batch = [SeqChunk([1, 5, 9, 30, 2], 0, [1, 2], logits_from=0), SeqChunk([7, 3], 0, [3])]
    torch.testing.assert_close(
        packed.forward(ForwardBatch.build(batch, 4)), plain.forward(ForwardBatch.build(batch, 4)), atol=0.05, rtol=0.02
    )
