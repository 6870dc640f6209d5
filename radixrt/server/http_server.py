"""The HTTP app: SGLang's native API and the OpenAI-compatible API over one TokenizerManager.

Native:  POST /generate, GET /get_model_info, GET /get_server_info, GET|POST /flush_cache, POST /abort_request,
         sessions, GET|POST /start_profile and /stop_profile (radixrt.server.native_routes); LoRA loads
         (radixrt.server.lora_routes); updates of weights, pauses, weight versions (radixrt.server.weights_routes);
         POST /tokenize,
         /detokenize, also under /v1/ (radixrt.server.tokenize_routes)
OpenAI:  POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /v1/models/{model}
         (radixrt.server.openai_routes); POST /v1/embeddings (radixrt.server.embedding_routes); a classifier's
         POST /classify and /v1/classify (radixrt.server.classify_routes)
Ops:     GET /health, GET /health_generate, GET /metrics (Prometheus text), GET /openapi.json
         (radixrt.server.ops_routes)

Errors are OpenAI-style JSON (``{"error": {"message", "type", "param", "code"}}``) with a 4xx code for bad
input, 500 when the runtime failed while serving that request (the others go on), 503 when the waiting queue
is full or the runtime is down (radixrt.server.http_common). Tokenizing, chat templating and decoding run off
the event loop (``tm.off_loop``); keys, body size and slow clients are handled in front of the app
(radixrt.server.security). A client that closes its connection before its answer is complete has its
requests aborted at once (client_wait; streams: AbortOnCloseStream).
"""

from __future__ import annotations

from typing import Callable

from fastapi import FastAPI

from radixrt.server.classify_routes import add_classify_routes
from radixrt.server.embedding_routes import add_embedding_routes
from radixrt.server.score_routes import add_score_routes
from radixrt.server.lora_routes import add_lora_routes
from radixrt.server.native_routes import add_native_routes
from radixrt.server.openai_routes import add_openai_routes
from radixrt.server.ops_routes import add_ops_routes
from radixrt.server.tokenize_routes import add_tokenize_routes
from radixrt.server.tokenizer_manager import TokenizerManager
from radixrt.server.weights_routes import add_weights_routes


def create_app(tm: TokenizerManager, health: Callable[[], str | None]) -> FastAPI:
    """``health()`` returns None when all processes are alive, else why not."""
    app = FastAPI(title="radixrt", docs_url=None, redoc_url=None, openapi_url=None)
    add_native_routes(app, tm)
    add_lora_routes(app, tm)
    add_weights_routes(app, tm)
    add_ops_routes(app, tm, health)
    add_openai_routes(app, tm)
    add_embedding_routes(app, tm)
    add_classify_routes(app, tm)
    add_score_routes(app, tm)
    add_tokenize_routes(app, tm)
    return app
