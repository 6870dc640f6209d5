"""A chat answer's text parsed into its parts: the reasoning block (``reasoning_content``), the content, and the
tool calls, whole (``parsed_message``) or as a stream's deltas (``ParsedStream``).

The reasoning parser (radixrt.reasoning) reads the text first; what it gives as the answer goes on to the tool-call
parser (radixrt.tools), so one answer can hold both. Both parsers read characters, so a stream's deltas fold to
the whole answer however the text arrived. A stream sends reasoning as it comes, or (``stream_reasoning`` false,
SGLang's) in one delta once the block ends; it holds back content that may still become a call, and trailing
whitespace until more content or the end (the layout around calls is not content).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from radixrt.reasoning import ReasoningStreamParser, split_reasoning
from radixrt.server.openai_reasoning import ReasoningPlan
from radixrt.tools.formats import ToolCallFormat
from radixrt.tools.parser import ToolCall, ToolCallDelta, ToolCallStreamParser, parse_tool_calls


def tool_call_json(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def tool_call_delta_json(delta: ToolCallDelta) -> dict[str, Any]:
    """A stream's piece of a call: its id, type and name first, then argument fragments."""
    out: dict[str, Any] = {"index": delta.index}
    function: dict[str, Any] = {"arguments": delta.arguments}
    if delta.id is not None:
        out["id"] = delta.id
        out["type"] = "function"
    if delta.name is not None:
        function["name"] = delta.name
    out["function"] = function
    return out


def parsed_message(text: str, reasoning: ReasoningPlan | None, tools: ToolCallFormat | None
                   ) -> tuple[dict[str, Any], bool]:
    """(the assistant message of a whole answer, whether it holds tool calls)."""
    message: dict[str, Any] = {"role": "assistant"}
    content: str | None = text
    if reasoning is not None and reasoning.separate:
        thought, content = split_reasoning(reasoning.fmt, text, reasoning.in_reasoning)
        message["reasoning_content"] = thought
    calls: list[ToolCall] = []
    if tools is not None:
        content, calls = parse_tool_calls(tools, content)
        if calls:
            content = content.rstrip() or None  # the layout around calls is not content
    message["content"] = content
    if calls:
        message["tool_calls"] = [tool_call_json(c) for c in calls]
    return message, bool(calls)


@dataclass
class ParsedStream:
    """One streamed choice's parsers and what they hold back."""

    reasoning: ReasoningPlan | None
    tools: ToolCallFormat | None
    called: bool = False  # a tool call was sent
    _thinker: ReasoningStreamParser | None = field(default=None, init=False)
    _caller: ToolCallStreamParser | None = field(default=None, init=False)
    _held_space: str = field(default="", init=False)  # trailing whitespace of the content so far
    _held_reasoning: str = field(default="", init=False)  # a block not streamed as it comes

    def __post_init__(self) -> None:
        if self.reasoning is not None and self.reasoning.separate:
            self._thinker = self.reasoning.fmt.parser(self.reasoning.in_reasoning)
        if self.tools is not None:
            self._caller = self.tools.parser()

    def delta(self, text: str, finished: bool) -> dict[str, Any]:
        """The delta for ``text``, the output's new text (``finished``: the output ended with it)."""
        thought, content = "", text
        if self._thinker is not None:
            step = self._thinker.feed(text)
            thought, content = step.reasoning, step.content
            if finished:
                last = self._thinker.finish()
                thought, content = thought + last.reasoning, content + last.content
            if not self.reasoning.stream:
                self._held_reasoning += thought
                block_open = self._thinker.in_reasoning and not finished
                thought, self._held_reasoning = ("", self._held_reasoning) if block_open else (
                    self._held_reasoning, "")
        calls: list[ToolCallDelta] = []
        if self._caller is not None:
            parsed = self._caller.feed(content)
            content, calls = parsed.content, list(parsed.calls)
            if finished:
                rest = self._caller.finish()
                content, calls = content + rest.content, calls + rest.calls
            self.called = self.called or bool(calls)
            kept = (self._held_space + content).rstrip()
            self._held_space, content = (self._held_space + content)[len(kept):], kept
            if finished and not self.called:
                content, self._held_space = content + self._held_space, ""
        out: dict[str, Any] = {}
        if thought:
            out["reasoning_content"] = thought
        if content:
            out["content"] = content
        if calls:
            out["tool_calls"] = [tool_call_delta_json(c) for c in calls]
        return out
