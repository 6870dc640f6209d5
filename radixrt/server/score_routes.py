"""Scoring and reranking routes: SGLang's /v1/score (on a generating model) and, on a model that reranks
(radixrt.rerank: a one-label classifier, or a generating model with a yes/no reranker template), SGLang's
/v1/rerank, vLLM's (Cohere's) /rerank and /v2/rerank, and vLLM's /score (text pairs; SGLang's /v1/score is the
label-token API above).

/v1/score answers ``{"object": "scoring", "model", "scores", "usage", "created"}``: per item, the label tokens'
probabilities (radixrt.scoring). /v1/rerank answers SGLang's list of ``{"score", "document", "index",
"meta_info"}``, best first; /rerank and /v2/rerank answer ``{"id", "model", "usage", "results": [{"index",
"document": {"text"}, "relevance_score"}]}``, best first; /score answers ``{"id", "object": "list", "created",
"model", "data": [{"index", "object": "score", "score"}], "usage"}``, in the pairs' order. Every item, document or
pair is one prefill-only request on the runtime's one request path.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from radixrt.protocol.request import GenerateInput
from radixrt.rerank import RerankCall, Reranker, ranked, score_pairs, served_reranker
from radixrt.scoring import ScoreCall, label_scores, score_input, usage
from radixrt.server import openai_protocol as oai
from radixrt.server.client_wait import gather
from radixrt.server.http_common import decode_request, json_response, route
from radixrt.server.openai_routes import served_model
from radixrt.server.tokenizer_manager import TokenizerManager


def add_score_routes(app: FastAPI, tm: TokenizerManager) -> None:
    if tm.model_info.get("is_generation", True):
        route(app, "/v1/score", ["POST"], score, tm)
    reranker = served_reranker(tm.model_info, tm.tokenizer)
    if reranker is not None:
        route(app, "/v1/rerank", ["POST"], rerank, tm, reranker)
        for path in ("/rerank", "/v2/rerank"):
            route(app, path, ["POST"], rerank_results, tm, reranker)
        route(app, "/score", ["POST"], score_pairs_route, tm, reranker)


async def _run(tm: TokenizerManager, request: Request, call: GenerateInput) -> list[dict[str, Any]]:
    states = tm.submit(await tm.off_loop(tm.prepare, call))
    await gather(request, tm, states, stream=False)
    return [s.builder.to_dict() for s in states]


async def score(tm: TokenizerManager, request: Request) -> Response:
    req = decode_request(await request.body(), oai.ScoreRequest)
    model, lora = served_model(tm, req.model)
    call = ScoreCall(req.query, req.items, req.label_token_ids, req.apply_softmax, req.item_first, lora)
    results = await _run(tm, request, score_input(call))
    return json_response({"object": "scoring", "model": model, "created": int(time.time()), "usage": usage(results),
                          "scores": [label_scores(r, req.label_token_ids, req.apply_softmax) for r in results]})


async def _ranked(tm: TokenizerManager, reranker: Reranker,
                  request: Request) -> tuple[str, list[dict[str, Any]], dict[str, int]]:
    req = decode_request(await request.body(), oai.RerankRequest)
    model, lora = served_model(tm, req.model)
    call = RerankCall(req.query, req.documents, req.instruct, req.top_n, req.return_documents)
    requests = await tm.off_loop(reranker.request, tm.tokenizer, call, lora)
    results = await _run(tm, request, requests)
    answer = ranked(call, [reranker.score(r) for r in results], [r["meta_info"] for r in results])
    return model, answer, usage(results)


async def rerank(tm: TokenizerManager, reranker: Reranker, request: Request) -> Response:
    """SGLang's /v1/rerank."""
    _, answer, _ = await _ranked(tm, reranker, request)
    return json_response(answer)


async def rerank_results(tm: TokenizerManager, reranker: Reranker, request: Request) -> Response:
    """vLLM's (Cohere's) /rerank and /v2/rerank."""
    model, answer, tokens = await _ranked(tm, reranker, request)
    results = [{"index": r["index"], "relevance_score": r["score"],
                "document": None if r["document"] is None else {"text": r["document"]}} for r in answer]
    return json_response({"id": f"rerank-{uuid.uuid4().hex}", "model": model, "results": results,
                          "usage": {k: tokens[k] for k in ("prompt_tokens", "total_tokens")}})


async def score_pairs_route(tm: TokenizerManager, reranker: Reranker, request: Request) -> Response:
    """vLLM's /score: each pair's relevance, in the pairs' order."""
    req = decode_request(await request.body(), oai.PairScoreRequest)
    model, lora = served_model(tm, req.model)
    pairs = score_pairs(req.text_1, req.text_2)
    results = await _run(tm, request, await tm.off_loop(reranker.pairs_request, tm.tokenizer, pairs, None, lora))
    data = [{"index": i, "object": "score", "score": reranker.score(r)} for i, r in enumerate(results)]
    tokens = usage(results)
    return json_response({"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                          "model": model, "data": data,
                          "usage": {k: tokens[k] for k in ("prompt_tokens", "total_tokens")}})
