"""Control calls: the scheduler's answer to each ``ControlReq``, between steps, on the scheduler's thread.

``answer`` looks the request's type up in ``HANDLERS`` (an update of weights is answered once its turn comes:
radixrt.scheduler.weights; joining a weight group once every rank has joined: radixrt.scheduler.weight_groups) and wraps the result in a ``ControlOut`` with the
request's id (the client matches it to its caller by that id). A ``RequestError`` is the caller's fault (400,
404 or 409 for its kinds ``NotFound``, ``Conflict``);
any other error is a failure (500), logged here. A control call reaches the scheduler in its inbox, so it sees
every message sent before it (a flush after an abort finds the request gone).

A new control call: its request and reply structs in radixrt/protocol/messages.py (added to ``Control`` and
``ControlReply``), a handler here, and its route or Engine method calling ``SchedulerClient.call``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable

from radixrt.protocol.errors import RequestError, status_of
from radixrt.protocol.messages import (
    CloseSessionOut,
    CloseSessionReq,
    ControlOut,
    ControlReq,
    FlushCacheOut,
    FlushCacheReq,
    LoadLoraReq,
    LoraAdaptersOut,
    ContinueReq,
    DestroyWeightGroupReq,
    OpenSessionOut,
    OpenSessionReq,
    PauseReq,
    ProfileOut,
    ProfileStateOut,
    ProfileStateReq,
    ReleaseMemoryReq,
    ResumeMemoryReq,
    StartProfileReq,
    StatsOut,
    StatsReq,
    StopProfileReq,
    UnloadLoraReq,
    UpdateWeightsReq,
    WeightsByNameReq,
    WeightVersionReq,
)
from radixrt.scheduler import occupation, weight_groups, weights

if TYPE_CHECKING:
    from radixrt.scheduler.scheduler import Scheduler

logger = logging.getLogger("radixrt.scheduler")


def _stats(scheduler: Scheduler, req: StatsReq) -> StatsOut:
    h = scheduler.step_latency
    return StatsOut(stats=scheduler.stats(), step_buckets=list(h.buckets), step_counts=h.cumulative(),
                    step_sum=h.sum, step_count=h.count)


def _flush(scheduler: Scheduler, req: FlushCacheReq) -> FlushCacheOut:
    return FlushCacheOut(ok=scheduler.flush_cache())


def _open_session(scheduler: Scheduler, req: OpenSessionReq) -> OpenSessionOut:
    return OpenSessionOut(scheduler.open_session(req.capacity_of_str_len, req.session_id))


def _close_session(scheduler: Scheduler, req: CloseSessionReq) -> CloseSessionOut:
    return CloseSessionOut(scheduler.close_session(req.session_id))


def _start_profile(scheduler: Scheduler, req: StartProfileReq) -> ProfileOut:
    scheduler.profiler.start(req)
    return ProfileOut({})


def _stop_profile(scheduler: Scheduler, req: StopProfileReq) -> ProfileOut:
    operators = scheduler.profiler.stop(req.trace_dir, req.operators)
    return ProfileOut(operators, scheduler.profiler.last_trace)


def _profile_state(scheduler: Scheduler, req: ProfileStateReq) -> ProfileStateOut:
    return ProfileStateOut(scheduler.profiler.running, scheduler.profiler.last_trace)


def _load_lora(scheduler: Scheduler, req: LoadLoraReq) -> LoraAdaptersOut:
    return LoraAdaptersOut(scheduler.load_lora(req.lora_name, req.lora_path, req.folder))


def _unload_lora(scheduler: Scheduler, req: UnloadLoraReq) -> LoraAdaptersOut:
    return LoraAdaptersOut(scheduler.unload_lora(req.lora_name))


HANDLERS: dict[type, Callable[[Any, Any], Any]] = {
    StatsReq: _stats, FlushCacheReq: _flush, OpenSessionReq: _open_session, CloseSessionReq: _close_session,
    StartProfileReq: _start_profile, StopProfileReq: _stop_profile, ProfileStateReq: _profile_state,
    LoadLoraReq: _load_lora, UnloadLoraReq: _unload_lora, PauseReq: weights.pause,
    ContinueReq: weights.resume, UpdateWeightsReq: weights.update, WeightVersionReq: weights.weight_version,
    DestroyWeightGroupReq: weight_groups.destroy, WeightsByNameReq: weights.weights_by_name,
    ReleaseMemoryReq: occupation.release, ResumeMemoryReq: occupation.resume,
}


def answer(scheduler: Scheduler, msg: ControlReq) -> ControlOut:
    handler = HANDLERS.get(type(msg.body))
    if handler is None:
        return ControlOut(msg.id, error=f"unknown control call {type(msg.body).__name__}", status_code=400)
    try:
        return ControlOut(msg.id, body=handler(scheduler, msg.body))
    except RequestError as exc:
        return ControlOut(msg.id, error=str(exc), status_code=status_of(exc))
    except Exception as exc:
        logger.exception("control call %s failed", type(msg.body).__name__)
        return ControlOut(msg.id, error=str(exc) or repr(exc), status_code=500)
