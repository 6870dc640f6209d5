"""A classifier's or reward model's routes (served only when the model is one: ``*ForSequenceClassification``).

SGLang's native /classify answers as /encode does (``{"embedding": scores, "meta_info"}``, a list for a batch): the
score head's output at each prompt's last token, unnormalized (a reward model's one score). /v1/classify is
vLLM's (and SGLang's) classification API: each input's ``probs`` (the softmax of its scores; a one-label model's
sigmoid), the likeliest ``label`` (the config's ``id2label``) and ``num_classes``. Every input is a prefill-only
request on the runtime's one request path, as an embedding request is.
"""

from __future__ import annotations

import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import Response

from radixrt.scoring import sigmoid, softmax
from radixrt.server import openai_protocol as oai
from radixrt.server.client_wait import gather
from radixrt.server.embedding_routes import encode, prepare_inputs, prompt_tokens
from radixrt.server.http_common import decode_request, json_response, route
from radixrt.server.openai_routes import served_model
from radixrt.server.tokenizer_manager import TokenizerManager


def add_classify_routes(app: FastAPI, tm: TokenizerManager) -> None:
    if tm.model_info.get("classifier_labels") is None:
        return
    route(app, "/classify", ["POST", "PUT"], encode, tm)
    route(app, "/v1/classify", ["POST"], classify, tm)


def probabilities(scores: list[float]) -> list[float]:
    """vLLM's activation of a classifier's scores: a softmax over several labels, a sigmoid over one."""
    return [sigmoid(scores[0])] if len(scores) == 1 else softmax(scores)


async def classify(tm: TokenizerManager, request: Request) -> Response:
    req = decode_request(await request.body(), oai.ClassifyRequest)
    model, lora = served_model(tm, req.model)
    prompts = oai.check_classify(req)
    states = tm.submit(await tm.off_loop(prepare_inputs, tm, prompts, lora))
    await gather(request, tm, states, stream=False)
    labels = tm.model_info["classifier_labels"]
    data = []
    for i, state in enumerate(states):
        probs = probabilities(state.builder.embedding)
        best = max(range(len(probs)), key=probs.__getitem__)
        data.append({"index": i, "label": labels[best], "probs": probs, "num_classes": len(probs)})
    tokens = prompt_tokens(states)
    return json_response({"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                          "model": model, "data": data,
                          "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                                    "prompt_tokens_details": None}})
