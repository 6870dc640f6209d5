"""ForwardBatch: the decode builder gives the very batch the general builder does."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixrt.model.forward_batch import TENSOR_FIELDS, ForwardBatch, SeqChunk


@st.composite
def decode_rows(draw):
    page_size = draw(st.sampled_from([1, 4, 16]))
    rows = []
    for _ in range(draw(st.integers(1, 12))):
        prefix = draw(st.integers(0, 70))
        extra = draw(st.integers(0, 2))  # pages past the new token, as a request with room reserved holds
        num_pages = prefix // page_size + 1 + extra
        pages = draw(st.lists(st.integers(0, 500), min_size=num_pages, max_size=num_pages))
        rows.append((draw(st.integers(0, 49151)), prefix, pages))
    return page_size, rows


@settings(max_examples=60, deadline=None)
@given(decode_rows())
def test_build_decode_equals_build(case):
    page_size, rows = case
    general = ForwardBatch.build([SeqChunk([t], p, pages) for t, p, pages in rows], page_size)
    fast = ForwardBatch.build_decode([t for t, _, _ in rows], [p for _, p, _ in rows], [pg for _, _, pg in rows],
                                     page_size)
    for name in TENSOR_FIELDS:
        a, b = getattr(general, name), getattr(fast, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert general.host_fields() == fast.host_fields()


def test_build_decode_refuses_pages_that_miss_the_new_token():
    with pytest.raises(ValueError, match="do not cover"):
        ForwardBatch.build_decode([5], [16], [[3]], 16)
    with pytest.raises(ValueError, match="at least one"):
        ForwardBatch.build_decode([], [], [], 16)
    assert np.array_equal(ForwardBatch.build_decode([5], [15], [[3]], 16).out_slots.numpy(), [3 * 16 + 15])
