"""The page tables of running requests as rows of one array (radixrt/scheduler/page_rows.py): a row is its request's
pages and zeros after them through appends, trims, rewrites and releases, rows and columns grow on demand, and a
gathered decode batch equals the one built from the page lists. That Memory writes every change: the scheduler
simulation's ``check`` after each step (tests/test_scheduler_sim.py)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from radixrt.model.forward_batch import ForwardBatch
from radixrt.sampling.params import SamplingParams
from radixrt.scheduler.page_rows import PageRows
from radixrt.scheduler.request import Req


def _req(rid: str) -> Req:
    return Req(rid=rid, prompt_ids=[1], params=SamplingParams())


def test_rows_follow_random_changes_of_the_page_lists():
    rng = random.Random(0)
    rows = PageRows(rows=2, width=2)  # both grow
    reqs = [_req(str(i)) for i in range(9)]
    for _ in range(600):
        req = rng.choice(reqs)
        move = rng.random()
        if move < 0.5:  # pages appended
            held = len(req.pages)
            req.pages.extend(rng.randrange(1000) for _ in range(rng.randint(1, 9)))
            rows.write(req, held)
        elif move < 0.7 and req.pages:  # trimmed
            keep = rng.randrange(len(req.pages))
            del req.pages[keep:]
            rows.write(req, keep)
        elif move < 0.85 and req.pages:  # a prefix replaced (the tree's copies of the same tokens)
            n = rng.randint(1, len(req.pages))
            req.pages[:n] = [rng.randrange(1000) for _ in range(n)]
            rows.write(req)
        else:  # released
            req.pages = []
            rows.drop(req)
        rows.check(reqs)
    holding = [r for r in reqs if r.pages]
    table, counts = rows.gather(holding)
    assert counts.tolist() == [len(r.pages) for r in holding]
    for line, req in zip(table, holding):
        assert line[: len(req.pages)].tolist() == req.pages and not line[len(req.pages) :].any()
    assert rows.table.shape[0] >= 9 and rows.table.shape[1] >= max(counts)


def test_a_row_out_of_step_fails_the_check():
    rows, req = PageRows(), _req("a")
    req.pages = [4, 5]
    rows.write(req)
    req.pages.append(6)  # appended without writing the row
    with pytest.raises(AssertionError, match="not its pages"):
        rows.check([req])
    rows.write(req, 2)
    del req.pages[1:]  # trimmed without writing the row
    with pytest.raises(AssertionError, match="not its pages|past its own"):
        rows.check([req])
    with pytest.raises(RuntimeError, match="without pages"):
        rows.gather([req, _req("no pages")])


def test_a_gathered_decode_batch_equals_one_built_from_the_lists():
    rng = random.Random(1)
    rows = PageRows()
    reqs = [_req(str(i)) for i in range(5)]
    for req in reqs:
        req.pages = [rng.randrange(100) for _ in range(rng.randint(1, 6))]
        rows.write(req)
    prefix = [len(r.pages) * 4 - 1 - rng.randrange(4) for r in reqs]
    tokens = [rng.randrange(50) for _ in reqs]
    lists = ForwardBatch.build_decode(tokens, prefix, [r.pages for r in reqs], 4)
    gathered = ForwardBatch.build_decode(tokens, prefix, rows.gather(reqs), 4)
    for name in ("input_ids", "positions", "out_slots", "page_table", "seq_lens"):
        assert np.array_equal(getattr(lists, name).numpy(), getattr(gathered, name).numpy()), name


def test_a_gathered_mixed_batch_equals_one_built_from_the_lists():
    """The synchronous loop's batches (prefill chunks beside decodes) take the gathered table too."""
    from radixrt.model.forward_batch import SeqChunk

    rng = random.Random(2)
    rows = PageRows()
    reqs = [_req(str(i)) for i in range(4)]
    chunks = []
    for i, req in enumerate(reqs):
        req.pages = [rng.randrange(100) for _ in range(rng.randint(2, 6))]
        rows.write(req)
        n = 1 if i % 2 else rng.randint(2, 4)  # decodes and prefill chunks
        prefix = len(req.pages) * 4 - n - rng.randrange(3)
        chunks.append(SeqChunk([rng.randrange(50) for _ in range(n)], prefix, req.pages))
    lists = ForwardBatch.build(chunks, 4)
    gathered = ForwardBatch.build(chunks, 4, page_table=rows.gather(reqs))
    for name in ("input_ids", "positions", "out_slots", "page_table", "seq_lens", "logits_indices"):
        assert np.array_equal(getattr(lists, name).numpy(), getattr(gathered, name).numpy()), name
