"""Pauses and weight updates between steps: SGLang's /pause_generation, /continue_generation,
/update_weights_from_disk and /update_weight_version, as the scheduler serves them (for the Engine and the server
alike, since both reach it through control calls).

``Gate`` holds the state. While it is closed, requests that arrive are held, in arrival order, and taken in when it
opens again; aborts and control calls are served as always. It closes for:

- a pause (``PauseReq``): no step runs until ``ContinueReq``. Mode ``abort`` ends every request the scheduler
  holds (aborted); ``retract`` sends running requests back to the queue with their pages released (they are
  computed again after the pause, from the cache where it still holds their prefix); ``in_place`` keeps them as
  they are, pages and all.
- a pause in mode ``wait`` (vLLM's): as ``in_place`` once every request that arrived before it has finished (the
  pause is answered then), new ones held meanwhile. ``clear_cache`` (not with ``in_place``) drops the prefix cache
  once paused.
- an update of weights (``UpdateWeightsReq``: another checkpoint of the model, some of its tensors, or those a
  trainer broadcasts): it waits until every request that arrived before it has finished
  (``abort_all_requests``: aborts them), so no request runs partly on each set of weights, and runs at once while
  paused. It loads the new weights (``ModelRunner.update_weights``: the served ones stay on any failure, which is
  the caller's 400) and, with ``flush_cache`` (the default), drops the prefix cache and the sessions' pins: their
  pages hold keys and values of the old weights. Requests paused in place hold such pages too: an update that
  would flush is refused (409) while they do.
- memory released (radixrt.scheduler.occupation, ``released``): no step runs until every tag is resumed.

``weight_version`` names the served weights (``--weight-version`` at start, then each update's or
``WeightVersionReq``'s); every request's last delta carries it (``meta_info["weight_version"]``).
``checkpoint_version`` names the weights of the runner's checkpoint as read (until tensors are copied in place),
which resumed weights are again. ``weights_by_name`` reads the served values of one tensor back (SGLang's
/get_weights_by_name, for checking that an update landed).
"""

from __future__ import annotations

import logging
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING

from radixrt.model.reload import tensors_from_records
from radixrt.protocol.errors import Conflict, NotFound, RequestError
from radixrt.protocol.messages import (
    Broadcast,
    ContinueReq,
    ControlOut,
    ControlReq,
    FinishReason,
    GenerateReq,
    PauseOut,
    PauseReq,
    UpdateWeightsReq,
    WeightsByNameOut,
    WeightsByNameReq,
    WeightsOut,
    WeightVersionReq,
)

if TYPE_CHECKING:
    from radixrt.scheduler.scheduler import Scheduler

logger = logging.getLogger("radixrt.scheduler")


class Gate:
    def __init__(self, weight_version: str) -> None:
        self.paused: str | None = None  # the pause's mode while paused
        self.pending: ControlReq | None = None  # an update of weights waiting for the requests in flight
        self.aborted = 0  # the requests the waiting update aborted
        self.held: deque[GenerateReq] = deque()
        self.released: set[str] = set()  # memory given back (radixrt.scheduler.occupation)
        self.weight_version = weight_version
        self.checkpoint_version = weight_version  # names the weights of the runner's checkpoint as read

    @property
    def stopped(self) -> bool:
        """No step runs: paused, or memory released."""
        return self.paused is not None or bool(self.released)

    @property
    def closed(self) -> bool:
        return self.stopped or self.pending is not None

    def drop_held(self, rid: str) -> GenerateReq | None:
        for msg in self.held:
            if msg.rid == rid:
                self.held.remove(msg)
                return msg
        return None


def abort_all(scheduler: Scheduler) -> int:
    """End every request the scheduler holds (waiting, running, held), as aborted; returns how many."""
    reqs = scheduler.waiting + scheduler.running
    scheduler.waiting.clear()
    scheduler.running.clear()
    for req in reqs:
        scheduler.memory.release(req)
        scheduler.sessions.ended(req.rid)
        req.finish_reason = FinishReason.aborted()
    if reqs:
        scheduler.output.emit(reqs)
    held = list(scheduler.gate.held)
    scheduler.gate.held.clear()
    for msg in held:
        scheduler.refuse(msg, FinishReason.aborted())
    return len(reqs) + len(held)


def pause(scheduler: Scheduler, req: PauseReq) -> PauseOut:
    if req.mode not in ("abort", "retract", "in_place", "wait"):
        raise RequestError(f"unknown pause mode {req.mode!r}; choose abort, retract, in_place or wait")
    if req.clear_cache and req.mode == "in_place":
        raise RequestError("clear_cache with mode in_place: the requests kept in place hold cached pages")
    if req.mode == "wait" and (scheduler.running or scheduler.waiting):  # its turn came while others ran
        raise Conflict("another pause or update of weights waits for the requests in flight; retry when it is done")
    touched = 0
    if req.mode == "abort":
        touched = abort_all(scheduler)
    elif req.mode == "retract":
        for running in list(scheduler.running):
            scheduler.memory.release(running)
            scheduler.running.remove(running)
            if running.outgrows_short_rope(scheduler.runner.long_rope_from):  # as the next step would have
                running.switch_to_long_rope()  # (Scheduler._restart_long_rope): it comes back rotated long
                scheduler.admission.num_long_rope_restarts += 1
            scheduler.admission.take_back(running, "paused")
            touched += 1
    scheduler.gate.paused = req.mode
    if req.clear_cache:  # nothing runs now: no request holds a tree page
        scheduler.drop_cache()
    logger.info("generation paused (%s): %d requests %s", req.mode, touched,
                {"abort": "aborted", "retract": "retracted", "wait": "finished first"}.get(req.mode, "kept in place"))
    return PauseOut(paused=True, requests=touched)


def resume(scheduler: Scheduler, req: ContinueReq | None = None) -> PauseOut:
    """End the pause; a pause still waiting for the requests in flight (mode ``wait``) is called off, its caller
    answered ``paused: false``."""
    gate = scheduler.gate
    if gate.paused is not None:
        gate.paused = None
        logger.info("generation continues")
    if gate.pending is not None and isinstance(gate.pending.body, PauseReq):
        scheduler.sink(ControlOut(gate.pending.id, body=PauseOut(paused=False, requests=0)))
        gate.pending = None
    if not gate.closed:
        release_held(scheduler)
    return PauseOut(paused=False, requests=0)


def release_held(scheduler: Scheduler) -> None:
    """The gate is open: held requests are taken in next, before anything that arrived after them."""
    held = scheduler.gate.held
    scheduler.inbox.extendleft(reversed(held))
    held.clear()


def waits_for_requests(msg: ControlReq) -> bool:
    """An update of weights, or a pause in mode ``wait``: answered once the requests in flight have finished."""
    return isinstance(msg.body, UpdateWeightsReq) or (isinstance(msg.body, PauseReq) and msg.body.mode == "wait")


def begin_update(scheduler: Scheduler, msg: ControlReq) -> None:
    """An update of weights (or a pause in mode ``wait``) arrived: it waits until the requests in flight are done
    (``abort_all_requests``: they are aborted now)."""
    gate = scheduler.gate
    gate.aborted = abort_all(scheduler) if getattr(msg.body, "abort_all_requests", False) else 0
    gate.pending = msg


def update_due(scheduler: Scheduler) -> ControlReq | None:
    """The waiting update, taken off the gate, once it may run: paused, or every request that arrived before it
    has finished. Its answer opens the gate (``update`` runs it)."""
    gate = scheduler.gate
    in_flight = scheduler.running or scheduler.waiting or scheduler.launched
    if gate.pending is None or (not gate.stopped and in_flight):
        return None
    msg, gate.pending = gate.pending, None
    return msg


def update(scheduler: Scheduler, req: UpdateWeightsReq) -> WeightsOut:
    """Load the new weights: the waiting update's turn has come. Another arriving while one waits: a 409."""
    gate = scheduler.gate
    if gate.pending is not None:
        raise Conflict("another update of weights or pause waits for the requests in flight; retry when it is done")
    try:
        if req.flush_cache and scheduler.running:
            raise Conflict(f"{len(scheduler.running)} requests paused in place hold pages computed with the served "
                           "weights: pause with mode retract or abort first, or update with flush_cache false")
        if "weights" in gate.released:
            raise Conflict("the weights are released: resume_memory_occupation with tag weights first")
        _load(scheduler, req)
    finally:
        if not gate.closed:
            release_held(scheduler)
    if req.flush_cache:
        scheduler.drop_cache()
    if req.weight_version is not None:
        set_version(scheduler, req.weight_version)
    _note_checkpoint(scheduler)
    served = str(scheduler.runner.model_path)
    source = "tensors" if req.tensors is not None else "a broadcast" if req.broadcast is not None else served
    logger.info("weights updated from %s (version %s)", source, gate.weight_version)
    return WeightsOut(model_path=served, weight_version=gate.weight_version, aborted=gate.aborted,
                      message="Succeeded to update model weights." + (" Cache flushed." if req.flush_cache else ""))


def _load(scheduler: Scheduler, req: UpdateWeightsReq) -> None:
    """The runner's new weights; where the checkpoint or tensors cannot replace the served ones, a RequestError."""
    runner = scheduler.runner
    if req.tensors is None and req.model_path is None and req.broadcast is None:
        raise RequestError("an update of weights names a model_path, tensors or a broadcast")
    try:
        if req.broadcast is not None:
            runner.update_tensors(_receive(scheduler, req.broadcast))
        elif req.tensors is not None:
            runner.update_tensors(tensors_from_records(req.tensors))
        else:
            runner.update_weights(Path(req.model_path))
    except RequestError:
        raise  # no such weight group (404)
    except (ValueError, OSError, KeyError) as exc:
        raise RequestError(str(exc)) from exc


def _receive(scheduler: Scheduler, broadcast: Broadcast) -> dict:
    """The tensors a trainer broadcasts through its weight group (radixrt.scheduler.weight_groups); a group whose
    broadcast failed is left."""
    import torch.distributed as dist

    from radixrt.model.weight_group import check_announcement, receive

    groups = scheduler.weight_groups
    group = groups.group(broadcast.group_name)
    check_announcement(broadcast.names, broadcast.dtypes, broadcast.shapes)
    device = scheduler.runner.device if dist.get_backend(group) == "nccl" else "cpu"
    try:
        return receive(group, broadcast.names, broadcast.dtypes, broadcast.shapes, device)
    except RuntimeError as exc:  # the trainer left, or sent other tensors than it announced
        groups.drop(broadcast.group_name)
        raise RequestError(f"receiving the tensors of weight group {broadcast.group_name!r} failed (the group is "
                           f"left; create it again): {exc}") from exc


def weight_version(scheduler: Scheduler, req: WeightVersionReq) -> WeightsOut:
    aborted = 0
    if req.new_version is not None:
        if req.abort_all_requests:
            aborted = abort_all(scheduler)
        set_version(scheduler, req.new_version)
    return WeightsOut(model_path=str(scheduler.runner.model_path), weight_version=scheduler.gate.weight_version,
                      aborted=aborted)


MAX_VALUES_READ = 1 << 24  # about 200 MB of JSON


def weights_by_name(scheduler: Scheduler, req: WeightsByNameReq) -> WeightsByNameOut:
    if "weights" in scheduler.gate.released:
        raise Conflict("the weights are released: resume_memory_occupation with tag weights first")
    if req.truncate_size < 0:
        raise RequestError(f"truncate_size {req.truncate_size} is negative")
    try:
        values = scheduler.runner.read_weight(req.name)[: req.truncate_size]
    except KeyError as exc:
        raise NotFound(exc.args[0]) from exc
    except ValueError as exc:
        raise RequestError(str(exc)) from exc
    if values.numel() > MAX_VALUES_READ:
        raise RequestError(f"{values.numel()} values asked for, more than {MAX_VALUES_READ}: ask for fewer rows")
    return WeightsByNameOut(values.float().tolist())


def set_version(scheduler: Scheduler, version: str) -> None:
    scheduler.gate.weight_version = scheduler.output.weight_version = version
    _note_checkpoint(scheduler)
    logger.info("weight version %s", version)


def _note_checkpoint(scheduler: Scheduler) -> None:
    """The served weights are their checkpoint's as read: what resumed weights are named after (occupation)."""
    if not scheduler.runner.weights_diverged:
        scheduler.gate.checkpoint_version = scheduler.gate.weight_version
