"""A speculative verify step's forward on the CPU: a few new tokens a request, as decode rows and as an extend.

    python -m radixrt.bench.verify_step_bench [--batch 8] [--context 500] [--rows 1,2,3,4,6,9] [--dtype bfloat16]
                                              [--logits]

Prefills ``--batch`` requests of ``--context`` tokens into the default model's KV pool, then times forwards in
which every request adds k tokens and wants the logits of each (a verify step of k - 1 draft tokens; k = 1 is
a plain decode step). Each k runs two ways, alternating: the backend as it is (up to
``torch_attention.row_requests`` says which requests attend as decode rows) and with that path off (the extend
kernel). Each figure is the median of ``--repeats`` forwards, in ms.

``--logits`` instead times each forward with its rows' greedy tokens (what a greedy verify step computes on the
device), two ways alternating: as the runtime does it (on AMX, the LM head writes fp32 logits in its one pass;
greedy tokens from ``sampler.greedy_tokens``, the C++ argmax where the kernels are built) and the former way (the
head's bf16 output widened after, greedy tokens read off torch's ``max``).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from unittest import mock

from radixrt.model import cpu_linear, llama, torch_attention
from radixrt.model.forward_batch import ForwardBatch, SeqChunk
from radixrt.model.runner import ModelRunner
from radixrt.model.weights import resolve_model_path
from radixrt.sampling import sampler

PAGE_SIZE = 16


def verify_steps(model: str, dtype: str, batch: int, context: int, max_rows: int):
    """``forward_ms(k, greedy=None)`` over a runner with ``batch`` requests of ``context`` random tokens prefilled:
    the time of a forward in which every request adds ``k`` tokens and wants the logits of each (with ``greedy``,
    also its rows' greedy tokens read from those logits), in ms."""
    pages_each = -(-(context + max_rows) // PAGE_SIZE)
    runner = ModelRunner(resolve_model_path(model), dtype=dtype, page_size=PAGE_SIZE,
                         num_pages=batch * pages_each + 1)
    rng = random.Random(0)
    tokens = lambda n: [rng.randrange(1000, 20000) for _ in range(n)]  # noqa: E731
    pages = [list(range(1 + b * pages_each, 1 + (b + 1) * pages_each)) for b in range(batch)]
    runner.forward(ForwardBatch.build([SeqChunk(tokens(context), 0, p) for p in pages], PAGE_SIZE))

    def forward_ms(k: int, greedy=None) -> float:
        step = ForwardBatch.build([SeqChunk(tokens(k), context, p, logits_from=0 if k > 1 else None)
                                   for p in pages], PAGE_SIZE)
        start = time.perf_counter()
        logits = runner.forward(step)
        if greedy is not None:
            greedy(logits).tolist()
        return (time.perf_counter() - start) * 1e3

    return forward_ms


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=500)
    parser.add_argument("--rows", default="1,2,3,4,6,9", help="new tokens a request, comma-separated")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--logits", action="store_true", help="forward and greedy tokens, now and the former way")
    args = parser.parse_args(argv)
    rows = [int(k) for k in args.rows.split(",")]
    forward_ms = verify_steps(args.model, args.dtype, args.batch, args.context, max(rows))

    if args.logits:
        return _compare_logits_paths(args, rows, forward_ms)
    print(f"{args.dtype}, batch {args.batch}, {args.context} tokens of context each")
    print("| new tokens a request | as decode rows, ms | through the extend kernel, ms |")
    print("|---:|---:|---:|")
    for k in rows:
        timed: dict[str, list[float]] = {"rows": [], "extend": []}
        forward_ms(k)
        for _ in range(args.repeats):
            timed["rows"].append(forward_ms(k))
            with mock.patch.object(torch_attention, "SHORT_EXTEND", 0), \
                    mock.patch.object(torch_attention, "TILED_ROWS_NEW", 0):
                timed["extend"].append(forward_ms(k))
        extend = "-" if k == 1 else f"{statistics.median(timed['extend']):.2f}"  # one token: a decode either way
        print(f"| {k} | {statistics.median(timed['rows']):.2f} | {extend} |")
    return 0


def _compare_logits_paths(args, rows: list[int], forward_ms) -> int:
    packed_linear = cpu_linear.packed_linear

    def widened_after(x, packed, bias=None, fp32_out=False):
        out = packed_linear(x, packed, bias)
        return out.float() if fp32_out else out

    def read_off_max(logits):
        return logits.max(dim=-1).indices

    print(f"{args.dtype}, batch {args.batch}, {args.context} tokens of context each: a forward and its rows' greedy "
          "tokens, ms")
    print("| new tokens a request (rows) | now | the former way |")
    print("|---:|---:|---:|")
    for k in rows:
        timed: dict[str, list[float]] = {"now": [], "former": []}
        forward_ms(k, sampler.greedy_tokens)
        for _ in range(args.repeats):
            timed["now"].append(forward_ms(k, sampler.greedy_tokens))
            with mock.patch.object(llama, "packed_linear", widened_after):
                timed["former"].append(forward_ms(k, read_off_max))
        print(f"| {k} ({k * args.batch}) | {statistics.median(timed['now']):.2f} | "
              f"{statistics.median(timed['former']):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
