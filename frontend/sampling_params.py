"""Sampling parameters: the run()'s defaults and the fields a gen() overrides, and their wire forms.

A gen() node holds an SglSamplingParams whose unset fields are None; the executor fills them from the
run()'s defaults (only the OVERRIDABLE_FIELDS). The backends send them with `to_native_kwargs` (the
native /generate API) or `to_openai_kwargs` (the `openai` client).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Union

# Fields that a gen() may override on top of the run()'s defaults.
OVERRIDABLE_FIELDS = (
    "max_new_tokens",
    "min_new_tokens",
    "n",
    "stop",
    "stop_token_ids",
    "stop_regex",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "ignore_eos",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "return_text_in_logprobs",
    "dtype",
    "regex",
    "json_schema",
)


@dataclasses.dataclass
class SglSamplingParams:
    """Sampling parameters of one generation call. On a gen() node the unset fields are None and
    the run()'s defaults fill them in (see StreamExecutor._resolve_sampling_params)."""

    max_new_tokens: Optional[int] = 128
    min_new_tokens: Optional[int] = 0
    n: Optional[int] = 1
    stop: Union[str, Sequence[str], None] = ()
    stop_token_ids: Optional[Sequence[int]] = ()
    stop_regex: Union[str, Sequence[str], None] = None
    temperature: Optional[float] = 1.0
    top_p: Optional[float] = 1.0
    top_k: Optional[int] = -1  # -1 disables top-k
    min_p: Optional[float] = 0.0
    frequency_penalty: Optional[float] = 0.0
    presence_penalty: Optional[float] = 0.0
    ignore_eos: Optional[bool] = False
    return_logprob: Optional[bool] = None
    logprob_start_len: Optional[int] = None
    top_logprobs_num: Optional[int] = None
    return_text_in_logprobs: Optional[bool] = None
    # Constrained decoding.
    dtype: Any = None
    regex: Optional[str] = None
    json_schema: Optional[str] = None

    def clone(self) -> "SglSamplingParams":
        out = dataclasses.replace(self)
        if isinstance(out.stop, list):
            out.stop = list(out.stop)
        if isinstance(out.stop_token_ids, list):
            out.stop_token_ids = list(out.stop_token_ids)
        return out

    def stop_list(self) -> List[str]:
        if self.stop is None:
            return []
        if isinstance(self.stop, str):
            return [self.stop]
        return list(self.stop)

    def to_native_kwargs(self) -> Dict[str, Any]:
        """The `sampling_params` object of the native /generate API (SGLang's field names).
        Fields left at None are omitted, so the server's own defaults apply."""
        out: Dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens,
            "stop": self.stop_list(),
            "stop_token_ids": list(self.stop_token_ids or ()),
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "ignore_eos": self.ignore_eos,
        }
        if self.min_new_tokens:
            out["min_new_tokens"] = self.min_new_tokens
        if self.n is not None and self.n != 1:
            out["n"] = self.n
        for key in ("stop_regex", "regex", "json_schema"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        return {k: v for k, v in out.items() if v is not None}

    def to_openai_kwargs(self) -> Dict[str, Any]:
        """Keyword arguments for the `openai` client; fields the OpenAI API lacks go in
        `extra_body` only when they are set, so a plain OpenAI server never sees them."""
        out: Dict[str, Any] = {
            "max_tokens": self.max_new_tokens,
            "stop": self.stop_list() or None,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
        }
        extra: Dict[str, Any] = {}
        if self.top_k is not None and self.top_k > 0:
            extra["top_k"] = self.top_k
        if self.min_p:
            extra["min_p"] = self.min_p
        if self.min_new_tokens:
            extra["min_tokens"] = self.min_new_tokens
        if self.ignore_eos:
            extra["ignore_eos"] = True
        if self.stop_token_ids:
            extra["stop_token_ids"] = list(self.stop_token_ids)
        for key in ("regex", "json_schema"):
            value = getattr(self, key)
            if value is not None:
                extra[key] = value
        if extra:
            out["extra_body"] = extra
        return {k: v for k, v in out.items() if v is not None}
