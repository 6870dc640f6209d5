"""Forward-pass timings of the default model on the CPU, straight through the ModelRunner (no scheduler).

    python -m radixrt.bench.cpu_step_bench [--batch 64] [--prompt-len 200] [--shared-len 1008]

Prints prefill tokens/s (prompts in chunks of the scheduler's default ``chunked_prefill_size``), a batch
decode step over distinct prompts, the prefill and a decode step of requests that share a cached prefix,
with the cascade attention on and off (``torch_cascade.MAX_GROUPS = 0`` turns grouping off), and a decode
step at long distinct contexts (``--long-batch`` x ``--long-len``, the multi-turn chat case). Run it again with
``RADIXRT_DISABLE_MALLOC_TUNING=1``, ``RADIXRT_DISABLE_PACKED_LINEAR=1`` or ``RADIXRT_DISABLE_CPU_KERNELS=1``
for the effect of each. ``--ab-packed-linear`` instead times the linear layers on radixrt's kernels for the dtype (fp32: the
panel kernel; bf16: the bf16 panels, and the AMX kernel where the CPU has AMX), on oneDNN's prepacked kernel and on
plain ``F.linear`` interleaved in one process (a runner each), which this
VM's drift between runs makes the fairer comparison;
``--ab-fused-ops`` does the same for the fused C++ element-wise ops against the torch ops they replace, and
``--ab-module-call`` for the layers called straight through their forward against nn.Module's call,
``--ab-extend-kernel`` for prefill attention in the C++ extend kernel against the runtime's choice (on an AMX
CPU, torch's flash attention), and
``--ab-bound-attributes`` for weights and submodules read as plain attributes against nn.Module's lookup, and
``--ab-extend-rows`` for prefill attention as decode rows, a row per token (what ``--enable-deterministic-inference``
runs; its linear layers are not switched here), against the runtime's choice.
"""

from __future__ import annotations

import argparse
import os
import time
from types import SimpleNamespace
from typing import Callable
from unittest import mock

import torch
from torch import nn

from radixrt.kernels import cpu_kernels, torch_cascade
from radixrt.model import layers
from radixrt.model.cpu_linear import KERNEL_ENV
from radixrt.model.forward_batch import ForwardBatch, SeqChunk
from radixrt.model.module import InferenceModule
from radixrt.model.runner import ModelRunner
from radixrt.model.weights import resolve_model_path
from radixrt.server_args import DEFAULT_MODEL
from radixrt.server_args import ServerArgs

PAGE_SIZE = 16
CHUNK = ServerArgs.chunked_prefill_size


def _timed(fn, repeats: int) -> float:
    fn()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - started) / repeats


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--shared-len", type=int, default=1008, help="a multiple of the page size (16)")
    parser.add_argument("--long-batch", type=int, default=32)
    parser.add_argument("--long-len", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--ab-packed-linear", action="store_true",
                        help="only compare the panel, oneDNN and plain linear layers, interleaved")
    parser.add_argument("--ab-fused-ops", action="store_true",
                        help="only compare the fused C++ element-wise ops vs torch ops, interleaved")
    parser.add_argument("--ab-module-call", action="store_true",
                        help="only compare layers called through forward vs nn.Module.__call__, interleaved")
    parser.add_argument("--ab-bound-attributes", action="store_true",
                        help="only compare weights and submodules as plain attributes vs nn.Module's lookup")
    parser.add_argument("--ab-extend-kernel", action="store_true",
                        help="only compare prefill attention in the C++ extend kernel vs the runtime's choice here")
    parser.add_argument("--cached-len", type=int, default=0,
                        help="A/B modes: each prompt's first this many tokens are cached before the timed prefill")
    parser.add_argument("--ab-extend-rows", action="store_true",
                        help="only compare prefill attention as decode rows (deterministic inference) vs the default")
    args = parser.parse_args(argv)
    if args.ab_extend_rows:
        _ab_extend_rows(args)
        return
    if args.ab_extend_kernel:
        _ab_extend_kernel(args)
        return
    if args.ab_bound_attributes:
        _ab_bound_attributes(args)
        return
    if args.ab_module_call:
        _ab_module_call(args)
        return
    if args.ab_packed_linear:
        _ab_packed_linear(args)
        return
    if args.ab_fused_ops:
        _ab_fused_ops(args)
        return
    gen = torch.Generator().manual_seed(0)
    batch, length = args.batch, args.prompt_len
    own = -(-(length + args.repeats + 2) // PAGE_SIZE)
    shared = args.shared_len // PAGE_SIZE
    long_own = -(-(args.long_len + args.repeats + 2) // PAGE_SIZE)
    num_pages = 1 + max(shared + batch * own, args.long_batch * long_own)
    runner = ModelRunner(resolve_model_path(args.model), dtype=args.dtype, page_size=PAGE_SIZE, num_pages=num_pages)
    toggles = {name: "off" if os.environ.get(f"RADIXRT_DISABLE_{var}") == "1" else "on"
               for name, var in (("malloc tuning", "MALLOC_TUNING"), ("packed linear", "PACKED_LINEAR"),
                                 ("C++ kernels", "CPU_KERNELS"))}
    print(f"{args.dtype}, {torch.get_num_threads()} threads, " + ", ".join(f"{k} {v}" for k, v in toggles.items()))

    pages = [list(range(1 + shared + r * own, 1 + shared + (r + 1) * own)) for r in range(batch)]
    prompts = [torch.randint(100, 40000, (length,), generator=gen).tolist() for _ in range(batch)]
    started = time.perf_counter()
    per_chunk = max(1, CHUNK // length)
    for first in range(0, batch, per_chunk):
        rows = range(first, min(first + per_chunk, batch))
        runner.forward(ForwardBatch.build([SeqChunk(prompts[r], 0, pages[r]) for r in rows], PAGE_SIZE))
    seconds = time.perf_counter() - started
    print(f"prefill {batch} x {length} tokens: {seconds:.2f} s, {batch * length / seconds:.0f} tok/s")

    def decode(prefix: list[int], context: int) -> None:
        runner.forward(ForwardBatch.build([SeqChunk([5], context, prefix + pages[r]) for r in range(batch)], PAGE_SIZE))

    step = _timed(lambda: decode([], length), args.repeats)
    print(f"decode step, batch {batch}, context {length}: {step * 1000:.0f} ms, {batch / step:.0f} tok/s")

    prefix = list(range(1, 1 + shared))
    doc = torch.randint(100, 40000, (shared * PAGE_SIZE,), generator=gen).tolist()
    runner.forward(ForwardBatch.build([SeqChunk(doc, 0, prefix)], PAGE_SIZE))
    # each request's own tokens: its old prompt, now after the shared document (a burst of questions about
    # one cached document), in chunks; run twice, with the cascade (here the extend one) on and off
    groups = torch_cascade.MAX_GROUPS
    for label, max_groups in (("cascade on", groups), ("cascade off", 0)):
        torch_cascade.MAX_GROUPS = max_groups
        started = time.perf_counter()
        for first in range(0, batch, per_chunk):
            rows = range(first, min(first + per_chunk, batch))
            runner.forward(ForwardBatch.build([SeqChunk(prompts[r], len(doc), prefix + pages[r]) for r in rows],
                                              PAGE_SIZE))
        seconds = time.perf_counter() - started
        print(f"prefill {batch} x {length} tokens after {len(doc)} shared, {label}: {seconds:.2f} s, "
              f"{batch * length / seconds:.0f} tok/s")
    context = len(doc) + length
    for label, max_groups in (("cascade on", groups), ("cascade off", 0)):
        torch_cascade.MAX_GROUPS = max_groups
        step = _timed(lambda: decode(prefix, context), args.repeats)
        print(f"decode step, batch {batch}, {len(doc)} shared + {length} own tokens, {label}: "
              f"{step * 1000:.0f} ms, {batch / step:.0f} tok/s")
    torch_cascade.MAX_GROUPS = groups

    # long distinct histories: every request's K/V is read once per layer per step. Their values do not
    # change the timing, so the pool is set to a constant instead of running a prefill of all those tokens.
    for cache in (*runner.pool.k_caches, *runner.pool.v_caches):
        cache.fill_(0.01)
    long_pages = [list(range(1 + r * long_own, 1 + (r + 1) * long_own)) for r in range(args.long_batch)]

    def decode_long() -> None:
        runner.forward(ForwardBatch.build(
            [SeqChunk([5], args.long_len, long_pages[r]) for r in range(args.long_batch)], PAGE_SIZE))

    step = _timed(decode_long, args.repeats)
    print(f"decode step, batch {args.long_batch}, context {args.long_len} (distinct): {step * 1000:.0f} ms, "
          f"{args.long_batch / step:.0f} tok/s")


def _ab_packed_linear(args) -> None:
    """A prefill chunk and a decode step, alternating runners whose linears run radixrt's kernels for the dtype
    (fp32: the panel kernel; bf16: the bf16 panels and, on AMX CPUs, the AMX kernel), oneDNN's prepacked kernel,
    or plain ``F.linear``."""
    path = resolve_model_path(args.model)
    own = -(-(args.prompt_len + 2) // PAGE_SIZE)
    runners = {}
    dtype = getattr(torch, args.dtype)
    settings = {kernel: {KERNEL_ENV: kernel} for kernel in (("panels",) if dtype == torch.float32 else ("bf16", "amx"))
                if _chosen_under(kernel, dtype)}
    settings.update({"onednn": {KERNEL_ENV: "onednn"}, "plain": {"RADIXRT_DISABLE_PACKED_LINEAR": "1"}})
    for label, env in settings.items():
        with mock.patch.dict(os.environ, env):  # restores the environment, removed names included
            for name in {KERNEL_ENV, "RADIXRT_DISABLE_PACKED_LINEAR"} - env.keys():
                os.environ.pop(name, None)
            runners[label] = ModelRunner(path, dtype=args.dtype, page_size=PAGE_SIZE, num_pages=1 + args.batch * own)
    kinds = {label: {m.packed.kernel for m in r.model.modules() if getattr(m, "packed", None) is not None}
             for label, r in runners.items()}
    print(f"{args.dtype}, {torch.get_num_threads()} threads, kernels per runner: {kinds}")
    _time_interleaved(args, {label: (runner, lambda: None) for label, runner in runners.items()})


def _chosen_under(kernel: str, dtype: torch.dtype) -> bool:
    """Whether forcing ``kernel`` makes a linear of ``dtype`` (the default model's widths) run on it here."""
    from radixrt.model.cpu_linear import choose_kernel

    with mock.patch.dict(os.environ, {KERNEL_ENV: kernel}):
        return choose_kernel(torch.ones(2, 64, dtype=dtype)) == kernel


def _ab_runner(args) -> ModelRunner:
    """The runner an A/B mode switches something in: room for ``--batch`` prompts of ``--prompt-len`` tokens."""
    own = -(-(args.cached_len + args.prompt_len + 2) // PAGE_SIZE)
    return ModelRunner(resolve_model_path(args.model), dtype=args.dtype, page_size=PAGE_SIZE,
                       num_pages=1 + args.batch * own)


def _ab_swapped(args, owner, name: str, variants: dict[str, object]) -> None:
    """One runner, ``owner.name`` set to each of ``variants`` in turn (restored afterwards)."""
    runner = _ab_runner(args)
    original = getattr(owner, name)
    print(f"{args.dtype}, {torch.get_num_threads()} threads")
    try:
        _time_interleaved(args, {label: (runner, lambda value=value: setattr(owner, name, value))
                                 for label, value in variants.items()})
    finally:
        setattr(owner, name, original)


def _ab_fused_ops(args) -> None:
    """Its layers' fused C++ ops (RMSNorm, SiLU-and-mul, rotary) switched on and off in turn."""
    _ab_swapped(args, layers, "cpu_kernels", {"fused": cpu_kernels, "torch ops": SimpleNamespace(load=lambda: None)})


def _ab_extend_kernel(args) -> None:
    """Prefill attention in the C++ paged extend kernel and where the runtime sends it on this CPU (on an AMX CPU:
    torch's flash attention through the cascade extend) in turn."""

    def forced(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        return q.dtype == k_cache.dtype == torch.bfloat16 and q.shape[-1] in (32, 64, 128)

    _ab_swapped(args, cpu_kernels, "paged_extend_usable",
                {"C++ extend": forced, "runtime's choice": cpu_kernels.paged_extend_usable})


def _ab_extend_rows(args) -> None:
    """One runner, its prefill attention as decode rows (``TorchAttention.all_rows``, deterministic inference) and
    where the runtime sends it by default, in turn."""
    runner = _ab_runner(args)
    print(f"{args.dtype}, {torch.get_num_threads()} threads")
    try:
        _time_interleaved(args, {"decode rows": (runner, lambda: setattr(runner.attention, "all_rows", True)),
                                 "default": (runner, lambda: setattr(runner.attention, "all_rows", False))})
    finally:
        runner.attention.all_rows = False


def _ab_module_call(args) -> None:
    """Its layers called straight through their forward (``InferenceModule``) and through nn.Module's
    ``__call__`` (hook checks around every forward) in turn."""
    _ab_swapped(args, InferenceModule, "__call__",
                {"forward": InferenceModule.__call__, "nn.Module call": nn.Module.__call__})


def _ab_bound_attributes(args) -> None:
    """One runner, its layers' parameters, buffers and submodules read as plain attributes
    (``InferenceModule.bind_attributes``) and through nn.Module's ``__getattr__`` in turn."""
    runner = _ab_runner(args)
    print(f"{args.dtype}, {torch.get_num_threads()} threads")
    try:
        _time_interleaved(args, {"bound": (runner, lambda: runner.model.bind_attributes(True)),
                                 "nn.Module lookup": (runner, lambda: runner.model.bind_attributes(False))})
    finally:
        runner.model.bind_attributes(True)


def _time_interleaved(args, variants: dict[str, tuple[ModelRunner, Callable[[], None]]]) -> None:
    """A prefill chunk and a decode step of distinct prompts, the variants alternating ``--repeats`` times
    (each variant's callable sets it up before its turn). With ``--cached-len`` each prompt's first tokens are
    prefilled once, untimed, and the timed chunk is the rest."""
    cached = args.cached_len
    own = -(-(cached + args.prompt_len + 2) // PAGE_SIZE)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 40000, (args.prompt_len,), generator=gen).tolist()
    pages = [list(range(1 + r * own, 1 + (r + 1) * own)) for r in range(args.batch)]
    per_chunk = max(1, CHUNK // args.prompt_len)
    runners = list({id(runner): runner for runner, _ in variants.values()}.values())
    for r in range(args.batch if cached else 0):
        head = torch.randint(100, 40000, (cached,), generator=gen).tolist()  # distinct cached prefixes
        for runner in runners:
            runner.forward(ForwardBatch.build([SeqChunk(head, 0, pages[r])], PAGE_SIZE))

    def prefill(runner: ModelRunner) -> None:
        rows = range(min(per_chunk, args.batch))
        runner.forward(ForwardBatch.build([SeqChunk(prompt, cached, pages[r]) for r in rows], PAGE_SIZE))

    def decode(runner: ModelRunner) -> None:
        runner.forward(ForwardBatch.build([SeqChunk([5], cached + args.prompt_len, pages[r])
                                           for r in range(args.batch)], PAGE_SIZE))

    after = f" after {cached} cached" if cached else ""
    for name, fn in ((f"prefill {min(per_chunk, args.batch)} x {args.prompt_len} tokens{after}", prefill),
                     (f"decode step, batch {args.batch}, context {cached + args.prompt_len}", decode)):
        times: dict[str, list[float]] = {label: [] for label in variants}
        for _ in range(args.repeats):
            for label, (runner, setup) in variants.items():
                setup()
                times[label].append(_timed(lambda: fn(runner), 1))
        print(name + ": " + ", ".join(
            f"{label} median {sorted(t)[len(t) // 2] * 1000:.1f} ms (best {min(t) * 1000:.1f})"
            for label, t in times.items()))


if __name__ == "__main__":
    main()
