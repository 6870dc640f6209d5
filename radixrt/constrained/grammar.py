"""Compiled grammars (an outlines-core token ``Index`` plus per-state caches) and their compiler.

``GrammarCompiler`` turns a request's constraint into a ``Grammar`` off the scheduler's thread:
``validate`` is fast and raises ``ValueError`` for bad input (the HTTP layer calls it before the
request is queued); ``compile_async`` returns a ``Future`` at once, compiling in a thread pool (the
Rust index builder releases the GIL, so other requests keep decoding meanwhile). Compiled grammars are
kept in an LRU cache keyed by (kind, normalised spec); one compiler serves one tokenizer.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from radixrt.constrained import patterns
from radixrt.constrained.vocabulary import END_TEXT, END_TOKEN_ID, TokenizerInfo, get_tokenizer_info

KINDS = patterns.KINDS
# How far ahead (bytes) the shortest way to a match is looked for when a request's token budget runs low.
CLOSING_HORIZON = 64


def end_anchored(regex: str) -> str:
    """The regex the token index is built from: ``regex`` followed by the end-of-match character.

    outlines-core's index drops a transition that leaves a state where the regex may already end for one
    where it may not (its DFA reports matches one byte late), and its DFA prefers the first alternative that
    matches (leftmost-first), dropping longer matches of later ones: ``a(,b)*`` would never produce ``a,b``
    one byte at a time, nor ``(a|ab)`` produce ``ab``. With an end character that only a pseudo-token spells,
    the regex may end only after that character, so no state of the text itself is final and both effects
    are gone; a state accepts where the pseudo-token leads to a final state. Real tokens could still spell
    the character byte by byte (byte-level vocabularies have a token per byte); ``Grammar`` masks the few
    tokens that would lead into it.
    """
    return f"({regex}){END_TEXT}"


class Grammar:
    """One compiled constraint: immutable, shared by every request that uses the same spec.

    States are outlines-core index states (ints). Per state it caches, on first visit, the packed
    bitmask row of allowed tokens, whether it is accepting, whether anything but eos may follow, and
    the forced continuation bytes (for jump-forward). Reads and the lazy fill are safe from any thread.
    """

    def __init__(self, kind: str, spec_key: str, regex: str, index, info: TokenizerInfo, mask_vocab_size: int):
        self.kind = kind
        self.spec_key = spec_key
        self.regex = regex
        self.index = index
        self.info = info
        self.mask_vocab_size = mask_vocab_size  # bits per mask row (the model's logits width)
        self.words = (mask_vocab_size + 31) // 32
        self.initial_state: int = index.get_initial_state()
        self.compile_seconds = 0.0
        self._final = frozenset(index.get_final_states())
        self._accepting: dict[int, bool] = {}
        self._dead: dict[int, bool] = {}
        self._closing: dict[int, tuple[int, int | None]] = {}
        self._reopen: dict[int, int] = {}
        self._leaving: dict[int, list[tuple[int, int]]] = {}
        self._rows: dict[int, torch.Tensor] = {}
        self._token_masks: dict[int, tuple[int, torch.Tensor]] = {}
        self._continues: dict[int, bool] = {}
        self._forced_byte: dict[int, int] = {}
        self._forced: dict[int, tuple[bytes, int]] = {}
        self._forced_text: dict[int, tuple[str, int]] = {}
        self._lock = threading.Lock()
        self._eos_bits = [t for t in info.eos_token_ids if t < mask_vocab_size]

    # -- transitions

    def next_state(self, state: int, token_id: int) -> int | None:
        """State after ``token_id`` (a grammar token, not eos), or None when it is not allowed."""
        if token_id in self.info.eos_token_ids:
            return None
        return self.index.get_next_state(state, token_id)

    def is_accepting(self, state: int) -> bool:
        """The text so far is a whole match: the end-of-match pseudo-token leads to a final state."""
        accepting = self._accepting.get(state)
        if accepting is None:
            following = self.index.get_next_state(state, END_TOKEN_ID)
            accepting = self._accepting[state] = following is not None and following in self._final
        return accepting

    def _is_dead(self, state: int) -> bool:
        """Real text cannot go on from ``state`` to a match: it lies inside (or after) the end-of-match
        character, reached by spelling its bytes with real tokens."""
        dead = self._dead.get(state)
        if dead is None:
            self._dead[state] = False  # provisional, for cycles
            dead = not self.is_accepting(state) and all(
                t in self.info.end_fragments and self._is_dead(self.index.get_next_state(state, t))
                for t in self.index.get_allowed_tokens(state)
                if t < self.info.vocab_size and t not in self.info.eos_token_ids)
            self._dead[state] = dead
        return dead

    def has_continuation(self, state: int) -> bool:
        """Whether some non-eos token may follow ``state``."""
        if state not in self._continues:
            self._visit(state)
        return self._continues[state]

    def allowed_row(self, state: int) -> torch.Tensor:
        """Packed allowed-token bits of ``state``: int32 ``[words]``, bit ``i % 32`` of word ``i // 32``."""
        row = self._rows.get(state)
        if row is None:
            self._visit(state)
            row = self._rows[state]
        return row

    def token_mask(self, state: int) -> tuple[int, torch.Tensor]:
        """The cheapest form of ``state``'s mask for ``masks.apply_token_masks`` (cached):
        ``(MASK_ALLOWED, int64 ids)`` when few tokens are allowed, ``(MASK_DISALLOWED, int64 ids)`` when
        few are not, else ``(MASK_DENSE, float32 [mask_vocab_size] row of 0.0 / -inf)``."""
        mask = self._token_masks.get(state)
        if mask is None:
            from radixrt.constrained.masks import token_mask_of_row

            mask = token_mask_of_row(self.allowed_row(state), self.mask_vocab_size)
            with self._lock:
                self._token_masks[state] = mask
        return mask

    def _visit(self, state: int) -> None:
        allowed = np.asarray(self.index.get_allowed_tokens(state), dtype=np.int64)
        eos = np.isin(allowed, self.info.eos_token_ids)
        tokens = allowed[~eos]
        tokens = tokens[tokens < min(self.mask_vocab_size, self.info.vocab_size)]
        fragments = [t for t in tokens.tolist() if t in self.info.end_fragments]
        dead = [t for t in fragments if self._is_dead(self.index.get_next_state(state, t))]
        if dead:
            tokens = tokens[~np.isin(tokens, dead)]
        bits = np.zeros(self.words * 32, dtype=bool)
        bits[tokens] = True
        accepting = self.is_accepting(state)
        if accepting or tokens.size == 0:
            # eos only where the grammar may end (or, defensively, where nothing else is left).
            bits[self._eos_bits] = True
        row = torch.from_numpy(np.packbits(bits, bitorder="little").view(np.int32).copy())
        first = self.info.first_byte[tokens] if tokens.size else np.empty(0, dtype=np.int16)
        forced = int(first[0]) if first.size and not accepting and (first == first[0]).all() else -1
        with self._lock:
            self._continues[state] = bool(tokens.size)
            self._forced_byte[state] = forced
            self._rows[state] = row

    # -- closing within a budget

    def closing(self, state: int) -> tuple[int, int | None]:
        """The shortest way from ``state`` to a match, one byte a token: (its length in bytes, the token of
        its first byte). (0, None) where the text already matches; (-1, None) where no way of at most
        ``CLOSING_HORIZON`` bytes exists. Cached, for every state on the path found."""
        cached = self._closing.get(state)
        if cached is not None:
            return cached
        parent: dict[int, tuple[int, int]] = {}
        frontier, depth, found = [state], 0, None
        seen = {state}
        while frontier and found is None and depth <= CLOSING_HORIZON:
            following = []
            for current in frontier:
                known = self._closing.get(current)
                if self.is_accepting(current) or (known is not None and known[0] >= 0 and current != state):
                    found = current
                    break
                for token in self.info.byte_tokens.values():
                    nxt = self.index.get_next_state(current, token)
                    if nxt is None or nxt in seen or (token in self.info.end_fragments and self._is_dead(nxt)):
                        continue
                    seen.add(nxt)
                    parent[nxt] = (current, token)
                    following.append(nxt)
            frontier = following
            depth += 1
        if found is None:
            result = self._closing[state] = (-1, None)
            return result
        tail = 0 if self.is_accepting(found) else self._closing[found][0]
        path = []
        node = found
        while node != state:
            node, token = parent[node]
            path.append((node, token))
        with self._lock:
            self._closing.setdefault(found, (0, None))
            for distance, (node, token) in enumerate(path, start=1):
                self._closing[node] = (distance + tail, token)
        return self._closing[state]

    def reopen(self, state: int) -> int:
        """From a matching ``state``: the shortest way (bytes) through more text to a match again, e.g. a
        whole further call after a tool call; -1 where none is within ``CLOSING_HORIZON`` bytes. Cached."""
        cached = self._reopen.get(state)
        if cached is None:
            cached = -1
            for token in self.info.byte_tokens.values():
                nxt = self.index.get_next_state(state, token)
                if nxt is None or (token in self.info.end_fragments and self._is_dead(nxt)):
                    continue
                length = self.closing(nxt)[0]
                if length >= 0 and (cached < 0 or length + 1 < cached):
                    cached = length + 1
            self._reopen[state] = cached
        return cached

    def leaving(self, state: int) -> list[tuple[int, int]]:
        """From an accepting ``state``: (token, next state) of the allowed tokens after which the text no longer
        matches (the start of a call, of a structure), e.g. the few hundred tokens of a free text that begin a
        marker. One pass over the allowed tokens on first use, cached."""
        cached = self._leaving.get(state)
        if cached is None:
            cached = []
            for token in self.index.get_allowed_tokens(state):
                if token >= self.info.vocab_size or token in self.info.eos_token_ids:
                    continue
                nxt = self.index.get_next_state(state, token)
                if nxt is not None and not self.is_accepting(nxt):
                    cached.append((token, nxt))
            with self._lock:
                self._leaving[state] = cached
        return cached

    # -- jump-forward

    def forced_bytes(self, state: int) -> tuple[bytes, int]:
        """The bytes every continuation from ``state`` must start with, and the state after them.

        A byte is forced while the state is not accepting and every allowed token starts with it; the
        walk steps through the single-byte token of that byte. Empty when nothing is forced.
        """
        cached = self._forced.get(state)
        if cached is not None:
            return cached
        out = bytearray()
        current = state
        seen = {state}
        while True:
            if current not in self._forced_byte:
                self._visit(current)
            byte = self._forced_byte[current]
            token = self.info.byte_tokens.get(byte) if byte >= 0 else None
            following = self.index.get_next_state(current, token) if token is not None else None
            if following is None or following in seen:
                break
            out.append(byte)
            current = following
            seen.add(current)
        result = (bytes(out), current)
        with self._lock:
            self._forced[state] = result
        return result

    def forced_text(self, state: int) -> tuple[str, int]:
        """``forced_bytes`` cut to whole UTF-8 characters, and the state after that text."""
        cached = self._forced_text.get(state)
        if cached is not None:
            return cached
        result = self._compute_forced_text(state)
        with self._lock:
            self._forced_text[state] = result
        return result

    def _compute_forced_text(self, state: int) -> tuple[str, int]:
        data, _ = self.forced_bytes(state)
        if not data or 0x80 <= data[0] < 0xC0:  # empty, or the state sits inside a character
            return "", state
        cut = len(data)
        while cut > 0:
            try:
                text = data[:cut].decode("utf-8")
                break
            except UnicodeDecodeError:
                cut -= 1
        else:
            return "", state
        current = state
        for byte in data[:cut]:
            current = self.index.get_next_state(current, self.info.byte_tokens[byte])
        return text, current

    def matcher(self):
        """A fresh per-request ``GrammarMatcher`` at the initial state."""
        from radixrt.constrained.matcher import GrammarMatcher

        return GrammarMatcher(self)

    def __repr__(self) -> str:
        return f"Grammar({self.kind}, regex={self.regex[:60]!r}{'...' if len(self.regex) > 60 else ''})"


class GrammarCompiler:
    """Validates and compiles constraints for one tokenizer; an LRU cache of compiled grammars.

    ``vocab_size``: the width of the model's logits (defaults to the tokenizer's size); mask rows have
    this many bits, ids the tokenizer lacks are never allowed. ``json_whitespace``: regex allowed
    between JSON tokens (default "": compact JSON, the best for jump-forward; outlines' is ``[ ]?``).
    """

    def __init__(
        self,
        tokenizer,
        eos_token_ids,
        cache_size: int = 64,
        max_workers: int = 1,
        vocab_size: int | None = None,
        json_whitespace: str = "",
    ):
        self.json_whitespace = json_whitespace
        self.info = get_tokenizer_info(tokenizer, eos_token_ids)
        self.vocab_size = max(vocab_size or 0, self.info.vocab_size)
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar")
        self.hits = 0
        self.misses = 0

    # -- validation (fast, on the caller's thread)

    def validate(self, kind: str, spec: Any = None) -> str:
        """The regex ``spec`` compiles to, or ``ValueError`` naming the problem. No token index is built."""
        _, regex = self._normalise(kind, spec)
        return regex

    def _normalise(self, kind: str, spec: Any) -> tuple[str, str]:
        """(cache key text, regex) for a constraint."""
        return patterns.normalise_constraint(kind, spec, self.json_whitespace)

    # -- compilation

    def compile_async(self, kind: str, spec: Any = None) -> "Future[Grammar]":
        """A future of the compiled grammar; never blocks. Invalid input fails the future with
        ``ValueError`` (call ``validate`` first to reject it earlier). Cached by (kind, spec)."""
        try:
            key_text, regex = self._normalise(kind, spec)
        except ValueError as exc:
            failed: Future = Future()
            failed.set_exception(exc)
            return failed
        key = (kind, key_text)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return future
            self.misses += 1
            future = self._pool.submit(self._build, kind, key_text, regex)
            self._cache[key] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        future.add_done_callback(lambda f, key=key: self._forget_failure(key, f))
        return future

    def compile(self, kind: str, spec: Any = None, timeout: float | None = None) -> Grammar:
        """Blocking convenience (tests, offline use)."""
        return self.compile_async(kind, spec).result(timeout)

    def _forget_failure(self, key, future: Future) -> None:
        if future.exception() is not None:
            with self._lock:
                if self._cache.get(key) is future:
                    del self._cache[key]

    def _build(self, kind: str, key_text: str, regex: str) -> Grammar:
        from outlines_core import Index

        start = time.perf_counter()
        try:
            index = Index(end_anchored(regex), self.info.vocabulary)
        except BaseException as exc:  # pyo3 may raise its own exception types
            raise ValueError(f"cannot compile {kind} into a token index: {exc}") from None
        grammar = Grammar(kind, key_text, regex, index, self.info, self.vocab_size)
        grammar.allowed_row(grammar.initial_state)  # warm the first state off the hot path
        grammar.forced_bytes(grammar.initial_state)
        grammar.compile_seconds = time.perf_counter() - start
        return grammar

    def cached(self, kind: str, spec: Any = None) -> bool:
        try:
            key_text, _ = self._normalise(kind, spec)
        except ValueError:
            return False
        with self._lock:
            return (kind, key_text) in self._cache

    def __len__(self) -> int:
        return len(self._cache)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
