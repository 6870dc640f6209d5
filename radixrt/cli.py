"""The `radixrt` command: fetch-model, generate, serve, bench, env."""

from __future__ import annotations

import argparse
import sys


def _fetch_model(args: argparse.Namespace) -> int:
    from radixrt.model.weights import resolve_model_path

    print(resolve_model_path(args.model))
    return 0


def _generate(args: argparse.Namespace) -> int:
    import time

    from radixrt.model.runner import ModelRunner
    from radixrt.model.weights import resolve_model_path
    from radixrt.lockstep import generate_ids
    from radixrt.sampling.params import SamplingParams
    from radixrt.tokenizer import apply_chat_template, eos_token_ids, load_tokenizer

    path = resolve_model_path(args.model)
    runner = ModelRunner(path, dtype=args.dtype, page_size=args.page_size)
    tokenizer = load_tokenizer(path)
    prompts = [apply_chat_template(tokenizer, [{"role": "user", "content": p}]) for p in args.prompt]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    started = time.perf_counter()
    outputs = generate_ids(runner, prompts, params, eos_token_ids(path, tokenizer))
    elapsed = time.perf_counter() - started
    for prompt, out in zip(args.prompt, outputs):
        print(f"### {prompt}\n{tokenizer.decode(out, skip_special_tokens=True)}\n")
    total = sum(len(o) for o in outputs)
    print(f"{total} tokens in {elapsed:.2f}s: {total / elapsed:.1f} tok/s ({runner.dtype}, batch {len(prompts)})")
    return 0


def _env(args: argparse.Namespace) -> int:
    from radixrt import env

    print(env.describe())
    return 0


def _serve(args: argparse.Namespace) -> int:
    from radixrt.server.launch import serve
    from radixrt.server_args import ServerArgs

    return serve(ServerArgs.from_cli_args(args))


def main(argv: list[str] | None = None) -> int:
    from radixrt.server_args import DEFAULT_MODEL

    parser = argparse.ArgumentParser(prog="radixrt", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    fetch = commands.add_parser("fetch-model", help="fetch and convert a model once; print its folder")
    fetch.add_argument("--model", default=DEFAULT_MODEL)
    fetch.set_defaults(run=_fetch_model)

    gen = commands.add_parser("generate", help="generate for chat prompts in one batch")
    gen.add_argument("prompt", nargs="+")
    gen.add_argument("--model", default=DEFAULT_MODEL)
    gen.add_argument("--dtype", default="auto")
    gen.add_argument("--page-size", type=int, default=16)
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.set_defaults(run=_generate)

    srv = commands.add_parser("serve", help="HTTP server: native /generate and the OpenAI-compatible API")
    from radixrt.server_args import ServerArgs

    ServerArgs.add_cli_args(srv)
    srv.set_defaults(run=_serve)

    from radixrt.bench.commands import add_bench_parser

    add_bench_parser(commands)

    commands.add_parser("env", help="the environment variables radixrt reads, their meaning and values").set_defaults(
        run=_env)

    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
