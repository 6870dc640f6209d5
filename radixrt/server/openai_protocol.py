"""OpenAI-compatible request schemas (msgspec, unknown fields refused) and response/chunk assembly.

Requests map onto radixrt sampling params (SGLang's names); validation then runs the runtime's own checks.
Extensions accepted beside OpenAI's fields (as SGLang and vLLM do): top_k, min_p, repetition_penalty,
min_tokens, ignore_eos, skip_special_tokens, stop_token_ids, regex, json_schema.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec

from radixrt.scheduler.validation import RequestError
from radixrt.server.response_format import response_format_to_params

MAX_TOP_LOGPROBS = 20
ROLES = {"system", "user", "assistant", "developer", "tool"}


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Common(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
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
    regex: str | None = None
    json_schema: str | None = None


class ChatCompletionRequest(_Common, kw_only=True):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None


_UNSET = -(2**62)


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[Any]
    max_tokens: int | None = _UNSET  # OpenAI's default is 16; an explicit null means "up to the context"
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _out_of_int64(value: Any, path: str = "$") -> str | None:
    """The JSON path of the first integer outside the 64-bit range (the runtime's messages carry int64s)."""
    stack = [(value, path)]
    while stack:
        node, where = stack.pop()
        if isinstance(node, int) and not isinstance(node, bool):
            if not INT64_MIN <= node <= INT64_MAX:
                return where
        elif isinstance(node, list):
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(node))
        elif isinstance(node, dict):
            stack.extend((v, f"{where}.{k}") for k, v in node.items())
    return None


def decode_request(body: bytes, kind: type):
    if not body.strip():
        raise RequestError("the request body is empty; send a JSON object")
    try:
        raw = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise RequestError(f"malformed JSON: {exc}") from None
    where = _out_of_int64(raw)
    if where is not None:
        raise RequestError(f"invalid request: integer out of the 64-bit range - at `{where}`")
    try:
        return msgspec.convert(raw, type=kind)
    except msgspec.ValidationError as exc:
        raise RequestError(f"invalid request: {exc}") from None


def check_common(req: _Common) -> None:
    if req.stream_options is not None and not req.stream:
        raise RequestError("stream_options is only allowed when stream is true")
    if req.logit_bias:
        raise RequestError("logit_bias is not supported")


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


def sampling_dict(req: _Common, max_new_tokens: int) -> dict[str, Any]:
    """OpenAI fields -> radixrt sampling params (validated afterwards by SamplingParams / validate_request)."""
    out: dict[str, Any] = {"max_new_tokens": max_new_tokens, "n": req.n}
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens", "seed",
                 "regex", "json_schema"):
        value = getattr(req, name)
        if value is not None:
            out[name] = value
    if req.min_tokens is not None:
        out["min_new_tokens"] = req.min_tokens
    if req.response_format is not None:
        extra = response_format_to_params(req.response_format)
        if extra and (req.regex is not None or req.json_schema is not None):
            raise RequestError("pass response_format or regex/json_schema, not both")
        out.update(extra)
    return out


def chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Validate and flatten OpenAI messages (text content parts are joined) for the chat template."""
    if not messages:
        raise RequestError("messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if role not in ROLES:
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
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def finish_reason(meta: dict[str, Any]) -> tuple[str | None, Any]:
    reason = meta.get("finish_reason")
    if not reason:
        return None, None
    return reason.get("type"), reason.get("matched")


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def usage_of(states, n: int) -> dict[str, Any]:
    """Prompt (and cached) tokens once per prompt, as SGLang counts them; completion tokens of every sample."""
    metas = [s.builder.meta for s in states]
    firsts = metas[::n]
    return usage(sum(m.get("prompt_tokens", 0) for m in firsts),
                 sum(m.get("completion_tokens", 0) for m in metas),
                 sum(m.get("cached_tokens", 0) for m in firsts))


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


# ----- logprobs ---------------------------------------------------------------------------------------


def chat_logprobs(entries, top_entries, token_text) -> dict[str, Any]:
    content = []
    for k, (logprob, token_id, _) in enumerate(entries):
        text = token_text(token_id)
        item = {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8")), "top_logprobs": []}
        if top_entries is not None and k < len(top_entries):
            for lp, tid, _ in top_entries[k]:
                t = token_text(tid)
                item["top_logprobs"].append({"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))})
        content.append(item)
    return {"content": content}


def completion_logprobs(entries, top_entries, token_text, offset: int) -> dict[str, Any]:
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for k, (logprob, token_id, _) in enumerate(entries):
        text = token_text(token_id)
        tokens.append(text)
        token_logprobs.append(logprob)
        offsets.append(offset)
        offset += len(text)
        if top_entries is not None:
            row = top_entries[k] if k < len(top_entries) else []
            tops.append({token_text(tid): lp for lp, tid, _ in row})
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops if top_entries is not None else None,
            "text_offset": offsets}
