"""A node other than 0 of a multi-node runtime (``radixrt serve --node-rank N``): no HTTP, no scheduler; it
spawns this node's follower ranks and waits. Exit 0 once they all stopped cleanly (rank 0 shut down); exit 1
as soon as one fails (rank 0 died or a rank crashed), with the others killed; SIGTERM/SIGINT stop them all."""

from __future__ import annotations

import logging
import signal
import subprocess
import time

from radixrt.distributed.options import check_dist_args, node_ranks
from radixrt.server_args import ServerArgs

logger = logging.getLogger("radixrt.node")


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        proc.wait()


def run_node(args: ServerArgs) -> int:
    check_dist_args(args)
    if args.node_rank == 0:
        raise ValueError("node 0 runs the server; run_node is for the other nodes")
    from radixrt.distributed.world import spawn_follower
    from radixrt.model.llama import check_tensor_parallel
    from radixrt.model.runner import load_config
    from radixrt.model.weights import resolve_model_path

    model_path = resolve_model_path(args.model)
    check_tensor_parallel(load_config(model_path, args.model_overrides()), args.tp_size)
    args = args.replace(model=str(model_path))

    def _term(signum, frame):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, _term)
    procs: list[subprocess.Popen] = []
    try:
        procs = [spawn_follower(args, rank, args.dist_init_addr) for rank in node_ranks(args)]
        logger.info("node %d: ranks %s started, waiting for node 0 at %s", args.node_rank,
                    list(node_ranks(args)), args.dist_init_addr)
        while True:
            codes = [proc.poll() for proc in procs]
            failed = [(rank, c) for rank, c in zip(node_ranks(args), codes) if c not in (None, 0)]
            if failed:
                logger.error("node %d: rank %d exited with code %d; stopping", args.node_rank, *failed[0])
                return 1
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.2)
    except (SystemExit, KeyboardInterrupt):
        return 0
    finally:
        _stop(procs)
