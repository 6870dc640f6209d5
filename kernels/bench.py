"""Kernel benchmark: Triton paged attention against the torch reference and SDPA, on one GPU.

    python -m radixrt.kernels.bench              # the full sweep, under 5 minutes on an H100/H200
    python -m radixrt.kernels.bench --smoke      # tiny shapes; runs on CPU in triton's interpreter

Every case first checks the Triton kernel against ``torch_ref`` on the same paged data (pages in shuffled
order), then times it. Decode prints the achieved memory bandwidth (bytes of K/V read / time) against the
card's peak, and every attention case prints the time of ``torch.nn.functional.scaled_dot_product_attention``
on the same K/V already gathered into dense tensors (so SDPA's time excludes the gather it would need).
Shapes are Llama-8B-like: 32 query heads, 8 KV heads, head dim 128, bf16.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from radixrt.kernels import torch_ref, triton_ops  # noqa: E402

# Peak DRAM bandwidth in bytes/s by device-name fragment (checked in order), from the vendors' data sheets.
PEAK_BANDWIDTH = [
    ("H200", 4.8e12), ("H100 NVL", 3.9e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12), ("H800", 3.35e12),
    ("GH200", 4.0e12), ("B200", 8.0e12), ("A100-SXM4-80GB", 2.039e12), ("A100 80GB PCIe", 1.935e12),
    ("A100", 1.555e12), ("L40S", 0.864e12), ("L40", 0.864e12), ("L4", 0.3e12), ("A10G", 0.6e12), ("A10", 0.6e12),
    ("RTX 4090", 1.008e12), ("RTX 3090", 0.936e12), ("V100", 0.9e12), ("T4", 0.32e12),
]
# Seconds since start after which each section skips its remaining cases, so the script ends within 5 min.
DEADLINES = {"decode": 140.0, "extend": 215.0, "other pages": 265.0}


def peak_bandwidth(device: torch.device) -> tuple[float | None, str]:
    if device.type != "cuda":
        return None, "n/a (cpu)"
    props = torch.cuda.get_device_properties(device)
    for fragment, peak in PEAK_BANDWIDTH:
        if fragment in props.name:
            return peak, f"{peak / 1e12:.2f} TB/s (data sheet, {props.name})"
    clock, bus = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    if clock and bus:  # kHz, bits; double data rate
        peak = 2 * clock * 1e3 * bus / 8
        return peak, f"{peak / 1e12:.2f} TB/s (from clock and bus width, {props.name})"
    return None, f"unknown ({props.name})"


def timed(fn, device: torch.device) -> float:
    """Milliseconds per call: triton's do_bench on a GPU (median), one timed call in the interpreter."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=10, rep=40))
    fn()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def paged_cache(seq_lens: list[int], page_size: int, kv_heads: int, head_dim: int, dtype, device, gen):
    """K/V caches with every request's pages scattered in shuffled order, and the page table."""
    pages_needed = [math.ceil(s / page_size) for s in seq_lens]
    num_pages = sum(pages_needed) + 1
    perm = torch.randperm(num_pages, generator=gen).tolist()
    k_cache = torch.randn(num_pages, page_size, kv_heads, head_dim, dtype=dtype, device=device)
    v_cache = torch.randn(num_pages, page_size, kv_heads, head_dim, dtype=dtype, device=device)
    page_table = torch.zeros(len(seq_lens), max(pages_needed), dtype=torch.int32)
    at = 0
    for r, n in enumerate(pages_needed):
        page_table[r, :n] = torch.tensor(perm[at : at + n], dtype=torch.int32)
        at += n
    return k_cache, v_cache, page_table.to(device)


def dense_kv(k_cache, v_cache, page_table, seq_len: int):
    """[B, KH, L, D] K and V of requests that all hold ``seq_len`` keys (for SDPA)."""
    page_size = k_cache.shape[1]
    pos = torch.arange(seq_len, device=k_cache.device).expand(page_table.shape[0], seq_len)
    slots = torch_ref.gather_slots(page_table, pos, page_size)
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    return flat_k[slots].transpose(1, 2).contiguous(), flat_v[slots].transpose(1, 2).contiguous()


class Report:
    def __init__(self, tol: float):
        self.tol = tol
        self.failures = 0
        self.started = time.perf_counter()

    def check(self, name: str, out: torch.Tensor, ref: torch.Tensor) -> str:
        diff = (out.float() - ref.float()).abs().max().item()
        ok = diff <= self.tol
        self.failures += 0 if ok else 1
        return f"{'ok' if ok else 'FAIL'} {diff:.1e}"

    def out_of_time(self, section: str) -> bool:
        return time.perf_counter() - self.started > DEADLINES[section]


def bench_decode(args, device, gen, rep: Report, peak) -> None:
    print(f"\n## decode (page {args.page_size}): K/V bytes read / time, vs peak; SDPA on the same gathered K/V")
    print(f"{'batch':>6} {'ctx':>6} {'splits':>6} {'check':>12} {'triton ms':>10} {'GB/s':>8} {'% peak':>7} "
          f"{'sdpa ms':>9} {'speedup':>7}")
    elem = torch.empty((), dtype=args.dtype).element_size()
    from radixrt.kernels.triton_decode import choose_num_splits, multiprocessors

    for ctx in args.contexts:
        for batch in args.batches:
            if batch * ctx > args.max_tokens:
                continue
            if rep.out_of_time(args.section or "decode"):
                print(f"{batch:>6} {ctx:>6}  skipped: over the time budget")
                continue
            seq_lens = [ctx] * batch
            k_cache, v_cache, page_table = paged_cache(seq_lens, args.page_size, args.kv_heads, args.head_dim,
                                                       args.dtype, device, gen)
            q = torch.randn(batch, args.heads, args.head_dim, dtype=args.dtype, device=device)
            lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
            call = (q, k_cache, v_cache, page_table, lens, args.head_dim**-0.5)
            check = rep.check("decode", triton_ops.decode_attention(*call), torch_ref.decode_attention(*call))
            ms = timed(lambda: triton_ops.decode_attention(*call), device)
            kv_bytes = sum(seq_lens) * args.kv_heads * args.head_dim * 2 * elem
            gbs = kv_bytes / (ms * 1e-3) / 1e9
            pct = f"{100 * gbs * 1e9 / peak:.0f}%" if peak else "-"
            k, v = dense_kv(k_cache, v_cache, page_table, ctx)
            qd = q.unsqueeze(2)
            sdpa_ms = timed(lambda: F.scaled_dot_product_attention(qd, k, v, scale=args.head_dim**-0.5, enable_gqa=True),
                            device)
            splits = choose_num_splits(batch, args.kv_heads, page_table.shape[1] * args.page_size,
                                       multiprocessors(device))
            print(f"{batch:>6} {ctx:>6} {splits:>6} {check:>12} {ms:>10.3f} {gbs:>8.0f} {pct:>7} {sdpa_ms:>9.3f} "
                  f"{sdpa_ms / ms:>6.2f}x", flush=True)
            del k_cache, v_cache, k, v


def bench_extend(args, device, gen, rep: Report) -> None:
    print(f"\n## extend (page {args.page_size}): new chunk over its cached prefix; SDPA on the same gathered K/V")
    print(f"{'batch':>6} {'prefix':>6} {'chunk':>6} {'check':>12} {'triton ms':>10} {'TFLOP/s':>8} {'sdpa ms':>9} "
          f"{'speedup':>7}")
    for batch, prefix, chunk in args.extend_cases:
        if rep.out_of_time(args.section or "extend"):
            print(f"{batch:>6} {prefix:>6} {chunk:>6}  skipped: over the time budget")
            continue
        seq = prefix + chunk
        k_cache, v_cache, page_table = paged_cache([seq] * batch, args.page_size, args.kv_heads, args.head_dim,
                                                   args.dtype, device, gen)
        q = torch.randn(batch * chunk, args.heads, args.head_dim, dtype=args.dtype, device=device)
        prefix_lens = torch.full((batch,), prefix, dtype=torch.int32, device=device)
        extend_lens = torch.full((batch,), chunk, dtype=torch.int32, device=device)
        call = (q, k_cache, v_cache, page_table, prefix_lens, extend_lens, args.head_dim**-0.5)
        check = rep.check("extend", triton_ops.extend_attention(*call), torch_ref.extend_attention(*call))
        ms = timed(lambda: triton_ops.extend_attention(*call), device)
        # Causal work: each new token sees its prefix plus the chunk tokens up to itself.
        pairs = batch * (chunk * prefix + chunk * (chunk + 1) / 2)
        tflops = 4 * pairs * args.heads * args.head_dim / (ms * 1e-3) / 1e12
        k, v = dense_kv(k_cache, v_cache, page_table, seq)
        qd = q.view(batch, chunk, args.heads, args.head_dim).transpose(1, 2)
        if prefix == 0:
            sdpa = lambda: F.scaled_dot_product_attention(qd, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
        else:
            mask = torch.arange(seq, device=device)[None, :] <= prefix + torch.arange(chunk, device=device)[:, None]
            sdpa = lambda: F.scaled_dot_product_attention(qd, k, v, attn_mask=mask, enable_gqa=True)  # noqa: E731
        sdpa_ms = timed(sdpa, device)
        print(f"{batch:>6} {prefix:>6} {chunk:>6} {check:>12} {ms:>10.3f} {tflops:>8.1f} {sdpa_ms:>9.3f} "
              f"{sdpa_ms / ms:>6.2f}x", flush=True)
        del k_cache, v_cache, k, v


def bench_store(args, device, gen, rep: Report, peak) -> None:
    print("\n## store_kv: one launch writes T tokens' K and V into shuffled slots")
    print(f"{'tokens':>7} {'check':>12} {'triton ms':>10} {'GB/s':>8} {'torch ms':>9}")
    elem = torch.empty((), dtype=args.dtype).element_size()
    for tokens in args.store_tokens:
        pages = math.ceil(2 * tokens / args.page_size) + 1
        shape = (pages, args.page_size, args.kv_heads, args.head_dim)
        caches = [torch.zeros(shape, dtype=args.dtype, device=device) for _ in range(4)]
        slots = torch.randperm(pages * args.page_size, device=device)[:tokens]
        k = torch.randn(tokens, args.kv_heads, args.head_dim, dtype=args.dtype, device=device)
        v = torch.randn_like(k)
        triton_ops.store_kv(caches[0], caches[1], slots, k, v)
        torch_ref.store_kv(caches[2], caches[3], slots, k, v)
        same = torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
        rep.failures += 0 if same else 1
        ms = timed(lambda: triton_ops.store_kv(caches[0], caches[1], slots, k, v), device)
        torch_ms = timed(lambda: torch_ref.store_kv(caches[2], caches[3], slots, k, v), device)
        gbs = 2 * 2 * k.numel() * elem / (ms * 1e-3) / 1e9  # read and write K and V
        print(f"{tokens:>7} {'ok exact' if same else 'FAIL':>12} {ms:>10.3f} {gbs:>8.0f} {torch_ms:>9.3f}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Triton paged-attention kernels vs torch_ref and SDPA")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (the CPU interpreter can run them)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--other-page-sizes", type=int, nargs="*", default=[1, 64],
                        help="page sizes checked and timed on one decode and one extend shape each")
    args = parser.parse_args(argv)
    args.dtype = getattr(torch, args.dtype)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        print("no CUDA device: run with --smoke to exercise the script in triton's interpreter", file=sys.stderr)
        return 2
    if args.smoke:
        args.heads, args.kv_heads, args.head_dim = 4, 1, 64
        args.batches, args.contexts, args.max_tokens = [1, 3], [40], 1 << 10
        args.extend_cases = [(1, 0, 20), (2, 17, 9)]
        args.store_tokens = [8]
    else:
        args.heads, args.kv_heads, args.head_dim = 32, 8, 128
        args.batches, args.contexts = [1, 8, 32, 64, 128, 256], [128, 1024, 4096, 8192, 32768]
        args.max_tokens = 1 << 22  # 4M cached tokens: 16 GiB of bf16 K/V
        args.extend_cases = [(1, 0, 512), (1, 0, 4096), (1, 4096, 1024), (4, 0, 2048), (8, 2048, 512),
                             (16, 1024, 256), (1, 28672, 4096)]
        args.store_tokens = [1, 256, 8192]
    gen = torch.Generator().manual_seed(0)
    peak, peak_text = peak_bandwidth(device)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}[args.dtype]
    rep = Report(tol)
    args.section = None
    print(f"# radixrt kernel bench: {device.type} {torch.cuda.get_device_name() if device.type == 'cuda' else ''}")
    print(f"# {args.dtype}, {args.heads} q heads / {args.kv_heads} kv heads, head dim {args.head_dim}; "
          f"peak memory bandwidth {peak_text}; check tolerance {tol:g} (max abs diff vs torch_ref)")
    bench_decode(args, device, gen, rep, peak)
    bench_extend(args, device, gen, rep)
    bench_store(args, device, gen, rep, peak)
    main_page = args.page_size
    args.section = "other pages"
    for page_size in args.other_page_sizes:
        args.page_size = page_size
        saved = args.batches, args.contexts, args.extend_cases
        args.batches, args.contexts = args.batches[1:2], args.contexts[2:3] or args.contexts[:1]
        args.extend_cases = args.extend_cases[-2:-1]
        bench_decode(args, device, gen, rep, peak)
        bench_extend(args, device, gen, rep)
        args.batches, args.contexts, args.extend_cases = saved
    args.page_size = main_page
    elapsed = time.perf_counter() - rep.started
    print(f"\n# {rep.failures} check failure(s); {elapsed:.0f} s")
    return 1 if rep.failures else 0


if __name__ == "__main__":
    sys.exit(main())
