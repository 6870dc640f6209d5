"""CPU linear layers with prepacked weights (the AVX2 fp32 panel kernel, the AVX512-BF16 bf16 panel kernel,
oneDNN's) must compute what F.linear computes, and each CPU gets the kernel meant for it."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from radixrt.kernels import cpu_kernels
from radixrt.model import cpu_linear
from radixrt.model.forward_batch import ForwardBatch, SeqChunk
from radixrt.model.parallel import ColumnParallelLinear, RowParallelLinear
from radixrt.model.runner import ModelRunner
from tiny_models import save_tiny_model

# Alone after the parallel part of `make test`, on every core: the C++ kernels split their work over threads.
pytestmark = pytest.mark.serial

needs_mkldnn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@pytest.fixture(params=["onednn", "panels"])
def kernel(request, monkeypatch):
    """Each kernel in turn. The panel kernel must build on every CPU this project runs on (all have AVX2)."""
    monkeypatch.setenv(cpu_linear.KERNEL_ENV, request.param)
    if request.param == "onednn" and not torch.backends.mkldnn.is_available():
        pytest.skip("torch built without oneDNN")
    if request.param == "panels":
        assert cpu_kernels.linear_panels_usable(), "the panel kernel did not build with AVX2/FMA here"
    return request.param


# rows: every tile size (1-6 on AVX2, 1-8 with AVX-512; 8 as 4 + 4 on AVX2) and tail, a block of 128 and past it;
# outputs: a partial last panel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 64, 128, 131, 300])
@pytest.mark.parametrize("outputs", [96, 37])
def test_packed_linear_equals_f_linear(kernel, rows, outputs):
    gen = torch.Generator().manual_seed(rows * outputs)
    weight, bias = torch.randn(outputs, 40, generator=gen), torch.randn(outputs, generator=gen)
    x = torch.randn(rows, 40, generator=gen)
    packed = cpu_linear.pack_weight(weight)
    assert packed is not None and packed.kernel == kernel and packed.out_features == outputs
    assert (packed.data.is_mkldnn) == (kernel == "onednn")
    want = F.linear(x, weight, bias)
    torch.testing.assert_close(cpu_linear.packed_linear(x, packed, bias), want, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(cpu_linear.packed_linear(x, packed), want - bias, atol=1e-4, rtol=1e-5)


def test_panels_take_any_leading_shape_and_a_strided_input(monkeypatch):
    monkeypatch.setenv(cpu_linear.KERNEL_ENV, "panels")
    weight = torch.randn(50, 24)
    packed = cpu_linear.pack_weight(weight)
    assert packed.kernel == "panels"
    x = torch.randn(3, 5, 48)[..., ::2]  # [3, 5, 24], not contiguous
    torch.testing.assert_close(cpu_linear.packed_linear(x, packed), F.linear(x, weight), atol=1e-4, rtol=1e-5)


def test_panels_refuse_a_mismatched_input_clearly(monkeypatch):
    monkeypatch.setenv(cpu_linear.KERNEL_ENV, "panels")
    packed = cpu_linear.pack_weight(torch.randn(16, 8))
    with pytest.raises(RuntimeError, match="input has 9 features, the weight 8"):
        cpu_linear.packed_linear(torch.randn(2, 9), packed)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_linear.packed_linear(torch.randn(2, 8, dtype=torch.float64), packed)


@pytest.mark.parametrize("flags, model, panels", [
    ({"avx2", "fma"}, ("AuthenticAMD", 25), True),  # AVX2-only EPYC: the panel kernel beat oneDNN there
    ({"avx2", "fma"}, ("GenuineIntel", 6), True),
    ({"avx2", "fma", "avx512f", "avx512_bf16"}, ("AuthenticAMD", 25), True),  # Zen 4: 512 bits on 256-bit units
    ({"avx2", "fma", "avx512f", "avx512_bf16"}, ("AuthenticAMD", 26), False),  # Zen 5: not measured
    ({"avx2", "fma", "avx512f", "amx_bf16"}, ("GenuineIntel", 6), False),  # Sapphire Rapids: oneDNN's AVX-512
    ({"avx2", "fma", "avx512f"}, ("", 0), False),  # unknown vendor with AVX-512
    ({"sse4_2"}, ("AuthenticAMD", 25), False),
])
def test_the_panel_kernel_is_preferred_on_avx2_cpus_without_avx512_and_on_zen4(flags, model, panels):
    assert cpu_linear.prefers_panels(frozenset(flags), model) is panels


def test_the_cpu_model_is_read_from_cpuinfo():
    zen4 = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n\nprocessor\t: 1\n"
    assert cpu_kernels.parse_cpu_model(zen4) == ("AuthenticAMD", 25)
    intel = "processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 143\n"
    assert cpu_kernels.parse_cpu_model(intel) == ("GenuineIntel", 6)
    assert cpu_kernels.parse_cpu_model("processor\t: 0\nBogoMIPS\t: 50.00\n") == ("", 0)  # arm64 has neither
    info = Path("/proc/cpuinfo")
    if info.exists() and "vendor_id" in info.read_text():
        assert cpu_kernels.cpu_model() == cpu_kernels.parse_cpu_model(info.read_text()) != ("", 0)


@pytest.mark.parametrize("flags, bf16_panels", [
    ({"avx2", "fma"}, False),  # no bf16 dot product
    ({"avx2", "fma", "avx512f", "avx512_bf16"}, True),  # Zen 4: the bf16 panels beat oneDNN there
    ({"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"}, False),  # Sapphire Rapids: oneDNN's AMX tiles
])
def test_the_bf16_panel_kernel_is_preferred_on_avx512_bf16_cpus_without_amx(flags, bf16_panels):
    assert cpu_linear.prefers_bf16_panels(frozenset(flags)) is bf16_panels


def test_the_kernel_choice_follows_the_cpu_and_the_dtype(monkeypatch):
    monkeypatch.delenv(cpu_linear.KERNEL_ENV, raising=False)
    flags = cpu_kernels.cpu_flags()
    expected = "panels" if cpu_linear.prefers_panels(flags, cpu_kernels.cpu_model()) else "onednn"
    assert cpu_linear.choose_kernel(torch.ones(4, 4)) == expected
    bf16 = "bf16" if cpu_linear.prefers_bf16_panels(flags) and cpu_kernels.linear_bf16_built() else "onednn"
    assert cpu_linear.choose_kernel(torch.ones(4, 4, dtype=torch.bfloat16)) == bf16
    assert cpu_linear.choose_kernel(torch.ones(4, 5, dtype=torch.bfloat16)) == "onednn"  # pairs need an even K
    monkeypatch.setenv(cpu_linear.KERNEL_ENV, "panels")
    assert cpu_linear.choose_kernel(torch.ones(4, 4, dtype=torch.bfloat16)) == "onednn"  # panels are fp32 only
    monkeypatch.setenv(cpu_linear.KERNEL_ENV, "bf16")
    assert cpu_linear.choose_kernel(torch.ones(4, 4)) == "onednn"  # the bf16 panels are bf16 only
    built = "bf16" if cpu_kernels.linear_bf16_built() else "onednn"
    assert cpu_linear.choose_kernel(torch.ones(4, 4, dtype=torch.bfloat16)) == built
    monkeypatch.setenv(cpu_linear.KERNEL_ENV, "fastest")
    with pytest.raises(ValueError, match="RADIXRT_CPU_LINEAR='fastest'"):
        cpu_linear.choose_kernel(torch.ones(4, 4))


@pytest.mark.parametrize("layer_cls", [ColumnParallelLinear, RowParallelLinear])
def test_layer_packs_and_frees_its_plain_weight(kernel, layer_cls):
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
    assert not packed or layer.packed.kernel == cpu_linear.choose_kernel(torch.ones(48, 32, dtype=torch.bfloat16))
    torch.testing.assert_close(layer(x).float(), expected, atol=0.1, rtol=0.02)


def test_env_var_keeps_f_linear():
    code = "import torch; from radixrt.model.cpu_linear import pack_weight; print(pack_weight(torch.ones(4, 4)))"
    out = subprocess.run(
        [sys.executable, "-c", code], env={"RADIXRT_DISABLE_PACKED_LINEAR": "1", "PATH": ""},
        capture_output=True, text=True, check=True,
    )
    assert out.stdout.strip() == "None"


@pytest.mark.parametrize("family", ["llama", "untied-gqa1"])
def test_runner_logits_same_packed_or_not(tmp_path, monkeypatch, kernel, family):
    save_tiny_model(family, tmp_path)
    packed = ModelRunner(tmp_path, dtype="float32", num_pages=16, page_size=4)
    monkeypatch.setenv("RADIXRT_DISABLE_PACKED_LINEAR", "1")
    plain = ModelRunner(tmp_path, dtype="float32", num_pages=16, page_size=4)
    assert packed.packed_linears == 2 * 4 + 1 and plain.packed_linears == 0
    assert packed.model.packed_head is not None and packed.model.packed_head.kernel == kernel
    batch = [SeqChunk([1, 5, 9, 30, 2], 0, [1, 2], logits_from=0), SeqChunk([7, 3], 0, [3])]
    torch.testing.assert_close(
        packed.forward(ForwardBatch.build(batch, 4)), plain.forward(ForwardBatch.build(batch, 4)), atol=1e-4, rtol=1e-4
    )


# rows: every tile height (1-8), balanced tiles (11 as 6 + 5, 25 as 7 + 6 + 6 + 6), a block of 256 and past it;
# outputs: one panel, a partial panel, groups of panels ending in 1, 2 or 3 panels (16 columns each), several
# groups a thread (the next one prefetched at 2-32 rows)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 11, 25, 256, 259])
@pytest.mark.parametrize("outputs", [16, 37, 64, 80, 96, 200])
def test_the_bf16_panels_compute_what_fp32_computes_rounded_once(rows, outputs):
    """On every CPU: with AVX512-BF16 on vdpbf16ps, elsewhere on the instruction's stand-in (bf16_pairs.h)."""
    gen = torch.Generator().manual_seed(rows * outputs)
    weight = torch.randn(outputs, 48, generator=gen).bfloat16()
    bias = torch.randn(outputs, generator=gen).bfloat16()
    x = torch.randn(rows, 48, generator=gen).bfloat16()
    panels = cpu_kernels.pack_linear_bf16(weight)
    assert panels.shape == ((outputs + 15) // 16, 24, 16, 2)
    want = x.double() @ weight.double().t()
    for b, ref in ((None, want), (bias, want + bias.double())):
        out = cpu_kernels.linear_bf16(x, panels, outputs, b)
        assert out.dtype == torch.bfloat16 and out.shape == (rows, outputs)
        # one rounding of an fp32 sum of exact products: within a bf16 ulp of the exact result (2**-8 relative)
        torch.testing.assert_close(out.double(), ref, rtol=2**-8, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_gets_the_same_bits_whatever_rows_share_its_product(dtype):
    """A speculative verify step's rows must be the decode step's rows: a row's output may not depend on the
    balanced tiles (up to 6 rows fp32 on AVX2, 8 with AVX-512 and in bf16) that the row count splits into."""
    assert cpu_kernels.linear_panels_usable(), "the panel kernel did not build with AVX2/FMA here"
    pack, linear = ((cpu_kernels.pack_linear_panels, cpu_kernels.linear_panels) if dtype == torch.float32
                    else (cpu_kernels.pack_linear_bf16, cpu_kernels.linear_bf16))
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(200, 96, generator=gen).to(dtype)
    x = torch.randn(40, 96, generator=gen).to(dtype)
    panels = pack(weight)
    alone = torch.cat([linear(x[r : r + 1], panels, 200) for r in range(40)])
    for rows in (2, 6, 7, 8, 9, 10, 13, 17, 23, 40):
        assert torch.equal(linear(x[:rows], panels, 200), alone[:rows]), rows


def test_grouped_bf16_products_give_each_rows_range_its_own_weights_bits():
    """A mixture-of-experts layer's experts in one call: rows bounds[e]:bounds[e + 1] through weight e, each row with
    the bits linear_bf16 gives it alone (ranges empty, of one row, of decode sizes and past a 256-row block)."""
    gen = torch.Generator().manual_seed(11)
    weights = [torch.randn(80, 48, generator=gen).bfloat16() for _ in range(5)]
    panels = [cpu_kernels.pack_linear_bf16(w) for w in weights]
    bounds = [0, 3, 3, 20, 279, 280]
    x = torch.randn(bounds[-1], 48, generator=gen).bfloat16()
    got = cpu_kernels.linear_bf16_grouped(x, panels, bounds, 80)
    alone = torch.cat([cpu_kernels.linear_bf16(x[a:b], p, 80) for p, a, b in zip(panels, bounds, bounds[1:])])
    assert torch.equal(got, alone)
    with pytest.raises(RuntimeError, match="bounds must cover"):
        cpu_kernels.linear_bf16_grouped(x, panels, [0, 3, 3, 20, 279, 279], 80)
    with pytest.raises(RuntimeError, match="one more entry"):
        cpu_kernels.linear_bf16_grouped(x, panels, [0, 280], 80)
    with pytest.raises(RuntimeError, match="out_features disagrees with the panels"):
        cpu_kernels.linear_bf16_grouped(x, [panels[0], cpu_kernels.pack_linear_bf16(weights[1][:40])], [0, 3, 280], 80)


def test_the_bf16_panels_take_any_leading_shape_a_strided_input_and_refuse_bad_ones():
    weight = torch.randn(40, 24).bfloat16()
    panels = cpu_kernels.pack_linear_bf16(weight)
    x = torch.randn(3, 5, 48).bfloat16()[..., ::2]  # [3, 5, 24], not contiguous
    torch.testing.assert_close(cpu_kernels.linear_bf16(x, panels, 40).double(), x.double() @ weight.double().t(),
                               rtol=2**-8, atol=1e-5)
    with pytest.raises(RuntimeError, match="x has 26 features, the weight 24"):
        cpu_kernels.linear_bf16(torch.randn(2, 26).bfloat16(), panels, 40)
    with pytest.raises(RuntimeError, match="bf16"):
        cpu_kernels.linear_bf16(torch.randn(2, 24), panels, 40)
    with pytest.raises(RuntimeError, match="out_features"):
        cpu_kernels.linear_bf16(torch.randn(2, 24).bfloat16(), panels, 60)
    with pytest.raises(RuntimeError, match="even number of input features"):
        cpu_kernels.pack_linear_bf16(torch.randn(4, 7).bfloat16())


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: q/k/v biases
def test_runner_logits_with_the_bf16_panels_match_the_plain_path(tmp_path, monkeypatch, family):
    """Where the bf16 panels run (AVX512-BF16), a bf16 model packs every projection and the head for them."""
    save_tiny_model(family, tmp_path)
    monkeypatch.setenv(cpu_linear.KERNEL_ENV, "bf16")
    packed = ModelRunner(tmp_path, dtype="bfloat16", num_pages=16, page_size=4)
    monkeypatch.setenv("RADIXRT_DISABLE_PACKED_LINEAR", "1")
    plain = ModelRunner(tmp_path, dtype="bfloat16", num_pages=16, page_size=4)
    kernels = {m.packed.kernel for m in packed.model.modules() if getattr(m, "packed", None) is not None}
    assert kernels == ({"bf16"} if cpu_kernels.linear_bf16_built() else kernels & {"onednn"})
    batch = [SeqChunk([1, 5, 9, 30, 2], 0, [1, 2], logits_from=0), SeqChunk([7, 3], 0, [3])]
    torch.testing.assert_close(
        packed.forward(ForwardBatch.build(batch, 4)), plain.forward(ForwardBatch.build(batch, 4)), atol=0.05, rtol=0.02
    )


@pytest.mark.parametrize("forced", ["onednn", "bf16", "amx"])
def test_an_lm_heads_fp32_logits_are_its_bf16_outputs_widened(forced, monkeypatch):
    monkeypatch.setenv(cpu_linear.KERNEL_ENV, forced)
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(200, 64, generator=gen).bfloat16()
    packed = cpu_linear.pack_weight(weight)
    if packed is None:  # a CPU without AVX512-BF16, AMX or AVX-NE-CONVERT: bf16 stays on F.linear
        pytest.skip(f"no packed bf16 kernel runs on this CPU ({forced} asked)")
    for rows in (1, 8, 40, 300):
        x = torch.randn(rows, 64, generator=gen).bfloat16()
        bf16 = cpu_linear.packed_linear(x, packed)
        wide = cpu_linear.packed_linear(x, packed, fp32_out=True)
        assert bf16.dtype == torch.bfloat16 and wide.dtype == torch.float32
        assert torch.equal(wide, bf16.float()), (packed.kernel, rows)
