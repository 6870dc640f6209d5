"""Compile every Triton kernel ahead of time for an NVIDIA target, without a GPU.

``python -m radixrt.kernels.triton_compile [--quick] [--arch 90 80]`` lowers each kernel down to a cubin
(triton's bundled ptxas) and prints registers, spills and shared memory per variant. It catches what the
interpreter lets through: tile-shape rules of ``tl.dot``, type errors, unsupported control flow, resource
limits. Must run with ``TRITON_INTERPRET`` unset (the kernels must be JIT functions, not interpreted).
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402


def _jit_fn(kernel):
    while not hasattr(kernel, "cache_key"):  # unwrap an Autotuner
        kernel = kernel.fn
    return kernel


def _source(kernel, types: dict[str, str], constexprs: dict[str, object]) -> ASTSource:
    fn = _jit_fn(kernel)
    names = list(inspect.signature(fn.fn).parameters)
    signature = {n: ("constexpr" if n in constexprs else types.get(n, "i32")) for n in names}
    return ASTSource(fn=fn, signature=signature, constexprs={(names.index(k),): v for k, v in constexprs.items()})


def _ptxas_usage(ptx: str, arch: int) -> str:
    # triton assembles sm_90+ with its newer ptxas (named ptxas-blackwell), older targets with ptxas.
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / ("ptxas-blackwell" if arch >= 90 else "ptxas")
    suffix = "a" if arch >= 90 else ""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        res = subprocess.run([str(ptxas), "-v", f"--gpu-name=sm_{arch}{suffix}", str(src), "-o", str(Path(tmp) / "k.o")],
                             capture_output=True, text=True)
    regs = re.search(r"Used (\d+) registers", res.stderr)
    spills = re.search(r"(\d+) bytes spill stores", res.stderr)
    return f"regs {regs.group(1) if regs else '?'} spills {spills.group(1) if spills else '?'}"


def variants(quick: bool):
    """(name, kernel, pointer types, constexprs, num_warps, num_stages) of every variant worth compiling."""
    from radixrt.kernels import triton_decode, triton_extend, triton_fused, triton_store

    dtypes = ["bf16"] if quick else ["bf16", "fp32"]
    head_dims = [128] if quick else [64, 128]
    page_sizes = [16] if quick else [16, 1]  # the page size changes only index arithmetic
    decode_cfgs = triton_decode._DECODE_CONFIGS[1:2] if quick else triton_decode._DECODE_CONFIGS
    extend_cfgs = triton_extend._EXTEND_CONFIGS[:1] if quick else triton_extend._EXTEND_CONFIGS
    for dt in dtypes:
        f32 = dt == "fp32"
        for d in head_dims:
            for ps in page_sizes:
                ptr = {"Q": f"*{dt}", "K_CACHE": f"*{dt}", "V_CACHE": f"*{dt}", "OUT": f"*{dt}", "PAGE_TABLE": "*i32",
                       "SEQ_LENS": "*i32", "MID_O": "*fp32", "MID_LSE": "*fp32", "sm_scale_log2": "fp32",
                       "PREFIX_LENS": "*i32", "EXTEND_LENS": "*i32", "Q_STARTS": "*i32"}
                for splits in (8,) if quick else (1, 8):
                    for cfg in decode_cfgs:
                        c = dict(GROUP=4, HEAD_DIM=d, PAGE_SIZE=ps, NUM_SPLITS=splits, SPLIT_ALIGN=64, DOT_F32=f32,
                                 BLOCK_H=16, BLOCK_D=d, **cfg.kwargs)
                        yield (f"decode_stage1 {dt} d{d} page{ps} splits{splits} {cfg.kwargs} w{cfg.num_warps} "
                               f"s{cfg.num_stages}", triton_decode._decode_stage1, ptr, c, cfg.num_warps, cfg.num_stages)
                for cfg in extend_cfgs:
                    c = dict(GROUP=4, HEAD_DIM=d, PAGE_SIZE=ps, DOT_F32=f32, BLOCK_D=d, **cfg.kwargs)
                    yield (f"extend {dt} d{d} page{ps} {cfg.kwargs} w{cfg.num_warps} s{cfg.num_stages}",
                           triton_extend._extend_kernel, ptr, c, cfg.num_warps, cfg.num_stages)
            ptr = {"MID_O": "*fp32", "MID_LSE": "*fp32", "SEQ_LENS": "*i32", "OUT": f"*{dt}"}
            yield (f"decode_stage2 {dt} d{d}", triton_decode._decode_stage2, ptr,
                   dict(HEAD_DIM=d, NUM_SPLITS=8, SPLIT_ALIGN=64, BLOCK_S=8, BLOCK_D=d), 4, 2)
            ptr = {"K": f"*{dt}", "V": f"*{dt}", "K_CACHE": f"*{dt}", "V_CACHE": f"*{dt}", "SLOTS": "*i64"}
            yield (f"store_kv {dt} d{d}", triton_store._store_kv_kernel, ptr,
                   dict(KV_HEADS=8, HEAD_DIM=d, PAGE_SIZE=16, BLOCK_H=8, BLOCK_D=d), 4, 2)
            ptr = {"Q": f"*{dt}", "K": f"*{dt}", "V": f"*{dt}", "COS": f"*{dt}", "SIN": f"*{dt}",
                   "K_CACHE": f"*{dt}", "V_CACHE": f"*{dt}", "POSITIONS": "*i32", "SLOTS": "*i32"}
            for rot in (d, d * 3 // 4):  # every element rotated; Phi-4-mini's partial rotary
                yield (f"rope_store {dt} d{d} rotary {rot}", triton_fused._rope_store_kernel, ptr,
                       dict(HEADS=32, KV_HEADS=8, HALF=rot // 2, HEAD_DIM=d, PAGE_SIZE=16, BLOCK_H=32, BLOCK_KH=8,
                            BLOCK_D=triton.next_power_of_2(rot // 2), BLOCK_FULL=d), 4, 2)
        ptr = {"X": f"*{dt}", "RES": f"*{dt}", "W": f"*{dt}", "OUT": f"*{dt}", "eps": "fp32"}
        for residual in (False, True):
            yield (f"rms_norm {dt} residual={residual}", triton_fused._rms_norm_kernel, ptr,
                   dict(HAS_RESIDUAL=residual, BLOCK=2048), 8, 2)
        yield (f"silu_and_mul {dt}", triton_fused._silu_and_mul_kernel, {"GATE_UP": f"*{dt}", "OUT": f"*{dt}"},
               dict(BLOCK=1024), 4, 2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="bf16, head dim 128, page 16, default tiles only")
    parser.add_argument("--arch", type=int, nargs="+", default=[90], help="compute capabilities, e.g. 90 80")
    args = parser.parse_args(argv)
    if triton.knobs.runtime.interpret:
        print("unset TRITON_INTERPRET: the interpreter compiles nothing", file=sys.stderr)
        return 2
    failures = 0
    for arch in args.arch:
        target = GPUTarget("cuda", arch, 32)
        for name, kernel, ptr, constexprs, warps, stages in variants(args.quick):
            try:
                compiled = triton.compile(_source(kernel, ptr, constexprs), target=target,
                                          options={"num_warps": warps, "num_stages": stages})
                usage = _ptxas_usage(compiled.asm["ptx"], arch)
                print(f"sm_{arch} ok   {name}: {usage} shared {compiled.metadata.shared} B", flush=True)
            except Exception as exc:  # report every failing variant, not just the first
                failures += 1
                print(f"sm_{arch} FAIL {name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
