"""Speculative decoding in the scheduler's own batches: draft, verify, keep what the model agrees with.

``--speculative-algorithm NGRAM`` turns it on. Each step, ``draft`` gives every decoding request that may
speculate a draft (``radixrt.scheduler.drafts``: the radix cache's continuation of its exact context, else
the longest suffix match in its own context or in recent requests' text), as long as the request's adaptive
length allows and pages can be had without retracting anyone; the plan entry ``(req, 1)`` becomes
``(req, 1 + len(req.draft))``. The forward computes the last token and the draft together, one logits row
each; ``OutputProcessor`` then verifies (``rows`` gives each row's view of the request).

Verification: row i's token is the one the request would have produced, without speculation, after the
first i draft tokens (penalties, bans, grammar masks and sampling as for any token; the grammar state of row
i comes from checking the draft against the grammar at draft time, which also cuts the draft at the first
token the grammar refuses). The draft's longest prefix equal to those tokens is accepted, plus the next row's
token: ``accepted + 1`` tokens per verify step, taken one by one through the usual finish checks.

Sampled requests keep their distribution and their tokens: row i draws the noise of the output index it samples
(radixrt.sampling.draws: a hash of the request's seed and that index), so the k-th output token always meets the
same draw, speculation on or off, and rows past the first rejection leave nothing to rewind. Accepting a draft
token exactly when the sampled token equals it is the standard rejection rule for a draft that is a point
mass (accepted with probability p(d); otherwise a token from p without d), coupled to the same draws.

Pages: a draft's tokens get pages like any others (free pages, then evicting cached pages no request holds);
after verification the pages past the next token's are freed at once (``Memory.trim``).

Adaptation: each request keeps an estimate of how often its drafts' tokens are accepted (decayed counts
with a prior), one per class of evidence (how many tokens of the context the match agreed on: 1-2, 3-4, 5-7,
8 or more), each drawn towards the request's overall estimate until it has counts of its own, and drafts the
length that maximises expected tokens per unit of cost. As in SuffixDecoding, a long match is better evidence
than a short one: a one-token match on ``"`` proposes whatever followed some quote, a ten-token match proposes
what followed this very phrase; so a request drafts long after long matches and stops drafting after short
ones once they have failed, instead of one rate mixing the two. An n-gram draft is also weighed token by
token against every earlier occurrence of the latest tokens (``drafts.support``): the class's estimate is
the prior, and where those occurrences went on alike the chance of a draft token rises, where they parted
ways (a value after a shared key) it falls, so a draft stops where the text it copies is likely to differ.
Replayed offline over the bench's workloads (``spec_replay``), it gave 3.5% more tokens per unit of cost on
extraction at a batch-8 token cost on 2 vCPUs and 6-10% on extraction and refinement where a token costs three
times that, and moved the others by less than 2%. The cost of a draft token
comes from the steps themselves (``StepCost``: a decode or verify step's time fitted as ``a + b * tokens``):
one more token costs ``b`` against a request's share ``(a + b * batch) / batch`` of a decode step, which is
little at batch 1 (a step reads every weight once whatever it computes) and more in a large batch on a small
CPU. A request whose drafts keep failing stops drafting and probes again as its estimate relaxes towards the
prior. A greedy request trusts a continuation from the radix cache more: the whole context matched, so the
model wrote those very tokens after it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING


from radixrt.memory.radix_cache import namespaced, plain
from radixrt.scheduler.drafts import ContextIndex, History, Match, cache_continuation, candidates, ngram_match, support
from radixrt.scheduler.memory import Memory
from radixrt.scheduler.request import Req

if TYPE_CHECKING:
    from radixrt.constrained.matcher import GrammarMatcher
    from radixrt.memory.radix_cache import RadixCache
    from radixrt.sampling.params import SamplingParams
    from radixrt.scheduler.batch import Plan
    from radixrt.server_args import ServerArgs

logger = logging.getLogger("radixrt.scheduler")

ALGORITHMS = ("NGRAM",)
# One more token in a step as a fraction of a request's share of a decode step, until steps of different
# sizes have been timed.
DEFAULT_TOKEN_COST = 0.1
# The least a token may be taken to cost: a fitted slope at or below zero is timing noise (steps of more tokens
# timed faster, as an AMX CPU gave at batch 1 on a 135M model), and no token is free: it takes a slot and a row.
MIN_TOKEN_COST = 0.01
MIN_GAIN = 1.02  # a draft must promise this many tokens per unit of cost, relative to plain decoding
PRIOR_ACCEPTED, PRIOR_REJECTED = 1.0, 1.0  # the acceptance estimate starts at one half
DECAY = 0.8  # weight of earlier verify steps in the estimate
RELAX = 0.95  # per step without a draft: the estimate's counts shrink towards the prior
CACHE_RATE = 0.9  # acceptance assumed, at least, for a greedy request's continuation of its exact context
EVIDENCE_CLASSES = (3, 5, 8)  # matches agreeing on < 3, 3-4, 5-7 and >= 8 tokens keep estimates of their own
CLASS_PRIOR = 2.0  # weight of the overall estimate in a class's (pseudo-counts)
SUPPORT_PRIOR = 8.0  # weight of the class's estimate against the earlier occurrences' (``drafts.support``) at a token


def evidence_class(agreed: int) -> int:
    """The class of a match that agreed on ``agreed`` tokens of the context (0: the weakest)."""
    return sum(agreed >= edge for edge in EVIDENCE_CLASSES)


@dataclass
class SpecState:
    """One request's speculation: its context index, acceptance estimates (overall and per evidence class)
    and counters."""

    index: ContextIndex
    accepted_weight: float = 0.0
    rejected_weight: float = 0.0
    class_accepted: list[float] = field(default_factory=lambda: [0.0] * (len(EVIDENCE_CLASSES) + 1))
    class_rejected: list[float] = field(default_factory=lambda: [0.0] * (len(EVIDENCE_CLASSES) + 1))
    draft_class: int = 0  # the evidence class of the draft being verified
    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # draft tokens that became output
    verify_steps: int = 0

    @property
    def rate(self) -> float:
        return (self.accepted_weight + PRIOR_ACCEPTED) / (
            self.accepted_weight + self.rejected_weight + PRIOR_ACCEPTED + PRIOR_REJECTED)

    def class_rate(self, cls: int) -> float:
        """The estimate for drafts of evidence class ``cls``: its own counts, drawn towards :attr:`rate`."""
        accepted, rejected = self.class_accepted[cls], self.class_rejected[cls]
        return (accepted + CLASS_PRIOR * self.rate) / (accepted + rejected + CLASS_PRIOR)

    @property
    def best_rate(self) -> float:
        return max(self.class_rate(c) for c in range(len(self.class_accepted)))

    def observe(self, cls: int, agreed: int, rejected: bool) -> None:
        self.accepted_weight = DECAY * self.accepted_weight + agreed
        self.rejected_weight = DECAY * self.rejected_weight + rejected
        self.class_accepted[cls] = DECAY * self.class_accepted[cls] + agreed
        self.class_rejected[cls] = DECAY * self.class_rejected[cls] + rejected

    def ngrams_pay(self, limit: int, token_cost: float) -> bool:
        """Whether even the best class's longest n-gram draft would pay (else only the radix cache is asked)."""
        return best_length(self.best_rate, limit, token_cost) > 0

    def draft_length(self, match: Match, limit: int, token_cost: float, trusted: bool = False,
                     weights: list[tuple[float, float]] | None = None) -> int:
        """How many of ``match``'s tokens (at most ``limit``) to draft, by the estimate of its evidence class;
        ``trusted``: a greedy request's continuation of its exact context, accepted at least ``CACHE_RATE``;
        ``weights``: the earlier occurrences' ``drafts.support`` for the match's tokens, which moves the class's
        estimate token by token towards how often those occurrences went on as the draft does there."""
        rate = self.class_rate(evidence_class(match.length))
        cap = min(len(match.tokens), limit)
        if trusted:
            return best_length(max(rate, CACHE_RATE), cap, token_cost)
        if weights is None:
            return best_length(rate, cap, token_cost)
        chances = [(agreeing + SUPPORT_PRIOR * rate) / (total + SUPPORT_PRIOR) for agreeing, total in weights[:cap]]
        return best_prefix(chances, token_cost)

    def relax(self) -> None:
        """Shrink every count towards the prior (a step in which no draft would pay)."""
        self.accepted_weight *= RELAX
        self.rejected_weight *= RELAX
        self.class_accepted = [w * RELAX for w in self.class_accepted]
        self.class_rejected = [w * RELAX for w in self.class_rejected]


@dataclass(slots=True)
class DraftRow:
    """A request as it stands after the first ``i`` draft tokens: what ``next_tokens`` reads for verify row i."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    return_logprob: bool
    top_logprobs_num: int
    seed: int | None
    grammar: GrammarMatcher | None
    token_ids_logprob: list[int] | None = None
    pending_output_logprobs: list = field(default_factory=list)
    pending_output_top: list = field(default_factory=list)
    pending_output_token_ids: list = field(default_factory=list)


def best_length(rate: float, cap: int, token_cost: float) -> int:
    """The draft length (0..cap) with the most expected tokens per unit of cost, for tokens each accepted with
    probability ``rate`` until the first rejection, each draft token costing ``token_cost`` of a decode."""
    return best_prefix([rate] * cap, token_cost)


def best_prefix(chances: Sequence[float], token_cost: float) -> int:
    """The draft length (0..len(chances)) with the most expected tokens per unit of cost, where draft token ``k``
    is accepted with probability ``chances[k]`` once the tokens before it are, each costing ``token_cost`` of a
    decode; 0 unless some length promises ``MIN_GAIN`` times plain decoding."""
    best, best_value = 0, MIN_GAIN
    expected, reach = 1.0, 1.0
    for k, chance in enumerate(chances, 1):
        reach *= chance  # the first k tokens all accepted
        expected += reach
        value = expected / (1.0 + token_cost * k)
        if value > best_value:
            best, best_value = k, value
    return best


class StepCost:
    """Decode and verify steps' times fitted as ``a + b * tokens`` by least squares, older steps forgotten.

    A step timed more than ``OUTLIER`` times what the fit predicts counts as that much: a step the machine stalled
    (another process, a page fault storm) would otherwise lift the intercept and flatten the slope for the next
    hundred steps, and a flat slope makes every draft look cheap (a verify run's step times replayed with one step
    in a hundred stalled 4x: the fitted cost of a token fell from 0.13 to below 0.08 for a quarter of the run, to
    0.05 at worst). A lasting change in speed still moves the fit, by up to half again a step at a time."""

    FORGET = 0.98  # weight of a step one step older
    MIN_SPREAD = 0.25  # weighted variance of the token counts below which the slope is not trusted
    OUTLIER = 1.5  # a step counts as at most this many times the time the fit predicts for it

    def __init__(self) -> None:
        self.sums = [0.0] * 5  # weights, tokens, seconds, tokens^2, tokens * seconds

    def line(self) -> tuple[float, float] | None:
        """The fitted (intercept, slope) in seconds, the slope at least 0; None until steps of different sizes
        have been timed."""
        w, x, y, xx, xy = self.sums
        if w < 2 or xx / w - (x / w) ** 2 < self.MIN_SPREAD:
            return None
        slope = (w * xy - x * y) / (w * xx - x * x)
        return (y - slope * x) / w, max(slope, 0.0)

    def observe(self, tokens: int, seconds: float) -> None:
        fitted = self.line()
        if fitted is not None:
            predicted = fitted[0] + fitted[1] * tokens
            if predicted > 0:
                seconds = min(seconds, self.OUTLIER * predicted)
        f = self.FORGET
        w, x, y, xx, xy = self.sums
        self.sums = [f * w + 1, f * x + tokens, f * y + seconds, f * xx + tokens * tokens, f * xy + tokens * seconds]

    def token_cost(self, batch: int) -> float:
        """One more token, as a fraction of one request's share of a decode step of ``batch`` requests."""
        fitted = self.line()
        if fitted is None:
            return DEFAULT_TOKEN_COST
        intercept, slope = fitted
        if intercept <= 0:
            return 1.0  # time grows with every token: drafts only where acceptance is near certain
        return max(slope * batch / (intercept + slope * batch), MIN_TOKEN_COST)


class Speculator:
    def __init__(self, args: ServerArgs, cache: RadixCache, memory: Memory, context_length: int,
                 long_rope_from: int | None = None) -> None:
        """``long_rope_from``: a LongRoPE model's original context, which a request rotated short drafts no token
        past (the scheduler computes it again, rotated long, once its sequence outgrows that context)."""
        if args.speculative_algorithm not in ALGORITHMS:
            raise ValueError(f"speculative_algorithm must be one of {', '.join(ALGORITHMS)}; "
                             f"got {args.speculative_algorithm!r}")
        self.max_draft = args.speculative_num_draft_tokens
        self.min_window = args.speculative_ngram_min_match_window_size
        self.max_window = args.speculative_ngram_max_match_window_size
        if self.max_draft < 1:
            raise ValueError("speculative_num_draft_tokens must be >= 1")
        if not 1 <= self.min_window <= self.max_window:
            raise ValueError("speculative n-gram match windows need 1 <= min <= max")
        if args.speculative_ngram_capacity < 1:
            raise ValueError("speculative_ngram_capacity must be >= 1")
        self.cache = cache
        self.memory = memory
        self.page_size = memory.page_size
        self.context_length = context_length
        self.long_rope_from = long_rope_from
        self.from_cache = not args.disable_speculative_cache_drafts and not cache.disabled
        self.history = History(args.speculative_ngram_capacity, self.min_window, self.max_window)
        self.drafted = 0
        self.accepted = 0
        self.verify_steps = 0
        self.sources: dict[str, int] = {"cache": 0, "context": 0, "history": 0}  # drafts by source
        # False: n-gram drafts' lengths from the evidence classes' estimates alone (what ``radixrt bench spec
        # --compare-unweighted`` measures the weighing against)
        self.weigh_by_support = True
        self.cost = StepCost()

    # ----- drafting ------------------------------------------------------------------------------------

    def draft(self, plan: Plan) -> Plan:
        """Extend the plan's decode entries by drafts (pages already reserved for their next tokens)."""
        out: Plan = []
        token_cost = self.cost.token_cost(len(plan))
        for req, n in plan:
            if n == 1 and req.num_to_compute == 1 and not req.finished:
                try:
                    n += self._draft(req, token_cost)
                except Exception:  # a draft is an optimisation: this request decodes one token instead
                    logger.exception("drafting for request %s failed", req.rid)
                    req.draft, req.draft_matchers = [], None
            out.append((req, n))
        return out

    def _draft(self, req: Req, token_cost: float) -> int:
        room = min(req.params.max_new_tokens - len(req.output_ids), self.context_length - req.total_len) - 1
        if self.long_rope_from is not None and not req.long_rope:
            room = min(room, self.long_rope_from - req.total_len)
        if room < 1:
            return 0
        state = req.spec
        tokens = req.fill_ids
        if state is None:
            state = req.spec = SpecState(ContextIndex(self.min_window, self.max_window))
        state.index.sync(tokens, len(req.prompt_ids) + req.num_sent)
        limit = min(self.max_draft, room)
        ngrams_pay = state.ngrams_pay(limit, token_cost)
        match = self._match(req, tokens, limit, ngrams_pay)
        length = 0
        if match is not None:
            trusted = match.source == "cache" and req.params.greedy  # the same context: the same tokens
            weights = None
            if match.source != "cache" and self.weigh_by_support:
                weights = support(match.tokens[:limit], candidates(state.index, self.history, tokens, limit))
            length = state.draft_length(match, limit, token_cost, trusted, weights)
        if length == 0:
            if not ngrams_pay:  # the estimates relax towards the prior: drafts are tried again later
                state.relax()
            return 0
        draft = match.tokens[:length]
        matchers = None
        if req.grammar is not None:
            draft, matchers = _check_against_grammar(req.grammar, draft)
        length = self.memory.grant_draft(req, len(draft))
        if length < 1:
            return 0
        req.draft = draft[:length]
        req.draft_matchers = matchers[: length + 1] if matchers is not None else None
        state.draft_class = evidence_class(match.length)
        self.sources[match.source] += 1
        return length

    def _match(self, req: Req, tokens: list[int], limit: int, ngrams: bool) -> Match | None:
        if self.from_cache and req.node is not None:
            tree_tokens = req.num_tree_pages * self.page_size
            tail = namespaced(tokens[tree_tokens:], req.cache_namespace)
            continuation = plain(cache_continuation(req.node, tail, self.page_size, limit), req.cache_namespace)
            if continuation:
                return Match(continuation, len(tokens), "cache")
        if not ngrams:
            return None
        return ngram_match(req.spec.index, self.history, tokens, limit)

    # ----- verification ---------------------------------------------------------------------------------

    def rows(self, req: Req) -> list[DraftRow]:
        """The request's view at each of its verify rows (row i: after the first i draft tokens)."""
        draft = req.draft
        matchers = req.draft_matchers
        return [DraftRow(req.params, req.prompt_ids, req.output_ids + draft[:i], req.return_logprob,
                         req.top_logprobs_num, req.seed, matchers[i] if matchers is not None else None,
                         req.token_ids_logprob)
                for i in range(len(draft) + 1)]

    def verified(self, req: Req, agreed: int, taken: int) -> None:
        """Account for a verify step: the model agreed with ``agreed`` draft tokens; ``taken`` tokens were
        appended (fewer than ``agreed + 1`` when the request finished on the way)."""
        state, drafted = req.spec, len(req.draft)
        used = min(agreed, taken)
        state.drafted += drafted
        state.accepted += used
        state.verify_steps += 1
        self.drafted += drafted
        self.accepted += used
        self.verify_steps += 1
        state.observe(state.draft_class, agreed, agreed < drafted)
        req.draft, req.draft_matchers = [], None

    def step_timed(self, plan: Plan, seconds: float) -> None:
        """A step that decoded or verified only (no prefill chunk) took ``seconds``."""
        self.cost.observe(sum(n for _, n in plan), seconds)

    def retired(self, req: Req) -> None:
        """A finished request: its text joins the history other requests draft from."""
        if req.output_ids:
            self.history.add(req.fill_ids)
        req.spec = None

    @property
    def accept_length(self) -> float:
        """Mean tokens per verify step (accepted drafts plus the one the model adds)."""
        return (self.accepted + self.verify_steps) / self.verify_steps if self.verify_steps else 0.0


def _check_against_grammar(grammar: GrammarMatcher, draft: list[int]) -> tuple[list[int], list[GrammarMatcher]]:
    """The draft up to the first token the grammar refuses, and the grammar's state before each verify row."""
    matchers = [grammar.copy()]
    for i, token in enumerate(draft):
        following = matchers[-1].copy()
        if not following.accept_token(token):
            return draft[:i], matchers
        matchers.append(following)
    return draft, matchers
