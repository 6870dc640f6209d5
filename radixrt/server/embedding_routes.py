"""OpenAI's /v1/embeddings and SGLang's native /encode, from the served model.

Each input (a string, strings, token ids or lists of token ids) becomes one prefill-only request on the runtime's
one request path (``GenerateInput(embed=True)``, the scheduler client's ``prepare`` and ``submit``); the
scheduler answers with the prompt's pooled hidden state (radixrt.scheduler.embedding: the last token's final
hidden state, unit length). The answer is OpenAI's: ``{"object": "list", "data": [{"object": "embedding",
"index", "embedding"}], "model", "usage"}``, each embedding a list of floats, or with ``encoding_format`` "base64"
the base64 of its little-endian float32 bytes (what the ``openai`` client asks for by default); ``dimensions`` cuts
a Matryoshka model's vectors. /encode answers as ``Engine.encode`` does: ``{"embedding", "meta_info"}``, a list of
them for a batch of prompts.
"""

from __future__ import annotations

import base64
import struct
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from radixrt.client import Handle
from radixrt.protocol.request import GenerateInput, Prepared
from radixrt.server import openai_protocol as oai
from radixrt.server.client_wait import gather
from radixrt.server.http_common import decode_request, json_response, route
from radixrt.server.native_protocol import EncodeBody
from radixrt.server.openai_routes import prompt_ids, served_model
from radixrt.server.tokenizer_manager import TokenizerManager


def add_embedding_routes(app: FastAPI, tm: TokenizerManager) -> None:
    route(app, "/v1/embeddings", ["POST"], embeddings, tm)
    route(app, "/encode", ["POST", "PUT"], encode, tm)


async def embeddings(tm: TokenizerManager, request: Request) -> Response:
    req = decode_request(await request.body(), oai.EmbeddingRequest)
    model, lora = served_model(tm, req.model)
    prompts = oai.check_embedding(req)
    prepared = await tm.off_loop(prepare_inputs, tm, prompts, lora, req.dimensions)
    states = tm.submit(prepared)
    await gather(request, tm, states, stream=False)
    data = [{"object": "embedding", "index": i, "embedding": encode_vector(s.builder.embedding, req.encoding_format)}
            for i, s in enumerate(states)]
    tokens = prompt_tokens(states)
    return json_response({"object": "list", "data": data, "model": model,
                          "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def prepare_inputs(tm: TokenizerManager, prompts: list[str | list[int]], lora: str | None,
                   dimensions: int | None = None) -> Prepared:
    """Each input a prefill-only request (through the LoRA adapter ``model`` names, if it names one). Blocking (it
    tokenizes text): call it off the event loop."""
    return tm.prepare(GenerateInput(input_ids=prompt_ids(tm, prompts), embed=True, lora_path=lora,
                                    dimensions=dimensions))


def prompt_tokens(states: list[Handle]) -> int:
    """The prompt tokens of a call's requests (its usage)."""
    return sum(s.builder.meta.get("prompt_tokens", 0) for s in states)


async def encode(tm: TokenizerManager, request: Request) -> Response:
    """SGLang's native /encode: the Engine's ``encode`` over HTTP (a dict, or a list for a batch of prompts)."""
    body = decode_request(await request.body(), EncodeBody)
    prepared = await tm.off_loop(tm.prepare, body.generate_input())
    states = tm.submit(prepared)
    await gather(request, tm, states, stream=False)
    results = [s.builder.to_dict() for s in states]
    return json_response(results if prepared.batched else results[0])


def encode_vector(vector: list[float], encoding_format: str | None) -> Any:
    """A list of floats, or for "base64" the base64 text of the float32 little-endian bytes."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector
