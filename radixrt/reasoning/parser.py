"""A reasoning model's output split into its reasoning block and the answer, whole or streamed.

The formats (``--reasoning-parser``, SGLang's names):

- ``deepseek-r1``, ``qwen3-thinking``: the output starts inside the reasoning block (their templates open it in
  the prompt); a ``<think>`` that opens the output anyway is dropped. The block ends at the first ``</think>``.
- ``qwen3``: the block is opened by a ``<think>`` that begins the output (after whitespace), or from the first
  character when the prompt itself ends in ``<think>`` (``ReasoningFormat.starts_in_reasoning``); otherwise the
  whole output is the answer (``enable_thinking: false`` renders an empty block into the prompt). The block ends at
  ``</think>``, or where a ``<tool_call>`` starts (that marker stays in the answer, for the tool-call parser).

Text after the block is the answer, exactly as written (the model's newlines included); a block the output
never closes holds all of it. A ``ReasoningStreamParser`` reads the output one character at a time through a
state machine whose decisions depend only on the characters read so far, holding back just the characters that
may still be the start of a marker, so how the output is split into pieces never changes the result: folding its
deltas gives ``split_reasoning`` of the whole text. Torch-free, and imports nothing of the runtime but itself
(the DSL's ``separate_reasoning`` uses it).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    always_reasoning: bool  # the output starts inside the block, whatever the prompt
    interrupt: str | None = None  # a marker that also ends the block and stays in the answer
    start: str = "<think>"
    end: str = "</think>"

    def starts_in_reasoning(self, prompt_tail: str = "") -> bool:
        """Whether an output starts inside the block: always for the forced formats, else when the prompt's text
        (its last characters are enough) ends in the start marker."""
        return self.always_reasoning or prompt_tail.rstrip().endswith(self.start)

    def parser(self, in_reasoning: bool | None = None) -> "ReasoningStreamParser":
        return ReasoningStreamParser(self, self.always_reasoning if in_reasoning is None else in_reasoning)


FORMATS: dict[str, ReasoningFormat] = {
    "deepseek-r1": ReasoningFormat("deepseek-r1", always_reasoning=True),
    "qwen3": ReasoningFormat("qwen3", always_reasoning=False, interrupt="<tool_call>"),
    "qwen3-thinking": ReasoningFormat("qwen3-thinking", always_reasoning=True, interrupt="<tool_call>"),
}


def reasoning_format(name: str) -> ReasoningFormat:
    """The format called ``name``; ValueError naming the known ones."""
    if name not in FORMATS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {', '.join(FORMATS)}")
    return FORMATS[name]


@dataclass
class ReasoningDelta:
    reasoning: str  # new text of the reasoning block
    content: str  # new text of the answer


class ReasoningStreamParser:
    """One output's parser: ``feed`` each new piece of text, ``finish`` at the end. States: ``open`` (the output's
    start: whitespace and a possible start marker are held), ``reasoning``, ``content``."""

    def __init__(self, fmt: ReasoningFormat, in_reasoning: bool) -> None:
        self.fmt = fmt
        self.forced = in_reasoning
        self.state = "open"
        self.entered = in_reasoning  # the output has a reasoning block (possibly empty)
        self._held = ""  # characters that may still be (the start of) a marker
        self._markers = [m for m in (fmt.end, fmt.interrupt) if m]
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._queue: deque[str] = deque()

    @property
    def in_reasoning(self) -> bool:
        """Inside the block now (an unread start marker counts once it opened it)."""
        return self.state == "reasoning" or (self.state == "open" and self.forced)

    def feed(self, text: str) -> ReasoningDelta:
        self._queue.extend(text)
        while self._queue:
            self._step(self._queue.popleft())
        return self._take()

    def finish(self) -> ReasoningDelta:
        """The end of the output: what was held back is released where it stands."""
        held, self._held = self._held, ""
        if self.state == "reasoning" or (self.state == "open" and self.forced):
            self._reasoning.append(held)
        else:
            self._content.append(held)
        return self._take()

    def _take(self) -> ReasoningDelta:
        out = ReasoningDelta("".join(self._reasoning), "".join(self._content))
        self._reasoning, self._content = [], []
        return out

    def _step(self, ch: str) -> None:
        if self.state == "content":
            self._content.append(ch)
        elif self.state == "reasoning":
            self._reasoning_step(ch)
        else:
            self._open_step(ch)

    def _open_step(self, ch: str) -> None:
        self._held += ch
        marker = self._held.lstrip()
        if marker == self.fmt.start:  # the output opens the block: marker and layout before it are dropped
            self._held = ""
            self.state, self.entered = "reasoning", True
            return
        if self.fmt.start.startswith(marker):
            return  # whitespace so far, or part of the start marker
        held, self._held = self._held, ""
        if self.forced:  # no start marker: the text is the block's, read again for its end
            self.state = "reasoning"
            self._queue.extendleft(reversed(held))
        else:
            self.state = "content"
            self._content.append(held)

    def _reasoning_step(self, ch: str) -> None:
        pending = self._held + ch
        for marker in self._markers:
            if pending.endswith(marker):
                self._reasoning.append(pending[: -len(marker)])
                self._held = ""
                self.state = "content"
                if marker != self.fmt.end:  # an interrupting marker belongs to the answer
                    self._content.append(marker)
                return
        cut = next(i for i in range(len(pending) + 1)
                   if any(m.startswith(pending[i:]) for m in self._markers))
        self._reasoning.append(pending[:cut])
        self._held = pending[cut:]


def split_reasoning(fmt: ReasoningFormat, text: str, in_reasoning: bool | None = None) -> tuple[str | None, str]:
    """(the reasoning block's text, or None when the output has none; the answer) of a whole output."""
    parser = fmt.parser(in_reasoning)
    first, last = parser.feed(text), parser.finish()
    reasoning = first.reasoning + last.reasoning
    return (reasoning if parser.entered else None), first.content + last.content
