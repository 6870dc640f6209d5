"""A stopped tensor-parallel runtime's ranks leave their process groups before they exit, so each exits 0.

A process that reaches interpreter shutdown with its gloo groups alive still has gloo's threads
(``pt_gloo_runloop``, ``gloo_tcp_loop``); one that then needs the GIL is ended by CPython with a forced unwind
through C++ frames, which aborts the process (std::terminate, exit code -6). It happened to a two-node
server's node 1 after a clean shutdown, about one stop in ten. The test runs the real stop protocol
(``TPWorld.close`` on rank 0, ``follower.follow`` on rank 1) on two processes without a model and checks the
contract directly: once ``follow`` returns, no group and no gloo thread is left in the follower."""

from __future__ import annotations

import json
import subprocess
import sys

from radixrt.procs import free_port

RANK = """
import json, os, sys
import torch
import torch.distributed as dist
from radixrt.distributed import follower
from radixrt.distributed.world import TPWorld
from radixrt.server_args import ServerArgs

rank, addr = int(sys.argv[1]), sys.argv[2]
args = ServerArgs(model="unused", device="cpu", tp_size=2, nnodes=2, node_rank=rank, dist_init_addr=addr)
world = TPWorld(args, rank, addr, followers=[])
world.tp.all_reduce(torch.ones(8))  # the model group has carried traffic, as after a forward
if rank == 0:
    world.close()
else:
    follower.follow(world, runner=None)  # the first step is the stop: the runner is never called
threads = []
for task in os.listdir("/proc/self/task"):
    with open(f"/proc/self/task/{task}/comm") as f:
        threads.append(f.read().strip())
print(json.dumps({"initialized": dist.is_initialized(), "gloo_threads": [t for t in threads if "gloo" in t]}))
"""


def test_a_stopped_follower_leaves_no_group_and_no_gloo_thread_and_exits_0():
    addr = f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(rank), addr], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    results = [proc.communicate(timeout=120) for proc in procs]
    for proc, (_, err) in zip(procs, results):
        assert proc.returncode == 0, err[-2000:]
    for out, _ in results:
        assert json.loads(out.strip().splitlines()[-1]) == {"initialized": False, "gloo_threads": []}
