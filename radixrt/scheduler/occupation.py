"""Memory given back between uses: SGLang's /release_memory_occupation and /resume_memory_occupation (vLLM's /sleep
and /wake_up map onto them), as the scheduler serves them for the Engine and the server alike.

A reinforcement-learning loop trains on the machine that serves: between rollouts it releases the runtime's memory
and takes it again before the next. Tags (``radixrt.model.runner.MEMORY_TAGS``; none given: all of them):

- ``kv_cache``: the prefix cache and the sessions' pins are dropped, then the pool's memory is given back
  (``PagePool.release_memory``);
- ``weights``: the model is dropped; resumed, it is built again from its checkpoint (the one last read from disk).
  Tensors sent since (``update_weights_from_tensor`` or a broadcast) are not kept: a trainer sends its weights
  again after resuming, as it does with SGLang, whose resumed weights hold no values unless backed up. The weight
  version then goes back to the one the checkpoint had (``Gate.checkpoint_version``). With a backup
  (``--enable-weights-cpu-backup``, vLLM's sleep level 1) the weights move to host memory instead and come back as
  they were, version and all (on a CPU they are in host memory already and stay);
- ``cuda_graph``: the decode graphs (nothing on a CPU); they go with the weights or the pool too, whose addresses
  they replay, and are captured again once all three are back.

A release is refused (409) while requests hold KV pages (running, paused in place, or launched) or an update of
weights or a pause waits for them: pause with mode ``abort`` or ``retract`` first, or wait. While any memory is
released no step runs and requests that arrive wait, in order, as during a pause; resuming every tag lets them in.
Releasing what is released, or resuming what is not, changes nothing. An update of weights or a read of them while
the weights are released is a 409; an update with the pool released runs (it needs no KV).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from radixrt.model.runner import MEMORY_TAGS
from radixrt.protocol.errors import Conflict, RequestError
from radixrt.protocol.messages import MemoryOut, ReleaseMemoryReq, ResumeMemoryReq
from radixrt.scheduler.weights import release_held, set_version

if TYPE_CHECKING:
    from radixrt.scheduler.scheduler import Scheduler

logger = logging.getLogger("radixrt.scheduler")


def memory_tags(tags: list[str] | None) -> set[str]:
    """The tags a call names (none: all); a ``RequestError`` for one that is not a tag."""
    if not tags:
        return set(MEMORY_TAGS)
    unknown = sorted(set(tags) - set(MEMORY_TAGS))
    if unknown:
        raise RequestError(f"unknown memory tag(s) {', '.join(map(repr, unknown))}: choose among "
                           f"{', '.join(MEMORY_TAGS)}")
    return set(tags)


def release(scheduler: Scheduler, req: ReleaseMemoryReq) -> MemoryOut:
    tags = memory_tags(req.tags)
    gate = scheduler.gate
    if gate.pending is not None:
        raise Conflict("an update of weights or a pause waits for the requests in flight; release the memory once "
                       "it is done")
    holding = [r for r in scheduler.running + scheduler.waiting if r.pages or r.node is not None]
    if holding or scheduler.launched is not None:
        raise Conflict(f"{max(len(holding), 1)} requests in flight hold KV pages: wait for them, or pause generation "
                       "with mode abort or retract first")
    if "kv_cache" in tags:
        scheduler.drop_cache()
    try:
        backup = req.backup_weights if req.backup_weights is not None else scheduler.args.enable_weights_cpu_backup
        scheduler.runner.release_memory(tags, backup)
    except ValueError as exc:  # tensor parallelism
        raise RequestError(str(exc)) from exc
    finally:
        gate.released = set(scheduler.runner.released)
    return MemoryOut(sorted(gate.released), gate.weight_version)


def resume(scheduler: Scheduler, req: ResumeMemoryReq) -> MemoryOut:
    gate = scheduler.gate
    tags = memory_tags(req.tags) & scheduler.runner.released
    try:
        lost_updates = scheduler.runner.resume_memory(tags)
    except (ValueError, OSError) as exc:  # the checkpoint is gone or unreadable: the weights stay released
        raise RequestError(f"the weights could not be read again from {scheduler.runner.model_path}: {exc}") from exc
    finally:
        gate.released = set(scheduler.runner.released)
    if lost_updates and gate.weight_version != gate.checkpoint_version:
        logger.warning("resumed weights are their checkpoint's (the tensors sent since are not kept): version %s",
                       gate.checkpoint_version)
        set_version(scheduler, gate.checkpoint_version)
    if not gate.closed:
        release_held(scheduler)
    return MemoryOut(sorted(gate.released), gate.weight_version)
