"""Process groups between a trainer and the runtime, for updates of weights sent by broadcast (SGLang's
``init_weights_update_group`` / ``update_weights_from_distributed`` / ``destroy_weights_update_group``).

The trainer is rank 0 and hosts the rendezvous (``tcp://master_address:master_port``); the runtime joins as rank
``rank_offset`` of ``world_size``. The group stands beside any other the processes have (the runtime's
tensor-parallel world, the trainer's own) and is made as SGLang and the trainers built on it (verl, OpenRLHF, slime)
make theirs: the rendezvous store, prefixed by the group's name, behind a group registered under that name with
ranks numbered as in the group. So a trainer may create its side with ``init_custom_process_group`` from here or
with its own copy of SGLang's.

Then the trainer broadcasts tensors from rank 0 in an order both sides know (the update names them, with their
dtypes and shapes, first); ``receive`` takes them, each into a new tensor of that dtype and shape.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

# SGLang's default; a group's collectives (a broadcast waiting for the requests in flight to finish) wait this long.
GROUP_TIMEOUT = datetime.timedelta(minutes=30)
BACKENDS = ("gloo", "nccl")


def init_custom_process_group(backend: str, init_method: str, world_size: int, rank: int, group_name: str,
                              timeout: datetime.timedelta = GROUP_TIMEOUT) -> dist.ProcessGroup:
    """Join the group ``group_name`` (``backend`` ``gloo`` or ``nccl``) as ``rank`` of ``world_size`` through the
    rendezvous at ``init_method`` (``tcp://host:port``, hosted by rank 0); returns it for ``torch.distributed``'s
    collectives (``group=``). Blocks until every rank has joined, at most ``timeout``."""
    from torch.distributed.distributed_c10d import _new_process_group_helper, _world
    from torch.distributed.rendezvous import rendezvous

    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(world_size, rank, [], backend, dist.PrefixStore(group_name, store),
                                         group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}  # src=0 names the trainer
    return group


def destroy(group: dist.ProcessGroup) -> None:
    dist.destroy_process_group(group)


def parse_dtype(name: str) -> torch.dtype:
    """``bfloat16`` or ``torch.bfloat16`` as a dtype (a ``ValueError`` for anything else)."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def check_announcement(names: list[str], dtypes: list[str], shapes: list[list[int]]) -> None:
    """A ``ValueError`` for an update whose names, dtypes and shapes do not describe the same tensors."""
    if not names:
        raise ValueError("no tensor to update: names is empty")
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(f"{len(names)} names, {len(dtypes)} dtypes and {len(shapes)} shapes: one of each a tensor")
    for name, dtype, shape in zip(names, dtypes, shapes):
        parse_dtype(dtype)
        if any(not isinstance(size, int) or size < 0 for size in shape):
            raise ValueError(f"{name!r}: shape {shape} is not a list of sizes")


def receive(group: dist.ProcessGroup, names: list[str], dtypes: list[str], shapes: list[list[int]],
            device: torch.device) -> dict[str, torch.Tensor]:
    """The tensors rank 0 broadcasts, in the announced order, received on ``device`` (NCCL: a CUDA device; gloo:
    host memory). Every announced tensor is received, whatever becomes of it, so the trainer's broadcasts never wait
    for a rank that left."""
    received: dict[str, torch.Tensor] = {}
    for name, dtype, shape in zip(names, dtypes, shapes):
        tensor = torch.empty(shape, dtype=parse_dtype(dtype), device=device)
        dist.broadcast(tensor, src=0, group=group)
        received[name] = tensor
    return received
