"""OpenAI-compatible request schemas (msgspec, unknown fields refused) and the checks that need no tokenizer.

``check_chat`` and ``check_completion`` refuse what the runtime does not serve (suffix, ...) and
return the messages or prompts to tokenize; ``sampling_dict`` maps a request onto radixrt sampling params
(SGLang's names), which then go through the runtime's own request path (radixrt.protocol.request.prepare).
Extensions accepted beside OpenAI's fields (as SGLang and vLLM do): top_k, min_p, repetition_penalty,
min_tokens, ignore_eos, skip_special_tokens, stop_token_ids, stop_regex, regex, json_schema, ebnf, rid (SGLang: the request id,
one per sequence); on chat, SGLang's separate_reasoning, stream_reasoning and chat_template_kwargs. SGLang's other extensions are declared from ``sglang_compat.OPENAI`` and checked by
``check_common`` (ignored, or refused unless they ask for nothing).
Responses are built in radixrt.server.openai_responses. ``EmbeddingRequest`` is /v1/embeddings' body.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from radixrt.sampling.compat_fields import struct_fields
from radixrt.protocol.errors import RequestError
from radixrt.protocol.request import MAX_KEY_CHARS
from radixrt.server import sglang_compat
from radixrt.server.response_format import response_format_to_params

Key = Annotated[str, msgspec.Meta(max_length=MAX_KEY_CHARS)]  # an adapter's name, a cache isolation key

MAX_TOP_LOGPROBS = 20
ROLES = {"system", "user", "assistant", "developer", "tool"}


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


_SGLangExtras = msgspec.defstruct("_SGLangExtras", struct_fields(sglang_compat.OPENAI), forbid_unknown_fields=True,
                                  kw_only=True, module=__name__)


class _Common(_SGLangExtras, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: dict | None = None
    # extensions (SGLang / vLLM)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None  # SGLang's: a match ends the output there (checked by SamplingParams)
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None  # SGLang's: a grammar the output follows (radixrt.constrained.ebnf)
    rid: str | list[str] | None = None
    priority: int | None = None  # SGLang's request priority (checked by radixrt.protocol.request.prepare)
    session_params: dict | None = None  # SGLang's session of the request (checked by radixrt.protocol.request.prepare)
    lora_path: Key | None = None  # SGLang's: a loaded LoRA adapter's name (``model`` may name one too)
    extra_key: Key | None = None  # SGLang's: cached prefixes are shared only with requests of the same key
    cache_salt: Key | None = None  # vLLM's, the same way

    def rids(self) -> list[str] | None:
        return None if self.rid is None else ([self.rid] if isinstance(self.rid, str) else list(self.rid))


class ChatCompletionRequest(_Common, kw_only=True):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    # reasoning models (SGLang's; radixrt.server.openai_reasoning)
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


_UNSET = -(2**62)


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[Any]
    max_tokens: int | None = _UNSET  # OpenAI's default is 16; an explicit null means "up to the context"
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


MAX_EMBEDDING_INPUTS = 2048  # OpenAI's bound on the inputs of one embeddings call


class EmbeddingRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """OpenAI's /v1/embeddings: ``input`` is a string, strings, token ids or lists of token ids."""

    input: str | list[Any]
    model: str | None = None
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = None  # a Matryoshka model's embedding cut to this length (protocol.validation)
    user: str | None = None


class ClassifyRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM's /v1/classify: ``input`` is a string, strings, token ids or lists of token ids."""

    input: str | list[Any]
    model: str | None = None
    user: str | None = None


class ScoreRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """SGLang's /v1/score: the probabilities of ``label_token_ids`` after the query and each item
    (radixrt.scoring)."""

    query: str | list[int]
    items: str | list[Any]
    label_token_ids: list[int]
    apply_softmax: bool = False
    item_first: bool = False
    model: str | None = None


class RerankRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """SGLang's /v1/rerank, and vLLM's (Cohere's) /rerank and /v2/rerank (radixrt.rerank)."""

    query: str
    documents: list[str]
    instruct: str | None = None
    top_n: int | None = None
    return_documents: bool = True
    model: str | None = None


class PairScoreRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM's /score: the relevance of text pairs (radixrt.rerank.score_pairs)."""

    text_1: str | list[str]
    text_2: str | list[str]
    model: str | None = None


def check_classify(req: ClassifyRequest) -> list[str | list[int]]:
    """The inputs of a classify call, as prompts (text or token ids)."""
    prompts = completion_prompts(req.input)
    if len(prompts) > MAX_EMBEDDING_INPUTS:
        raise RequestError(f"at most {MAX_EMBEDDING_INPUTS} inputs are allowed in one classify request")
    return prompts


def check_embedding(req: EmbeddingRequest) -> list[str | list[int]]:
    """The inputs of an embeddings call, as prompts (text or token ids)."""
    prompts = completion_prompts(req.input)
    if len(prompts) > MAX_EMBEDDING_INPUTS:
        raise RequestError(f"at most {MAX_EMBEDDING_INPUTS} inputs are allowed in one embeddings request")
    return prompts


def check_common(req: _Common) -> None:
    sglang_compat.check(req, sglang_compat.OPENAI)
    if req.stream_options is not None and not req.stream:
        raise RequestError("stream_options is only allowed when stream is true")


def check_chat_limits(req: ChatCompletionRequest, max_messages: int, max_tools: int, limits: Any) -> None:
    """The server's bounds on a chat request, checked before the chat template runs."""
    if len(req.messages) > max_messages:
        raise RequestError(f"at most {max_messages} messages are allowed in one request")
    if req.tools is not None and len(req.tools) > max_tools:
        raise RequestError(f"at most {max_tools} tools are allowed in one request")
    chars = 0
    for m in req.messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            chars += sum(len(p.get("text") or "") for p in content if isinstance(p, dict)
                         and isinstance(p.get("text"), str))
    limits.check_chars(chars, "the messages")


def check_chat(req: ChatCompletionRequest, max_messages: int, max_tools: int, limits: Any) -> list[dict[str, Any]]:
    """Everything about a chat request that needs no tokenizer; returns the messages for the chat template."""
    check_common(req)
    check_chat_limits(req, max_messages, max_tools, limits)
    if req.top_logprobs is not None:
        if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            raise RequestError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]")
        if not req.logprobs:
            raise RequestError("top_logprobs requires logprobs to be true")
    return chat_messages(req.messages)


def chat_max_new_tokens(req: ChatCompletionRequest) -> int | None:
    """The output budget a chat request asks for; None: up to the context."""
    if req.max_tokens is not None and req.max_completion_tokens is not None:
        raise RequestError("pass max_tokens or max_completion_tokens, not both")
    return req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens


def check_completion(req: CompletionRequest) -> list[str | list[int]]:
    """Everything about a completion request that needs no tokenizer; returns its prompts (text or token ids)."""
    check_common(req)
    if req.suffix:
        raise RequestError("suffix is not supported")
    if req.best_of is not None and req.best_of != req.n:
        raise RequestError("best_of must equal n (or be omitted)")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
        raise RequestError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}]")
    return completion_prompts(req.prompt)


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def completion_prompts(prompt: str | list[Any]) -> list[str | list[int]]:
    """OpenAI's four prompt shapes (a string, strings, token ids, lists of token ids) as a list of prompts."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if prompt and all(_is_token_id(t) for t in prompt):
        return [list(prompt)]
    if prompt and all(isinstance(p, list) for p in prompt):
        if not all(_is_token_id(t) for p in prompt for t in p):
            raise RequestError("token id prompts must hold integers only")
        return [list(p) for p in prompt]
    raise RequestError("prompt must be a string, a list of strings, a list of token ids or a list of such lists, "
                       "and not empty")


def completion_max_new_tokens(req: CompletionRequest) -> int | None:
    """The output budget a completion request asks for: OpenAI's default is 16; None: up to the context."""
    return 16 if req.max_tokens == _UNSET else req.max_tokens


def sampling_dict(req: _Common, max_new_tokens: int) -> dict[str, Any]:
    """OpenAI fields -> radixrt sampling params (validated afterwards by SamplingParams / validate_request)."""
    out: dict[str, Any] = {"max_new_tokens": max_new_tokens, "n": req.n}
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "stop", "stop_token_ids", "stop_regex", "logit_bias", "ignore_eos",
                 "skip_special_tokens", "seed",
                 "regex", "json_schema", "ebnf"):
        value = getattr(req, name)
        if value is not None:
            out[name] = value
    if req.min_tokens is not None:
        out["min_new_tokens"] = req.min_tokens
    if req.response_format is not None:
        extra = response_format_to_params(req.response_format)
        if extra and (req.regex is not None or req.json_schema is not None or req.ebnf is not None):
            raise RequestError("pass response_format or regex/json_schema/ebnf, not both")
        out.update(extra)
    return out


def chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Validate and flatten OpenAI messages (text content parts are joined) for the chat template. An assistant
    message keeps its ``tool_calls`` and a tool result its ``tool_call_id`` and ``name``, for
    radixrt.server.openai_tools (which checks them)."""
    if not messages:
        raise RequestError("messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:  # an object is no role (and cannot be hashed)
            raise RequestError(f"messages[{i}].role must be one of {sorted(ROLES)}, got {role!r}")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise RequestError(f"messages[{i}].content: only text parts are supported")
                parts.append(part["text"])
            content = "".join(parts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise RequestError(f"messages[{i}].content must be a string or a list of text parts")
        if m.get("name") is not None and not isinstance(m["name"], str):
            raise RequestError(f"messages[{i}].name must be a string")
        message: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content}
        for key in _TOOL_KEYS.get(role, ()):
            if m.get(key) is not None:
                message[key] = m[key]
        out.append(message)
    return out


_TOOL_KEYS = {"assistant": ("tool_calls",), "tool": ("tool_call_id", "name")}
