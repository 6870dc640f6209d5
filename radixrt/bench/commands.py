"""`radixrt bench offline | serving | decode | vllm | embed | tools | priority | spec`: argument parsing and the runs (see the
modules for details).

    radixrt bench offline --workload random --num-prompts 64 --input-len 200 --output-len 64 --baseline hf
    radixrt bench offline --workload shared-prefix --prefix-len 1000 --question-len 30 --compare-no-cache --baseline hf
    radixrt bench offline --workload sharegpt --turns 3 --num-prompts 32
    radixrt bench offline --workload tree --num-prompts 4 --branches 3 --depth 2
    radixrt bench serving --url http://127.0.0.1:30000 --workload sharegpt --num-prompts 200
    radixrt bench serving --url http://127.0.0.1:30000 --worker-urls http://127.0.0.1:30001 http://127.0.0.1:30002
    radixrt bench decode --dtypes bfloat16,float32 --batch-sizes 1,32
    radixrt bench vllm --vllm-python /tmp/radixrt-peers/venv-vllm/bin/python --workloads a:nocache,b:cache
    radixrt bench embed --vllm-python /tmp/radixrt-peers/venv-vllm/bin/python
    radixrt bench tools --num-prompts 50 --tool-choice required
    radixrt bench priority --batch 16 --interactive 6 --interval 1.5
    radixrt bench spec --workloads extraction,extraction-series,agent,refine,random --batch-sizes 1,8
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys


def _workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", choices=["random", "shared-prefix", "sharegpt", "tree"], default="random")
    p.add_argument("--num-prompts", type=int, default=64, help="prompts (conversations, tree programs)")
    p.add_argument("--input-len", type=int, default=200, help="random: prompt tokens")
    p.add_argument("--output-len", type=int, default=64, help="output tokens (random, shared-prefix, tree)")
    p.add_argument("--prefix-len", type=int, default=1000, help="shared-prefix: shared document tokens")
    p.add_argument("--question-len", type=int, default=30, help="shared-prefix: question tokens")
    p.add_argument("--turns", type=int, default=1, help="sharegpt: human turns per conversation (>1: multi-turn)")
    p.add_argument("--max-input-len", type=int, default=1024, help="sharegpt: longest human message kept")
    p.add_argument("--max-output-len", type=int, default=128, help="sharegpt: output tokens at most")
    p.add_argument("--sharegpt-path", default=None, help="sharegpt: a JSON file instead of the packaged one")
    p.add_argument("--branches", type=int, default=3, help="tree: forks per node")
    p.add_argument("--depth", type=int, default=2, help="tree: levels of forks")
    p.add_argument("--doc-words", type=int, default=300, help="tree: words of each program's document")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the summaries to this file")
    p.add_argument("--no-progress", action="store_true")


def _engine_args(p: argparse.ArgumentParser) -> None:
    from radixrt.server_args import DEFAULT_MODEL
    from radixrt.server_args import ServerArgs

    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--page-size", type=int, default=ServerArgs.page_size)
    p.add_argument("--max-running-requests", type=int, default=ServerArgs.max_running_requests)
    p.add_argument("--chunked-prefill-size", type=int, default=ServerArgs.chunked_prefill_size)
    p.add_argument("--kv-memory-gb", type=float, default=ServerArgs.kv_memory_gb)
    p.add_argument("--schedule-policy", default=ServerArgs.schedule_policy)
    p.add_argument("--enable-mixed-chunk", action="store_true", help="decodes ride along with prefill chunks")
    p.add_argument("--quantization", default=None, choices=("fp8",),
                   help="fp8: radixrt's projections quantized at load (the transformers column stays unquantized)")


def add_bench_parser(commands) -> None:
    """Add `bench` with its subcommands to the CLI's subparsers."""
    bench = commands.add_parser("bench", help="benchmarks: offline (Engine), serving (HTTP), decode, vllm, embed, "
                                              "tools, priority, spec, startup")
    sub = bench.add_subparsers(dest="bench_command", required=True)

    off = sub.add_parser("offline", help="a workload through the in-process Engine")
    _workload_args(off)
    _engine_args(off)
    off.add_argument("--baseline", choices=["none", "hf"], default="none",
                     help="hf: the same prompts through transformers generate in the same run")
    off.add_argument("--hf-batch-size", type=int, default=16)
    off.add_argument("--compare-no-cache", action="store_true",
                     help="also run with --disable-radix-cache in the same run")
    off.add_argument("--compare-deterministic", action="store_true",
                     help="also run with --enable-deterministic-inference in the same run")
    off.add_argument("--max-concurrency", type=int, default=None, help="conversations in flight (default: all)")
    off.set_defaults(run=_offline)

    srv = sub.add_parser("serving", help="a workload against a running `radixrt serve`")
    _workload_args(srv)
    srv.add_argument("--url", default="http://127.0.0.1:30000")
    srv.add_argument("--model", default=None, help="tokenizer for sharegpt (default: the server's model)")
    srv.add_argument("--max-concurrency", type=int, default=64)
    srv.add_argument("--timeout", type=float, default=600.0)
    srv.add_argument("--worker-urls", nargs="+", default=None,
                     help="the radixrt workers behind a router at --url, for per-worker cache stats "
                          "(default: the router's own worker list, or --url itself when it is one server)")
    srv.set_defaults(run=_serving)

    dec = sub.add_parser("decode", help="decode tokens/s at fixed batch sizes: our forward vs transformers")
    _engine_args(dec)
    dec.add_argument("--dtypes", default="bfloat16,float32")
    dec.add_argument("--batch-sizes", default="1,32")
    dec.add_argument("--input-len", type=int, default=128)
    dec.add_argument("--output-len", type=int, default=64)
    dec.add_argument("--no-hf", action="store_true", help="skip the transformers column")
    dec.add_argument("--json", default=None)
    dec.set_defaults(run=_decode)

    from radixrt.bench.vs_vllm import add_vllm_parser

    add_vllm_parser(sub)

    from radixrt.bench.embed_vs_vllm import add_embed_parser

    add_embed_parser(sub)

    from radixrt.bench.tool_calls import add_arguments as add_tool_call_arguments
    from radixrt.bench.tool_calls import run as run_tool_calls

    tools = sub.add_parser("tools", help="tool calls' validity through the openai client, constrained vs not")
    add_tool_call_arguments(tools)
    tools.set_defaults(run=run_tool_calls)

    from radixrt.bench.priority_bench import add_arguments as add_priority_arguments
    from radixrt.bench.priority_bench import run as run_priority

    priority = sub.add_parser("priority", help="interactive requests next to a batch job, preemption on vs off")
    add_priority_arguments(priority)
    priority.set_defaults(run=run_priority)

    from radixrt.bench.spec_bench import add_arguments as add_spec_arguments
    from radixrt.bench.spec_bench import run as run_spec

    spec = sub.add_parser("spec", help="speculative decoding on vs off on copy-heavy and random workloads")
    add_spec_arguments(spec)
    spec.set_defaults(run=run_spec)

    from radixrt.bench.startup import add_arguments as add_startup_arguments
    from radixrt.bench.startup import run as run_startup

    startup = sub.add_parser("startup", help="seconds from `radixrt serve` to its first answer, beside vLLM's server")
    add_startup_arguments(startup)
    startup.set_defaults(run=run_startup)


def machine() -> dict:
    import torch

    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"), "cpu": cpu, "cores": os.cpu_count(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "load_1min_at_start": round(load, 2)}


def _print_context(ctx: dict) -> None:
    print(" ".join(f"{k}={v}" for k, v in ctx.items()))


def build_workload(args, tokenizer, vocab_size: int):
    from radixrt.bench import workloads as w

    if args.workload == "random":
        return w.random_workload(args.num_prompts, args.input_len, args.output_len, vocab_size, args.seed)
    if args.workload == "shared-prefix":
        return w.shared_prefix_workload(args.num_prompts, args.prefix_len, args.question_len, args.output_len,
                                        vocab_size, args.seed)
    if args.workload == "sharegpt":
        data = w.load_sharegpt(args.sharegpt_path)
        return w.sharegpt_workload(tokenizer, args.num_prompts, args.turns, args.max_input_len, args.max_output_len,
                                   seed=args.seed, data=data)
    raise ValueError(f"workload {args.workload!r} has no prompt list")


def _engine_kwargs(args, **extra) -> dict:
    kwargs = dict(model=args.model, dtype=args.dtype, page_size=args.page_size,
                  max_running_requests=args.max_running_requests, chunked_prefill_size=args.chunked_prefill_size,
                  kv_memory_gb=args.kv_memory_gb, schedule_policy=args.schedule_policy, log_interval=0.0,
                  enable_mixed_chunk=args.enable_mixed_chunk, quantization=args.quantization,
                  engine_scheduler="thread")  # the step recorder and the runner are read in this process
    return {**kwargs, **extra}


def _finish(summaries, args, ctx) -> int:
    from radixrt.bench.report import format_table, write_json

    print(format_table(summaries))
    if args.json:
        write_json(args.json, summaries, ctx)
        print(f"wrote {args.json}")
    return 0 if all(s.failed == 0 for s in summaries) else 1


def _offline(args) -> int:
    from radixrt.bench.offline import run_workload, warm_up
    from radixrt.engine import Engine

    ctx = machine()
    runs = [("radixrt", {})]
    if args.compare_no_cache:
        runs.append(("radixrt no-cache", {"disable_radix_cache": True}))
    if args.compare_deterministic:
        runs.append(("radixrt deterministic", {"enable_deterministic_inference": True}))
    summaries = []
    workload = None
    engine = None
    for label, extra in runs:
        engine = Engine(**_engine_kwargs(args, **extra))
        try:
            ctx.setdefault("dtype", str(engine.runner.dtype).replace("torch.", ""))
            warm_up(engine)
            if args.workload == "tree":
                from radixrt.bench.tree import run_tree

                summary, _ = run_tree(engine, args.num_prompts, args.branches, args.depth, args.output_len,
                                      args.doc_words, args.seed, label=label)
            else:
                if workload is None:
                    workload = build_workload(args, engine.tokenizer, engine.runner.config.vocab_size)
                    ctx["workload"] = {"name": workload.name, **workload.params,
                                       "requests": workload.num_requests}
                summary, _ = run_workload(engine, workload, label, progress=not args.no_progress,
                                          max_concurrency=args.max_concurrency)
            summaries.append(summary)
        finally:
            model_path, dtype, tokenizer = engine.model_path, engine.runner.dtype, engine.tokenizer
            engine.shutdown()
            del engine
    if args.baseline == "hf":
        if workload is None:
            print("the hf baseline runs prompt workloads only (not tree)", file=sys.stderr)
        else:
            from radixrt.bench.hf_baseline import HFBaseline

            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
            hf = HFBaseline(model_path, dtype, pad)
            summaries.append(hf.run_workload(workload, args.hf_batch_size, progress=not args.no_progress))
    _print_context(ctx)
    return _finish(summaries, args, ctx)


def _serving(args) -> int:
    import httpx

    from radixrt.bench.serving import run_serving_workers
    from radixrt.bench.workers import format_workers, router_workers, total

    ctx = machine()
    ctx["url"] = args.url
    workers = args.worker_urls or router_workers(args.url) or [args.url]
    ctx["workers"] = workers
    info = httpx.get(workers[0].rstrip("/") + "/get_model_info", timeout=30).json()
    tokenizer = None
    vocab = info.get("vocab_size") or 49152
    if args.workload == "sharegpt":
        from radixrt.model.weights import resolve_model_path
        from radixrt.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(resolve_model_path(args.model or info.get("model_path")))
    if args.workload == "tree":
        print("the tree workload runs offline only (radixrt bench offline --workload tree)", file=sys.stderr)
        return 2
    workload = build_workload(args, tokenizer, vocab)
    ctx["workload"] = {"name": workload.name, **workload.params, "requests": workload.num_requests}
    summary, stats = run_serving_workers(args.url, workload, workers, args.max_concurrency, args.timeout,
                                         not args.no_progress)
    _print_context(ctx)
    ctx["worker_stats"] = [s.to_dict() for s in stats] + [total(stats).to_dict()]
    print(format_workers(stats))
    unsent = workload.num_requests - summary.requests
    print(f"failed requests: {summary.failed} (of {summary.requests} sent; {unsent} later turns not sent)")
    if total(stats).requests != summary.requests - summary.failed:
        print(f"warning: the workers count {total(stats).requests} finished requests, the bench "
              f"{summary.requests - summary.failed} (other clients, or workers missing from the list)")
    code = _finish([summary], args, ctx)
    return code if unsent == 0 else 1


def _decode(args) -> int:
    """Decode tokens/s of our forward (Engine, decode steps only) and of transformers generate (generate n tokens
    minus generate 1 token), at each batch size and dtype, in the same run."""
    from radixrt.bench.offline import run_workload, warm_up
    from radixrt.bench.workloads import random_workload
    from radixrt.engine import Engine

    ctx = machine()
    rows = []
    for dtype in args.dtypes.split(","):
        engine = Engine(**_engine_kwargs(args, dtype=dtype))
        vocab = engine.runner.config.vocab_size
        model_path, torch_dtype, tokenizer = engine.model_path, engine.runner.dtype, engine.tokenizer
        warm_up(engine)
        ours = {}
        for bs in [int(b) for b in args.batch_sizes.split(",")]:
            workload = random_workload(bs, args.input_len, args.output_len, vocab, seed=bs)
            summary, _ = run_workload(engine, workload, f"radixrt b{bs}", progress=False)
            ours[bs] = (workload, summary.extra.get("decode tok/s (steps)", float("nan")), summary)
            engine.flush_cache()
        engine.shutdown()
        hf = None
        if not args.no_hf:
            from radixrt.bench.hf_baseline import HFBaseline

            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
            hf = HFBaseline(model_path, torch_dtype, pad)
        for bs, (workload, rate, summary) in ours.items():
            hf_rate = hf.decode_rate(workload.first_prompts(), args.output_len) if hf else float("nan")
            rows.append({"dtype": str(torch_dtype).replace("torch.", ""), "batch": bs, "radixrt decode tok/s": rate,
                         "transformers decode tok/s": hf_rate, "ratio": rate / hf_rate if hf else float("nan"),
                         "radixrt step ms p50": summary.extra.get("decode step ms p50")})
        del hf
    _print_context(ctx)
    header = list(rows[0])
    print(" | ".join(header))
    for r in rows:
        print(" | ".join(f"{v:.1f}" if isinstance(v, float) else str(v) for v in r.values()))
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump({"context": ctx, "rows": rows}, f, indent=2)
        print(f"wrote {args.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="radixrt")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
