"""Where speculative drafts come from (radixrt.scheduler.drafts) and how long they are
(radixrt.scheduler.speculation): suffix matches over a request's context and the history, the radix cache's
continuation of an exact context, the adaptive length and the measured cost of a draft token."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixrt.memory.page_pool import KVLayout, PagePool
from radixrt.memory.radix_cache import RadixCache
from radixrt.scheduler.drafts import (HISTORY_WEIGHT, ContextIndex, History, Match, TokenIndex, cache_continuation,
                                      candidates, ngram_match, support)
from radixrt.scheduler.speculation import (DEFAULT_TOKEN_COST, MIN_TOKEN_COST, SpecState, StepCost, best_length,
                                           best_prefix, evidence_class)
from radixrt.server_args import ServerArgs


def brute_force_longest(tokens: list[int], gram: int, max_window: int) -> int:
    """The longest agreement (>= gram, <= max_window) of an earlier occurrence with the end of ``tokens``."""
    n, best = len(tokens), 0
    for end in range(gram, n):
        agreed = 0
        while agreed < min(max_window, n) and end - agreed - 1 >= 0 and tokens[end - agreed - 1] == tokens[n - agreed - 1]:
            agreed += 1
        if agreed >= gram:
            best = max(best, agreed)
    return best


def test_context_match_proposes_what_followed_the_longest_earlier_occurrence():
    index = ContextIndex(min_window=1, max_window=12)
    # "b c d" occurs twice: after "a b c d" (then "x") and after "z b c d" (then "y"); the query ends "a b c d".
    tokens = [1, 2, 3, 4, 50, 9, 2, 3, 4, 60, 7, 1, 2, 3, 4]
    index.sync(tokens, len(tokens))
    match = index.match(limit=3)
    assert match.tokens == [50, 9, 2] and match.length == 4 and match.source == "context"
    # a short window still finds the single-token match when no longer one exists
    tokens = [5, 6, 7, 8, 6]
    index = ContextIndex(min_window=1, max_window=12)
    index.sync(tokens, len(tokens))
    assert index.match(limit=2).tokens == [7, 8]
    # min window 2: a single shared token is not evidence enough
    index = ContextIndex(min_window=2, max_window=12)
    index.sync(tokens, len(tokens))
    assert index.match(limit=2) is None


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 4), min_size=1, max_size=60), gram=st.integers(1, 3))
def test_token_index_finds_the_longest_match_a_brute_force_finds(tokens, gram):
    index = TokenIndex(gram, max_window=8)
    index.extend(tokens)
    end, length = index.find(tokens, skip_end=len(tokens))
    want = brute_force_longest(tokens, gram, 8)
    # the chain walk looks at the 16 latest occurrences: on these short sequences that is all of them
    assert length == want
    if length:
        assert tokens[end - length:end] == tokens[len(tokens) - length:] and end < len(tokens)


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 5), min_size=0, max_size=40), cut=st.integers(0, 40),
       rewrite=st.lists(st.integers(0, 5), max_size=8))
def test_truncating_and_rewriting_an_index_equals_building_it_afresh(tokens, cut, rewrite):
    index = ContextIndex(min_window=1, max_window=6)
    index.sync(tokens, final=0)  # nothing final: jump-forward may rewrite any of it
    changed = tokens[: min(cut, len(tokens))] + rewrite
    index.sync(changed, final=len(changed))
    fresh = ContextIndex(min_window=1, max_window=6)
    fresh.sync(changed, final=len(changed))
    for got, want in zip(index.indexes, fresh.indexes):
        assert got.tokens == want.tokens and got.heads == want.heads and got.prev == want.prev


def test_candidates_hold_every_occurrence_longest_agreement_first_the_drafted_one_among_them():
    index = ContextIndex(min_window=1, max_window=12)
    history = History(1000, min_window=1, max_window=12)
    history.add([8, 2, 3, 4, 70, 71])  # "2 3 4" then 70 (agrees on 3 tokens)
    tokens = [1, 2, 3, 4, 50, 51, 9, 4, 60, 61, 1, 2, 3, 4]  # "1 2 3 4" then 50 (4 tokens); "4" then 60 (1)
    index.sync(tokens, len(tokens))
    found = candidates(index, history, tokens, limit=2)
    firsts = [(m.tokens, m.length, m.source) for m in found]
    assert firsts[0] == ([50, 51], 4, "context")
    assert ([70, 71], 3, "history") in firsts and ([60, 61], 1, "context") in firsts
    assert [m.length for m in found] == sorted((m.length for m in found), reverse=True)
    chosen = ngram_match(index, history, tokens, limit=2)
    assert (chosen.tokens, chosen.length) == (found[0].tokens, found[0].length)


def test_each_occurrence_is_a_candidate_once_though_both_context_windows_find_it():
    index = ContextIndex(min_window=1, max_window=12)  # windows of 3 tokens and of 1 over the same context
    tokens = [1, 2, 3, 40, 7, 1, 2, 3, 41, 7, 1, 2, 3]
    index.sync(tokens, len(tokens))
    found = candidates(index, History(1000, 1, 12), tokens, limit=2)
    assert sorted(m.tokens for m in found) == [[40, 7], [41, 7]]


def test_support_weighs_each_draft_token_by_the_occurrences_that_go_on_alike():
    # "1 2 3" was followed by a value and then "7 8" three times: the values differ, what follows them does not
    tokens = [9, 1, 2, 3, 40, 7, 8, 1, 2, 3, 41, 7, 8, 1, 2, 3, 42, 7, 8, 1, 2, 3]
    index = ContextIndex(min_window=1, max_window=12)
    index.sync(tokens, len(tokens))
    history = History(1000, 1, 12)
    found = candidates(index, history, tokens, limit=4)
    draft = ngram_match(index, history, tokens, limit=4).tokens
    assert draft == [42, 7, 8, 1]  # the newest of the longest agreement (7 tokens: "7 8 1 2 3" and before)
    weights = support(draft, found)
    agreeing, total = weights[0]
    assert agreeing < total  # the value: only its own occurrence proposes 42
    assert all(a == t == agreeing for a, t in weights[1:])  # after it, the occurrences left all go on alike
    # the same context in another request's text counts HISTORY_WEIGHT as much as in the request's own
    history.add([5, 1, 2, 3, 43, 7, 8])
    found = candidates(index, history, tokens, limit=4)
    other = next(m for m in found if m.source == "history")
    assert support([43], [other]) == [(HISTORY_WEIGHT * other.length, HISTORY_WEIGHT * other.length)]
    assert support([99], found)[0][0] == 0.0


def test_a_draft_stops_where_earlier_occurrences_part_ways():
    state = SpecState(ContextIndex(1, 12))
    match = Match(list(range(100, 108)), 10, "context")
    cost = 0.12  # a draft token in a batch of 8 on a small CPU
    class_only = state.draft_length(match, 8, cost)
    assert class_only == best_length(state.class_rate(evidence_class(10)), 8, cost) == 2
    alike = [(40.0, 40.0)] * 8  # every earlier occurrence went on as the draft does
    assert state.draft_length(match, 8, cost, weights=alike) == 8
    parted = [(4.0, 40.0)] + [(4.0, 4.0)] * 7  # they went on ten ways at the first token
    assert state.draft_length(match, 8, cost, weights=parted) < class_only
    later = [(40.0, 40.0)] * 3 + [(4.0, 40.0)] + [(4.0, 4.0)] * 4  # alike for three tokens, then apart
    assert state.draft_length(match, 8, cost, weights=later) == 3
    # a continuation of the exact context from the radix cache keeps its own floor
    assert state.draft_length(match, 8, cost, trusted=True, weights=parted) == best_length(0.9, 8, cost)
    assert best_prefix([], cost) == 0 and best_prefix([1.0] * 3, 0.0) == 3


def test_the_speculator_drafts_far_only_where_the_context_repeats_alike():
    from test_speculative_verify import processor

    from radixrt.protocol.messages import GenerateReq
    from radixrt.sampling.params import SamplingParams
    from radixrt.scheduler.request import Req

    def drafted(prompt: list[int]) -> int:
        out, memory, spec = processor()
        req = Req.from_message(GenerateReq(rid="r", input_ids=prompt,
                                           params=SamplingParams(max_new_tokens=64, temperature=0.0)), 0)
        req.num_computed = req.total_len - 1
        req.pages = memory.pool.alloc(-(-(req.total_len + 8) // memory.page_size))
        spec.from_cache = False
        return spec.draft([(req, 1)])[0][1] - 1

    phrase = [1, 2, 3, 4, 5, 6, 7, 8]
    alike = [t for _ in range(6) for t in phrase + [20, 21, 22, 23, 24, 25, 26, 27]] + phrase
    apart = [t for i in range(6) for t in phrase + [30 + i, 21, 22, 23, 24, 25, 26, 27]] + phrase
    class_only = best_length(0.5, 8, DEFAULT_TOKEN_COST)  # a fresh request's estimate, the cost before any fit
    assert drafted(alike) == 8 > class_only
    assert drafted(apart) < drafted(alike)


def test_history_matches_across_requests_and_stays_bounded():
    history = History(capacity_tokens=400, min_window=1, max_window=12)
    history.add([10, 11, 12, 13, 14, 15])
    match = history.match([7, 7, 11, 12, 13], limit=4)
    assert match.tokens == [14, 15] and match.length == 3 and match.source == "history"  # stops at the end
    for i in range(200):
        history.add(list(range(1000 + 10 * i, 1010 + 10 * i)))
    assert history.num_tokens <= 400 + 4 * 11
    assert history.match([11, 12, 13], limit=4) is None  # the oldest segment was dropped whole


def make_cache(page_size: int) -> tuple[PagePool, RadixCache]:
    layout = KVLayout(num_layers=1, kv_heads=1, head_dim=2, page_size=page_size, dtype=torch.float32)
    pool = PagePool(layout, 64)
    return pool, RadixCache(pool)


def insert(pool: PagePool, cache: RadixCache, tokens: list[int]) -> None:
    pages = pool.alloc(len(tokens) // pool.page_size)
    result = cache.insert(tokens, pages)
    pool.decref(result.duplicates)


@pytest.mark.parametrize("page_size", [1, 4])
def test_cache_continuation_reads_what_the_tree_holds_after_an_exact_context(page_size):
    pool, cache = make_cache(page_size)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    insert(pool, cache, prompt + [20, 21, 22, 23, 24, 25, 26, 27])  # an earlier request's prompt and output
    insert(pool, cache, prompt + [30, 31, 32, 33])  # a later one that went elsewhere
    cache.match_prefix(prompt + [20, 21, 22, 23])  # the first branch is the most recently used again
    match = cache.match_prefix(prompt)
    node = match.node
    # the request has computed its prompt and written 20, 21: the tree continues with 22...
    assert cache_continuation(node, [20, 21], page_size, limit=3) == [22, 23, 24]
    # nothing written yet: the most recently used branch
    assert cache_continuation(node, [], page_size, limit=2) == [20, 21]
    # a context the tree never continued
    assert cache_continuation(node, [20, 99], page_size, limit=3) == []
    assert cache_continuation(node, [30, 31, 32, 33], page_size, limit=3) == []  # the branch ends there
    cache.check()


def test_draft_length_follows_acceptance_and_cost():
    assert best_length(0.0, 8, 0.05) == 0
    assert best_length(0.95, 8, 0.02) == 8  # nearly always accepted, nearly free: the longest
    assert best_length(0.95, 3, 0.02) == 3  # never past what the match offers
    assert best_length(0.5, 8, 0.9) == 0  # a draft token as dear as a decode: drafts do not pay
    assert 0 < best_length(0.5, 8, 0.1) < best_length(0.8, 8, 0.1)


def test_step_cost_is_fitted_from_timed_steps():
    cost = StepCost()
    assert cost.token_cost(8) == DEFAULT_TOKEN_COST  # nothing timed yet
    for _ in range(5):
        cost.observe(8, 0.028)  # all steps alike: no slope to learn
    assert cost.token_cost(8) == DEFAULT_TOKEN_COST
    for tokens in (8, 16, 24, 40, 72) * 4:
        cost.observe(tokens, 0.020 + 0.001 * tokens)
    # one token costs 1 ms against a request's share (20 + 8) / 8 ms of a decode step of 8
    assert cost.token_cost(8) == pytest.approx(8 / 28, rel=0.05)
    assert cost.token_cost(1) == pytest.approx(1 / 21, rel=0.05)


def test_a_stalled_step_does_not_make_drafts_look_cheap_and_a_lasting_change_still_moves_the_fit():
    sizes = (8, 16, 24, 40, 72) * 20

    def fitted(times) -> StepCost:
        cost = StepCost()
        for tokens, seconds in times:
            cost.observe(tokens, seconds)
        return cost

    steady = [(t, 0.020 + 0.001 * t) for t in sizes]
    assert fitted(steady).token_cost(8) == pytest.approx(8 / 28, rel=0.05)
    # every 25th step stalls 4x (a small step each time): unclipped they lift the intercept and flatten the slope
    # (the cost of a token came out 0.21 for 0.29; clipped, 0.26)
    stalled = [(t, s * 4 if i % 25 == 0 else s) for i, (t, s) in enumerate(steady)]
    assert fitted(stalled).token_cost(8) == pytest.approx(8 / 28, rel=0.1)
    # the machine really slows by half again and stays so: the fit follows (the ratio a token costs stays)
    slower = steady + [(t, 1.5 * (0.020 + 0.001 * t)) for t in sizes]
    line = fitted(slower).line()
    assert line[0] == pytest.approx(0.030, rel=0.05) and line[1] == pytest.approx(0.0015, rel=0.05)


def test_a_token_never_costs_nothing():
    """Steps of more tokens timed faster (noise, where tokens cost next to nothing) fit a slope below zero: the
    cost is floored, so the policy still weighs a draft's length."""
    cost = StepCost()
    for tokens in (1, 2, 3, 5, 9) * 4:
        cost.observe(tokens, 0.0126 - 0.00001 * tokens)
    assert cost.token_cost(1) == MIN_TOKEN_COST and cost.token_cost(8) == MIN_TOKEN_COST
    assert best_length(0.05, 8, MIN_TOKEN_COST) < 8  # a draft that is rarely accepted is still cut short


def test_speculative_options_are_checked():
    assert ServerArgs(speculative_algorithm="ngram").speculative_algorithm == "NGRAM"
    with pytest.raises(ValueError, match="NGRAM"):
        ServerArgs(speculative_algorithm="EAGLE")
    with pytest.raises(ValueError, match="match_type"):
        ServerArgs(speculative_ngram_match_type="DFS")


def test_sglang_launch_flags_and_runtime_keywords_reach_the_options():
    import argparse

    from radixrt.frontend.runtime import server_flags

    flags = server_flags({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 4,
                          "speculative_ngram_max_match_window_size": 8})
    assert flags == ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "4",
                     "--speculative-ngram-max-match-window-size", "8"]
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args(flags + ["--speculative-ngram-max-bfs-breadth", "4"]))
    assert (args.speculative_algorithm, args.speculative_num_draft_tokens) == ("NGRAM", 4)
    assert args.speculative_ngram_max_match_window_size == 8


def test_each_evidence_class_keeps_its_own_acceptance():
    """Short matches that keep failing stop drafting while long matches that keep succeeding draft in full,
    where one rate for both would draft a middling length after either."""
    from radixrt.scheduler.drafts import ContextIndex
    from radixrt.scheduler.speculation import SpecState, evidence_class

    assert [evidence_class(n) for n in (1, 2, 3, 4, 5, 7, 8, 12)] == [0, 0, 1, 1, 2, 2, 3, 3]
    state = SpecState(ContextIndex(1, 12))
    fresh = state.class_rate(evidence_class(1))
    assert fresh == state.rate == 0.5  # no counts: every class at the request's (prior) estimate
    short, long = evidence_class(1), evidence_class(10)
    for _ in range(6):
        state.observe(short, agreed=0, rejected=True)
        state.observe(long, agreed=8, rejected=False)
    cost = 0.3  # a draft token's cost in a mid-sized batch on a small CPU
    assert best_length(state.class_rate(short), 8, cost) == 0
    assert best_length(state.class_rate(long), 8, cost) == 8
    assert 0 < best_length(state.rate, 8, cost) < 8
    assert state.best_rate == state.class_rate(long)
    # an unseen class starts from the overall estimate
    assert state.class_rate(evidence_class(4)) == pytest.approx(state.rate)
    state.relax()
    assert state.class_rate(short) > 0 and state.class_accepted[long] < 8 / (1 - 0.8)
