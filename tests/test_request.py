"""A scheduler request's token reads: the same tokens as slicing its whole context."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from radixrt.protocol.messages import GenerateReq
from radixrt.sampling.params import SamplingParams
from radixrt.scheduler.request import Req


@given(prompt=st.lists(st.integers(0, 99), min_size=1, max_size=12), output=st.lists(st.integers(0, 99), max_size=12),
       data=st.data())
def test_tokens_between_and_token_at_read_the_context_as_a_slice(prompt, output, data):
    req = Req.from_message(GenerateReq(rid="r", input_ids=prompt, params=SamplingParams()), 0)
    req.output_ids = list(output)
    total = len(prompt) + len(output)
    start = data.draw(st.integers(0, total))
    stop = data.draw(st.integers(start, total + 2))
    assert req.tokens_between(start, stop) == req.fill_ids[start:stop]
    if start < total:
        assert req.token_at(start) == req.fill_ids[start]
