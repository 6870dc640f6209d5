"""A request as the scheduler sees it: its tokens, its pages and how far it has been computed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from radixrt.detokenize import TextStream
from radixrt.memory.radix_cache import cache_namespace, long_rope_namespace
from radixrt.model.pooling import Pooling
from radixrt.protocol.messages import FinishReason, GenerateReq
from radixrt.sampling.params import SamplingParams
from radixrt.scheduler.embedding import EmbeddingPool

LAST_TOKEN = Pooling()  # SGLang's pooling of a causal model: the last token's state, normalized

if TYPE_CHECKING:
    from concurrent.futures import Future

    from radixrt.constrained.grammar import Grammar
    from radixrt.constrained.matcher import GrammarMatcher
    from radixrt.memory.radix_cache import TreeNode
    from radixrt.scheduler.speculation import SpecState


@dataclass
class Req:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None
    output_ids: list[int] = field(default_factory=list)
    # Page table: pages[:num_tree_pages] belong to the radix tree (protected by locking `node`); the rest are
    # private to this request, one reference each. Only radixrt.scheduler.memory changes them.
    pages: list[int] = field(default_factory=list)
    page_row: int = -1  # its row of radixrt.scheduler.page_rows.PageRows while it holds pages
    num_tree_pages: int = 0
    node: TreeNode | None = None
    num_computed: int = 0  # tokens of fill_ids whose K/V sit in `pages`
    cached_tokens: int = 0  # prompt tokens served by the prefix cache
    finish_reason: FinishReason | None = None
    seed: int | None = None  # a sampled request's seed: its own, or one the scheduler drew (radixrt.sampling.draws)
    stop_text: TextStream | None = None  # set when the request has stop strings
    grammar_future: Future[Grammar] | None = None  # the grammar being compiled
    grammar: GrammarMatcher | None = None  # the request's constrained-decoding state once compiled
    grammar_spec: tuple[str, str] | None = None
    # logprobs, accumulated until sent
    input_logprobs: list[tuple[float | None, int]] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[float | None, int]]] = field(default_factory=list)
    pending_output_logprobs: list[tuple[float | None, int]] = field(default_factory=list)
    pending_output_top: list[list[tuple[float | None, int]]] = field(default_factory=list)
    input_token_ids_logprobs: list[list[tuple[float | None, int]]] = field(default_factory=list)
    pending_output_token_ids: list[list[tuple[float | None, int]]] = field(default_factory=list)
    num_sent: int = 0  # output ids already reported
    input_logprobs_sent: bool = False
    num_retractions: int = 0
    arrival: float = 0.0
    priority: int = 0  # SGLang's request priority (by default a larger value is more urgent)
    # Speculative decoding (radixrt.scheduler.speculation): this step's draft tokens, verified after the
    # forward; the grammar's state before each verify row; the request's drafting state and counters.
    draft: list[int] = field(default_factory=list)
    draft_matchers: list[GrammarMatcher] | None = None
    spec: SpecState | None = None
    embed: bool = False  # an embedding request: prefill only, then its pooled hidden state
    pooling: EmbeddingPool | None = None  # an embedding request's pooling (radixrt.scheduler.embedding)
    embedding: list[float] | None = None
    # The LoRA adapter its tokens go through (radixrt.model.lora; 0: the base model), and its namespace in the
    # radix cache (the adapter's, and its isolation key's: radixrt.memory.radix_cache.cache_namespace), so K/V
    # computed through other weights, or for a request of another key, is never shared.
    lora_uid: int = 0
    cache_namespace: int = 0
    # A LongRoPE model's request whose sequence outgrew the original context: every position rotates with the long
    # frequencies (radixrt.model.forward_batch.rope_table_rows), its K/V in a namespace of its own.
    long_rope: bool = False

    @classmethod
    def from_message(cls, msg: GenerateReq, drawn_seed: int, lora_uid: int = 0, long_rope_from: int | None = None,
                     pooling: Pooling = LAST_TOKEN) -> "Req":
        """``drawn_seed`` seeds a sampled request that brings no seed of its own; ``lora_uid`` is the loaded
        adapter ``msg.lora_path`` names; ``long_rope_from``: a LongRoPE model's original context (a prompt past it
        rotates long from the start); ``pooling``: the model's, for an embedding request."""
        req = cls(
            rid=msg.rid,
            prompt_ids=list(msg.input_ids),
            params=msg.params,
            return_logprob=msg.return_logprob,
            logprob_start_len=msg.logprob_start_len,
            top_logprobs_num=msg.top_logprobs_num,
            token_ids_logprob=msg.token_ids_logprob,
            grammar_spec=msg.grammar,
            priority=msg.priority if msg.priority is not None else 0,
            embed=msg.embed,
            pooling=EmbeddingPool(pooling, msg.dimensions) if msg.embed else None,
            lora_uid=lora_uid,
            cache_namespace=cache_namespace(lora_uid, msg.cache_key),
        )
        if req.outgrows_short_rope(long_rope_from):
            req.switch_to_long_rope()
        if not msg.params.greedy:
            # Every sampled request draws from its own seed, so its tokens do not depend on the batch.
            req.seed = msg.params.seed if msg.params.seed is not None else drawn_seed
        return req

    def urgency(self, low_priority_first: bool) -> int:
        """How urgent the request is, larger first: its priority, negated under
        ``--schedule-low-priority-values-first``."""
        return -self.priority if low_priority_first else self.priority

    @property
    def fill_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_at(self, index: int) -> int:
        """``fill_ids[index]`` without building the list."""
        prompt = self.prompt_ids
        return prompt[index] if index < len(prompt) else self.output_ids[index - len(prompt)]

    def tokens_between(self, start: int, stop: int) -> list[int]:
        """``fill_ids[start:stop]`` without building the whole list (a decode step reads one token of a long
        context)."""
        prompt = self.prompt_ids
        if start >= len(prompt):
            return self.output_ids[start - len(prompt) : stop - len(prompt)]
        if stop <= len(prompt):
            return prompt[start:stop]
        return prompt[start:] + self.output_ids[: stop - len(prompt)]

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def outgrows_short_rope(self, long_rope_from: int | None, in_flight: int = 0) -> bool:
        """Whether the request's sequence (with ``in_flight`` sampled tokens not yet in ``output_ids``) outgrew a
        LongRoPE model's original context while rotated short: it must then be computed again, every position with
        the long frequencies, as transformers' Phi-3 generation recomputes it once its sequence first exceeds that
        context (``switch_to_long_rope``)."""
        return long_rope_from is not None and not self.long_rope and self.total_len + in_flight > long_rope_from

    def switch_to_long_rope(self) -> None:
        """Rotate long from now on, in the long-rope namespace of the radix cache (its pages released first)."""
        assert not self.pages and self.node is None, "release the request's pages before its namespace changes"
        self.long_rope = True
        self.cache_namespace = long_rope_namespace(self.cache_namespace)

    @property
    def final_len(self) -> int:
        """Tokens of ``fill_ids`` that can no longer change, the only ones the radix tree may hold for this request:
        all of them, except a running constrained request's unsent output tokens, which jump-forward may still
        re-tokenise (radixrt.scheduler.output). Tree pages are never rewritten, so a retracted request whose
        unsent tail went into the tree would re-tokenise less than it would have had it kept running, and write
        other tokens than it does alone."""
        if self.grammar is None or self.finished:
            return self.total_len
        return len(self.prompt_ids) + self.num_sent

    @property
    def num_to_compute(self) -> int:
        """Tokens whose K/V are missing; the logits of the last of them give the next token."""
        return self.total_len - self.num_computed

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0

    @property
    def pools_every_token(self) -> bool:
        """An embedding request whose pooling reads every prompt token's state (mean, first token): no prefix from
        the cache, every row of each chunk kept."""
        return self.pooling is not None and self.pooling.every_token

    @property
    def computes_prompt_logprobs(self) -> bool:
        """Prompt logprobs are still to be collected: wanted and not sent yet (a request computing its
        prompt again after a retraction sent them with its first delta)."""
        return self.wants_prompt_logprobs and not self.input_logprobs_sent

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
