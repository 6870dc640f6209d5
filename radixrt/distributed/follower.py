"""A follower rank: joins the process groups, loads its model shard and K/V pool, then runs every forward
rank 0 broadcasts (after the page copies that came with it) until rank 0 says stop: then it leaves the process
groups and exits 0. Any error of its own ends it with code 1 (fail-stop: rank 0 then finds it dead); it dies with
the process that spawned it.

Run by rank 0 or a node launcher: ``python -m radixrt.distributed.follower ARGS_JSON RANK HOST:PORT PARENT_PID``.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
from typing import TYPE_CHECKING

from radixrt.procs import die_with_parent
from radixrt.server_args import ServerArgs

if TYPE_CHECKING:
    from radixrt.distributed.world import TPWorld
    from radixrt.model.runner import ModelRunner

logger = logging.getLogger("radixrt.follower")


def run(args: ServerArgs, rank: int, init_addr: str) -> None:
    from radixrt.distributed.world import TPWorld
    from radixrt.model.runner import ModelRunner
    from radixrt.model.weights import resolve_model_path

    world = TPWorld(args, rank, init_addr, followers=[])
    follow(world, ModelRunner.from_args(resolve_model_path(args.model), args, world))


def follow(world: "TPWorld", runner: "ModelRunner") -> None:
    """Run rank 0's steps until it says stop, then leave the process groups."""
    while True:
        step = world.recv_batch()
        if step is None:
            world.leave()
            return
        batch, page_copies = step
        runner.apply_page_copies(page_copies)
        runner.forward(batch)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args_json, rank, init_addr, parent_pid = argv[0], int(argv[1]), argv[2], int(argv[3])
    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; rank 0 stops us
    args = ServerArgs(**json.loads(args_json))
    logging.basicConfig(level=args.log_level.upper(), format=f"[tp rank {rank} %(asctime)s] %(message)s",
                        datefmt="%H:%M:%S")
    try:
        run(args, rank, init_addr)
    except BaseException:
        logger.exception("tensor-parallel rank %d failed", rank)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
