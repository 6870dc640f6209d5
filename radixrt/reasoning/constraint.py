"""A constrained chat answer of a reasoning model: the constraint applies to the answer after the reasoning block.

``reasoning_prefix(fmt, in_reasoning)`` is the regex of the block as the parser reads it (radixrt.reasoning.parser):
any text without the end marker (nor the marker that interrupts the block, where the format has one), then
the end marker and optional whitespace; when the output may open the
block itself (``qwen3`` without a ``<think>`` at the prompt's end), the block is optional and begins with the
start marker. ``with_reasoning`` puts it in front of a constraint's regex, so tool calls, ``regex``,
``json_schema`` and ``response_format`` leave the model free to think first, as SGLang's reasoning grammar does.
The pieces come from radixrt.tools.regex (the same marker automaton the parsers use).
"""

from __future__ import annotations

from radixrt.reasoning.parser import ReasoningFormat
from radixrt.tools.regex import WS_CLASS, escape, text_without, text_without_any


def reasoning_prefix(fmt: ReasoningFormat, in_reasoning: bool) -> str:
    if fmt.interrupt is None:
        text = text_without(fmt.end, before_marker=True)
    else:  # the block's text holds no interrupting marker either: the parser would end the block there
        text = text_without_any((fmt.end, fmt.interrupt), before=fmt.end)
    block = text + escape(fmt.end) + WS_CLASS + "*"
    if in_reasoning:
        return block
    return "(" + WS_CLASS + "*" + escape(fmt.start) + block + ")?"


def with_reasoning(fmt: ReasoningFormat, in_reasoning: bool, regex: str) -> str:
    """``regex`` (one constraint, whole) after the reasoning block."""
    return reasoning_prefix(fmt, in_reasoning) + "(" + regex + ")"
