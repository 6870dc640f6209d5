"""SGLang's LoRA routes: POST /load_lora_adapter and /unload_lora_adapter (admin routes: a load reads files).

Both answer SGLang's shape, ``{"success", "error_message", "loaded_adapters": {name: path}}``: 200 when done,
else the error's status (400 an adapter that cannot be served or a server without ``--enable-lora``, 404 an
unknown name, 409 a name in use, an adapter in use, or ``--max-loaded-loras`` reached) with ``success`` false.
A hub id is fetched here first, on a thread of its own, so the scheduler reads local files only and no download
holds up its steps. It loads and unloads between steps (radixrt.scheduler.lora); the server's list of names,
which the OpenAI routes read, follows each answer.
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import Response

from radixrt.protocol.errors import RequestError, status_of
from radixrt.protocol.messages import LoadLoraReq, UnloadLoraReq
from radixrt.server.http_common import decode_request, json_response, route
from radixrt.server.native_protocol import LoadLoraBody, UnloadLoraBody
from radixrt.server.tokenizer_manager import TokenizerManager

LOAD_TIMEOUT_S = 120.0  # reading a fetched adapter's files and laying it out


def add_lora_routes(app: FastAPI, tm: TokenizerManager) -> None:
    route(app, "/load_lora_adapter", ["POST"], load_lora_adapter, tm)
    route(app, "/unload_lora_adapter", ["POST"], unload_lora_adapter, tm)


async def load_lora_adapter(tm: TokenizerManager, request: Request) -> Response:
    body = decode_request(await request.body(), LoadLoraBody)
    folder = None
    if tm.args.enable_lora:  # else the scheduler refuses the call: nothing to fetch
        try:  # a hub download, on a thread of its own: neither the event loop nor the scheduler waits for it
            folder = str(await asyncio.to_thread(_fetch, body.lora_path))
        except ValueError as exc:
            return json_response({"success": False, "error_message": str(exc), "loaded_adapters": tm.lora_adapters},
                                 400)
    return await _change(tm, LoadLoraReq(body.lora_name, body.lora_path, folder), LOAD_TIMEOUT_S)


def _fetch(path: str):
    from radixrt.model.weights import resolve_adapter_path

    return resolve_adapter_path(path)


async def unload_lora_adapter(tm: TokenizerManager, request: Request) -> Response:
    body = decode_request(await request.body(), UnloadLoraBody)
    return await _change(tm, UnloadLoraReq(body.lora_name), 30.0)


async def _change(tm: TokenizerManager, call: LoadLoraReq | UnloadLoraReq, timeout: float) -> Response:
    try:
        out = await tm.call(call, timeout=timeout)
    except RequestError as exc:
        return json_response({"success": False, "error_message": str(exc), "loaded_adapters": tm.lora_adapters},
                             status_of(exc))
    tm.lora_adapters = dict(out.loaded)
    return json_response({"success": True, "error_message": None, "loaded_adapters": tm.lora_adapters})
