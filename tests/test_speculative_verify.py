"""Verification of speculative drafts (radixrt.scheduler.output, radixrt.scheduler.speculation), without a
model: the acceptance rule keeps the sampling distribution and the very tokens of a seed, logprobs and stop
checks see each token, and the pages of rejected draft tokens are freed in the step that rejects them."""

from __future__ import annotations

import math

import pytest
import torch

from radixrt.memory.page_pool import KVLayout, PagePool
from radixrt.memory.radix_cache import RadixCache
from radixrt.protocol.messages import GenerateReq
from radixrt.sampling import draws
from radixrt.sampling.params import SamplingParams
from radixrt.scheduler.drafts import ContextIndex, Match
from radixrt.scheduler.memory import Memory
from radixrt.scheduler.output import OutputProcessor
from radixrt.scheduler.request import Req
from radixrt.scheduler.speculation import SpecState, Speculator
from radixrt.server_args import ServerArgs

VOCAB = 6
PAGE = 4
# Three verify rows of a request drafting [1, 2]: row 0 decides the first token, row 1 (after draft token 1)
# the second, row 2 (after both) the third.
ROWS = torch.tensor([[1.0, 2.0, 0.5, 0.0, -1.0, -0.5],
                     [0.0, 0.3, 1.5, -1.0, 0.2, 0.0],
                     [0.5, 0.0, 0.0, 2.0, 0.0, -2.0]])
DRAFT = [1, 2]
# chi-square critical values at p = 0.001
CHI2_CRITICAL = {5: 20.52}


@pytest.fixture(autouse=True)
def one_thread():
    """Rows of six logits: torch's threads would cost more than the arithmetic."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Tokenizer:
    def decode(self, ids, **_):
        return "".join(f"<{i}>" for i in ids)


def processor() -> tuple[OutputProcessor, Memory, Speculator]:
    layout = KVLayout(num_layers=1, kv_heads=1, head_dim=2, page_size=PAGE, dtype=torch.float32)
    pool = PagePool(layout, 32)
    cache = RadixCache(pool)
    memory = Memory(pool, cache, PAGE)
    out = OutputProcessor(Tokenizer(), eos_ids=set(), vocab_size=VOCAB, context_length=1024, page_size=PAGE,
                          grammars=None, memory=memory, sink=lambda batch: None)
    spec = Speculator(ServerArgs(speculative_algorithm="NGRAM"), cache, memory, 1024)
    out.speculator = spec
    return out, memory, spec


def verifying(memory: Memory, params: SamplingParams, seed: int | None = None, return_logprob: bool = False) -> Req:
    """A request that has decoded one token and verifies DRAFT now (pages for all three positions)."""
    msg = GenerateReq(rid=f"r{seed}", input_ids=[0, 3, 4, 5, 0], params=params, return_logprob=return_logprob)
    req = Req.from_message(msg, seed or 0)
    req.output_ids = [3]
    req.num_computed = req.total_len - 1
    req.pages = memory.pool.alloc(math.ceil((req.num_computed + 1 + len(DRAFT)) / PAGE))
    req.spec = SpecState(ContextIndex(1, 12))
    req.draft = list(DRAFT)
    return req


def sample_alone(logits: torch.Tensor, temperature: float, seed: int, counter: int) -> int:
    """The sampler's inverse CDF for one row, as a decode step without a draft runs it for output index
    ``counter``."""
    cdf = torch.softmax(logits.float() / temperature, dim=-1).double().cumsum(0)
    u = draws.reference_uniform(seed, counter)
    return int(torch.searchsorted(cdf, u * cdf[-1], right=True))


def test_sampled_verification_keeps_the_distribution_and_the_seeds_tokens():
    temperature, n = 1.0, 3000
    first, second_after_accept = [0] * VOCAB, [0] * VOCAB
    out, memory, _ = processor()
    for seed in range(n):
        params = SamplingParams(max_new_tokens=16, temperature=temperature, seed=seed)
        req = verifying(memory, params, seed)
        out.process([(req, 1 + len(DRAFT))], (ROWS,))
        new = req.output_ids[1:]
        # the same tokens as decoding one at a time with the same seed: output index k meets draw k
        want = [sample_alone(ROWS[0], temperature, seed, 1)]
        for row in range(1, 3):
            if want[-1] != DRAFT[row - 1]:
                break
            want.append(sample_alone(ROWS[row], temperature, seed, 1 + row))
        assert new == want, seed
        memory.pool.decref(req.pages)
        first[new[0]] += 1
        if new[0] == DRAFT[0]:
            second_after_accept[new[1]] += 1
    for counts, row in ((first, ROWS[0]), (second_after_accept, ROWS[1])):
        p = torch.softmax(row / temperature, dim=-1).tolist()
        total = sum(counts)
        chi2 = sum((c - total * q) ** 2 / (total * q) for c, q in zip(counts, p))
        assert chi2 < CHI2_CRITICAL[VOCAB - 1], (counts, [round(total * q) for q in p])
    # the first draft token is accepted with its probability under the model
    p1 = torch.softmax(ROWS[0] / temperature, dim=-1)[DRAFT[0]].item()
    assert abs(first[DRAFT[0]] / n - p1) < 4 * math.sqrt(p1 * (1 - p1) / n)


def test_greedy_verification_keeps_the_agreed_prefix_plus_one_and_frees_the_rest():
    out, memory, spec = processor()
    req = verifying(memory, SamplingParams(max_new_tokens=16, temperature=0.0), return_logprob=True)
    free_before = memory.pool.num_free
    pages_before = len(req.pages)
    progressed = out.process([(req, 3)], (ROWS,))
    # argmax(row 0) = 1 = draft[0]; argmax(row 1) = 2 = draft[1]; argmax(row 2) = 3: all three taken
    assert req.output_ids == [3, 1, 2, 3] and progressed == [req]
    assert req.num_computed == req.total_len - 1
    assert [t for _, t in req.pending_output_logprobs] == [1, 2, 3]
    lp = torch.log_softmax(ROWS, dim=-1)
    assert [round(x, 5) for x, _ in req.pending_output_logprobs] == [round(lp[i, t].item(), 5)
                                                                    for i, t in enumerate([1, 2, 3])]
    assert req.spec.accepted == 2 and req.spec.drafted == 2 and req.spec.verify_steps == 1
    assert spec.accepted == 2 and spec.accept_length == 3.0
    # every draft token was accepted: the pages hold all of them (the next token's page comes next step)
    assert req.draft == [] and len(req.pages) == pages_before
    assert memory.pool.num_free == free_before

    # a draft the model rejects at once: one token, and the draft's pages are freed in the same step
    req.draft = [5, 5, 5, 5, 5, 5]
    needed = math.ceil((req.num_computed + 1 + len(req.draft)) / PAGE)
    req.pages += memory.pool.alloc(needed - len(req.pages))
    rows = torch.zeros(7, VOCAB)
    rows[:, 0] = 1.0  # the model wants token 0 everywhere
    out.process([(req, 7)], (rows,))
    assert req.output_ids[-1] == 0 and req.num_computed == req.total_len - 1
    assert len(req.pages) == math.ceil((req.num_computed + 1) / PAGE)
    assert req.spec.drafted == 8 and req.spec.accepted == 2


def test_a_stop_token_inside_accepted_drafts_ends_the_request_there():
    out, memory, _ = processor()
    req = verifying(memory, SamplingParams(max_new_tokens=16, temperature=0.0, stop_token_ids=[2]))
    out.process([(req, 3)], (ROWS,))
    assert req.output_ids == [3, 1, 2] and req.finished and req.finish_reason.type == "stop"


def test_max_new_tokens_bounds_the_draft():
    out, memory, spec = processor()
    req = verifying(memory, SamplingParams(max_new_tokens=3, temperature=0.0))
    req.draft = []
    spec._match = lambda *a: Match([1, 2, 3, 4, 5], 12, "context")
    plan = spec.draft([(req, 1)])
    # one output so far, three at most: the verify step may add two, so the draft holds one token
    assert plan == [(req, 2)] and req.draft == [1]


def test_drafts_never_retract_a_request_when_pages_run_out():
    out, memory, spec = processor()
    req = verifying(memory, SamplingParams(max_new_tokens=64, temperature=0.0))
    req.draft = []
    memory.pool.alloc(memory.pool.num_free)  # someone else holds every other page
    spec._match = lambda *a: Match(list(range(1, 6)) * 4, 12, "context")
    plan = spec.draft([(req, 1)])
    # the request's own pages cover the next token and two more: the draft shrinks to fit, nobody is retracted
    room = len(req.pages) * PAGE - req.num_computed - 1
    assert plan == [(req, 1 + room)] and len(req.draft) == room
