"""Operations routes: GET /health, GET /health_generate, GET /metrics (Prometheus text), GET /openapi.json.

/health answers 503 while a helper process is down (``health()`` says why). /health_generate (SGLang's) also
runs a one-token generation (an embedding model: a one-token embedding) through the request path and the
scheduler, and answers 503 unless it finishes within HEALTH_GENERATE_TIMEOUT_S. /metrics answers even when the
scheduler does not (its part is then left out). /openapi.json is built once, on first request, from the
model's and the server's limits (radixrt.server.openapi).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response

import radixrt
from radixrt.server.http_common import encode_json, error_response, json_response, route
from radixrt.server.metrics import render
from radixrt.server.openapi import ApiLimits, build_openapi
from radixrt.protocol.errors import RequestFailed, RuntimeDown
from radixrt.protocol.messages import StatsReq
from radixrt.protocol.request import GenerateInput
from radixrt.rerank import served_reranker
from radixrt.server.client_wait import gather
from radixrt.server.tokenizer_manager import TokenizerManager


HEALTH_GENERATE_TIMEOUT_S = 20.0


def add_ops_routes(app: FastAPI, tm: TokenizerManager, health: Callable[[], str | None]) -> None:
    """``health()`` returns None when all processes are alive, else why not."""
    route(app, "/health", ["GET"], health_check, health)
    route(app, "/health_generate", ["GET"], health_generate, tm, health)
    route(app, "/openapi.json", ["GET"], openapi, tm, [])
    route(app, "/metrics", ["GET"], metrics, tm)


async def health_check(health: Callable[[], str | None], request: Request) -> Response:
    problem = health()
    if problem is not None:
        return error_response(f"unhealthy: {problem}", 503)
    return json_response({"status": "ok"})


async def health_generate(tm: TokenizerManager, health: Callable[[], str | None], request: Request) -> Response:
    """SGLang's /health_generate: a real one-token generation through the request path and the scheduler; 200
    when it finished in time, else 503 with why. While generation is paused (/pause_generation) no token can come:
    200 with ``paused`` once every process is alive; so while memory is released (``released``)."""
    problem = health()
    if problem is not None:
        return error_response(f"unhealthy: {problem}", 503)
    if tm.client.paused:
        return json_response({"status": "ok", "paused": True})
    if tm.client.released:  # memory given back (/release_memory_occupation): no token either
        return json_response({"status": "ok", "released": tm.client.released})
    first = tm.tokenizer.bos_token_id if tm.tokenizer.bos_token_id is not None else 0
    rid = f"HEALTH_CHECK_{uuid.uuid4().hex[:12]}"
    if tm.limits.generates:
        probe = GenerateInput(input_ids=[first], sampling_params={"max_new_tokens": 1, "temperature": 0}, rid=rid)
    else:  # an embedding model: one token's embedding
        probe = GenerateInput(input_ids=[first], embed=True, rid=rid)
    states = tm.submit(await tm.off_loop(tm.prepare, probe))
    try:
        await asyncio.wait_for(gather(request, tm, states, stream=False), HEALTH_GENERATE_TIMEOUT_S)
    except asyncio.TimeoutError:
        tm.abort_unfinished(states)
        return error_response(f"unhealthy: no token within {HEALTH_GENERATE_TIMEOUT_S:g} s", 503)
    except (RequestFailed, RuntimeDown) as exc:
        return error_response(f"unhealthy: {exc}", 503)
    return json_response({"status": "ok"})


async def openapi(tm: TokenizerManager, built: list[bytes], request: Request) -> Response:
    """``built``: this app's document once encoded (empty before the first request)."""
    if not built:
        limits = ApiLimits.of_server(tm.context_length, tm.vocab_size, getattr(tm, "client_limits", None),
                                     tuple(tm.served_names()), tm.args.max_messages, tm.limits,
                                     tm.model_info.get("classifier_labels") is not None,
                                     served_reranker(tm.model_info, tm.tokenizer) is not None)
        built.append(encode_json(build_openapi(limits, radixrt.__version__)))
    return Response(built[0], media_type="application/json")


async def metrics(tm: TokenizerManager, request: Request) -> Response:
    try:
        stats = await tm.call(StatsReq(), timeout=5.0)
    except RuntimeDown:
        stats = None
    text = render(tm.metrics, stats, tm.in_flight, tm.model_info["served_model_name"], tm.ready.page_size)
    return Response(text, media_type="text/plain; version=0.0.4")
