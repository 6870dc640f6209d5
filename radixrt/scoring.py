"""SGLang's scoring API over the one request path: the probabilities of label tokens after a query and each item.

``score_input`` turns a ``score`` call (a query and items, both text or both token ids; ``label_token_ids``;
``item_first``) into one prompt-only ``GenerateInput``: a prompt per item (the query then the item, or the item then
the query), ``max_new_tokens`` 0 and the labels as ``token_ids_logprob``, so the scheduler answers each prompt with
the labels' logprobs at the position after it (the next token's distribution; nothing is sampled). Text is joined
before it is tokenized, as SGLang does; token ids are joined as they are. A query in front of its items is a prefix
they share through the radix cache. ``label_scores`` reads one answer: the labels' probabilities, or with
``apply_softmax`` a softmax over the labels alone. A label listed twice is asked for once. Torch-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from radixrt.protocol.errors import RequestError
from radixrt.protocol.request import GenerateInput

MAX_SCORE_ITEMS = 2048

PROMPT_ONLY = {"max_new_tokens": 0}


@dataclass(frozen=True)
class ScoreCall:
    """A ``score`` call's arguments, unchecked (SGLang's ``Engine.score`` and ``/v1/score``)."""

    query: Any
    items: Any
    label_token_ids: Any
    apply_softmax: bool = False
    item_first: bool = False
    lora_path: str | None = None


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(type(t) is int for t in value)


def score_input(call: ScoreCall) -> GenerateInput:
    """The call as one prompt-only request per item; RequestError naming what is wrong with it."""
    labels = call.label_token_ids
    if not _is_ids(labels) or not labels:
        raise RequestError("label_token_ids must be a non-empty list of token ids")
    if not isinstance(call.apply_softmax, bool) or not isinstance(call.item_first, bool):
        raise RequestError("apply_softmax and item_first must be booleans")
    items = [call.items] if isinstance(call.items, str) else call.items
    if not isinstance(items, list) or not items:
        raise RequestError("items must be a non-empty list (or one string)")
    if len(items) > MAX_SCORE_ITEMS:
        raise RequestError(f"at most {MAX_SCORE_ITEMS} items are scored in one call")
    common = dict(sampling_params=PROMPT_ONLY, return_logprob=True, token_ids_logprob=list(dict.fromkeys(labels)),
                  lora_path=call.lora_path)
    if call.query in ("", []):
        raise RequestError("query must not be empty")
    if isinstance(call.query, str) and all(isinstance(item, str) for item in items):
        texts = [item + call.query if call.item_first else call.query + item for item in items]
        return GenerateInput(text=texts, **common)
    if _is_ids(call.query) and all(_is_ids(item) for item in items):
        ids = [item + call.query if call.item_first else call.query + item for item in items]
        return GenerateInput(input_ids=ids, **common)
    raise RequestError("query and items must be both text (a string and strings) or both token ids (a list of ids "
                       "and lists of ids)")


def next_token_logprobs(result: dict[str, Any]) -> dict[int, float]:
    """A prompt-only answer's ``token_ids_logprob``, by id, at the position after its prompt."""
    return {token: logprob for logprob, token, _ in result["meta_info"]["output_token_ids_logprobs"][0]}


def softmax(values: list[float]) -> list[float]:
    top = max(values)
    weights = [math.exp(v - top) for v in values]
    total = sum(weights)
    return [w / total for w in weights]


def sigmoid(x: float) -> float:
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)  # no overflow for a very negative score
    return e / (1.0 + e)


def label_scores(result: dict[str, Any], label_token_ids: list[int], apply_softmax: bool) -> list[float]:
    """One item's scores, in the order of ``label_token_ids``, from its answer's ``output_token_ids_logprobs``."""
    logprobs = next_token_logprobs(result)
    values = [logprobs[token] for token in label_token_ids]
    return softmax(values) if apply_softmax else [math.exp(v) for v in values]


def usage(results: list[dict[str, Any]]) -> dict[str, int]:
    tokens = sum(r["meta_info"]["prompt_tokens"] for r in results)
    return {"prompt_tokens": tokens, "completion_tokens": 0, "total_tokens": tokens}
