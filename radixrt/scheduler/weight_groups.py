"""The trainers' process groups (SGLang's /init_weights_update_group, /destroy_weights_update_group), as the
scheduler keeps them for updates of weights sent by broadcast (/update_weights_from_distributed:
radixrt.scheduler.weights runs those in an update's turn, receiving through ``WeightGroups.group``).

Joining waits until every rank has joined: the rendezvous runs on a thread of its own, so the scheduler goes on
serving meanwhile, and the call is answered by ``settle`` once it is done (or has failed: the caller's 400). A group
whose broadcast failed is dropped (its collectives would not line up again): the trainer makes a new one.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Callable

from radixrt.protocol.errors import Conflict, NotFound, RequestError
from radixrt.protocol.messages import ControlOut, ControlReq, DestroyWeightGroupReq, InitWeightGroupReq, WeightGroupOut

if TYPE_CHECKING:
    import torch.distributed as dist

    from radixrt.scheduler.scheduler import Scheduler

logger = logging.getLogger("radixrt.scheduler")


class WeightGroups:
    def __init__(self) -> None:
        self.groups: dict[str, dist.ProcessGroup] = {}
        self.joining: dict[str, tuple[ControlReq, Future]] = {}

    def group(self, name: str) -> dist.ProcessGroup:
        if name not in self.groups:
            raise NotFound(f"no weight group {name!r}: create it with init_weights_update_group first")
        return self.groups[name]

    def drop(self, name: str) -> None:
        """Leave the group ``name`` (its collectives failed, or it was destroyed)."""
        from radixrt.model.weight_group import destroy

        group = self.groups.pop(name)
        try:
            destroy(group)
        except Exception:  # a broken group may fail to tear down; it is gone from here either way
            logger.warning("tearing down weight group %r failed", name, exc_info=True)

    def close(self) -> None:
        """Leave every group (the runtime stops): their names are free again in this process."""
        for name in list(self.groups):
            self.drop(name)

    def settle(self, sink: Callable[[ControlOut], None]) -> None:
        """Answer each join that has ended (scheduler thread)."""
        for name, (msg, future) in list(self.joining.items()):
            if not future.done():
                continue
            del self.joining[name]
            exc = future.exception()
            if exc is None:
                self.groups[name] = future.result()
                logger.info("joined weight group %r as rank %d of %d", name, msg.body.rank_offset,
                            msg.body.world_size)
                sink(ControlOut(msg.id, body=WeightGroupOut(f"Succeeded to initialize group {name}.")))
            else:
                logger.warning("joining weight group %r failed: %s", name, exc)
                sink(ControlOut(msg.id, error=f"could not join weight group {name!r}: {exc}", status_code=400))


def begin_join(scheduler: Scheduler, msg: ControlReq) -> None:
    """Start joining the group ``msg.body`` names (answered by ``WeightGroups.settle``); a ``RequestError`` for a
    request that cannot be joined as asked."""
    from radixrt.model.weight_group import init_custom_process_group

    req: InitWeightGroupReq = msg.body
    groups, runner = scheduler.weight_groups, scheduler.runner
    if req.group_name in groups.groups or req.group_name in groups.joining:
        raise Conflict(f"weight group {req.group_name!r} exists: destroy it first or choose another group_name")
    if runner.world is not None:
        raise RequestError("weights cannot be updated under tensor parallelism (--tp-size > 1) yet")
    if req.backend not in ("gloo", "nccl"):
        raise RequestError(f"backend {req.backend!r}: choose gloo or nccl")
    if req.backend == "nccl" and runner.device.type != "cuda":
        raise RequestError(f"backend nccl needs a runtime on CUDA; this one runs on {runner.device.type}: use gloo")
    if req.world_size < 2 or not 0 < req.rank_offset < req.world_size:
        raise RequestError(f"rank_offset {req.rank_offset} of world_size {req.world_size}: the trainer is rank 0, "
                           "the runtime one of ranks 1 to world_size - 1")
    future: Future = Future()

    def join() -> None:
        try:
            future.set_result(init_custom_process_group(
                req.backend, f"tcp://{req.master_address}:{req.master_port}", req.world_size, req.rank_offset,
                req.group_name))
        except BaseException as exc:  # noqa: BLE001 (the caller's answer, not this thread's end)
            future.set_exception(exc)

    groups.joining[req.group_name] = (msg, future)
    threading.Thread(target=join, name=f"join-{req.group_name}", daemon=True).start()


def destroy(scheduler: Scheduler, req: DestroyWeightGroupReq) -> WeightGroupOut:
    groups = scheduler.weight_groups
    groups.group(req.group_name)  # NotFound
    groups.drop(req.group_name)
    return WeightGroupOut(f"Succeeded to destroy group {req.group_name}.")
