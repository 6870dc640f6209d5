"""The HTTP app: SGLang's native API and the OpenAI-compatible API over one TokenizerManager.

Native:  POST /generate, GET /get_model_info, GET /get_server_info, GET|POST /flush_cache, POST /abort_request
OpenAI:  POST /v1/completions, POST /v1/chat/completions, GET /v1/models
Ops:     GET /health, GET /metrics (Prometheus text), GET /openapi.json (radixrt.server.openapi)

Errors are OpenAI-style JSON (``{"error": {"message", "type", "param", "code"}}``) with a 4xx code for bad
input, 500 when the runtime failed while serving that request (the others go on), 503 when the waiting queue
is full or the runtime is down. Tokenizing, chat templating and decoding run off the event loop
(``tm.off_loop``); keys, body size and slow clients are handled in front of the app (radixrt.server.security). A client that closes its connection
before its answer is complete has its requests aborted at once (client_wait; streams: AbortOnCloseStream).
"""

from __future__ import annotations

import logging
import os
from typing import Any, AsyncIterator, Awaitable, Callable

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from radixrt.scheduler.validation import RequestError
from radixrt.server import openai_protocol as oai
from radixrt.server.client_wait import ClientGone, gather, wait_any
from radixrt.server.metrics import render
from radixrt.server.native_protocol import AbortBody, GenerateBody
from radixrt.server.openapi import ApiLimits, build_openapi
from radixrt.server.tokenizer_manager import Overloaded, ReqState, RequestFailed, ServerDown, TokenizerManager
from radixrt.tokenizer import apply_chat_template

logger = logging.getLogger("radixrt.http")
_json = msgspec.json.Encoder()


class ModelNotFound(RequestError):
    pass


def json_response(content: Any, status: int = 200) -> Response:
    return Response(_json.encode(content), status_code=status, media_type="application/json")


def error_body(message: str, status: int) -> dict[str, Any]:
    kind = {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError"}.get(status, "ServerError")
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def error_response(message: str, status: int = 400) -> Response:
    return json_response(error_body(message, status), status)


def sse(data: Any) -> bytes:
    return b"data: " + _json.encode(data) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class AbortOnCloseStream(StreamingResponse):
    """A server-sent-events response that aborts its unfinished requests however it ends (client gone)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def create_app(tm: TokenizerManager, health: Callable[[], str | None]) -> FastAPI:
    """``health()`` returns None when all processes are alive, else why not."""
    app = FastAPI(title="radixrt", docs_url=None, redoc_url=None, openapi_url=None)

    def handle(fn: Callable[..., Awaitable[Response]]):
        async def wrapper(request: Request) -> Response:
            try:
                return await fn(request)
            except ModelNotFound as exc:
                return error_response(str(exc), 404)
            except RequestError as exc:
                return error_response(str(exc), 400)
            except Overloaded as exc:
                return error_response(str(exc), 503)
            except ServerDown as exc:
                return error_response(f"the runtime is unavailable: {exc}", 503)
            except RequestFailed as exc:
                return error_response(str(exc), 500)
            except ClientGone:
                return Response(status_code=499)
            except Exception as exc:  # keep serving everyone else
                logger.exception("request failed")
                return error_response(f"internal error: {exc!r}", 500)

        wrapper.__name__ = fn.__name__
        return wrapper

    def route(path: str, methods: list[str]):
        def register(fn):
            app.add_api_route(path, handle(fn), methods=methods)
            return fn

        return register

    def check_model(name: str | None) -> str:
        if name is not None and name not in tm.served_names():
            raise ModelNotFound(f"The model `{name}` does not exist; this server serves "
                                f"`{tm.model_info['served_model_name']}`")
        return tm.model_info["served_model_name"]

    # ----- native API ---------------------------------------------------------------------------------

    @route("/generate", ["POST"])
    async def generate(request: Request) -> Response:
        body = oai.decode_request(await request.body(), GenerateBody)
        ids, params, batched = await tm.off_loop(tm.prepare, body.text, body.sampling_dicts(), body.input_ids,
                                                 body.return_logprob, body.logprob_start_len, body.top_logprobs_num)
        rids = None if body.rid is None else ([body.rid] if isinstance(body.rid, str) else body.rid)
        if body.stream and (batched or sum(p.n for p in params) != 1):
            raise RequestError("stream=True takes one prompt with n=1")
        states = tm.submit_all(ids, params, body.return_logprob, body.logprob_start_len, body.top_logprobs_num,
                               rids)
        with_text = body.return_text_in_logprobs

        def result(state: ReqState) -> dict:
            out = state.builder.to_dict()
            if with_text and body.return_logprob:
                meta = out["meta_info"] = dict(out["meta_info"])
                for key in ("input_token_logprobs", "output_token_logprobs"):
                    if key in meta:
                        meta[key] = [[lp, t, tm.token_text(t)] for lp, t, _ in meta[key]]
                for key in ("input_top_logprobs", "output_top_logprobs"):
                    if key in meta:
                        meta[key] = [[[lp, t, tm.token_text(t)] for lp, t, _ in row] for row in meta[key]]
            return out

        await gather(request, tm, states, body.stream)
        if body.stream:
            state = states[0]

            async def chunks() -> AsyncIterator[bytes]:
                while True:
                    if state.error is not None and state.error != "aborted":
                        yield sse(error_body(state.error, 503))
                        break
                    if state.server_error() is not None:
                        yield sse(error_body(state.server_error(), 500))
                        break
                    yield sse(result(state))
                    if state.finished:
                        break
                    await wait_any(None, states)
                yield SSE_DONE

            return AbortOnCloseStream(chunks(), lambda: tm.abort_unfinished(states))

        results = [result(s) for s in states]
        return json_response(results if batched or len(results) > 1 else results[0])

    @route("/get_model_info", ["GET"])
    async def get_model_info(request: Request) -> Response:
        return json_response(tm.model_info)

    @route("/get_server_info", ["GET"])
    async def get_server_info(request: Request) -> Response:
        out = await tm.stats()
        return json_response({
            "server_args": tm.args.public_dict(),
            "model_info": tm.model_info,
            "stats": tm.stats_dict(out),
            "requests_in_flight": len(tm.states),
            "pids": {"server": os.getpid(), "scheduler": tm.ready.pid, "detokenizer": tm.detokenizer_ready.pid},
            "ipc_dir": tm.paths.folder,
            "version": __import__("radixrt").__version__,
        })

    @route("/flush_cache", ["GET", "POST"])
    async def flush_cache(request: Request) -> Response:
        if await tm.flush_cache():
            return Response("Cache flushed.\n", media_type="text/plain")
        raise RequestError("cache not flushed: requests are in flight; retry when the server is idle")

    @route("/abort_request", ["POST"])
    async def abort_request(request: Request) -> Response:
        body = oai.decode_request(await request.body(), AbortBody)
        if body.abort_all:
            return json_response({"success": True, "aborted": tm.abort_all()})
        if body.rid is None:
            raise RequestError("pass rid or abort_all")
        return json_response({"success": True, "aborted": int(tm.abort(body.rid))})

    # ----- ops ----------------------------------------------------------------------------------------

    @route("/health", ["GET"])
    async def health_check(request: Request) -> Response:
        problem = health()
        if problem is not None:
            return error_response(f"unhealthy: {problem}", 503)
        return json_response({"status": "ok"})

    openapi_doc: list[bytes] = []

    @route("/openapi.json", ["GET"])
    async def openapi(request: Request) -> Response:
        if not openapi_doc:
            limits = ApiLimits.of_server(tm.context_length, tm.vocab_size, getattr(tm, "client_limits", None))
            openapi_doc.append(_json.encode(build_openapi(limits, __import__("radixrt").__version__)))
        return Response(openapi_doc[0], media_type="application/json")

    @route("/metrics", ["GET"])
    async def metrics(request: Request) -> Response:
        try:
            stats = await tm.stats(timeout=5.0)
        except ServerDown:
            stats = None
        return Response(render(tm.metrics, stats, len(tm.states)), media_type="text/plain; version=0.0.4")

    # ----- OpenAI API ---------------------------------------------------------------------------------

    @route("/v1/models", ["GET"])
    async def models(request: Request) -> Response:
        info = tm.model_info
        return json_response({"object": "list", "data": [{
            "id": info["served_model_name"], "object": "model", "created": oai.now(), "owned_by": "radixrt",
            "root": info["model_path"], "max_model_len": info["context_length"]}]})

    @route("/v1/chat/completions", ["POST"])
    async def chat_completions(request: Request) -> Response:
        req = oai.decode_request(await request.body(), oai.ChatCompletionRequest)
        model = check_model(req.model)
        oai.check_common(req)
        oai.check_chat_limits(req, tm.args.max_messages, tm.args.max_tools, tm.client_limits)
        if req.tools or req.tool_choice not in (None, "none"):
            raise RequestError("tools are not supported")
        if req.top_logprobs is not None:
            if not 0 <= req.top_logprobs <= oai.MAX_TOP_LOGPROBS:
                raise RequestError(f"top_logprobs must be in [0, {oai.MAX_TOP_LOGPROBS}]")
            if not req.logprobs:
                raise RequestError("top_logprobs requires logprobs to be true")
        messages = oai.chat_messages(req.messages)
        try:
            ids = await tm.off_loop(apply_chat_template, tm.tokenizer, messages)
        except Exception as exc:  # template errors (e.g. roles out of order) are the client's
            raise RequestError(f"cannot apply the chat template: {exc}") from None
        if req.max_tokens is not None and req.max_completion_tokens is not None:
            raise RequestError("pass max_tokens or max_completion_tokens, not both")
        max_new = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_new is None:
            max_new = tm.max_new_tokens_default(len(ids))
        params = tm.params_from_dict(oai.sampling_dict(req, max_new))
        tm.validate(ids, params)
        top = (req.top_logprobs or 0) if req.logprobs else 0
        states = tm.submit_all([ids], [params], bool(req.logprobs), None, top)
        return await _respond(request, req, states, model, chat=True, n=req.n)

    @route("/v1/completions", ["POST"])
    async def completions(request: Request) -> Response:
        req = oai.decode_request(await request.body(), oai.CompletionRequest)
        model = check_model(req.model)
        oai.check_common(req)
        if req.suffix:
            raise RequestError("suffix is not supported")
        if req.best_of is not None and req.best_of != req.n:
            raise RequestError("best_of must equal n (or be omitted)")
        if req.logprobs is not None and not 0 <= req.logprobs <= oai.MAX_TOP_LOGPROBS:
            raise RequestError(f"logprobs must be in [0, {oai.MAX_TOP_LOGPROBS}]")
        if req.echo and req.logprobs is not None:
            raise RequestError("echo together with logprobs is not supported")
        prompt = req.prompt
        if isinstance(prompt, str):
            prompts = [prompt]
        elif prompt and all(isinstance(p, str) for p in prompt):
            prompts = list(prompt)
        elif prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            prompts = [list(prompt)]
        elif prompt and all(isinstance(p, list) for p in prompt):
            prompts = [list(p) for p in prompt]
        else:
            raise RequestError("prompt must be a string, a list of strings, a list of token ids or a list of such "
                               "lists, and not empty")
        ids = []
        for p in prompts:
            if isinstance(p, str):
                tm.client_limits.check_text(p)
                ids.append(await tm.off_loop(tm.encode, p))
            else:
                if not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                    raise RequestError("token id prompts must hold integers only")
                ids.append(p)
        param_list = []
        for one in ids:
            max_new = req.max_tokens
            if max_new == oai._UNSET:
                max_new = 16
            elif max_new is None:
                max_new = tm.max_new_tokens_default(len(one))
            params = tm.params_from_dict(oai.sampling_dict(req, max_new))
            tm.validate(one, params)
            param_list.append(params)
        top = req.logprobs or 0
        states = tm.submit_all(ids, param_list, req.logprobs is not None, None, top)
        echo = [await tm.off_loop(tm.tokenizer.decode, one) if req.echo else "" for one in ids for _ in range(req.n)]
        return await _respond(request, req, states, model, chat=False, n=req.n, echo=echo)

    async def _respond(request: Request, req, states: list[ReqState], model: str, chat: bool, n: int,
                       echo: list[str] | None = None) -> Response:
        rid = oai.new_id("chatcmpl" if chat else "cmpl")
        created = oai.now()
        obj = "chat.completion" if chat else "text_completion"
        want_logprobs = (req.logprobs if chat else req.logprobs is not None)

        def logprobs_of(state: ReqState, start: int, end: int | None, offset: int = 0):
            if not want_logprobs:
                return None
            meta = state.builder.meta
            entries = meta.get("output_token_logprobs", [])[start:end]
            tops = meta.get("output_top_logprobs")
            tops = tops[start:end] if tops is not None else None
            if chat:
                return oai.chat_logprobs(entries, tops, tm.token_text)
            return oai.completion_logprobs(entries, tops, tm.token_text, offset)

        await gather(request, tm, states, req.stream)
        if not req.stream:
            choices = []
            for i, s in enumerate(states):
                reason, matched = oai.finish_reason(s.builder.meta)
                choice: dict[str, Any] = {"index": i}
                if chat:
                    choice["message"] = {"role": "assistant", "content": s.builder.text}
                else:
                    choice["text"] = (echo[i] if echo else "") + s.builder.text
                choice["logprobs"] = logprobs_of(s, 0, None)
                choice["finish_reason"] = reason
                choice["matched_stop"] = matched
                choices.append(choice)
            return json_response({"id": rid, "object": obj, "created": created, "model": model,
                                  "choices": choices, "usage": oai.usage_of(states, n)})

        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices: list[dict]) -> bytes:
            data = {"id": rid, "object": chunk_obj, "created": created, "model": model, "choices": choices}
            if include_usage:
                data["usage"] = None
            return sse(data)

        async def events() -> AsyncIterator[bytes]:
            sent_text = [0] * len(states)
            sent_lp = [0] * len(states)
            done = [False] * len(states)
            if chat:
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for i in range(len(states))])
            elif echo and any(echo):
                yield chunk([{"index": i, "text": echo[i], "logprobs": None, "finish_reason": None}
                             for i in range(len(states))])
            while True:
                for s in states:
                    if s.error is not None and s.error != "aborted":
                        yield sse(error_body(s.error, 503))
                        yield SSE_DONE
                        return
                    if s.server_error() is not None:
                        yield sse(error_body(s.server_error(), 500))
                        yield SSE_DONE
                        return
                out = []
                for i, s in enumerate(states):
                    if done[i]:
                        continue
                    text = s.builder.text[sent_text[i]:]
                    n_lp = len(s.builder.meta.get("output_token_logprobs", []))
                    reason, matched = oai.finish_reason(s.builder.meta)
                    if not text and n_lp == sent_lp[i] and reason is None:
                        continue
                    choice: dict[str, Any] = {"index": i}
                    if chat:
                        choice["delta"] = {"content": text} if text else {}
                    else:
                        choice["text"] = text
                    choice["logprobs"] = logprobs_of(s, sent_lp[i], n_lp, sent_text[i])
                    choice["finish_reason"] = reason
                    if reason is not None:
                        choice["matched_stop"] = matched
                        done[i] = True
                    sent_text[i] += len(text)
                    sent_lp[i] = n_lp
                    out.append(choice)
                if out:
                    yield chunk(out)
                if all(done):
                    break
                await wait_any(None, states)
            if include_usage:
                yield sse({"id": rid, "object": chunk_obj, "created": created, "model": model, "choices": [],
                           "usage": oai.usage_of(states, n)})
            yield SSE_DONE

        return AbortOnCloseStream(events(), lambda: tm.abort_unfinished(states))

    return app
