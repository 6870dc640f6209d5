"""Assembles one request's streamed deltas into SGLang's native response dict (an embedding request's: its vector).

``meta["finish_reason"]`` is SGLang's dict (``FinishReason.to_dict()``); ``finish_reason`` keeps the typed one.
"""

from __future__ import annotations

import time
from typing import Any

from radixrt.protocol.messages import FinishReason, StrDelta


def _entries(items) -> list[list[Any]]:
    return [[logprob, token, None] for logprob, token in items]


class ResponseBuilder:
    def __init__(self, rid: str, return_logprob: bool = False, top_logprobs_num: int = 0,
                 token_ids_logprob: bool = False) -> None:
        self.rid = rid
        self.return_logprob = return_logprob
        self.top_logprobs_num = top_logprobs_num
        self.token_ids_logprob = return_logprob and token_ids_logprob
        self.text = ""
        self.output_ids: list[int] = []
        self.meta: dict[str, Any] = {"id": rid, "finish_reason": None, "prompt_tokens": 0, "completion_tokens": 0,
                                     "cached_tokens": 0}
        if return_logprob:
            self.meta.update(input_token_logprobs=[], output_token_logprobs=[])
            if top_logprobs_num:
                self.meta.update(input_top_logprobs=[], output_top_logprobs=[])
            if self.token_ids_logprob:
                self.meta.update(input_token_ids_logprobs=[], output_token_ids_logprobs=[])
        self.started = time.perf_counter()
        self.first_token_time: float | None = None
        self.finish_reason: FinishReason | None = None
        self.embedding: list[float] | None = None  # an embedding request's answer

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, out: StrDelta) -> str:
        """Fold one delta in; returns the new text."""
        d = out.delta
        self.text += out.text
        self.output_ids.extend(d.new_ids)
        if d.new_ids and self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        self.meta.update(prompt_tokens=d.prompt_tokens, completion_tokens=d.completion_tokens,
                         cached_tokens=d.cached_tokens)
        if d.spec_verify_ct:
            self.meta.update(spec_verify_ct=d.spec_verify_ct, spec_draft_tokens=d.spec_draft_tokens,
                             spec_accepted_tokens=d.spec_accepted_tokens,
                             spec_accept_length=round((d.spec_accepted_tokens + d.spec_verify_ct) / d.spec_verify_ct, 4))
        if self.return_logprob:
            if d.input_logprobs is not None:
                self.meta["input_token_logprobs"] = _entries(d.input_logprobs)
                if self.top_logprobs_num:
                    self.meta["input_top_logprobs"] = [_entries(t) for t in (d.input_top_logprobs or [])]
                if self.token_ids_logprob:
                    self.meta["input_token_ids_logprobs"] = [_entries(t) for t in (d.input_token_ids_logprobs or [])]
            self.meta["output_token_logprobs"].extend(_entries(d.output_logprobs or []))
            if self.top_logprobs_num:
                self.meta["output_top_logprobs"].extend(_entries(t) for t in (d.output_top_logprobs or []))
            if self.token_ids_logprob:
                self.meta["output_token_ids_logprobs"].extend(_entries(t) for t in (d.output_token_ids_logprobs or []))
        if d.embedding is not None:
            self.embedding = d.embedding
        if d.weight_version is not None:
            self.meta["weight_version"] = d.weight_version
        if d.finish_reason is not None:
            self.finish_reason = d.finish_reason
            self.meta["finish_reason"] = self.finish_reason.to_dict()
            self.meta["e2e_latency"] = time.perf_counter() - self.started
        return out.text

    def to_dict(self) -> dict[str, Any]:
        """SGLang's native dict: text, output ids and meta info, or for an embedding request (SGLang's
        ``encode``) the embedding and meta info."""
        if self.embedding is not None:
            return {"embedding": list(self.embedding), "meta_info": dict(self.meta)}
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": dict(self.meta)}
