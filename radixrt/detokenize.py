"""Incremental detokenization with stop strings and stop regexes.

Token ids arrive a few at a time; text is emitted only once it is stable (no partial UTF-8 sequence at the
end) and never includes a matched stop string or stop-regex match (radixrt.sampling.stop_regex): the text ends
where the earliest one starts. While streaming, text that could still become the start of either is held back
until the next tokens decide it. The scheduler runs the same class to decide when a request stops, so what it
stops on and what the client is sent agree.
"""

from __future__ import annotations

import logging

import msgspec

from radixrt.protocol.messages import BatchStrOut, BatchTokenOut, FinishReason, ReqDelta, StrDelta
from radixrt.sampling.stop_regex import first_match, may_match_from

logger = logging.getLogger("radixrt.detokenize")


def fast_decode(tokenizer):
    """``tokenizer.decode``, or the Rust tokenizer's own decode where both give the same text (a fast tokenizer
    that cleans up no tokenization spaces): a third of the time, paid per request and step."""
    rust = _rust_tokenizer(tokenizer)
    if rust is not None:
        return lambda ids, skip_special_tokens: rust.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids, skip_special_tokens: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def batch_decode(tokenizer):
    """Many id lists to their texts at once: the Rust tokenizer's ``decode_batch`` where ``fast_decode`` uses the
    Rust tokenizer. It releases the GIL while it decodes, so the scheduler thread runs meanwhile (decoding one
    list at a time holds the GIL for each, which at batch 256 took about a millisecond of every step)."""
    rust = _rust_tokenizer(tokenizer)
    if rust is not None:
        return lambda lists, skip_special_tokens: rust.decode_batch(lists, skip_special_tokens=skip_special_tokens)
    return lambda lists, skip_special_tokens: [tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
                                               for ids in lists]


def _rust_tokenizer(tokenizer):
    rust = getattr(tokenizer, "_tokenizer", None)
    if rust is not None and hasattr(rust, "decode") and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return rust
    return None


def decoder_json(tokenizer) -> str | None:
    """The Rust tokenizer through which ``fast_decode`` decodes, serialized (the tokenizers library's JSON), or
    None where decoding needs transformers: with it a process that only decodes loads in a tenth of a second
    what transformers takes seconds (and torch) to load, and decodes the very same text."""
    rust = _rust_tokenizer(tokenizer)
    return None if rust is None else rust.to_str()


class RustDecoder:
    """A fast tokenizer's Rust half alone (from ``decoder_json``): all the decoding a Detokenizer does."""

    clean_up_tokenization_spaces = False

    def __init__(self, json_text: str) -> None:
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_str(json_text)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class TextStream:
    def __init__(self, tokenizer, stop: list[str] | None = None, skip_special_tokens: bool = True,
                 prompt_tail: list[int] | None = None, decode=None, stop_regex: list[str] | None = None) -> None:
        self.tokenizer = tokenizer
        self._decoder = decode or fast_decode(tokenizer)
        self.stop = [s for s in (stop or []) if s]
        self.stop_regex = list(stop_regex or [])
        self.skip_special_tokens = skip_special_tokens
        # A few prompt tokens give the decoder its left context (leading spaces of SentencePiece-style vocabularies).
        self.ids: list[int] = list(prompt_tail or [])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""  # all stable text so far
        self.emitted = 0  # chars of self.text already handed out
        self.stopped_at: str | None = None  # the stop string (or stop regex pattern) that ended the text

    def _decode(self, ids: list[int]) -> str:
        return self._decoder(ids, self.skip_special_tokens)

    def add(self, new_ids: list[int]) -> None:
        pending = self.extend(new_ids)
        if pending is not None:
            self.decoded(*(self._decode(ids) for ids in pending))

    def extend(self, new_ids: list[int]) -> tuple[list[int], list[int]] | None:
        """``add`` in two halves, for a caller that decodes many streams' ids at once: take the ids and return the
        two id lists to decode (None: nothing to decode), then pass their texts to ``decoded``."""
        if self.stopped_at is not None:
            return None
        self.ids.extend(new_ids)
        return self.ids[self.prefix_offset : self.read_offset], self.ids[self.prefix_offset :]

    def decoded(self, prefix_text: str, full_text: str) -> None:
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            self._append(full_text[len(prefix_text) :])
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)

    def _append(self, delta: str) -> None:
        if not self.stop and not self.stop_regex:
            self.text += delta
            return
        start = max(0, len(self.text) - max((len(s) for s in self.stop), default=0) + 1)
        self.text += delta
        hits = [(self.text.find(s, start), s) for s in self.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if self.stop_regex:  # a match may start anywhere: the whole text is searched
            hit = first_match(self.stop_regex, self.text)
            if hit is not None:
                hits.append(hit)
        if hits:
            cut, matched = min(hits)
            self.text = self.text[:cut]
            self.stopped_at = matched

    def finish(self) -> None:
        """End of generation: flush an incomplete trailing character as the tokenizer renders it."""
        if self.stopped_at is None and self.read_offset < len(self.ids):
            prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
            full_text = self._decode(self.ids[self.prefix_offset :])
            if len(full_text) > len(prefix_text):
                self._append(full_text[len(prefix_text) :])
            self.read_offset = len(self.ids)

    def take(self, final: bool) -> str:
        """Text not handed out yet; unless ``final``, holds back a tail that may begin a stop string."""
        end = len(self.text)
        if not final and self.stopped_at is None:
            for stop in self.stop:
                for k in range(min(len(stop) - 1, end - self.emitted), 0, -1):
                    if self.text.endswith(stop[:k]):
                        end = min(end, len(self.text) - k)
                        break
            if self.stop_regex:
                end = min(end, max(self.emitted, may_match_from(self.stop_regex, self.text, self.emitted)))
        out = self.text[self.emitted : end]
        self.emitted = end
        return out


class Detokenizer:
    """Turns the scheduler's token deltas into text deltas, one TextStream per live request.

    A request whose text cannot be rendered ends there with a 500-coded abort (its client is answered and
    should abort it in the scheduler); the other requests of the batch are not affected.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.decode = fast_decode(tokenizer)
        self.decode_many = batch_decode(tokenizer)
        self.streams: dict[str, TextStream] = {}

    def process(self, batch: BatchTokenOut) -> BatchStrOut:
        """Every delta's new text: the ids of all streams are decoded together, one call per
        ``skip_special_tokens`` value; a request whose text fails alone ends with an error."""
        seen: set[str] = set()
        for index, delta in enumerate(batch.deltas):
            if delta.rid in seen:  # a request's second delta (the scheduler sends one): after its first
                head = self._process(batch.deltas[:index]).outputs
                return BatchStrOut(head + self.process(BatchTokenOut(batch.deltas[index:])).outputs)
            seen.add(delta.rid)
        return self._process(batch.deltas)

    def _process(self, deltas: list[ReqDelta]) -> BatchStrOut:
        streams: list[TextStream] = []
        pending: dict[bool, list[tuple[int, tuple[list[int], list[int]]]]] = {}
        for index, delta in enumerate(deltas):
            stream = self._stream(delta)
            streams.append(stream)
            ids = stream.extend(delta.new_ids)
            if ids is not None:
                pending.setdefault(delta.skip_special_tokens, []).append((index, ids))
        texts: dict[int, tuple[str, str] | Exception] = {}
        for skip, items in pending.items():
            try:
                flat = self.decode_many([ids for _, pair in items for ids in pair], skip)
                texts.update((index, (flat[2 * k], flat[2 * k + 1])) for k, (index, _) in enumerate(items))
            except Exception:  # find the request(s) that cannot be decoded: one by one
                for index, pair in items:
                    try:
                        texts[index] = (self.decode(pair[0], skip), self.decode(pair[1], skip))
                    except Exception as exc:
                        texts[index] = exc
        outputs = []
        for index, (delta, stream) in enumerate(zip(deltas, streams)):
            try:
                text = texts.get(index)
                if isinstance(text, Exception):
                    raise text
                if text is not None:
                    stream.decoded(*text)
                outputs.append(self._finish_one(delta, stream))
            except Exception as exc:
                logger.error("could not detokenize request %s: %r", delta.rid, exc, exc_info=exc)
                self.streams.pop(delta.rid, None)
                reason = FinishReason.error(f"internal error while detokenizing: {exc!r}", 500)
                outputs.append(StrDelta(rid=delta.rid, text="", delta=msgspec.structs.replace(
                    delta, new_ids=[], finish_reason=reason)))
        return BatchStrOut(outputs)

    def _stream(self, delta: ReqDelta) -> TextStream:
        stream = self.streams.get(delta.rid)
        if stream is None:
            stream = TextStream(self.tokenizer, delta.stop, delta.skip_special_tokens, decode=self.decode,
                                stop_regex=delta.stop_regex)
            self.streams[delta.rid] = stream
        return stream

    def _finish_one(self, delta: ReqDelta, stream: TextStream) -> StrDelta:
        final = delta.finish_reason is not None
        if final:
            stream.finish()
            del self.streams[delta.rid]
        return StrDelta(rid=delta.rid, text=stream.take(final), delta=delta)
