"""`radixrt serve`: start the scheduler and detokenizer processes, then the HTTP app in this process.

Lifecycle:
- The ipc sockets live in a private temp dir, removed on exit.
- The URL is printed (``radixrt serve: ready at http://HOST:PORT``) once the model is loaded, both helper
  processes have answered the handshake and the HTTP socket listens.
- SIGINT/SIGTERM: uvicorn stops accepting, open responses get a short grace period (SHUTDOWN_GRACE_S),
  after which the unfinished ones are answered 503; the helpers get SIGTERM (then SIGKILL); exit code 0.
  Helpers ignore SIGINT (a terminal's Ctrl-C reaches the whole group) and die with this process if it is
  killed (PR_SET_PDEATHSIG) or notice it is gone within a second.
- A helper that dies makes /health answer 503, fails every request in flight, and the server exits with
  code 1 instead of hanging.
- Tensor parallelism: the scheduler process is rank 0 and spawns the other ranks of its node; a rank that
  dies ends the scheduler process, hence the server (code 1). ``--node-rank N`` (N > 0) serves no HTTP:
  it runs that node's ranks only (``radixrt.distributed.node``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from typing import TYPE_CHECKING

from radixrt.procs import pin_helper_threads, stop_processes, torch_single_thread
from radixrt.server.ipc import IpcPaths
from radixrt.server.runtime_procs import dead_helper, spawn_detokenizer, spawn_scheduler
from radixrt.server_args import ServerArgs

if TYPE_CHECKING:
    import uvicorn
    from fastapi import FastAPI

    from radixrt.server.tokenizer_manager import TokenizerManager

logger = logging.getLogger("radixrt.server")

READY_LINE = "radixrt serve: ready at"
SHUTDOWN_GRACE_S = 2.0  # SIGTERM: how long in-flight requests may still finish (uvicorn's own limit is 3 s)


class StartupFailed(RuntimeError):
    pass


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def serve(args: ServerArgs) -> int:
    from radixrt.model.weights import resolve_model_path

    from radixrt.distributed.options import check_dist_args

    logging.basicConfig(level=args.log_level.upper(), format="[server %(asctime)s] %(message)s", datefmt="%H:%M:%S")
    if args.dp_size != 1:  # replicas behind sglang-router (docs/SCALING.md)
        from radixrt.server.dp_launch import serve_dp

        return serve_dp(args)
    try:
        check_dist_args(args)
    except ValueError as exc:
        logger.error("%s", exc)
        return 1
    if args.node_rank > 0:
        from radixrt.distributed.node import run_node

        try:
            return run_node(args)
        except ValueError as exc:  # the model does not split over tp_size ranks
            logger.error("%s", exc)
            return 1
    if not args.api_key and not _is_loopback(args.host):
        logger.warning("binding %s without an API key: anyone who can reach this port can use the server, flush "
                       "its cache and abort requests; pass --api-key (docs/SECURITY.md)", args.host)
    model_path = str(resolve_model_path(args.model))  # fetch/convert once, before the scheduler needs it
    compute_env = dict(os.environ)  # the scheduler gets the machine's compute threads
    pin_helper_threads()  # this process: one thread, no OpenMP spinning

    ipc_dir = tempfile.mkdtemp(prefix="radixrt-ipc-")
    paths = IpcPaths(ipc_dir)
    procs: dict[str, subprocess.Popen] = {}
    code = 1

    def _term(signum, frame):  # until uvicorn takes over the signals
        raise SystemExit(0)

    previous_term = signal.signal(signal.SIGTERM, _term)
    try:
        tokenizer_path = args.tokenizer_path or model_path
        procs["scheduler"] = spawn_scheduler(args, ipc_dir, compute_env)  # it loads the model meanwhile
        from radixrt.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(tokenizer_path, args.chat_template)
        procs["detokenizer"] = spawn_detokenizer(args, ipc_dir, tokenizer, tokenizer_path, compute_env)
        torch_single_thread()
        code = asyncio.run(_main(args, paths, tokenizer, procs))
    except KeyboardInterrupt:
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except StartupFailed as exc:
        logger.error("%s", exc)
        code = 1
    finally:
        stop_processes(list(procs.values()))
        shutil.rmtree(ipc_dir, ignore_errors=True)
        signal.signal(signal.SIGTERM, previous_term)
    return code


async def _main(args: ServerArgs, paths: IpcPaths, tokenizer, procs: dict[str, subprocess.Popen]) -> int:
    """Serve HTTP until a signal (exit code 0) or a helper's death (1); 1 as well when the port cannot be bound."""
    from radixrt.server.http_server import create_app
    from radixrt.server.tokenizer_manager import TokenizerManager

    tm = TokenizerManager(args, paths, tokenizer)
    await tm.start()
    try:
        await _handshake(tm, procs)
        problems: list[str] = []  # the helper death that stopped the server, once seen

        def health() -> str | None:
            return problems[0] if problems else dead_helper(procs)

        server = _http_server(args, create_app(tm, health))
        watch = asyncio.create_task(_watchdog(args, server, tm, procs, problems))
        await server.serve()
        watch.cancel()
        return 1 if problems or not server.started else 0
    finally:
        tm.close()


async def _handshake(tm: TokenizerManager, procs: dict[str, subprocess.Popen]) -> None:
    """Wait until both helpers are ready; StartupFailed as soon as one died."""
    while True:
        problem = dead_helper(procs)
        if problem is not None:
            raise StartupFailed(f"startup failed: {problem}")
        try:
            await asyncio.wait_for(tm.wait_ready(), 0.5)
            return
        except asyncio.TimeoutError:
            continue


def _http_server(args: ServerArgs, app: FastAPI) -> uvicorn.Server:
    """uvicorn serving ``app`` behind the RequestGuard, with the head timeout and the connection limit."""
    import uvicorn

    from radixrt.server.security import GuardedH11Protocol, RequestGuard

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            """uvicorn's, without re-raising the signal afterwards: we clean up and exit 0 instead."""
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            handled = (signal.SIGINT, signal.SIGTERM)
            original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

    guarded = RequestGuard(app, api_key=args.api_key, admin_api_key=args.admin_api_key,
                           max_body_bytes=args.max_request_bytes, body_timeout=args.request_body_timeout)
    GuardedH11Protocol.header_timeout = args.request_header_timeout
    http_level = args.log_level_http or "warning"
    config = uvicorn.Config(guarded, host=args.host, port=args.port, log_level=http_level,
                            access_log=http_level in ("info", "debug"),
                            lifespan="off", timeout_graceful_shutdown=3, timeout_keep_alive=30,
                            http=GuardedH11Protocol, limit_concurrency=args.max_connections)
    return Server(config)


async def _watchdog(args: ServerArgs, server: uvicorn.Server, tm: TokenizerManager, procs: dict[str, subprocess.Popen],
                    problems: list[str]) -> None:
    """Print the ready line once the socket listens; stop the server when a helper dies (appending to
    ``problems``); after a signal, answer 503 to the requests that outlive the grace period."""
    announced = False
    while not server.should_exit:
        if not announced and server.started:
            announced = True
            print(f"{READY_LINE} http://{args.host}:{args.port} (model {tm.model_info['served_model_name']},"
                  f" {tm.ready.num_pages} KV pages of {tm.ready.page_size} tokens)", flush=True)
        problem = dead_helper(procs)
        if problem is not None:
            logger.error("%s; shutting down", problem)
            problems.append(problem)
            tm.fail_all(problem)
            await asyncio.sleep(0.5)  # let waiting clients get their 503s
            server.should_exit = True
            return
        await asyncio.sleep(0.2)
    # A signal: uvicorn stops accepting and waits for open responses. Requests that do not finish
    # within the grace period are answered 503 (streams: an error event), so every connection closes.
    deadline = time.monotonic() + SHUTDOWN_GRACE_S
    while tm.in_flight and time.monotonic() < deadline and dead_helper(procs) is None:
        await asyncio.sleep(0.05)
    if tm.in_flight:
        logger.info("shutting down: %d requests unfinished are answered 503", tm.in_flight)
    tm.fail_all("the server is shutting down")
