"""SGLang's LoRA routes: POST /load_lora_adapter and /unload_lora_adapter (admin routes: a load reads files).

Both answer SGLang's shape, ``{"success", "error_message", "loaded_adapters": {name: path}}``: 200 when done,
else the error's status (400 an adapter that cannot be served or a server without ``--enable-lora``, 404 an
unknown name, 409 a name in use, an adapter in use, or ``--max-loaded-loras`` reached) with ``success`` false.
The scheduler loads and unloads between steps (radixrt.scheduler.lora); the server's list of names, which the
OpenAI routes read, follows each answer.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response

from radixrt.protocol.errors import RequestError, status_of
from radixrt.protocol.messages import LoadLoraReq, UnloadLoraReq
from radixrt.server.http_common import decode_request, json_response, route
from radixrt.server.native_protocol import LoadLoraBody, UnloadLoraBody
from radixrt.server.tokenizer_manager import TokenizerManager

LOAD_TIMEOUT_S = 600.0  # an adapter from the hub is downloaded first


def add_lora_routes(app: FastAPI, tm: TokenizerManager) -> None:
    route(app, "/load_lora_adapter", ["POST"], load_lora_adapter, tm)
    route(app, "/unload_lora_adapter", ["POST"], unload_lora_adapter, tm)


async def load_lora_adapter(tm: TokenizerManager, request: Request) -> Response:
    body = decode_request(await request.body(), LoadLoraBody)
    return await _change(tm, LoadLoraReq(body.lora_name, body.lora_path), LOAD_TIMEOUT_S)


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
