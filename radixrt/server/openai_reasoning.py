"""A chat request to a reasoning model (``--reasoning-parser``): how its answer is split, and its constraint.

``plan_reasoning`` reads SGLang's request fields: ``separate_reasoning`` (default true: the reasoning block goes
to ``reasoning_content``, the rest to ``content``; false: the text stays whole in ``content``) and
``stream_reasoning`` (default true: a stream sends reasoning as it comes; false: in one delta once the block
ends). Whether the output starts inside the block is the format's rule on the rendered prompt's end
(radixrt.reasoning.parser). ``constrain_after_reasoning`` moves a request's constraint (tool calls, ``regex``,
``json_schema``, ``response_format``) behind the reasoning block (radixrt.reasoning.constraint), so a
constrained answer may think first. ``template_kwargs`` checks ``chat_template_kwargs`` (e.g. Qwen3's
``enable_thinking``), which go to the chat template as its variables.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixrt.constrained.patterns import validate_grammar
from radixrt.protocol.errors import RequestError
from radixrt.reasoning import ReasoningFormat
from radixrt.reasoning.constraint import with_reasoning

# apply_chat_template's own arguments: a template variable of one of these names would collide with them
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
})


@dataclass(frozen=True)
class ReasoningPlan:
    fmt: ReasoningFormat
    in_reasoning: bool  # the output starts inside the block
    separate: bool  # the answer carries reasoning_content
    stream: bool  # a stream sends reasoning as it comes


def plan_reasoning(fmt: ReasoningFormat | None, req: Any, prompt_tail: str) -> ReasoningPlan | None:
    """The plan of a chat request (``req``: a ChatCompletionRequest) whose rendered prompt ends in
    ``prompt_tail``; None on a server without a reasoning parser."""
    if fmt is None:
        return None
    return ReasoningPlan(fmt, fmt.starts_in_reasoning(prompt_tail), req.separate_reasoning, req.stream_reasoning)


def constrain_after_reasoning(sampling: dict[str, Any], plan: ReasoningPlan | None) -> None:
    """Rewrite the request's constraint (``regex`` or ``json_schema`` in its sampling params), in place, to
    apply after the reasoning block."""
    if plan is None:
        return
    for kind in ("regex", "json_schema"):
        spec = sampling.get(kind)
        if spec is None:
            continue
        try:
            regex = validate_grammar(kind, spec)
        except ValueError as exc:
            raise RequestError(f"invalid grammar: {exc}") from None
        del sampling[kind]
        sampling["regex"] = with_reasoning(plan.fmt, plan.in_reasoning, regex)
        return


def template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """``chat_template_kwargs``: variables for the chat template, none named as apply_chat_template's own
    arguments."""
    if not kwargs:
        return {}
    clash = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
    if clash:
        raise RequestError(f"chat_template_kwargs may not set {', '.join(clash)}: the server sets them")
    return dict(kwargs)
