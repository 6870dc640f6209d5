"""What every simulated seed shares, built once per process: the default model's tokenizer, its eos ids,
the vocabulary width, a few hundred ordinary word tokens and the grammar backend the Engine builds.

A workload without constrained requests runs with logits only ``compact_vocab_size`` wide (every token it
can use, ids below that): the scheduler's sampling cost scales with the width, nothing else it does does.

Grammars compile synchronously here (``SyncGrammars``): the scheduler still sees a future, but one that is
already done, so the step at which a constrained request is admitted never depends on a compile thread's
timing and a seed replays step for step.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import Future
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

# Grammars the workloads draw from: few, so each compiles once per process (a regex index costs ~0.5 s).
REGEXES = (
    r"(the|a) [a-z]{2,10}( [a-z]{2,10}){0,5}\.",
    r"[0-9]{1,3}(, [0-9]{1,3}){0,6}",
)
CHOICES = (
    ("the red cat", "a blue dog", "the red car", "yes", "no"),
    ("alpha beta gamma", "alpha beta delta", "omega"),
)
BAD_REGEX = "(unclosed [a-z"  # compiles to an error: the request must end aborted with that reason
NUM_WORDS = 300
NUM_PUNCTUATION = 3  # ".", "," and "\n": text with sentences, so stop strings and regexes have hooks


class SyncGrammars:
    """The Engine's GrammarBackend, with ``compile_async`` waiting for the compile (see the module doc) and
    its own jump-forward switch (one backend, one compile cache, serves both settings)."""

    def __init__(self, backend, jump_forward: bool) -> None:
        self.backend = backend
        self.jump_forward_enabled = jump_forward

    def jump_forward(self, matcher, output_ids: list[int], max_tokens_to_append: int | None = None):
        if not self.jump_forward_enabled:
            return None
        return self.backend.jump_forward(matcher, output_ids, max_tokens_to_append=max_tokens_to_append)

    def compile_async(self, kind: str, spec: Any = None) -> Future:
        future = self.backend.compile_async(kind, spec)
        try:
            future.result()
        except Exception:  # noqa: BLE001 - the failed future reaches the scheduler, which aborts the request
            pass
        return future

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)


@dataclass
class World:
    model_path: Path
    tokenizer: Any
    eos_ids: set[int]
    vocab_size: int
    word_ids: list[int]  # ordinary word tokens (" cat"), the mass of the fake model's logits
    punctuation_ids: list[int]
    grammar_backend: Any  # radixrt.constrained.GrammarBackend, as the Engine builds it

    def grammars(self, jump_forward: bool) -> SyncGrammars:
        return SyncGrammars(self.grammar_backend, jump_forward)

    @property
    def compact_vocab_size(self) -> int:
        """Logits this wide cover every token a workload uses; 40x cheaper to sample than the whole vocabulary.
        Only workloads without grammars use it (grammar masks span the tokenizer's whole vocabulary)."""
        return max(self.word_ids + self.punctuation_ids + sorted(self.eos_ids)) + 1

    @property
    def eos_id(self) -> int:
        return min(self.eos_ids)

    def word_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


def _pick_words(tokenizer, count: int) -> list[int]:
    """The first ``count`` ids (lowest, i.e. the most frequent merges) that decode to " word"."""
    words = []
    for token_id in range(len(tokenizer)):
        text = tokenizer.decode([token_id])
        if re.fullmatch(r" [a-z]{3,8}", text) and tokenizer.encode(text, add_special_tokens=False) == [token_id]:
            words.append(token_id)
            if len(words) == count:
                break
    return words


@lru_cache(maxsize=1)
def load_world() -> World:
    from radixrt.constrained import GrammarBackend
    from radixrt.model.weights import resolve_model_path
    from radixrt.server_args import DEFAULT_MODEL
    from radixrt.tokenizer import eos_token_ids, load_tokenizer

    model_path = resolve_model_path(DEFAULT_MODEL)
    tokenizer = load_tokenizer(model_path)
    eos_ids = eos_token_ids(model_path, tokenizer)
    vocab_size = int(json.loads((model_path / "config.json").read_text())["vocab_size"])
    punctuation = [tokenizer.encode(p, add_special_tokens=False)[0] for p in (".", ",", "\n")][:NUM_PUNCTUATION]
    return World(
        model_path=model_path,
        tokenizer=tokenizer,
        eos_ids=eos_ids,
        vocab_size=vocab_size,
        word_ids=_pick_words(tokenizer, NUM_WORDS),
        punctuation_ids=punctuation,
        grammar_backend=GrammarBackend(tokenizer, eos_ids, vocab_size, jump_forward=True),
    )
