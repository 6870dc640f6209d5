"""C++ CPU kernels (kernels/csrc), compiled on first use with torch's JIT extension builder and cached.

``rms_norm`` (with the residual add fused in; Gemma's and OLMo 2's forms too), ``silu_and_mul``,
``gelu_tanh_and_mul`` (Gemma's gate), ``rotary_embedding`` and ``rope_and_store`` (rotary with the K/V store) each
replace a chain of small torch ops of a decoder layer, a vector at a time in
fp32 and rounding to bf16/fp16 where the transformers reference rounds. ``linear_panels`` is the fp32 linear
layer of CPUs with AVX2 and no AVX-512 (see radixrt.model.cpu_linear). ``paged_decode`` reads each request's
K/V pages where they lie in the pool: the torch path must first copy every request's whole history
(``gather_pages``) and then read the copy again, which at long contexts costs more than the attention itself;
on bf16 caches it multiplies with AVX512-BF16 dot products where the CPU has them. Build once:
``python -m radixrt.kernels.cpu_kernels`` (about 60 s with gcc; later loads take well under a second).

The kernels are compiled for the widest vectors the CPU has (:func:`vector_flags`): ATen's AVX-512 vectors
where it has AVX512F/BW/VL/DQ (and AVX512-BF16 instructions where it has them), else AVX2, else ATen's
portable ones. ``RADIXRT_CPU_VECTORS=avx512|avx2|default`` builds narrower ones, to test those paths on a wider
CPU.

Contract of :func:`load`: where the toolchain is present (the C++ compiler torch's extension builder would
call, ``$CXX`` else ``c++``, and ninja) the kernels must build, and a failed build raises
:class:`KernelBuildError` with the compiler's message; where either is missing the runtime keeps the torch
path and logs once why (:func:`unavailable_reason`). ``RADIXRT_DISABLE_CPU_KERNELS=1`` keeps the torch path
deliberately.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shlex
import shutil
import sys
import sysconfig
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)
CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / name for name in ("bindings.cpp", "paged_decode.cpp", "paged_extend.cpp", "fused_ops.cpp",
                                    "linear_panels.cpp", "linear_bf16.cpp", "linear_fp8.cpp", "linear_amx.cpp",
                                    "greedy_tokens.cpp", "sample_tokens.cpp")]
HEADERS = [CSRC / "dtype_vec.h", CSRC / "bf16_pairs.h", CSRC / "bf16_panel_tiles.h", CSRC / "panel_product.h",
           CSRC / "amx_tiles.h", CSRC / "attend_amx.h"]
VECTORS_ENV = "RADIXRT_CPU_VECTORS"
AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512dq")  # what ATen's AVX-512 vectors need
LEVELS = ("avx512bf16", "avx512", "avx2", "default")
# the CPU flags past each level, which -march=native enables and a build at that level switches off again
ABOVE = {"avx512bf16": (), "avx512": ("avx512_bf16",), "avx2": ("avx512_bf16", "avx512f"),
         "default": ("avx512_bf16", "avx512f", "avx2")}


def enabled() -> bool:
    return os.environ.get("RADIXRT_DISABLE_CPU_KERNELS") != "1"


def _cpu_flags() -> str:
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.processor()


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (``avx2``, ``avx512f``, ...)."""
    return frozenset(_cpu_flags().partition(":")[2].split())


def parse_cpu_model(cpuinfo: str) -> tuple[str, int]:
    """(vendor, family) of the first processor in /proc/cpuinfo's text; ``("", 0)`` for what it lacks."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            break
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    family = fields.get("cpu family", "")
    return fields.get("vendor_id", ""), int(family) if family.isdigit() else 0


@lru_cache(maxsize=1)
def cpu_model() -> tuple[str, int]:
    """The CPU's vendor and family (``("AuthenticAMD", 25)`` for Zen 3 and 4); ``("", 0)`` where unknown."""
    try:
        return parse_cpu_model(Path("/proc/cpuinfo").read_text())
    except OSError:
        return "", 0


def vector_levels(cpu_flags: str) -> list[str]:
    """The vector builds this CPU can run, widest first: ``avx512bf16``, ``avx512``, ``avx2``, ``default``."""
    names = set(cpu_flags.split())
    levels = ["default"]
    if {"avx2", "fma"} <= names:
        levels.insert(0, "avx2")
        if set(AVX512) <= names:
            levels.insert(0, "avx512")
            if "avx512_bf16" in names:
                levels.insert(0, "avx512bf16")
    return levels


def vector_flags(cpu_flags: str, limit: str | None = None) -> list[str]:
    """The compiler flags that pick ATen's vectors (at::vec) and the instruction sets the kernels may use: the
    widest the CPU has (:func:`vector_levels`), or at most ``limit`` (:data:`VECTORS_ENV`). They come after
    ``-march=native``, so a narrower build also switches off what that enabled."""
    if limit not in (None, "", *LEVELS):
        raise ValueError(f"{VECTORS_ENV}={limit!r}; choose one of {', '.join(LEVELS)}")
    levels = vector_levels(cpu_flags)
    level = levels[0] if not limit else next(lv for lv in levels if LEVELS.index(lv) >= LEVELS.index(limit))
    names = set(cpu_flags.split())
    off = [f"-mno-{name.replace('_', '')}" for name in ABOVE[level] if name in names]
    if level.startswith("avx512"):
        flags = ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512", *(f"-m{name}" for name in AVX512)]
        return flags + (["-mavx512bf16"] if level == "avx512bf16" else off)
    if level == "avx2":
        return ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", *off]
    return ["-DCPU_CAPABILITY=DEFAULT", *off]


def compile_flags() -> list[str]:
    # -ffp-contract=off: gcc fused a * b + c into one FMA in some template instantiations and not in others, so a
    # query row's bits depended on the row tile it fell in, and a verify row could differ from its decode row.
    return ["-O3", "-march=native", "-fopenmp", *vector_flags(_cpu_flags(), os.environ.get(VECTORS_ENV)),
            "-ffp-contract=off"]


def _build_name() -> str:
    """Sources, torch version, CPU flags and compiler flags in the name: ``-march=native`` code must not move
    between CPUs, and a build for other vectors is another build."""
    digest = hashlib.sha256(torch.__version__.encode())
    for source in SOURCES + HEADERS:
        digest.update(source.read_bytes())
    digest.update(_cpu_flags().encode())
    digest.update(" ".join(compile_flags()).encode())
    return f"radixrt_cpu_{digest.hexdigest()[:12]}"


class KernelBuildError(RuntimeError):
    """The toolchain is present but the kernels failed to build or load; the message carries the compiler's."""


def _cxx_compiler() -> str:
    from torch.utils.cpp_extension import get_cxx_compiler

    return get_cxx_compiler()


def _find_ninja() -> str | None:
    """ninja on PATH, else the one the ``ninja`` package put next to this interpreter (a venv not activated)."""
    found = shutil.which("ninja")
    if found is None:
        found = shutil.which("ninja", path=sysconfig.get_path("scripts"))
    return found


def unavailable_reason() -> str | None:
    """Why the kernels are off here by design (switched off, no compiler, no ninja), or None: they must build."""
    if not enabled():
        return "switched off by RADIXRT_DISABLE_CPU_KERNELS=1"
    compiler = _cxx_compiler()
    words = shlex.split(compiler)  # CXX may carry a launcher ("ccache g++")
    if not words or shutil.which(words[0]) is None:
        return f"no C++ compiler: {compiler!r} (torch's choice: $CXX, else c++) is not on PATH"
    if _find_ninja() is None:
        return "no ninja, which torch's extension builder needs (pip install ninja)"
    return None


@lru_cache(maxsize=1)
def load() -> ModuleType | None:
    """The compiled kernels, or None where :func:`unavailable_reason` says why (logged once).

    Raises :class:`KernelBuildError` where the toolchain is present but the build fails (not cached: the next
    call tries again).
    """
    reason = unavailable_reason()
    if reason is not None:
        (logger.info if not enabled() else logger.warning)("CPU kernels not built, using the torch path: %s", reason)
        return None
    ninja_dir = str(Path(_find_ninja()).parent)
    if ninja_dir not in os.environ.get("PATH", "").split(os.pathsep):  # torch runs "ninja" from PATH
        os.environ["PATH"] = os.pathsep.join([os.environ.get("PATH", ""), ninja_dir]).strip(os.pathsep)
    from torch.utils.cpp_extension import load as load_extension

    name = _build_name()
    _announce_first_build(name)
    try:
        return load_extension(
            name=name,
            sources=[str(s) for s in SOURCES],
            extra_cflags=compile_flags(),
            extra_ldflags=["-fopenmp"],
        )
    except Exception as exc:
        raise KernelBuildError(
            f"the CPU kernels failed to build with {_cxx_compiler()!r} (RADIXRT_DISABLE_CPU_KERNELS=1 runs the "
            f"torch path instead): {exc}"
        ) from exc


def _announce_first_build(name: str) -> None:
    """The first build takes most of a minute: say so, and where it is cached, rather than sit silent."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        folder = Path(_get_build_directory(name, verbose=False))
    except Exception:  # a private torch helper: without it, just build
        return
    if not (folder / f"{name}.so").exists():
        print(f"radixrt: compiling the C++ CPU kernels once (under a minute), cached in {folder}", file=sys.stderr,
              flush=True)


def usable_for(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether :func:`paged_decode` can run on these tensors here (CPU, one dtype, kernels built)."""
    return q.device.type == "cpu" and q.dtype == k_cache.dtype and load() is not None


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    sliding_window: int = 0,
    chunks: CascadeChunks | None = None,
    portable: bool = False,
    tiles: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention of ``q`` ``[B, heads, D]`` over paged K/V read in place: (out, log-sum-exp fp32).

    ``page_table`` ``[B, W]`` and ``seq_lens`` ``[B]`` (each >= 1) are int32; q and the caches share a dtype.
    With ``chunks`` (no sliding window), each request first attends to its chunk's shared pages, read once for
    the whole chunk, and ``page_table``/``seq_lens`` describe its keys after them. bf16 runs on AVX512-BF16 dot
    products where :func:`bf16_dot_built` (head_dim 32, 64 or 128), with those products on AMX tiles where
    :func:`decode_tiles_usable` (``tiles=False``: not); ``portable`` forces the fp32 path instead.
    """
    cascade = (None,) * 5 if chunks is None else (chunks.rows, chunks.offsets, chunks.groups, chunks.shared_table,
                                                  chunks.shared_pages)
    out, lse = _call("radixrt::paged_decode", _module().paged_decode, q, k_cache, v_cache, page_table, seq_lens,
                     float(sm_scale), int(sliding_window), *cascade, bool(portable), bool(tiles))
    return out, lse


def paged_extend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                 prefix_lens: torch.Tensor, extend_lens: torch.Tensor, sm_scale: float,
                 sliding_window: int = 0) -> torch.Tensor:
    """Prefill attention of bf16 ``q`` ``[T, heads, D]`` (each request's new tokens back to back, already stored)
    over bf16 K/V pages read in place, causal, within ``sliding_window`` (0: none); ``D`` 32, 64 or 128."""
    return _call("radixrt::paged_extend", _module().paged_extend, q, k_cache, v_cache, page_table, prefix_lens,
                 extend_lens, float(sm_scale), int(sliding_window))


def paged_extend_usable(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the runtime takes :func:`paged_extend` here: bf16 on the CPU, a head_dim it takes, and an AVX-512
    build (elsewhere its scalar fallback, built for the tests, is slower than torch's attention), on a CPU without
    AMX (there torch's flash attention multiplies on AMX tiles: a 2,048-token causal chunk of the default model's
    heads took 10.3 ms a layer against this kernel's 33.5 on a Xeon with AMX)."""
    if q.device.type != "cpu" or q.dtype != torch.bfloat16 or k_cache.dtype != torch.bfloat16:
        return False
    if "amx_bf16" in cpu_flags():
        return False
    module = load()
    return module is not None and q.shape[-1] in (32, 64, 128) and module.paged_extend_vectorized()


def decode_tiles_usable() -> bool:
    """Whether :func:`paged_decode` multiplies bf16 on AMX tiles here (an AMX CPU, its tiles granted): up to 16 query
    rows at once, so that a chunk's requests that read the same pages (a verify step's rows) walk them together."""
    module = load()
    return module is not None and module.decode_tiles_usable()


def bf16_dot_built() -> bool:
    """Whether :func:`paged_decode` multiplies bf16 with AVX512-BF16 dot products here."""
    module = load()
    return module is not None and module.bf16_dot_built()


@dataclass(frozen=True)
class CascadeChunks:
    """Requests in chunks for :func:`paged_decode`, int32: chunk c is ``rows[offsets[c]:offsets[c + 1]]``; its
    requests all begin with the first ``shared_pages[groups[c]]`` pages of row ``groups[c]`` of
    ``shared_table`` (none where ``groups[c]`` is -1)."""

    rows: torch.Tensor
    offsets: torch.Tensor
    groups: torch.Tensor
    shared_table: torch.Tensor
    shared_pages: torch.Tensor


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             round_once: bool = False, weight_offset: float = 0.0) -> torch.Tensor:
    """RMSNorm of ``x`` ``[T, H]``; with ``residual``, first ``residual += x`` in place and normalize that. With
    ``round_once`` (Gemma's norm, ``weight_offset`` 1; OLMo 2's, 0) the output is ``norm * (weight_offset +
    weight)`` in fp32, rounded once; else the normalised x is rounded before the product, as Llama's norm does."""
    return _call("radixrt::rms_norm", _module().rms_norm, x, residual, weight, float(eps), round_once,
                 float(weight_offset))


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up`` ``[T, 2I]`` holding gate then up."""
    return _call("radixrt::silu_and_mul", _module().silu_and_mul, gate_up)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gelu(gate, tanh approximation) * up`` for ``gate_up`` ``[T, 2I]`` holding gate then up (Gemma's MLP)."""
    return _call("radixrt::gelu_tanh_and_mul", _module().gelu_tanh_and_mul, gate_up)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_cache: torch.Tensor,
                     sin_cache: torch.Tensor) -> None:
    """Neox-style (rotate-half) RoPE of ``q`` ``[T, H, D]`` and ``k`` ``[T, KH, D]`` in place: the tables'
    ``positions`` rows ``[rows, R]`` rotate each head's first ``R`` elements (``R < D``: a partial rotary)."""
    _call("radixrt::rotary_embedding", _module().rotary_embedding, positions, q, k, cos_cache, sin_cache)


def rope_and_store(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   cos_cache: torch.Tensor, sin_cache: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor) -> None:
    """:func:`rotary_embedding` of ``q`` (in place) and ``k``, the rotated ``k`` and ``v`` ``[T, KH, D]`` written
    into the flat ``slots`` (int64; < 0: not stored) of the paged caches; ``k`` itself stays unrotated."""
    _call("radixrt::rope_and_store", _module().rope_and_store, positions, q, k, v, cos_cache, sin_cache, slots,
          k_cache, v_cache)


def linear_panels_usable() -> bool:
    """Whether this CPU runs the AVX2/FMA fp32 panel kernel (:func:`linear_panels`): built here with it."""
    module = load()
    return module is not None and module.linear_panels_built()


def pack_linear_panels(weight: torch.Tensor) -> torch.Tensor:
    """An fp32 ``weight`` ``[out, in]`` as panels of 16 outputs, ``[ceil(out / 16), in, 16]``, for :func:`linear_panels`."""
    return _module().pack_linear_panels(weight.detach())


def linear_panels(x: torch.Tensor, panels: torch.Tensor, out_features: int, bias: torch.Tensor | None = None):
    """``x @ W^T (+ bias)`` in fp32 with ``W`` packed by :func:`pack_linear_panels`; ``x`` ``[..., in]``."""
    return _call("radixrt::linear_panels", _module().linear_panels, x, panels, int(out_features), bias)


def linear_bf16_built() -> bool:
    """Whether :func:`linear_bf16` multiplies with AVX512-BF16 dot products here (elsewhere it runs, slowly, on
    their stand-in: for tests only)."""
    module = load()
    return module is not None and module.linear_bf16_built()


def pack_linear_bf16(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 ``weight`` ``[out, in]`` (``in`` even) as panels of 16 outputs in pairs, ``[ceil(out / 16), in / 2,
    16, 2]``, for :func:`linear_bf16`."""
    return _module().pack_linear_bf16(weight.detach())


def linear_bf16(x: torch.Tensor, panels: torch.Tensor, out_features: int, bias: torch.Tensor | None = None):
    """``x @ W^T (+ bias)`` in bf16 (fp32 sums, rounded once) with ``W`` packed by :func:`pack_linear_bf16`."""
    return _call("radixrt::linear_bf16", _module().linear_bf16, x, panels, int(out_features), bias)


def linear_bf16_grouped(x: torch.Tensor, panels: list[torch.Tensor], bounds: list[int],
                        out_features: int) -> torch.Tensor:
    """Rows ``bounds[e]:bounds[e + 1]`` of ``x`` times weight ``e`` (packed by :func:`pack_linear_bf16`, all of one
    shape) into the same rows of the output, in one parallel region: each row gets :func:`linear_bf16`'s bits."""
    return _call("radixrt::linear_bf16_grouped", _module().linear_bf16_grouped, x, panels, bounds, int(out_features))


def pack_linear_fp8(bits: torch.Tensor, row_scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 (e4m3) ``bits`` ``[out, in]`` (uint8, ``in`` even) and their scales ``[out, blocks]`` (fp32, one per
    output and block of inputs) as :func:`linear_fp8`'s panels ``[P, in / 2, 16, 2]`` (uint8, the layout of
    :func:`pack_linear_bf16`) and scales ``[P, blocks, 16]``, zero past ``out``."""
    out_features, in_features = bits.shape
    if in_features % 2:
        raise ValueError("the fp8 panels need an even number of input features")
    panels = -(-out_features // 16)
    padded = torch.zeros(panels * 16, in_features, dtype=torch.uint8)
    padded[:out_features] = bits
    scales = torch.zeros(panels * 16, row_scales.shape[1], dtype=torch.float32)
    scales[:out_features] = row_scales
    return (padded.view(panels, 16, in_features // 2, 2).permute(0, 2, 1, 3).contiguous(),
            scales.view(panels, 16, -1).permute(0, 2, 1).contiguous())


def linear_fp8(x: torch.Tensor, panels: torch.Tensor, scales: torch.Tensor, block_k: int, k_offset: int,
               out_features: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T (+ bias)`` in bf16 with ``W`` as fp8 panels and scales (:func:`pack_linear_fp8`), input ``k``'s
    scale that of block ``(k_offset + k) // block_k``: bit for bit :func:`linear_bf16` over ``W`` dequantized
    (each weight times its scale in fp32, rounded once to bf16)."""
    return _call("radixrt::linear_fp8", _module().linear_fp8, x, panels, scales, int(block_k), int(k_offset),
                 int(out_features), bias)


def linear_fp8_grouped(x: torch.Tensor, panels: list[torch.Tensor], scales: list[torch.Tensor], bounds: list[int],
                       block_k: int, k_offset: int, out_features: int) -> torch.Tensor:
    """Rows ``bounds[e]:bounds[e + 1]`` of ``x`` times fp8 weight ``e`` (:func:`pack_linear_fp8`'s panels and scales,
    all of one shape and blocking) into the same rows of the output, in one parallel region: each row gets
    :func:`linear_fp8`'s bits."""
    return _call("radixrt::linear_fp8_grouped", _module().linear_fp8_grouped, x, panels, scales, bounds, int(block_k),
                 int(k_offset), int(out_features))


@lru_cache(maxsize=1)
def linear_amx_usable() -> bool:
    """Whether :func:`linear_amx` runs here: built for a CPU with AMX-BF16, and the tile registers granted."""
    module = load()
    return module is not None and module.linear_amx_usable()


def linear_amx(x: torch.Tensor, panels: torch.Tensor, out_features: int, bias: torch.Tensor | None = None,
               fp32_out: bool = False):
    """:func:`linear_bf16`'s product on AMX tiles, over the same panels (``in`` a multiple of 32); with
    ``fp32_out`` its bf16 values come widened to fp32 (as ``.float()`` of the bf16 result, in the same pass)."""
    return _call("radixrt::linear_amx", _module().linear_amx, x, panels, int(out_features), bias, bool(fp32_out))


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest logit (int64), as ``logits.max(dim=-1).indices``: the first of equal maxima,
    the first NaN where a row has one; ``logits`` fp32 ``[rows, vocab]`` with contiguous rows."""
    return _call("radixrt::greedy_tokens", _module().greedy_tokens, logits)


def sample_tokens(logits: torch.Tensor, temperatures: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Each row's token (int64) drawn by inverse CDF from ``softmax(logits / T)`` at its uniform: the first token
    where the cumulative weight passes ``u`` times the total (``csrc/sample_tokens.cpp``); ``logits`` fp32 ``[rows,
    vocab]`` with contiguous rows, ``temperatures`` fp32 ``[rows]`` (> 0), ``uniforms`` fp64 ``[rows]`` in [0, 1).
    A row with a NaN or infinite logit gets ``vocab - 1``, as softmax then ``searchsorted`` gives it."""
    return _call("radixrt::sample_tokens", _module().sample_tokens, logits, temperatures, uniforms)


def _call(name: str, kernel, *args):
    """Run a kernel; under torch.profiler, as a named range (pybind functions are not operators it records)."""
    if torch.autograd._profiler_enabled():
        with torch.profiler.record_function(name):
            return kernel(*args)
    return kernel(*args)


def _module() -> ModuleType:
    module = load()
    if module is None:
        raise RuntimeError("the CPU kernels are not available here (see cpu_kernels.load)")
    return module


def main() -> int:
    """``python -m radixrt.kernels.cpu_kernels``: build (or load) the kernels; 1 where the build failed."""
    try:
        module = load()
    except KernelBuildError as exc:
        print(exc, file=sys.stderr)
        return 1
    print(f"built: {module.__file__}" if module is not None else f"not built, the torch path runs: {unavailable_reason()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
