"""Streaming parsing of a model's output into ordinary text and tool calls.

A ``ToolCallStreamParser`` (one per answer, made by ``ToolCallFormat.parser()``) is fed the output text piece by
piece and returns, for each piece, the text now certain to be ordinary content and the tool-call deltas now
certain. Every family reads the text one character at a time through a state machine whose decisions depend
only on the characters read so far, so how the output is split into pieces never changes the result: folding
the deltas (content concatenated; per call index the first delta's id and name and the arguments
concatenated) gives the same as ``parse_tool_calls`` on the whole text, ids aside.

Streaming order per call: the first delta carries ``id`` and ``name`` (its arguments may be ""), later ones
carry fragments of the arguments' JSON text as the model writes it. A possible start of a call (a partial
marker, an object whose name has not closed yet) is held back until it is decided; if it turns out not to be
a call it is released as content. A call cut off by the end of the output is closed with what arrived;
nothing is repaired. A call object without an arguments member gets ``"{}"``. The parser never raises on
model output. Torch-free.
"""

from __future__ import annotations

import secrets
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from radixrt.tools.scan import CallObjectScanner

if TYPE_CHECKING:
    from radixrt.tools.format_base import ToolCallFormat


def new_call_id() -> str:
    """``call_`` and 24 random hex characters."""
    return "call_" + secrets.token_hex(12)


@dataclass
class ToolCallDelta:
    index: int  # the call's position in this answer, 0, 1, ...
    id: str | None = None  # set on the call's first delta only
    name: str | None = None  # set on the call's first delta only
    arguments: str = ""  # the next fragment of the arguments' JSON text


@dataclass
class ParsedDelta:
    content: str  # ordinary text that is now certain not to be part of a call
    calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # the JSON text exactly as the model wrote it


class ToolCallStreamParser:
    """Base of the family parsers: the output buffers and the handling of one call object.

    Subclasses implement ``_step(ch)`` (one character) and ``_end()`` (end of output: release or close what
    is pending; it may queue text to read again, and is called again until nothing is pending). While a call
    is undecided its text accumulates in ``_held``; ``_rollback`` releases the held text's first ``_anchor``
    characters (the marker that opened the attempt, at least one character) as content and queues the rest
    to be read again in ``fallback`` state. Text read again goes through a queue, not recursion, so no
    output can exhaust the stack.
    """

    args_keys: tuple[str, ...] = ("arguments", "parameters")

    def __init__(self) -> None:
        self._content: list[str] = []
        self._deltas: list[ToolCallDelta] = []
        self._count = 0  # calls started in this answer
        self._open = False  # a call's name was sent; its arguments may still come
        self._held: list[str] = []
        self._anchor = 1
        self._scanner: CallObjectScanner | None = None
        self._early_args: list[str] = []  # arguments read before the name
        self._queue: deque[str] = deque()  # characters still to read (text read again first)
        self.state = "text"

    # -- public

    def feed(self, text: str) -> ParsedDelta:
        self._queue.extend(text)
        self._run()
        return self._take()

    def finish(self) -> ParsedDelta:
        self._run()
        while True:
            self._end()
            if not self._queue:
                break
            self._run()
        self._open = False
        return self._take()

    def _run(self) -> None:
        queue, step = self._queue, self._step
        while queue:
            step(queue.popleft())

    def _reread(self, text: str) -> None:
        """Read ``text`` again before anything else (the caller's character is done with)."""
        self._queue.extendleft(reversed(text))

    # -- subclass interface

    def _step(self, ch: str) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _end(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    # -- output

    def _take(self) -> ParsedDelta:
        out = ParsedDelta("".join(self._content), self._deltas)
        self._content, self._deltas = [], []
        return out

    def _emit_content(self, text: str) -> None:
        if text:
            self._content.append(text)

    def _emit_args(self, text: str) -> None:
        last = self._deltas[-1] if self._deltas else None
        if last is not None and last.index == self._count - 1:
            last.arguments += text
        else:
            self._deltas.append(ToolCallDelta(self._count - 1, arguments=text))

    def _start_call(self, name: str) -> None:
        self._deltas.append(ToolCallDelta(self._count, new_call_id(), name, ""))
        self._count += 1
        self._open = True

    # -- held text

    def _hold(self, text: str, anchor: int | None = None) -> None:
        if anchor is not None:
            self._anchor = anchor
        self._held.append(text)

    def _drop_held(self) -> str:
        held = "".join(self._held)
        self._held = []
        return held

    def _rollback(self, fallback: str, then: str = "") -> None:
        """The held attempt is not a call: its anchor is content, the rest (and ``then``) is read again."""
        held = self._drop_held() + then
        anchor = max(1, self._anchor)
        self._scanner = None
        self._early_args = []
        self.state = fallback
        self._emit_content(held[:anchor])
        self._reread(held[anchor:])

    # -- one call object

    def _begin_object(self, ch: str, anchor: int | None = None) -> None:
        """``ch`` is the ``{`` that opens a call object."""
        self._hold(ch, anchor)
        self._scanner = CallObjectScanner(self.args_keys)
        self._early_args = []
        self.state = "object"

    def _object_step(self, ch: str, fallback: str) -> str | None:
        """Read one character of the call object. Returns "done" when the call ended with its ``}``,
        "broken" when a started call's object cannot go on (``ch`` is not consumed; the call is closed),
        None otherwise. An attempt that turns out not to be a call is rolled back to ``fallback``."""
        scanner = self._scanner
        assert scanner is not None
        event = scanner.step(ch)
        if event is None:
            if not self._open:
                self._hold(ch)
            return None
        kind, value = event
        if kind == "args":
            if self._open:
                self._emit_args(value)
            else:
                self._hold(ch)
                self._early_args.append(value)
            return None
        if kind == "name":
            self._drop_held()
            self._start_call(value)
            if self._early_args:
                self._emit_args("".join(self._early_args))
                self._early_args = []
            return None
        if kind == "done":
            if not self._open:
                self._hold(ch)
                self._rollback(fallback)
                return None
            if not scanner.saw_args:
                self._emit_args("{}")
            self._close_call()
            return "done"
        # error
        if not self._open:
            self._rollback(fallback, ch)
            return None
        self._close_call()
        return "broken"

    def _close_call(self) -> None:
        self._open = False
        self._scanner = None

    def _end_object(self, fallback: str) -> None:
        """End of output inside a call object: a started call keeps what arrived, an undecided one is content."""
        if self._open:
            self._close_call()
            self.state = fallback
        else:
            self._rollback(fallback)


def parse_tool_calls(fmt: "ToolCallFormat", text: str) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole output: one fresh parser's ``feed(text)`` and ``finish()``, folded."""
    parser = fmt.parser()
    first, last = parser.feed(text), parser.finish()
    content = first.content + last.content
    ids: dict[int, str] = {}
    names: dict[int, str] = {}
    args: dict[int, list[str]] = {}
    for delta in first.calls + last.calls:
        if delta.index not in ids:
            ids[delta.index], names[delta.index] = delta.id or new_call_id(), delta.name or ""
            args[delta.index] = []
        args[delta.index].append(delta.arguments)
    calls = [ToolCall(ids[i], names[i], "".join(args[i])) for i in sorted(ids)]
    return content, calls
