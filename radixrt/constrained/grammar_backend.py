"""The scheduler-facing facade: one object per engine holding the compiler, the batch bitmask and the
jump-forward switch (what ``Engine`` and the scheduler process construct as ``GrammarBackend``)."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Sequence

import torch

from radixrt.constrained.grammar import Grammar, GrammarCompiler
from radixrt.constrained.jump_forward import JumpForward, jump_forward
from radixrt.constrained.masks import allocate_bitmask, apply_bitmask, apply_token_masks, fill_bitmasks
from radixrt.constrained.matcher import GrammarMatcher


class GrammarBackend:
    """``validate`` / ``compile_async`` (futures of ``Grammar``; ``grammar.matcher()`` per request),
    ``apply_masks`` for a batch's logits, ``jump_forward`` when enabled (None when disabled)."""

    def __init__(self, tokenizer, eos_token_ids, vocab_size: int | None = None, jump_forward: bool = True,
                 cache_size: int = 64, max_workers: int = 1, json_whitespace: str = ""):
        self.tokenizer = tokenizer
        self.compiler = GrammarCompiler(tokenizer, eos_token_ids, cache_size=cache_size, max_workers=max_workers,
                                        vocab_size=vocab_size, json_whitespace=json_whitespace)
        self.vocab_size = self.compiler.vocab_size
        self.jump_forward_enabled = jump_forward
        self._bitmask = allocate_bitmask(0, self.vocab_size)

    def validate(self, kind: str, spec: Any = None) -> str:
        return self.compiler.validate(kind, spec)

    def compile_async(self, kind: str, spec: Any = None) -> "Future[Grammar]":
        return self.compiler.compile_async(kind, spec)

    def apply_masks(self, logits: torch.Tensor, matchers: Sequence[GrammarMatcher | None]) -> torch.Tensor:
        """Mask row i of ``logits`` by ``matchers[i]`` (None: unconstrained), in place, vectorised."""
        if logits.device.type == "cpu":
            return apply_token_masks(logits, matchers)
        if self._bitmask.shape[0] < len(matchers):
            self._bitmask = allocate_bitmask(max(len(matchers), 2 * self._bitmask.shape[0]), self.vocab_size)
        bitmask = self._bitmask[: len(matchers)]
        rows = fill_bitmasks(bitmask, matchers)
        return apply_bitmask(logits, bitmask, rows)

    def jump_forward(self, matcher: GrammarMatcher, output_ids: list[int],
                     max_tokens_to_append: int | None = None) -> JumpForward | None:
        if not self.jump_forward_enabled or matcher is None or matcher.is_finished():
            return None
        return jump_forward(matcher, output_ids, self.tokenizer, max_tokens_to_append=max_tokens_to_append)

    def shutdown(self) -> None:
        self.compiler.shutdown()
