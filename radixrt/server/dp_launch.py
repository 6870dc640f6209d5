"""`radixrt serve --dp-size N` (N > 1): N worker servers behind sglang-router's cache_aware policy.

Contract:
- Each worker is a plain `radixrt serve` (the same options, dp_size 1) on a free loopback port, all with the
  same ``--served-model-name`` (the user's, else the model name); started through ServerProcess with
  ``die_with_parent`` so a killed launcher leaves none behind.
- The router is ``python -m sglang_router.launch_router --policy cache_aware`` on the user's host and port,
  with a free ``--prometheus-port``; it too dies with the launcher (PR_SET_PDEATHSIG). READY_LINE is printed
  once the router lists the model on /v1/models.
- A worker or the router that exits: everything is stopped, exit code 1. SIGTERM/SIGINT: everything is
  stopped, exit code 0.
- Refused with exit code 1 and a message, before anything starts: sglang-router not installed, dp_size < 1,
  and options the router does not carry to the workers (API keys, multi-node tensor parallelism).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import time

import httpx

from radixrt.procs import die_with, free_port
from radixrt.server.server_process import READY_LINE, ServerProcess
from radixrt.server_args import ServerArgs

logger = logging.getLogger("radixrt.server")

ROUTER_MODULE = "sglang_router"
ROUTER_READY_TIMEOUT_S = 120.0
WORKER_START_TIMEOUT_S = 1800.0
_NOT_FORWARDED = ("host", "port", "dp_size", "served_model_name")


def check_dp_args(args: ServerArgs) -> str | None:
    """Why ``args`` cannot run as data parallel replicas behind the router, or None when they can."""
    if args.dp_size < 1:
        return f"--dp-size must be at least 1 (got {args.dp_size})"
    if args.dp_size == 1:
        return None
    if importlib.util.find_spec(ROUTER_MODULE) is None:
        return "--dp-size > 1 needs sglang-router, which is not installed: pip install sglang-router==0.3.2"
    if args.api_key or args.admin_api_key:
        return ("--dp-size > 1 cannot be combined with --api-key/--admin-api-key: the router does not pass a "
                "client's key on to the workers; put the keys on separately started workers (docs/SCALING.md)")
    if args.nnodes > 1 or args.node_rank > 0:
        return "--dp-size > 1 runs on one machine: it cannot be combined with --nnodes or --node-rank"
    return None


def worker_argv(args: ServerArgs) -> list[str]:
    """The `radixrt serve` options of one worker: the user's, without host, port and dp_size."""
    argv: list[str] = ["--served-model-name", args.served_model_name or args.model]
    for f in dataclasses.fields(args):
        value = getattr(args, f.name)
        if f.name in _NOT_FORWARDED or f.name in ServerArgs.SECRETS or value is None or value is False:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, list):  # --lora-paths a=/x b=/y
            argv += [flag, *map(str, value)]
        else:
            argv += [flag] if value is True else [flag, str(value)]
    return argv


def _router_ready(url: str, model: str, router: subprocess.Popen) -> bool:
    deadline = time.monotonic() + ROUTER_READY_TIMEOUT_S
    while time.monotonic() < deadline and router.poll() is None:
        try:
            res = httpx.get(url + "/v1/models", timeout=5)
            if res.status_code == 200 and model in [m.get("id") for m in res.json().get("data", [])]:
                return True
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    return False


def serve_dp(args: ServerArgs) -> int:
    """Run the replicas and the router until a signal (0) or a child's exit (1)."""
    problem = check_dp_args(args)
    if problem is not None:
        logger.error("%s", problem)
        return 1
    stopping: list[int] = []

    def _on_signal(signum: int, frame: object) -> None:
        stopping.append(signum)
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, _on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    workers = [ServerProcess(worker_argv(args), timeout=WORKER_START_TIMEOUT_S, die_with_parent=True)
               for _ in range(args.dp_size)]
    router: subprocess.Popen | None = None
    try:
        for w in workers:  # one at a time: each resolves the model and takes its share of memory in turn
            w.start()
        model = args.served_model_name or args.model
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", args.host, "--port", str(args.port),
               "--prometheus-port", str(free_port()), "--policy", "cache_aware", "--log-level", "warn",
               "--worker-urls", *[w.url for w in workers]]
        router = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, preexec_fn=die_with(os.getpid()))
        host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
        url = f"http://{host}:{args.port}"
        if not _router_ready(url, model, router):
            logger.error("the router did not come up on %s (exit code %s)", url, router.poll())
            return 1
        print(f"{READY_LINE} {url} (model {model}, {args.dp_size} workers behind sglang-router cache_aware)",
              flush=True)
        while True:
            for name, proc in [("router", router), *[(f"worker {i}", w.proc) for i, w in enumerate(workers)]]:
                if proc is not None and proc.poll() is not None:
                    logger.error("the %s exited with code %s; stopping", name, proc.returncode)
                    return 1
            time.sleep(0.2)
    except KeyboardInterrupt:
        return 0
    except (RuntimeError, TimeoutError) as exc:  # a worker failed to start
        logger.error("%s", exc)
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _stop_all(router, workers)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _stop_all(router: subprocess.Popen | None, workers: list[ServerProcess]) -> None:
    if router is not None and router.poll() is None:
        router.terminate()
        try:
            router.wait(10)
        except subprocess.TimeoutExpired:
            router.kill()
            router.wait()
    for w in workers:
        w.stop()
