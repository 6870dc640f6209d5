"""SGLang's /tokenize and /detokenize (also under /v1/, as vLLM serves them), with the server's tokenizer.

/tokenize takes ``prompt`` (a string or a list of strings; ``add_special_tokens``) or vLLM's chat
``messages`` (rendered by the chat template, ``add_generation_prompt``) and answers SGLang's shape:
``{"tokens", "count", "max_model_len"}``, a list of each for a list of prompts. /detokenize takes ``tokens`` (ids, or
a list of such lists; ``skip_special_tokens``) and answers ``{"text"}`` (a list for a list), plus vLLM's name for
the same, ``"prompt"``. Both check the model name like the OpenAI routes (404), the prompt's length like every
prompt (400) and token ids against the vocabulary (400); the work runs off the event loop.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from radixrt.protocol.errors import RequestError
from radixrt.server.http_common import decode_request, json_response, route
from radixrt.server.native_protocol import DetokenizeBody, TokenizeBody
from radixrt.server.openai_protocol import chat_messages
from radixrt.server.openai_routes import ServerTools, chat_prompt_ids, served_model
from radixrt.server.tokenizer_manager import TokenizerManager


def add_tokenize_routes(app: FastAPI, tm: TokenizerManager) -> None:
    tools = ServerTools.of(tm)
    for prefix in ("", "/v1"):
        route(app, f"{prefix}/tokenize", ["POST"], tokenize, tm, tools)
        route(app, f"{prefix}/detokenize", ["POST"], detokenize, tm)


async def tokenize(tm: TokenizerManager, tools: ServerTools, request: Request) -> Response:
    body = decode_request(await request.body(), TokenizeBody)
    served_model(tm, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise RequestError("pass exactly one of prompt and messages")
    if body.messages is not None:
        ids = await tm.off_loop(_chat_ids, tm, tools, body)
        return json_response({"tokens": ids, "count": len(ids), "max_model_len": tm.context_length})
    prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    for text in prompts:
        tm.client_limits.check_text(text)
    ids = await tm.off_loop(lambda: [tm.tokenizer.encode(t, add_special_tokens=body.add_special_tokens)
                                     for t in prompts])
    if isinstance(body.prompt, str):
        return json_response({"tokens": ids[0], "count": len(ids[0]), "max_model_len": tm.context_length})
    return json_response({"tokens": ids, "count": [len(one) for one in ids], "max_model_len": tm.context_length})


def _chat_ids(tm: TokenizerManager, tools: ServerTools, body: TokenizeBody) -> list[int]:
    """The prompt ids a chat completion of these messages (without tools) would have."""
    if len(body.messages) > tm.args.max_messages:
        raise RequestError(f"at most {tm.args.max_messages} messages are allowed in one request")
    messages = chat_messages(body.messages)
    tm.client_limits.check_chars(sum(len(m["content"]) for m in messages), "the messages")
    return chat_prompt_ids(tm, tools, messages, None, body.add_generation_prompt)


async def detokenize(tm: TokenizerManager, request: Request) -> Response:
    body = decode_request(await request.body(), DetokenizeBody)
    served_model(tm, body.model)
    lists = body.tokens and isinstance(body.tokens[0], list)
    sequences: list[Any] = body.tokens if lists else [body.tokens]
    for ids in sequences:
        if not isinstance(ids, list) or not all(type(t) is int for t in ids):
            raise RequestError("tokens must be a list of token ids or a list of such lists")
        bad = [t for t in ids if not 0 <= t < tm.vocab_size]
        if bad:
            raise RequestError(f"tokens {bad[:5]} are outside the vocabulary (size {tm.vocab_size})")
    texts = await tm.off_loop(lambda: [tm.tokenizer.decode(ids, skip_special_tokens=body.skip_special_tokens)
                                       for ids in sequences])
    text: str | list[str] = texts if lists else texts[0]
    return json_response({"text": text, "prompt": text})
