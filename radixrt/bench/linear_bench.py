"""The CPU linear kernels side by side: the default model's projections at decode and prefill row counts.

    python -m radixrt.bench.linear_bench [--rows 1,8,16,32,64,128,512,2048] [--layers 30] [--rounds 2]
                                         [--dtype float32|bfloat16]

For each row count, each kernel of radixrt.model.cpu_linear that runs here for the dtype (fp32: ``panels``
where it is built; bf16: ``bf16`` where it is built, ``amx`` where the CPU has AMX; ``onednn`` where torch has
oneDNN) and plain ``F.linear``
compute the four projections of a decoder layer
(fused q/k/v, o, fused gate/up, down; SmolLM2-135M's shapes) over ``--layers`` layers' distinct random weights,
so that the weights come from memory as in a forward pass. Kernels alternate within a round; each figure is
the best round's time for all layers, with the GFLOPS it means.
"""

from __future__ import annotations

import argparse
import os
import time
from unittest import mock

import torch
import torch.nn.functional as F

from radixrt.model import cpu_linear

# (name, in_features, out_features) of SmolLM2-135M's projections: hidden 576, 9 q / 3 kv heads of 64, MLP 1536
SHAPES = (("qkv", 576, 960), ("o", 576, 576), ("gate_up", 576, 3072), ("down", 1536, 576))


def _kernels(dtype: torch.dtype) -> list[str]:
    found = []
    for own in (("panels",) if dtype == torch.float32 else ("bf16", "amx")):
        with mock.patch.dict(os.environ, {cpu_linear.KERNEL_ENV: own}):
            if cpu_linear.choose_kernel(torch.ones(2, 64, dtype=dtype)) == own:
                found.append(own)
    with mock.patch.dict(os.environ, {cpu_linear.KERNEL_ENV: "onednn"}):
        if cpu_linear.pack_weight(torch.ones(2, 2, dtype=dtype)) is not None:  # no bf16 kernel on some CPUs
            found.append("onednn")
    return found + ["plain"]


def _prepare(kernel: str, weights: list[torch.Tensor]):
    if kernel == "plain":
        return lambda x, i: F.linear(x, weights[i])
    with mock.patch.dict(os.environ, {cpu_linear.KERNEL_ENV: kernel}):
        packed = [cpu_linear.pack_weight(w) for w in weights]
    return lambda x, i: cpu_linear.packed_linear(x, packed[i])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,16,32,64,128,512,2048")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    kernels = _kernels(dtype)
    weights = {name: [(torch.randn(n, k) * 0.02).to(dtype) for _ in range(args.layers)] for name, k, n in SHAPES}
    runs = {kernel: {name: _prepare(kernel, ws) for name, ws in weights.items()} for kernel in kernels}
    print(f"{torch.get_num_threads()} threads, {args.dtype}, {args.layers} layers' weights, "
          f"kernels: {', '.join(kernels)}")
    print("| rows | " + " | ".join(f"{k} ms (GFLOPS)" for k in kernels) + " |")
    print("|---:|" + "---:|" * len(kernels))
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {name: torch.randn(rows, k).to(dtype) for name, k, _ in SHAPES}
        flops = sum(2 * rows * k * n * args.layers for _, k, n in SHAPES)
        best = {kernel: float("inf") for kernel in kernels}
        for _ in range(args.rounds + 1):  # the first round warms up
            for kernel in kernels:
                start = time.perf_counter()
                for name, _, _ in SHAPES:
                    for i in range(args.layers):
                        runs[kernel][name](xs[name], i)
                best[kernel] = min(best[kernel], time.perf_counter() - start)
        cells = [f"{best[k] * 1e3:.1f} ({flops / best[k] / 1e9:.0f})" for k in kernels]
        print(f"| {rows} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
