"""The ranks of one tensor-parallel runtime: process groups, the followers, the step broadcast, failure.

Design: rank 0 runs the only scheduler; followers run only the model. Each forward, rank 0 broadcasts the
planned ``ForwardBatch`` (token ids, positions, slots, page table: a few small CPU tensors) over a gloo
control group, and every rank runs the same forward on its shard: the row-parallel all-reduces and the LM
head's all-gather go over the model group (gloo on a CPU, NCCL on CUDA). Only rank 0 samples. Replaying the
inbox on every rank (SGLang's ``broadcast_pyobj``) would need every scheduler decision to be a pure function
of the messages, but admission here also depends on time (grammars compiling in a thread pool, queue
timeouts); broadcasting the batch makes a follower's work a pure function of what rank 0 sent, exact by
construction, and keeps tokenizers, grammars and radix caches out of the followers. Page ids are rank 0's:
every rank's pool has the same page count (the smallest any rank can hold) and K/V pages of its own heads.

Failure: a rank that dies closes its gloo connections, so the others' next collective raises at once; the
model group's collectives also time out (``COLLECTIVE_TIMEOUT``) should a rank hang. Rank 0 polls the
followers it spawned (``check``) before every step and raises ``RankFailure``; followers die with their
parent (PR_SET_PDEATHSIG) and exit on any error of their own; a forward that fails on rank 0 after its
broadcast kills the followers (the ranks are out of step). The runtime never runs with a rank missing.

Only one tensor-parallel runtime fits in a process (torch.distributed's default group is global).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import asdict

import torch
import torch.distributed as dist

from radixrt.distributed.options import check_dist_args, parse_addr, ranks_per_node
from radixrt.procs import free_port
from radixrt.model.forward_batch import HOST_FIELDS, ForwardBatch
from radixrt.model.parallel import TPGroup
from radixrt.server_args import ServerArgs

logger = logging.getLogger("radixrt.distributed")

COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)  # a hung rank ends the runtime after this
CONTROL_TIMEOUT = datetime.timedelta(days=365)  # followers wait this long for the next step
JOIN_TIMEOUT_S = 600.0  # rank 0 waits this long for every rank to join
_BATCH_TENSORS = ("input_ids", "positions", "out_slots", "page_table", "prefix_lens", "extend_lens", "seq_lens",
                  "logits_indices")


class RankFailure(RuntimeError):
    """A tensor-parallel rank died or fell out of step: the runtime cannot go on."""


def follower_args(args: ServerArgs) -> str:
    """The options a follower needs, as JSON: no keys on a command line that `ps` shows."""
    return json.dumps({**asdict(args), **{name: None for name in ServerArgs.SECRETS}})


def spawn_follower(args: ServerArgs, rank: int, init_addr: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "radixrt.distributed.follower", follower_args(args), str(rank), init_addr,
            str(os.getpid())]
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL)


def rank_device(args: ServerArgs, rank: int) -> str:
    """Each rank on a GPU node gets its own device: cuda:<local rank>."""
    if torch.device(args.device).type != "cuda" or args.tp_size == 1:
        return args.device
    return f"cuda:{rank % ranks_per_node(args)}"


class TPWorld:
    """This process's rank in the runtime: its TPGroup, the control group, and (rank 0) its local followers."""

    def __init__(self, args: ServerArgs, rank: int, init_addr: str, followers: list[subprocess.Popen]) -> None:
        self.args, self.rank, self.size = args, rank, args.tp_size
        self.followers = followers
        self.device = rank_device(args, rank)
        self._closed = False
        self._threads = torch.get_num_threads()  # given back on close (an Engine's process goes on)
        self.abort_reason: str | None = None
        try:
            self._join(init_addr)
        except BaseException as exc:
            self.abort(f"rank {rank} could not join: {exc!r}")
            if dist.is_initialized():
                dist.destroy_process_group()
            torch.set_num_threads(self._threads)
            raise
        self.tp = TPGroup(rank=rank, size=self.size)

    @classmethod
    def start_driver(cls, args: ServerArgs) -> "TPWorld":
        """Rank 0: spawn this node's followers, then join them (and any other node's) in the process groups."""
        check_dist_args(args)
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialised in this process: one tensor-parallel "
                               "runtime per process")
        init_addr = args.dist_init_addr or f"127.0.0.1:{free_port()}"
        followers = [spawn_follower(args, rank, init_addr) for rank in range(1, ranks_per_node(args))]
        return cls(args, 0, init_addr, followers)

    def _join(self, init_addr: str) -> None:
        host, port = parse_addr(init_addr)
        if torch.device(self.device).type == "cpu":
            torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // ranks_per_node(self.args)))
        else:
            torch.cuda.set_device(torch.device(self.device))
        if host in ("127.0.0.1", "localhost") and "GLOO_SOCKET_IFNAME" not in os.environ:
            os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # gloo would otherwise bind the hostname's interface
        store = dist.TCPStore(host, port, self.size, is_master=self.rank == 0, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S))
        store.add("radixrt/joined", 1)
        if self.rank == 0:
            self._wait_for_ranks(store)
        backend = "nccl" if torch.device(self.device).type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.PrefixStore("radixrt/pg", store), rank=self.rank,
                                world_size=self.size, timeout=COLLECTIVE_TIMEOUT)
        self.control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)

    def _wait_for_ranks(self, store: dist.TCPStore) -> None:
        """Until every rank has joined; RankFailure as soon as a local follower died on the way."""
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while store.add("radixrt/joined", 0) < self.size:
            self.check()
            if time.monotonic() > deadline:
                raise RankFailure(f"not every rank joined within {JOIN_TIMEOUT_S:.0f} s")
            time.sleep(0.05)

    # ----- the step broadcast -------------------------------------------------------------------------

    def send_batch(self, batch: ForwardBatch | None, page_copies: list[tuple[int, int, int]] = ()) -> None:
        """Rank 0: the next forward's input to every follower, with the page copies to make first (None: stop)."""
        payload = None
        if batch is not None:
            payload = {name: getattr(batch, name).cpu() for name in _BATCH_TENSORS}
            payload.update(batch.host_fields(), page_copies=list(page_copies))
        dist.broadcast_object_list([payload], src=0, group=self.control)

    def recv_batch(self) -> tuple[ForwardBatch, list[tuple[int, int, int]]] | None:
        """A follower: the next forward's input and the page copies to make first, from rank 0 (None: stop)."""
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        payload = box[0]
        if payload is None:
            return None
        tensors = {name: payload[name].to(self.device) for name in _BATCH_TENSORS}
        batch = ForwardBatch(**tensors, **{name: payload[name] for name in HOST_FIELDS})
        return batch, payload["page_copies"]

    def agree_min(self, value: int) -> int:
        """The smallest of every rank's ``value`` (the page count every pool can hold)."""
        t = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())

    # ----- failure and shutdown -----------------------------------------------------------------------

    def check(self) -> None:
        """RankFailure if a follower this process spawned has exited, or this rank killed them (``abort``)."""
        if self.abort_reason is not None:
            raise RankFailure(self.abort_reason)
        for rank, proc in enumerate(self.followers, start=1):
            code = proc.poll()
            if code is not None:
                raise RankFailure(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {code}")

    def abort(self, reason: str = "the tensor-parallel ranks were stopped after a failure") -> None:
        """Kill the local followers at once (the ranks are out of step, or a rank died)."""
        if self.abort_reason is None:
            self.abort_reason = reason
        for proc in self.followers:
            if proc.poll() is None:
                proc.kill()
        for proc in self.followers:
            proc.wait()

    def close(self, grace: float = 10.0) -> None:
        """Rank 0: tell the followers to stop, wait for them (then kill), leave the process groups."""
        if self._closed:
            return
        self._closed = True
        try:
            self.check()
            self.send_batch(None)
        except Exception as exc:  # a dead rank: the others are killed below
            logger.warning("could not stop the followers cleanly: %r", exc)
        deadline = time.monotonic() + grace
        for proc in self.followers:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.05))
            except subprocess.TimeoutExpired:
                pass
        self.abort()
        self.leave()

    def leave(self) -> None:
        """Destroy this process's groups. A process that reaches interpreter shutdown with them alive can abort
        (std::terminate: CPython ends a gloo thread that needs the GIL during shutdown through C++ frames).
        The groups' threads stop when the last reference to them goes: ours to the control group too."""
        self.control = None
        if dist.is_initialized():
            dist.destroy_process_group()
        torch.set_num_threads(self._threads)
