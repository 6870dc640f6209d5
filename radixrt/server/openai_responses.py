"""OpenAI response bodies from the runtime's per-request state: choices, logprobs, usage and stream chunks.

One call's answer is one ``OpenAIAnswer``. Its ``choice`` builds a choice for both forms: the whole choice
of a JSON answer, or, given a ``StreamCursor``, the delta of a stream since the previous chunk (None when
nothing is new). Choice ``i`` is request ``i`` (prompt ``i // n``, sample ``i % n``). Usage counts prompt
(and cached) tokens once per prompt, as SGLang does, and completion tokens of every sample. Nothing here
waits or does I/O: the routes (radixrt.server.openai_routes) drive it. A chat answer with tools, or from a server
with a reasoning parser, parses its text (radixrt.server.openai_parsed): the reasoning block becomes
``reasoning_content``, calls become ``message.tool_calls``; a stream sends reasoning deltas, each call's id and
name first, then argument fragments, and holds back text that may still turn out to be a call.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from radixrt.client import Handle
from radixrt.server.openai_parsed import ParsedStream, parsed_message
from radixrt.server.openai_reasoning import ReasoningPlan
from radixrt.tools.formats import ToolCallFormat


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def finish_reason(meta: dict[str, Any]) -> tuple[str | None, Any]:
    """(OpenAI's finish_reason, the matched stop) of a request's meta info; (None, None) while it runs."""
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


def usage_of(states: list[Handle], n: int) -> dict[str, Any]:
    """Prompt (and cached) tokens once per prompt, as SGLang counts them; completion tokens of every sample."""
    metas = [s.builder.meta for s in states]
    firsts = metas[::n]
    return usage(sum(m.get("prompt_tokens", 0) for m in firsts),
                 sum(m.get("completion_tokens", 0) for m in metas),
                 sum(m.get("cached_tokens", 0) for m in firsts))


# ----- logprobs ---------------------------------------------------------------------------------------


def chat_logprobs(entries, top_entries, token_text: Callable[[int], str]) -> dict[str, Any]:
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


def completion_logprobs(entries, top_entries, token_text: Callable[[int], str], offset: int) -> dict[str, Any]:
    """``offset``: where the first token's text starts in the choice's text."""
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
    return {"tokens": tokens, "token_logprobs": token_logprobs,
            "top_logprobs": tops if top_entries is not None else None, "text_offset": offsets}


# ----- one call's answer ------------------------------------------------------------------------------


@dataclass
class StreamCursor:
    """How much of one request a stream has sent: text characters, logprob entries, and whether it ended; for a
    chat answer parsed into reasoning and tool calls, its parsers (radixrt.server.openai_parsed)."""

    text: int = 0
    logprobs: int = 0
    prompt_logprobs_sent: bool = False  # completions with echo and logprobs: the prompt's went with a chunk
    done: bool = False
    parsed: ParsedStream | None = None


def tool_finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's "tool_calls" for an answer that ended (not cut by its length) with calls."""
    return "tool_calls" if called and reason == "stop" else reason


@dataclass
class OpenAIAnswer:
    """The answer to one /v1/chat/completions (``chat``) or /v1/completions call over its requests."""

    chat: bool
    model: str
    n: int  # samples per prompt
    want_logprobs: bool
    token_text: Callable[[int], str]
    echo: list[str] | None = None  # completions: the prompt text of each choice, sent before its output
    echo_logprobs: bool = False  # completions with echo and logprobs: the prompt's tokens lead the logprobs
    include_usage: bool = False  # streams: every chunk has "usage", and a last chunk carries it
    tool_format: ToolCallFormat | None = None  # chat with tools: the output is parsed into calls
    reasoning: ReasoningPlan | None = None  # chat on a reasoning model: the reasoning block apart
    id: str = field(init=False)
    created: int = field(init=False)

    def __post_init__(self) -> None:
        self.id = new_id("chatcmpl" if self.chat else "cmpl")
        self.created = now()

    def body(self, states: list[Handle]) -> dict[str, Any]:
        """The JSON answer once every request finished."""
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model,
                "choices": [self.choice(i, s) for i, s in enumerate(states)], "usage": usage_of(states, self.n)}

    def choice(self, index: int, state: Handle, cursor: StreamCursor | None = None) -> dict[str, Any] | None:
        """Choice ``index`` whole (no cursor), or what a stream has not sent yet (None: nothing new, or the
        choice ended). A stream's choice has a delta instead of a message and ``matched_stop`` only with its
        finish reason; the cursor moves past what it returns."""
        stream = cursor is not None
        if stream and cursor.done:
            return None
        if self.chat and (self.tool_format is not None or self.reasoning is not None):
            return self._parsed_choice(index, state, cursor)
        start = cursor or StreamCursor()
        meta = state.builder.meta
        text = state.builder.text[start.text:]
        n_logprobs = len(meta.get("output_token_logprobs", []))
        reason, matched = finish_reason(meta)
        if stream and not text and n_logprobs == start.logprobs and reason is None:
            return None
        out: dict[str, Any] = {"index": index}
        if self.chat and stream:
            out["delta"] = {"content": text} if text else {}
        elif self.chat:
            out["message"] = {"role": "assistant", "content": text}
        else:
            out["text"] = text if stream or not self.echo else self.echo[index] + text
        out["logprobs"] = self._logprobs(meta, start.logprobs, n_logprobs, start.text, index, cursor)
        out["finish_reason"] = reason
        if not stream or reason is not None:
            out["matched_stop"] = matched
        if stream:
            cursor.text += len(text)
            cursor.logprobs = n_logprobs
            cursor.done = reason is not None
        return out

    def _parsed_choice(self, index: int, state: Handle, cursor: StreamCursor | None) -> dict[str, Any] | None:
        """``choice`` of a chat answer parsed into reasoning, content and tool calls."""
        meta = state.builder.meta
        reason, matched = finish_reason(meta)
        n_logprobs = len(meta.get("output_token_logprobs", []))
        if cursor is None:
            message, called = parsed_message(state.builder.text, self.reasoning, self.tool_format)
            return {"index": index, "message": message, "logprobs": self._logprobs(meta, 0, n_logprobs, 0),
                    "finish_reason": tool_finish_reason(reason, called), "matched_stop": matched}
        if cursor.parsed is None:
            cursor.parsed = ParsedStream(self.reasoning, self.tool_format)
        text = state.builder.text[cursor.text:]
        delta = cursor.parsed.delta(text, finished=reason is not None)
        if not delta and n_logprobs == cursor.logprobs and reason is None:
            cursor.text += len(text)
            return None
        out: dict[str, Any] = {"index": index, "delta": delta,
                               "logprobs": self._logprobs(meta, cursor.logprobs, n_logprobs, cursor.text),
                               "finish_reason": tool_finish_reason(reason, cursor.parsed.called)}
        if reason is not None:
            out["matched_stop"] = matched
        cursor.text += len(text)
        cursor.logprobs = n_logprobs
        cursor.done = reason is not None
        return out

    def _logprobs(self, meta: dict[str, Any], start: int, end: int, text_offset: int, index: int = 0,
                  cursor: StreamCursor | None = None) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None
        entries = meta.get("output_token_logprobs", [])[start:end]
        tops = meta.get("output_top_logprobs")
        tops = tops[start:end] if tops is not None else None
        if self.chat:
            return chat_logprobs(entries, tops, self.token_text)
        if self.echo_logprobs and not (cursor is not None and cursor.prompt_logprobs_sent):
            # the echoed prompt's tokens first (the first has no logprob), their offsets from the echo's start
            prompt = meta.get("input_token_logprobs", [])
            if prompt:
                entries = prompt + entries
                if tops is not None:
                    tops = (meta.get("input_top_logprobs") or [[]] * len(prompt)) + tops
                if cursor is not None:
                    cursor.prompt_logprobs_sent = True
                return completion_logprobs(entries, tops, self.token_text, 0)
        offset = text_offset + (len(self.echo[index]) if self.echo_logprobs else 0)
        return completion_logprobs(entries, tops, self.token_text, offset)

    # ----- streams ------------------------------------------------------------------------------------

    def chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        data = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices}
        if self.include_usage:
            data["usage"] = None
        return data

    def opening_chunk(self, count: int) -> dict[str, Any] | None:
        """A stream's first chunk, before any output: the assistant role (chat) or the echoed prompts."""
        if self.chat:
            return self.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None} for i in range(count)])
        if self.echo and any(self.echo):
            return self.chunk([{"index": i, "text": self.echo[i], "logprobs": None, "finish_reason": None}
                               for i in range(count)])
        return None

    def usage_chunk(self, states: list[Handle]) -> dict[str, Any]:
        """The last chunk of a stream that asked for usage."""
        return {**self.chunk([]), "usage": usage_of(states, self.n)}
