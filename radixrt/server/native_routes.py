"""SGLang's native API: POST /generate, GET /model_info and /get_model_info, GET /server_info and
/get_server_info, GET|POST /flush_cache, POST /abort_request, POST /open_session and /close_session (sessions:
radixrt.scheduler.sessions; /generate's ``session_params`` names one), GET|POST /start_profile and /stop_profile
(torch.profiler on the scheduler's thread: radixrt.scheduler.profiler; admin routes, since they write files).

/generate takes the Engine's arguments (radixrt.server.native_protocol.GenerateBody) through the runtime's
one request path (the client's ``prepare``, off the event loop) and answers the Engine's dict per request:
one dict for one prompt with n=1, else a list. A stream (one prompt, n=1) sends the whole dict so far at every
wake-up, then ``[DONE]``. SGLang's other GenerateReqInput fields are checked by ``sglang_compat.check``.

/server_info (and /get_server_info) and /model_info carry what SGLang's router reads when it registers a
worker: ``model_path``, ``served_model_name`` (the model id it lists) and, in /model_info, the checkpoint's
``model_type`` and ``architectures`` (radixrt.server.model_card). /get_model_info stays the Engine's
``get_model_info()``.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, AsyncIterator

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response

import radixrt
from radixrt import env
from radixrt.protocol.errors import RequestError
from radixrt.server import sglang_compat
from radixrt.server.client_wait import gather, wait_any
from radixrt.server.http_common import (
    SSE_DONE,
    AbortOnCloseStream,
    decode_request,
    failure_event,
    json_response,
    route,
    sse,
)
from radixrt.server.model_card import model_card
from radixrt.server.native_protocol import AbortBody, CloseSessionBody, GenerateBody, OpenSessionBody, StartProfileBody
from radixrt.client import Handle
from radixrt.protocol.messages import (
    CloseSessionReq,
    FlushCacheReq,
    OpenSessionReq,
    ProfileStateReq,
    StartProfileReq,
    StatsReq,
    StopProfileReq,
)
from radixrt.server.tokenizer_manager import TokenizerManager


PROFILE_POLL_SECONDS = 0.05  # how often a num_steps /start_profile asks whether its profile has ended


def add_native_routes(app: FastAPI, tm: TokenizerManager) -> None:
    route(app, "/generate", ["POST"], generate, tm)
    route(app, "/model_info", ["GET"], model_info, tm)
    route(app, "/get_model_info", ["GET"], get_model_info, tm)
    route(app, "/server_info", ["GET"], get_server_info, tm)
    route(app, "/get_server_info", ["GET"], get_server_info, tm)
    route(app, "/flush_cache", ["GET", "POST"], flush_cache, tm)
    route(app, "/abort_request", ["POST"], abort_request, tm)
    route(app, "/open_session", ["POST"], open_session, tm)
    route(app, "/close_session", ["POST"], close_session, tm)
    route(app, "/start_profile", ["GET", "POST"], start_profile, tm)
    route(app, "/stop_profile", ["GET", "POST"], stop_profile, tm)


async def generate(tm: TokenizerManager, request: Request) -> Response:
    body = decode_request(await request.body(), GenerateBody)
    sglang_compat.check(body, sglang_compat.GENERATE)
    prepared = await tm.off_loop(tm.prepare, body.generate_input())
    states = tm.submit(prepared)
    with_text = body.return_text_in_logprobs and body.return_logprob
    await gather(request, tm, states, body.stream)
    if body.stream:
        return AbortOnCloseStream(_stream(tm, states[0], with_text), lambda: tm.abort_unfinished(states))
    results = [_result(tm, s, with_text) for s in states]
    return json_response(results if prepared.batched or len(results) > 1 else results[0])


def _result(tm: TokenizerManager, state: Handle, with_text: bool) -> dict[str, Any]:
    """The Engine's dict; ``with_text``: every logprob entry carries its token's text."""
    out = state.builder.to_dict()
    if with_text:
        meta = out["meta_info"] = dict(out["meta_info"])
        for key in ("input_token_logprobs", "output_token_logprobs"):
            if key in meta:
                meta[key] = [[lp, t, tm.token_text(t)] for lp, t, _ in meta[key]]
        for key in ("input_top_logprobs", "output_top_logprobs", "input_token_ids_logprobs",
                    "output_token_ids_logprobs"):
            if key in meta:
                meta[key] = [[[lp, t, tm.token_text(t)] for lp, t, _ in row] for row in meta[key]]
    return out


async def _stream(tm: TokenizerManager, state: Handle, with_text: bool) -> AsyncIterator[bytes]:
    while True:
        failure = failure_event([state])
        if failure is not None:
            yield failure
            break
        yield sse(_result(tm, state, with_text))
        if state.finished:
            break
        await wait_any(None, [state])
    yield SSE_DONE


async def get_model_info(tm: TokenizerManager, request: Request) -> Response:
    return json_response(tm.model_info)


async def model_info(tm: TokenizerManager, request: Request) -> Response:
    return json_response({**tm.model_info, **model_card(tm.model_info["model_path"])})


async def get_server_info(tm: TokenizerManager, request: Request) -> Response:
    out = await tm.call(StatsReq())
    info = tm.model_info
    return json_response({
        "model_path": info["model_path"],
        "served_model_name": info["served_model_name"],
        "server_args": tm.args.public_dict(),
        "model_info": tm.model_info,
        "stats": msgspec.structs.asdict(out.stats),
        "requests_in_flight": tm.in_flight,
        "pids": {"server": os.getpid(), "scheduler": tm.ready.pid, "detokenizer": tm.detokenizer_ready.pid},
        "ipc_dir": tm.paths.folder,
        "version": radixrt.__version__,
    })


async def flush_cache(tm: TokenizerManager, request: Request) -> Response:
    if (await tm.call(FlushCacheReq())).ok:
        return Response("Cache flushed.\n", media_type="text/plain")
    raise RequestError("cache not flushed: requests are in flight; retry when the server is idle")


async def open_session(tm: TokenizerManager, request: Request) -> Response:
    """SGLang's /open_session: the session's id as a JSON string; 400 for an id already open."""
    body = decode_request(await request.body(), OpenSessionBody)
    out = await tm.call(OpenSessionReq(body.capacity_of_str_len, body.session_id))
    return json_response(out.session_id)


async def close_session(tm: TokenizerManager, request: Request) -> Response:
    """SGLang's /close_session: 200 with an empty body, whether or not the session was open (as SGLang)."""
    body = decode_request(await request.body(), CloseSessionBody)
    await tm.call(CloseSessionReq(body.session_id))
    return Response(status_code=200, media_type="text/plain")


async def start_profile(tm: TokenizerManager, request: Request) -> Response:
    """SGLang's /start_profile: torch.profiler from the scheduler's next step on, until /stop_profile or
    ``num_steps`` steps with a forward; 400 while a profile runs. As SGLang's, a ``num_steps`` profile is answered
    once it has ended and its trace is written (a 400 if the trace could not be)."""
    raw = await request.body()
    body = decode_request(raw, StartProfileBody) if raw.strip() else StartProfileBody()
    activities = body.activities if body.activities is not None else ["CPU", "GPU"]  # SGLang's default
    folder = (body.output_dir or env.get("RADIXRT_TORCH_PROFILER_DIR") or env.get("SGLANG_TORCH_PROFILER_DIR")
              or "/tmp")
    await tm.call(StartProfileReq(trace_dir=folder, num_steps=body.steps, record_shapes=bool(body.record_shapes),
                                  with_stack=bool(body.with_stack), profile_memory="MEM" in activities,
                                  cuda="GPU" in activities, prefix=body.profile_prefix or "radixrt"))
    if body.steps is None:
        return Response("Start profiling.\n", media_type="text/plain")
    while (state := await tm.call(ProfileStateReq())).running:
        await asyncio.sleep(PROFILE_POLL_SECONDS)
    if state.last_trace is None:
        raise RequestError(f"the profile ended, but its trace could not be written into {folder!r}")
    return Response(f"Start profiling.\nThe trace is in {state.last_trace}.\n", media_type="text/plain")


async def stop_profile(tm: TokenizerManager, request: Request) -> Response:
    """SGLang's /stop_profile: the trace is written where the start said; 400 when no profile runs (one started
    with ``num_steps`` stops by itself)."""
    out = await tm.call(StopProfileReq(operators=False), timeout=600.0)  # a long trace takes a while to write
    return Response(f"Stop profiling. The trace is in {out.trace_path}.\n", media_type="text/plain")


async def abort_request(tm: TokenizerManager, request: Request) -> Response:
    body = decode_request(await request.body(), AbortBody)
    if body.abort_all:
        return json_response({"success": True, "aborted": tm.abort_all()})
    if body.rid is None:
        raise RequestError("pass rid or abort_all")
    return json_response({"success": True, "aborted": int(tm.abort(body.rid))})
