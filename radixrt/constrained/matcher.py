"""Per-request grammar state: which tokens may come next, what the request has accepted so far."""

from __future__ import annotations

import torch

from radixrt.constrained.grammar import CLOSING_HORIZON, Grammar


class GrammarMatcher:
    """The state of one request in its ``Grammar``; cheap (a list of ints), one per request.

    It remembers the state after every accepted token, so ``rollback(n)`` can undo the last ``n``
    (jump-forward re-tokenisation, retraction) and ``copy()`` forks it (n > 1, DSL fork).
    """

    __slots__ = ("grammar", "_states", "terminated")

    def __init__(self, grammar: Grammar):
        self.grammar = grammar
        self._states: list[int] = [grammar.initial_state]
        self.terminated = False  # an eos token was accepted

    @property
    def state(self) -> int:
        return self._states[-1]

    @property
    def num_accepted(self) -> int:
        """Tokens accepted so far (an accepted eos counts)."""
        return len(self._states) - 1 + int(self.terminated)

    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False (state unchanged) when the grammar forbids it.
        An eos id is accepted only in an accepting state, and ends the matcher."""
        if self.terminated:
            return False
        token_id = int(token_id)
        if token_id in self.grammar.info.eos_token_ids:
            if self.grammar.is_accepting(self.state) or not self.grammar.has_continuation(self.state):
                self.terminated = True
                return True
            return False
        following = self.grammar.next_state(self.state, token_id)
        if following is None:
            return False
        self._states.append(following)
        return True

    def accept_tokens(self, token_ids) -> bool:
        """Accept all of ``token_ids`` or none of them (True when all were accepted)."""
        accepted = 0
        for token_id in token_ids:
            if not self.accept_token(token_id):
                self.rollback(accepted)
                return False
            accepted += 1
        return True

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""
        if num_tokens < 0 or num_tokens > self.num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self.num_accepted} accepted")
        if num_tokens and self.terminated:
            self.terminated = False
            num_tokens -= 1
        if num_tokens:
            del self._states[-num_tokens:]

    def reset(self) -> None:
        self._states = [self.grammar.initial_state]
        self.terminated = False

    def copy(self) -> "GrammarMatcher":
        other = GrammarMatcher.__new__(GrammarMatcher)
        other.grammar = self.grammar
        other._states = list(self._states)
        other.terminated = self.terminated
        return other

    def fill_bitmask(self, row: torch.Tensor) -> None:
        """Write the allowed tokens of the current state into ``row`` (int32 ``[words]``, packed bits,
        see ``masks``). eos is set only where the grammar may end."""
        row.copy_(self.allowed_row())

    def allowed_row(self) -> torch.Tensor:
        """The cached packed row of the current state (do not modify)."""
        return self.grammar.allowed_row(self.state)

    def is_allowed(self, token_id: int) -> bool:
        row = self.allowed_row()
        return 0 <= token_id < self.grammar.mask_vocab_size and bool((int(row[token_id // 32]) >> (token_id % 32)) & 1)

    def can_terminate(self) -> bool:
        """The output so far is a full match: eos may come now."""
        return self.grammar.is_accepting(self.state)

    def is_finished(self) -> bool:
        """Nothing may follow: eos was accepted, or the state accepts and only eos may follow.
        The scheduler ends the request (finish reason: stop) without sampling again."""
        return self.terminated or (self.can_terminate() and not self.grammar.has_continuation(self.state))

    def closing_token(self, budget: int) -> int | None:
        """The token to write now so that the text still matches within ``budget`` more tokens: the first byte
        of the shortest way to a match, once the budget is no longer than that way; in a matching state, eos
        when going on could not match again within the budget (a further tool call); else None."""
        if self.terminated or budget <= 0:
            return None
        if self.grammar.is_accepting(self.state):
            if not self.grammar.has_continuation(self.state):
                return None
            again = self.grammar.reopen(self.state)
            if again < 0:  # no way back within the horizon: stop once the budget is inside it
                return self.grammar.info.eos_token_ids[0] if budget <= CLOSING_HORIZON else None
            return self.grammar.info.eos_token_ids[0] if again > budget else None
        length, token = self.grammar.closing(self.state)
        return token if token is not None and budget <= length else None

    def out_of_reach(self, budget: int) -> list[int]:
        """In a matching state with ``budget`` tokens left (within ``CLOSING_HORIZON``): the tokens that would
        begin something (a call, a structure) whose shortest way back to a match is longer than the rest of the
        budget, so that the output cannot be cut inside it at max_new_tokens."""
        if self.terminated or not 0 < budget <= CLOSING_HORIZON or not self.grammar.is_accepting(self.state):
            return []
        out = []
        for token, nxt in self.grammar.leaving(self.state):
            length = self.grammar.closing(nxt)[0]
            if length < 0 or length > budget - 1:
                out.append(token)
        return out

    def jump_forward_text(self) -> str | None:
        """The text every valid continuation starts with from here (whole characters), if any."""
        if self.terminated:
            return None
        text, _ = self.grammar.forced_text(self.state)
        return text or None

    def __repr__(self) -> str:
        return f"GrammarMatcher(state={self.state}, accepted={self.num_accepted}, terminated={self.terminated})"
