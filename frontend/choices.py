"""How select() turns per-choice token logprobs into a decision.

Every method receives, per choice, the logprobs of the choice's own tokens (after token healing at
the prefix boundary): `input_token_logprobs[i]` is a list of `[logprob, token_id, text|None]`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional


@dataclass
class ChoicesDecision:
    decision: str
    meta_info: Optional[Dict[str, Any]] = None


def _argmax(values: List[float]) -> int:
    """Index of the largest value; the first one on ties."""
    if not values:
        raise ValueError("select() needs at least one choice")
    best = 0
    for i, v in enumerate(values):
        if v > values[best]:
            best = i
    return best


def _mean(values: List[float]) -> float:
    return sum(values) / len(values) if values else float("-inf")


class ChoicesSamplingMethod:
    """Base class. Subclasses implement __call__ with the keyword arguments below."""

    @property
    def requires_unconditional_logprobs(self) -> bool:
        return False

    def __call__(
        self,
        *,
        choices: List[str],
        normalized_prompt_logprobs: List[float],
        input_token_logprobs: List[List[Any]],
        output_token_logprobs: List[List[Any]],
        unconditional_token_logprobs: Optional[List[List[Any]]] = None,
    ) -> ChoicesDecision:
        raise NotImplementedError

    def __repr__(self) -> str:
        return type(self).__name__


class TokenLengthNormalized(ChoicesSamplingMethod):
    """The choice with the highest mean token logprob (the default)."""

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs,
                 output_token_logprobs, unconditional_token_logprobs=None):
        best = _argmax(normalized_prompt_logprobs)
        return ChoicesDecision(
            decision=choices[best],
            meta_info={
                "normalized_prompt_logprobs": normalized_prompt_logprobs,
                "input_token_logprobs": input_token_logprobs,
                "output_token_logprobs": output_token_logprobs,
            },
        )


class GreedyTokenSelection(ChoicesSamplingMethod):
    """Compare the choices token by token, keeping those with the best logprob at each position.
    A choice shorter than the longest is padded with its own mean logprob."""

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs,
                 output_token_logprobs, unconditional_token_logprobs=None):
        width = max((len(x) for x in input_token_logprobs), default=0)
        matrix = []
        for row in input_token_logprobs:
            values = [t[0] for t in row]
            pad = _mean(values) if values else float("nan")
            matrix.append(values + [pad] * (width - len(values)))
        remaining = list(range(len(choices)))
        for j in range(width):
            column = [matrix[i][j] for i in remaining]
            valid = [v for v in column if not math.isnan(v)]
            if not valid:
                continue
            top = max(valid)
            remaining = [i for i in remaining if matrix[i][j] == top]
            if len(remaining) == 1:
                break
        return ChoicesDecision(
            decision=choices[remaining[0]],
            meta_info={
                "normalized_prompt_logprobs": normalized_prompt_logprobs,
                "input_token_logprobs": input_token_logprobs,
                "output_token_logprobs": output_token_logprobs,
                "greedy_logprob_matrix": matrix,
            },
        )


class UnconditionalLikelihoodNormalized(ChoicesSamplingMethod):
    """The choice with the highest mean of (conditional - unconditional) token logprob, where the
    unconditional logprobs score the choice's tokens alone; the first unconditional logprob
    (position 0, no context) counts as 0."""

    @property
    def requires_unconditional_logprobs(self) -> bool:
        return True

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs,
                 output_token_logprobs, unconditional_token_logprobs=None):
        if unconditional_token_logprobs is None:
            raise ValueError("unconditional_likelihood_normalized needs unconditional logprobs")
        scores = []
        for cond, uncond in zip(input_token_logprobs, unconditional_token_logprobs):
            c = [t[0] for t in cond]
            u = [t[0] for t in uncond]
            if len(c) != len(u):
                raise ValueError("conditional and unconditional logprobs differ in length")
            if u:
                u[0] = u[0] or 0.0
            scores.append(_mean([a - b for a, b in zip(c, u)]))
        return ChoicesDecision(
            decision=choices[_argmax(scores)],
            meta_info={
                "normalized_prompt_logprobs": normalized_prompt_logprobs,
                "input_token_logprobs": input_token_logprobs,
                "output_token_logprobs": output_token_logprobs,
                "unconditional_token_logprobs": unconditional_token_logprobs,
                "normalized_unconditional_prompt_logprobs": scores,
            },
        )


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()
