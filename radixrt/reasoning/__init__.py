"""Reasoning models' output: the reasoning block (``<think>...</think>``) apart from the answer. Torch-free.

``parser``: the formats (``--reasoning-parser``) and the streaming parser, imported by the DSL too;
``constraint``: the regex that lets a constrained chat answer think first (the server's).
"""

from radixrt.reasoning.parser import (
    FORMATS,
    ReasoningDelta,
    ReasoningFormat,
    ReasoningStreamParser,
    reasoning_format,
    split_reasoning,
)

REASONING_FORMATS = tuple(FORMATS)

__all__ = ["FORMATS", "REASONING_FORMATS", "ReasoningDelta", "ReasoningFormat", "ReasoningStreamParser",
           "reasoning_format", "split_reasoning"]
