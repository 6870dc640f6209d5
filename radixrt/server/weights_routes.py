"""SGLang's routes for reinforcement-learning loops (admin routes): POST /update_weights_from_disk,
/init_weights_update_group, /update_weights_from_distributed, /destroy_weights_update_group, /pause_generation,
/continue_generation, /update_weight_version, /get_weights_by_name, /release_memory_occupation and
/resume_memory_occupation (GET too), GET /get_weight_version; vLLM's POST /pause (query ``mode`` abort, wait or keep;
``wait_for_inflight_requests``, ``clear_cache``), POST /resume, GET /is_paused, POST /sleep (query ``level`` 1 or 2),
POST /wake_up (query ``tags``, repeated) and GET /is_sleeping.

The scheduler serves them between steps (radixrt.scheduler.weights): an update waits for the requests in flight and
holds new ones meanwhile, so its call may take as long as they do (no timeout here). A hub id or a GGUF file is
resolved to a local folder first, on a thread of its own, so the scheduler reads local files only. Answers are
SGLang's: ``{"success", "message", "num_paused_requests"}`` for an update (200, or the error's status with
``success`` false: the served weights stay; ``{"success", "message"}`` for the weight group's calls),
``{"message", "status": "ok"}`` for a pause or a continue,
``{"weight_version"}`` and ``{"success", "message", "new_version"}`` for the version, ``{"success", "message",
"released"}`` for memory released or resumed (radixrt.scheduler.occupation; 409 while requests hold KV pages),
vLLM's empty 200 for /sleep and /wake_up.
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import Response

from radixrt.protocol.errors import RequestError, status_of
from radixrt.protocol.messages import (
    Broadcast,
    ContinueReq,
    DestroyWeightGroupReq,
    InitWeightGroupReq,
    PauseReq,
    ReleaseMemoryReq,
    ResumeMemoryReq,
    UpdateWeightsReq,
    WeightsByNameReq,
    WeightVersionReq,
    sleep_release,
)
from radixrt.server.http_common import decode_request, json_response, route
from radixrt.server.native_protocol import (
    ContinueBody,
    DestroyWeightsGroupBody,
    InitWeightsGroupBody,
    MemoryTagsBody,
    PauseBody,
    UpdateDistributedBody,
    UpdateWeightsBody,
    WeightsByNameBody,
    WeightVersionBody,
)
from radixrt.server.tokenizer_manager import TokenizerManager


def add_weights_routes(app: FastAPI, tm: TokenizerManager) -> None:
    route(app, "/update_weights_from_disk", ["POST"], update_weights_from_disk, tm)
    route(app, "/init_weights_update_group", ["POST"], init_weights_update_group, tm)
    route(app, "/update_weights_from_distributed", ["POST"], update_weights_from_distributed, tm)
    route(app, "/destroy_weights_update_group", ["POST"], destroy_weights_update_group, tm)
    route(app, "/pause_generation", ["POST"], pause_generation, tm)
    route(app, "/continue_generation", ["POST"], continue_generation, tm)
    route(app, "/pause", ["POST"], vllm_pause, tm)
    route(app, "/resume", ["POST"], vllm_resume, tm)
    route(app, "/is_paused", ["GET"], vllm_is_paused, tm)
    route(app, "/get_weight_version", ["GET"], get_weight_version, tm)
    route(app, "/get_weights_by_name", ["GET", "POST"], get_weights_by_name, tm)
    route(app, "/update_weight_version", ["POST"], update_weight_version, tm)
    route(app, "/release_memory_occupation", ["GET", "POST"], release_memory_occupation, tm)
    route(app, "/resume_memory_occupation", ["GET", "POST"], resume_memory_occupation, tm)
    route(app, "/sleep", ["POST"], vllm_sleep, tm)
    route(app, "/wake_up", ["POST"], vllm_wake_up, tm)
    route(app, "/is_sleeping", ["GET"], vllm_is_sleeping, tm)


async def update_weights_from_disk(tm: TokenizerManager, request: Request) -> Response:
    from radixrt.model.weights import ModelNotFoundError, resolve_update_path

    body = decode_request(await request.body(), UpdateWeightsBody)
    try:
        refusal = body.refusal()
        if refusal is not None:
            raise RequestError(refusal)
        folder = await asyncio.to_thread(resolve_update_path, body.model_path)
        out = await tm.call(UpdateWeightsReq(str(folder), body.abort_all_requests, body.weight_version,
                                             body.flush_cache), timeout=None)
    except (RequestError, ModelNotFoundError) as exc:
        return json_response({"success": False, "message": f"weights not updated: {exc}", "num_paused_requests": 0},
                             status_of(exc) if isinstance(exc, RequestError) else 400)
    return json_response({"success": True, "message": out.message, "num_paused_requests": 0})


async def init_weights_update_group(tm: TokenizerManager, request: Request) -> Response:
    body = decode_request(await request.body(), InitWeightsGroupBody)
    req = InitWeightGroupReq(body.master_address, body.master_port, body.rank_offset, body.world_size,
                             body.group_name, body.backend)
    return await _success(tm, req, "")  # answered once every rank has joined


async def update_weights_from_distributed(tm: TokenizerManager, request: Request) -> Response:
    body = decode_request(await request.body(), UpdateDistributedBody)
    req = UpdateWeightsReq(None, body.abort_all_requests, body.weight_version, body.flush_cache,
                           broadcast=Broadcast(body.names, body.dtypes, body.shapes, body.group_name))
    return await _success(tm, req, "weights not updated: ")


async def destroy_weights_update_group(tm: TokenizerManager, request: Request) -> Response:
    raw = await request.body()
    body = decode_request(raw, DestroyWeightsGroupBody) if raw.strip() else DestroyWeightsGroupBody()
    return await _success(tm, DestroyWeightGroupReq(body.group_name), "")


async def _success(tm: TokenizerManager, req, failed: str) -> Response:
    """SGLang's ``{"success", "message"}``: 200, or the error's status with ``success`` false."""
    try:
        out = await tm.call(req, timeout=None)
    except RequestError as exc:
        return json_response({"success": False, "message": f"{failed}{exc}"}, status_of(exc))
    return json_response({"success": True, "message": out.message})


async def pause_generation(tm: TokenizerManager, request: Request) -> Response:
    raw = await request.body()
    body = decode_request(raw, PauseBody) if raw.strip() else PauseBody()
    await tm.call(PauseReq(body.mode))
    return json_response({"message": "Generation paused successfully.", "status": "ok"})


async def continue_generation(tm: TokenizerManager, request: Request) -> Response:
    raw = await request.body()
    if raw.strip():
        decode_request(raw, ContinueBody)
    await tm.call(ContinueReq())
    return json_response({"message": "Generation continued successfully.", "status": "ok"})


VLLM_PAUSE_MODES = {"abort": "abort", "wait": "wait", "keep": "in_place"}


def _query_flag(request: Request, name: str, default: bool) -> bool:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if raw.lower() not in ("true", "false", "1", "0"):
        raise RequestError(f"{name}={raw!r}: true or false")
    return raw.lower() in ("true", "1")


async def vllm_pause(tm: TokenizerManager, request: Request) -> Response:
    """vLLM's: ``abort`` (the default) ends the requests in flight, ``wait`` lets them finish first (the answer
    comes then), ``keep`` freezes them; ``clear_cache`` (default true) then drops the prefix cache, but for
    ``keep``."""
    mode = request.query_params.get("mode", "abort")
    if mode not in VLLM_PAUSE_MODES:
        raise RequestError(f"mode={mode!r}: abort, wait or keep")
    if _query_flag(request, "wait_for_inflight_requests", False):
        mode = "wait"  # vLLM's older spelling
    clear = _query_flag(request, "clear_cache", True) and mode != "keep"
    await tm.call(PauseReq(VLLM_PAUSE_MODES[mode], clear), timeout=None)
    return json_response({"status": "paused"})


async def vllm_resume(tm: TokenizerManager, request: Request) -> Response:
    await tm.call(ContinueReq())
    return json_response({"status": "resumed"})


async def vllm_is_paused(tm: TokenizerManager, request: Request) -> Response:
    return json_response({"is_paused": bool(tm.client.paused)})


async def get_weight_version(tm: TokenizerManager, request: Request) -> Response:
    out = await tm.call(WeightVersionReq())
    return json_response({"weight_version": out.weight_version})


async def update_weight_version(tm: TokenizerManager, request: Request) -> Response:
    body = decode_request(await request.body(), WeightVersionBody)
    out = await tm.call(WeightVersionReq(body.new_version, body.abort_all_requests))
    return json_response({"success": True, "message": f"Weight version updated to {out.weight_version}",
                          "new_version": out.weight_version})


async def get_weights_by_name(tm: TokenizerManager, request: Request) -> Response:
    body = decode_request(await request.body(), WeightsByNameBody)
    out = await tm.call(WeightsByNameReq(body.name, body.truncate_size))
    return json_response(out.values)


async def _memory_call(tm: TokenizerManager, req: ReleaseMemoryReq | ResumeMemoryReq, done: str) -> Response:
    out = await tm.call(req, timeout=None)  # a resume may read the checkpoint again
    return json_response({"success": True, "message": done, "released": out.released})


async def release_memory_occupation(tm: TokenizerManager, request: Request) -> Response:
    raw = await request.body()
    body = decode_request(raw, MemoryTagsBody) if raw.strip() else MemoryTagsBody()
    return await _memory_call(tm, ReleaseMemoryReq(body.tags), "Memory released.")


async def resume_memory_occupation(tm: TokenizerManager, request: Request) -> Response:
    raw = await request.body()
    body = decode_request(raw, MemoryTagsBody) if raw.strip() else MemoryTagsBody()
    return await _memory_call(tm, ResumeMemoryReq(body.tags), "Memory resumed.")


async def vllm_sleep(tm: TokenizerManager, request: Request) -> Response:
    raw = request.query_params.get("level", "1")
    if raw not in ("1", "2"):
        raise RequestError(f"level={raw!r}: 1 (the KV cache) or 2 (the weights too)")
    await tm.call(sleep_release(int(raw)), timeout=None)
    return Response(status_code=200)


async def vllm_wake_up(tm: TokenizerManager, request: Request) -> Response:
    tags = request.query_params.getlist("tags")
    await tm.call(ResumeMemoryReq(tags or None), timeout=None)
    return Response(status_code=200)


async def vllm_is_sleeping(tm: TokenizerManager, request: Request) -> Response:
    return json_response({"is_sleeping": bool(tm.client.released)})
