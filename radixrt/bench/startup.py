"""`radixrt bench startup`: how long `radixrt serve` takes from its command to its first answer, beside vLLM's
OpenAI server on the same model where a peer python is given (``--vllm-python``), the two alternating round by round.

A start: the server's command on a free loopback port, then GET /v1/models polled every 50 ms until it answers 200
(the first moment both servers can serve a client); the seconds from the command to that answer are the figure.
The server is then stopped (SIGTERM to its process group, SIGKILL after 30 s) before the next one starts. Prints a
line per start, a table of each server's starts (the median of them as well), and ``RESULT_JSON`` with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from radixrt.procs import free_port, stop_processes
from radixrt.server_args import DEFAULT_MODEL

POLL_S = 0.05
STOP_WITHIN_S = 30.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="what `radixrt serve --model` takes (default: the bundled)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--rounds", type=int, default=3, help="starts of each server")
    p.add_argument("--vllm-python", default=None, help="a python with vllm installed (../shared/peers/setup_vllm.sh)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one start may take before it counts as failed")


def radixrt_command(model: str, dtype: str, port: int) -> list[str]:
    return [sys.executable, "-m", "radixrt.cli", "serve", "--model", model, "--dtype", dtype, "--port", str(port),
            "--log-interval", "0"]


def vllm_command(python: str, model_dir: Path, dtype: str, port: int) -> list[str]:
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--dtype", dtype,
            "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048"]


def time_to_first_answer(command: list[str], port: int, timeout: float, env: dict[str, str] | None = None,
                         cwd: str | None = None) -> float:
    """Seconds from starting ``command`` to its server's first 200 on GET /v1/models; the server is stopped after.
    A ``RuntimeError`` (with the end of its log) where it exits first or does not answer within ``timeout``."""
    with tempfile.TemporaryFile("w+") as log:
        started = time.perf_counter()
        proc = subprocess.Popen(command, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            with httpx.Client(timeout=2.0) as client:
                while True:
                    if proc.poll() is not None:
                        raise RuntimeError(f"{' '.join(command[1:4])} exited with code {proc.returncode}: "
                                           f"{_tail(log)}")
                    try:
                        if client.get(f"http://127.0.0.1:{port}/v1/models").status_code == 200:
                            return time.perf_counter() - started
                    except httpx.TransportError:
                        pass
                    if time.perf_counter() - started > timeout:
                        raise RuntimeError(f"{' '.join(command[1:4])} did not answer within {timeout:.0f} s: "
                                           f"{_tail(log)}")
                    time.sleep(POLL_S)
        finally:
            stop_processes([proc], STOP_WITHIN_S, group=True)


def _tail(log) -> str:
    log.seek(0)
    return log.read()[-2000:]


def run(args: argparse.Namespace) -> int:
    from radixrt.bench.commands import machine
    from radixrt.model.weights import resolve_model_path

    model_dir = resolve_model_path(args.model)  # fetched or converted once, before any start is timed
    servers = {"radixrt": lambda port: (radixrt_command(args.model, args.dtype, port), None)}
    if args.vllm_python:
        vllm_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4")}
        servers["vllm"] = lambda port: (vllm_command(args.vllm_python, model_dir, args.dtype, port), vllm_env)
    seconds: dict[str, list[float]] = {name: [] for name in servers}
    for round_ in range(args.rounds):
        for name, command_of in servers.items():
            port = free_port()
            command, env = command_of(port)
            # vLLM away from a checkout: its kernels/ folder would stand in for the `kernels` transformers imports
            cwd = tempfile.gettempdir() if name == "vllm" else None
            seconds[name].append(round(time_to_first_answer(command, port, args.timeout, env, cwd), 2))
            print(f"round {round_ + 1}: {name} answered after {seconds[name][-1]:.2f} s", flush=True)
    print("\n| server | starts (s) | median (s) |\n|---|---|---:|")
    for name, figures in seconds.items():
        print(f"| {name} | {', '.join(f'{s:.2f}' for s in figures)} | {statistics.median(figures):.2f} |")
    print("RESULT_JSON " + json.dumps({"machine": machine(), "model": args.model, "dtype": args.dtype,
                                       "seconds": seconds}))
    return 0
