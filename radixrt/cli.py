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

    return serve(args.server_args)


def build_parser() -> argparse.ArgumentParser:
    import radixrt
    from radixrt.server_args import DEFAULT_MODEL, DTYPES, ServerArgs

    parser = argparse.ArgumentParser(prog="radixrt", description=__doc__)
    parser.add_argument("--version", action="version", version=f"radixrt {radixrt.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    fetch = commands.add_parser("fetch-model", help="fetch and convert a model once; print its folder",
                                description="Fetch a model (a bundled name, a hub id) and convert it once; print "
                                            "the local folder the runtime loads.")
    fetch.add_argument("--model", "--model-path", dest="model", default=DEFAULT_MODEL,
                       help=f"bundled model name, local folder, GGUF file, or hub id (default: {DEFAULT_MODEL})")
    fetch.set_defaults(run=_fetch_model)

    gen = commands.add_parser("generate", help="generate for chat prompts in one batch",
                              description="Generate for chat prompts in one lock-step batch, without a scheduler "
                                          "(a quick check that a model loads and answers).")
    gen.add_argument("prompt", nargs="+", help="user messages, each rendered with the model's chat template")
    gen.add_argument("--model", "--model-path", dest="model", default=DEFAULT_MODEL,
                     help=f"bundled model name, local folder, GGUF file, or hub id (default: {DEFAULT_MODEL})")
    gen.add_argument("--dtype", default="auto", choices=DTYPES,
                     help="weights' and activations' dtype; auto: bf16 where the CPU runs it fast, else fp32 "
                          "(default: auto)")
    gen.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default: 16)")
    gen.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt (default: 64)")
    gen.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy (default: 0)")
    gen.set_defaults(run=_generate)

    srv = commands.add_parser("serve", help="HTTP server: native /generate and the OpenAI-compatible API",
                              description="Serve a model over HTTP: SGLang's native API and the OpenAI-compatible "
                                          "API. Takes SGLang's launch flags too (`python -m radixrt.launch_server` "
                                          "is the same command).", allow_abbrev=False,
                              usage="%(prog)s [options] (--help lists them)")
    ServerArgs.add_cli_args(srv)
    srv.set_defaults(run=_serve, command_parser=srv)

    from radixrt.bench.commands import add_bench_parser

    add_bench_parser(commands)

    commands.add_parser("env", help="the environment variables radixrt reads, their meaning and values").set_defaults(
        run=_env)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # a bare `radixrt`: say what it can do
        parser.print_help()
        return 0
    if args.command == "serve":
        from radixrt.server_args import ServerArgs

        try:
            args.server_args = ServerArgs.from_cli_args(args)
        except ValueError as exc:  # a value the option refuses (radixrt does not serve it)
            args.command_parser.error(str(exc))
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
