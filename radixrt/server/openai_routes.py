"""The OpenAI-compatible API: GET /v1/models, GET /v1/models/{model}, POST /v1/chat/completions, POST
/v1/completions (/v1/embeddings: radixrt.server.embedding_routes).

A call is decoded (radixrt.server.openai_protocol), checked without the tokenizer, then tokenized (the chat
template, or each text prompt) off the event loop and handed to the runtime's one request path,
``TokenizerManager.prepare`` (the scheduler client's, radixrt.protocol.request.prepare: sampling params, the server's limits, every
sequence validated), exactly as /generate is. ``n`` samples of each prompt become ``n`` requests; choice
``i`` is request ``i``. Answers and stream chunks are built by radixrt.server.openai_responses. Chat requests
with tools are planned by radixrt.server.openai_tools (prompt, constraint) and their answers parsed into calls; on
a server with ``--reasoning-parser`` a chat answer's reasoning block is split off and its constraint applies after
it (radixrt.server.openai_reasoning). ``chat_template_kwargs`` go to the chat template. ``model`` may name a
loaded LoRA adapter (``served_model``); /v1/models lists them beside the base model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import Response

from radixrt.client import Handle
from radixrt.protocol.errors import RequestError
from radixrt.protocol.request import GenerateInput, Prepared
from radixrt.protocol.validation import validate_kind
from radixrt.server import openai_protocol as oai
from radixrt.server.client_wait import gather, wait_any
from radixrt.server.http_common import (
    SSE_DONE,
    AbortOnCloseStream,
    ModelNotFound,
    decode_request,
    failure_event,
    json_response,
    route,
    sse,
)
from radixrt.reasoning import ReasoningFormat, reasoning_format
from radixrt.server.openai_reasoning import ReasoningPlan, constrain_after_reasoning, plan_reasoning, template_kwargs
from radixrt.server.openai_responses import OpenAIAnswer, StreamCursor, now
from radixrt.server.openai_tools import ToolPlan, plan_tools, template_messages, tool_format
from radixrt.server.tokenizer_manager import TokenizerManager
from radixrt.tokenizer import apply_chat_template
from radixrt.tools.formats import ToolCallFormat


PROMPT_TAIL_TOKENS = 8  # the prompt's last tokens, decoded, tell whether it opens a reasoning block


@dataclass(frozen=True)
class ServerTools:
    """How this server calls tools: its format, whether the template renders tools, whether calls are
    constrained."""

    fmt: ToolCallFormat
    native: bool
    constrained: bool

    @classmethod
    def of(cls, tm: TokenizerManager) -> "ServerTools":
        fmt, native = tool_format(tm.args.tool_call_parser, getattr(tm.tokenizer, "chat_template", None))
        return cls(fmt, native, not tm.args.disable_tool_call_constraints)


def add_openai_routes(app: FastAPI, tm: TokenizerManager) -> None:
    route(app, "/v1/models", ["GET"], models, tm)
    route(app, "/v1/models/{model:path}", ["GET"], retrieve_model, tm)
    reasoning = reasoning_format(tm.args.reasoning_parser) if tm.args.reasoning_parser else None
    route(app, "/v1/chat/completions", ["POST"], chat_completions, tm, ServerTools.of(tm), reasoning)
    route(app, "/v1/completions", ["POST"], completions, tm)


def served_model(tm: TokenizerManager, name: str | None, lora_path: str | None = None) -> tuple[str, str | None]:
    """(the name answers carry, the LoRA adapter the request runs through). A request names the base model by any
    of the names the server knows it by; an adapter by its name (vLLM's way), as ``BASE:ADAPTER`` (SGLang's), or
    in ``lora_path``; the answers carry the name the request gave."""
    base = tm.model_info["served_model_name"]
    adapter = None
    if name is not None and name not in tm.served_names():
        head, _, tail = name.rpartition(":")
        if name in tm.lora_adapters:
            adapter = name
        elif head in tm.served_names() and tail in tm.lora_adapters:
            adapter = tail
        else:
            adapters = "".join(f", `{a}`" for a in tm.lora_adapters)
            raise ModelNotFound(f"The model `{name}` does not exist; this server serves `{base}`{adapters}")
    if lora_path is not None and adapter is not None and lora_path != adapter:
        raise RequestError(f"model `{name}` and lora_path `{lora_path}` name two LoRA adapters")
    return (name if adapter is not None else base), adapter or lora_path


def model_card(tm: TokenizerManager) -> dict[str, Any]:
    """OpenAI's model object of the served model (with vLLM's ``root`` and ``max_model_len``)."""
    info = tm.model_info
    return {"id": info["served_model_name"], "object": "model", "created": now(), "owned_by": "radixrt",
            "root": info["model_path"], "max_model_len": info["context_length"]}


def adapter_card(tm: TokenizerManager, name: str) -> dict[str, Any]:
    """A loaded LoRA adapter as vLLM lists it: its own model object, ``parent`` the base model."""
    return {**model_card(tm), "id": name, "root": tm.lora_adapters[name], "parent": tm.model_info["served_model_name"]}


async def models(tm: TokenizerManager, request: Request) -> Response:
    return json_response({"object": "list", "data": [model_card(tm), *(adapter_card(tm, a) for a in tm.lora_adapters)]})


async def retrieve_model(tm: TokenizerManager, request: Request) -> Response:
    """OpenAI's GET /v1/models/{model}: the model object by any name the server knows it by (an adapter's too),
    else 404."""
    name, adapter = served_model(tm, request.path_params["model"])
    return json_response(model_card(tm) if adapter is None else adapter_card(tm, adapter))


async def chat_completions(tm: TokenizerManager, tools: ServerTools, reasoning: ReasoningFormat | None,
                           request: Request) -> Response:
    req = decode_request(await request.body(), oai.ChatCompletionRequest)
    validate_kind(False, None, tm.limits)  # an embedding model: refused before its template is looked for
    model, lora = served_model(tm, req.model, req.lora_path)
    messages = oai.check_chat(req, tm.args.max_messages, tm.args.max_tools, tm.client_limits)
    prepared, plan, thinking = await tm.off_loop(_prepare_chat, tm, tools, reasoning, req, messages, lora)
    states = tm.submit(prepared)
    answer = OpenAIAnswer(chat=True, model=model, n=req.n, want_logprobs=req.logprobs, token_text=tm.token_text,
                          include_usage=_include_usage(req), tool_format=plan.fmt if plan is not None else None,
                          reasoning=thinking)
    return await _respond(request, tm, states, answer, req.stream)


async def completions(tm: TokenizerManager, request: Request) -> Response:
    req = decode_request(await request.body(), oai.CompletionRequest)
    model, lora = served_model(tm, req.model, req.lora_path)
    prompts = oai.check_completion(req)
    prepared = await tm.off_loop(_prepare_completion, tm, req, prompts, lora)
    states = tm.submit(prepared)
    echo = [await tm.off_loop(tm.tokenizer.decode, one) if req.echo else "" for one in prepared.ids
            for _ in range(req.n)]
    answer = OpenAIAnswer(chat=False, model=model, n=req.n, want_logprobs=req.logprobs is not None,
                          token_text=tm.token_text, echo=echo, echo_logprobs=req.echo and req.logprobs is not None,
                          include_usage=_include_usage(req))
    return await _respond(request, tm, states, answer, req.stream)


def _include_usage(req: oai.ChatCompletionRequest | oai.CompletionRequest) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


# ----- to the request path (run off the event loop) ---------------------------------------------------


def _prepare_chat(tm: TokenizerManager, tools: ServerTools, reasoning: ReasoningFormat | None,
                  req: oai.ChatCompletionRequest, messages: list[dict[str, Any]], lora: str | None
                  ) -> tuple[Prepared, ToolPlan | None, ReasoningPlan | None]:
    plan = plan_tools(req, tools.fmt, tools.native, tools.constrained)
    ids = chat_prompt_ids(tm, tools, messages, plan, template_kwargs=template_kwargs(req.chat_template_kwargs))
    thinking = plan_reasoning(reasoning, req, tm.tokenizer.decode(ids[-PROMPT_TAIL_TOKENS:]))
    max_new = oai.chat_max_new_tokens(req)
    if max_new is None:
        max_new = tm.max_new_tokens_default(len(ids))
    top = (req.top_logprobs or 0) if req.logprobs else 0
    sampling = oai.sampling_dict(req, max_new)
    if plan is not None:
        sampling.update(plan.sampling_fields(req.skip_special_tokens))
    constrain_after_reasoning(sampling, thinking)
    prepared = tm.prepare(GenerateInput(input_ids=[ids], sampling_params=[sampling], return_logprob=bool(req.logprobs),
                                        top_logprobs_num=top, priority=req.priority,
                                        session_params=req.session_params, rid=req.rids(), lora_path=lora,
                                    extra_key=req.extra_key, cache_salt=req.cache_salt))
    return prepared, plan, thinking


def chat_prompt_ids(tm: TokenizerManager, tools: ServerTools, messages: list[dict[str, Any]], plan: ToolPlan | None,
                    add_generation_prompt: bool = True, template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """A chat's prompt: the messages (tool calls and results as the template takes them) through the chat
    template, with the request's template variables. Run off the event loop."""
    messages = template_messages(messages, plan, tools.fmt, tools.native)
    try:
        return apply_chat_template(tm.tokenizer, messages, add_generation_prompt=add_generation_prompt,
                                   tools=plan.template_tools() if plan is not None else None,
                                   template_kwargs=template_kwargs)
    except Exception as exc:  # template errors (e.g. roles out of order) are the client's
        raise RequestError(f"cannot apply the chat template: {exc}") from None


def prompt_ids(tm: TokenizerManager, prompts: list[str | list[int]]) -> list[list[int]]:
    """Each prompt as token ids: text within the server's limits is encoded, ids pass as they are."""
    ids = []
    for prompt in prompts:
        if isinstance(prompt, str):
            tm.client_limits.check_text(prompt)
            prompt = tm.tokenizer.encode(prompt)
        ids.append(prompt)
    return ids


def _prepare_completion(tm: TokenizerManager, req: oai.CompletionRequest, prompts: list[str | list[int]],
                        lora: str | None) -> Prepared:
    ids = prompt_ids(tm, prompts)
    max_new = oai.completion_max_new_tokens(req)
    sampling = [oai.sampling_dict(req, tm.max_new_tokens_default(len(one)) if max_new is None else max_new)
                for one in ids]
    # echo with logprobs: the prompt's logprobs too (scoring a text, as evaluation harnesses do)
    return tm.prepare(GenerateInput(input_ids=ids, sampling_params=sampling, return_logprob=req.logprobs is not None,
                                    logprob_start_len=0 if req.echo and req.logprobs is not None else None,
                                    top_logprobs_num=req.logprobs or 0, priority=req.priority,
                                    session_params=req.session_params, rid=req.rids(), lora_path=lora,
                                    extra_key=req.extra_key, cache_salt=req.cache_salt))


# ----- answers ----------------------------------------------------------------------------------------


async def _respond(request: Request, tm: TokenizerManager, states: list[Handle], answer: OpenAIAnswer,
                   stream: bool) -> Response:
    await gather(request, tm, states, stream)
    if not stream:
        return json_response(answer.body(states))
    return AbortOnCloseStream(_events(answer, states), lambda: tm.abort_unfinished(states))


async def _events(answer: OpenAIAnswer, states: list[Handle]) -> AsyncIterator[bytes]:
    """A stream's events: the opening chunk, one chunk per wake-up with what is new, then usage and [DONE]."""
    cursors = [StreamCursor() for _ in states]
    opening = answer.opening_chunk(len(states))
    if opening is not None:
        yield sse(opening)
    while True:
        failure = failure_event(states)
        if failure is not None:
            yield failure
            yield SSE_DONE
            return
        choices = [c for i, s in enumerate(states) if (c := answer.choice(i, s, cursors[i])) is not None]
        if choices:
            yield sse(answer.chunk(choices))
        if all(c.done for c in cursors):
            break
        await wait_any(None, states)
    if answer.include_usage:
        yield sse(answer.usage_chunk(states))
    yield SSE_DONE
