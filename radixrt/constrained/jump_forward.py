"""Jump-forward decoding: append the text a grammar forces in one step instead of one token a forward.

Where every continuation of the current state starts with the same text (``{"name": "`` in a JSON
schema, the rest of a choice once it is unambiguous), that text is appended at once. Tokenising the
forced text alone would give a token boundary the model never sees in ordinary text (``"`` then ``:``
where the tokenizer writes ``":``), so, like SGLang, the last few output tokens are decoded, the forced
text appended, and the whole re-encoded; the common prefix with the old tokens is kept, the rest of the
old tail is dropped and the new tokens appended. The matcher is rolled back over the dropped tokens and
replays the new ones, so its state equals the state after the forced text.

What the scheduler must do with a ``JumpForward`` ``jf`` for a request:
1. remove the last ``jf.num_tokens_to_drop`` output ids; free the KV slots of those that already have
   KV (in decode, every output token but the last one does) and uncache nothing else: the kept prefix is
   unchanged, so its KV stays valid;
2. append ``jf.tokens_to_append`` to the output ids and compute their KV in one extend (prefill-like)
   forward; the logits of the last one give the next token. Output text would change
   (``text_changed``) where dropped tokens were already streamed; radixrt's scheduler never lets that
   happen: it passes only the unsent, non-tree tail of the output ids and holds a constrained request's
   last few tokens back from emission until they are final (``Scheduler._jump_forward``).
The returned matcher state is already synchronised; do not call ``accept_token`` for the appended ids.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixrt.constrained.matcher import GrammarMatcher
from radixrt.token_ids import common_prefix_len


@dataclass(frozen=True)
class JumpForward:
    num_tokens_to_drop: int  # trailing output tokens to remove (their KV must be recomputed)
    tokens_to_append: list[int]  # new output tokens (need one extend forward)
    forced_text: str  # the text the grammar forced

    @property
    def text_changed(self) -> bool:
        return self.num_tokens_to_drop > 0


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def jump_forward(
    matcher: GrammarMatcher,
    output_ids: list[int],
    tokenizer,
    window: int = 4,
    max_tokens_to_append: int | None = None,
) -> JumpForward | None:
    """Apply jump-forward to ``matcher`` if its state forces some text; None (nothing changed) if not.

    ``output_ids``: the request's output tokens so far, all accepted by ``matcher`` (the last
    ``matcher.num_accepted`` of them are re-tokenisable). ``window``: how many trailing tokens are
    re-tokenised with the forced text (extended backwards to a character boundary).
    ``max_tokens_to_append``: cap (the request's remaining ``max_new_tokens``); the appended tokens are
    cut to it, still a valid prefix.
    """
    text = matcher.jump_forward_text()
    if not text:
        return None
    info = matcher.grammar.info
    limit = min(len(output_ids), matcher.num_accepted - int(matcher.terminated))
    forced = text.encode("utf-8")
    plan = None
    for k in _tail_lengths(output_ids, info, min(window, limit), limit):
        tail_ids = list(output_ids[len(output_ids) - k :]) if k else []
        if any(info.token_bytes[i] is None for i in tail_ids):
            continue
        tail = info.decode_bytes(tail_ids)
        try:
            prefix = tail.decode("utf-8")
        except UnicodeDecodeError:
            continue
        new_ids = _encode(tokenizer, prefix + text)
        if any(i >= info.vocab_size or info.token_bytes[i] is None for i in new_ids):
            continue  # the text spelled a special token: leave it to ordinary decoding
        if info.decode_bytes(new_ids) != tail + forced:
            continue
        common = common_prefix_len(tail_ids, new_ids)
        plan = (k - common, new_ids[common:])
        break
    if plan is None:
        return None
    drop, append = plan
    if max_tokens_to_append is not None:
        append = append[: max(0, max_tokens_to_append)]
    if not append and not drop:
        return None
    trial = matcher.copy()
    trial.rollback(drop)
    if not trial.accept_tokens(append):
        return None
    matcher.rollback(drop)
    matcher.accept_tokens(append)
    return JumpForward(num_tokens_to_drop=drop, tokens_to_append=append, forced_text=text)


def _tail_lengths(output_ids: list[int], info, preferred: int, limit: int):
    """Candidate numbers of trailing tokens to re-tokenise: ``preferred`` extended backwards until the
    tail starts on a character boundary (at most 4 more), then 0 (forced text on its own)."""
    k = preferred
    while k < limit and k - preferred < 4:
        first = info.token_bytes[output_ids[len(output_ids) - k]] if k else b"x"
        if first and not (0x80 <= first[0] < 0xC0):
            break
        k += 1
    if k > 0:
        yield k
    yield 0
