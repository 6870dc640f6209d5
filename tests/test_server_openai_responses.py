"""The OpenAI answer builder without a server: a stream's deltas add up to the whole choice, logprob offsets
follow the streamed text, usage counts each prompt once, and the metrics histogram is the scheduler's too."""

from __future__ import annotations

import msgspec

from radixrt.protocol.messages import FinishReason, ReqDelta, StrDelta
from radixrt.response import ResponseBuilder
from radixrt.metrics import STEP_BUCKETS, Histogram
from radixrt.server.openai_responses import OpenAIAnswer, StreamCursor
from radixrt.client import Handle, ThreadWaker

TOKEN_TEXT = {5: "ab", 6: "c", 7: "de"}


def state(rid: str = "r", logprobs: bool = True) -> Handle:
    return Handle(rid, ResponseBuilder(rid, logprobs, 1 if logprobs else 0), ThreadWaker(), 0)


def add(s: Handle, token: int, finish: dict | None = None, prompt_tokens: int = 3) -> None:
    reason = None if finish is None else msgspec.convert(finish, FinishReason)
    delta = ReqDelta(rid=s.rid, new_ids=[token], finish_reason=reason, prompt_tokens=prompt_tokens,
                     cached_tokens=1, completion_tokens=len(s.builder.output_ids) + 1,
                     output_logprobs=[(-0.5, token)], output_top_logprobs=[[(-0.25, token)]])
    s.builder.add(StrDelta(rid=s.rid, text=TOKEN_TEXT[token], delta=delta))


def answer(chat: bool, n: int = 1, echo: list[str] | None = None) -> OpenAIAnswer:
    return OpenAIAnswer(chat=chat, model="m", n=n, want_logprobs=True, token_text=TOKEN_TEXT.__getitem__,
                        echo=echo)


def test_stream_deltas_add_up_to_the_whole_completion_choice():
    whole, streamed = state(), state()
    cursor, deltas = StreamCursor(), []
    ans = answer(chat=False)
    for token, finish in [(5, None), (6, None), (7, {"type": "stop", "matched": "x"})]:
        add(whole, token, finish)
        add(streamed, token, finish)
        deltas.append(ans.choice(0, streamed, cursor))
    assert ans.choice(0, streamed, cursor) is None  # nothing new
    choice = ans.choice(0, whole)
    assert choice["text"] == "".join(d["text"] for d in deltas) == "abcde"
    assert choice["logprobs"]["text_offset"] == [0, 2, 3]
    assert [d["logprobs"]["text_offset"] for d in deltas] == [[0], [2], [3]]
    assert choice["finish_reason"] == "stop" and choice["matched_stop"] == "x"
    assert "matched_stop" not in deltas[0] and deltas[-1]["matched_stop"] == "x" and cursor.done


def test_chat_choices_and_stream_chunks():
    s = state()
    ans = answer(chat=True)
    ans.include_usage = True
    assert ans.opening_chunk(1)["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None}]
    add(s, 5, {"type": "length", "matched": None})
    delta = ans.choice(0, s, StreamCursor())
    assert delta["delta"] == {"content": "ab"} and delta["logprobs"]["content"][0]["token"] == "ab"
    assert ans.choice(0, s)["message"] == {"role": "assistant", "content": "ab"}
    assert list(ans.chunk([delta])) == ["id", "object", "created", "model", "choices", "usage"]
    assert ans.usage_chunk([s])["usage"]["total_tokens"] == 4


def test_echo_and_usage_count_each_prompt_once():
    states = [state(f"r{i}", logprobs=False) for i in range(4)]  # two prompts, n=2
    for i, s in enumerate(states):
        add(s, 6, {"type": "length", "matched": None}, prompt_tokens=10 + i // 2)
    ans = answer(chat=False, n=2, echo=["P0", "P0", "P1", "P1"])
    ans.want_logprobs = False
    body = ans.body(states)
    assert [c["text"] for c in body["choices"]] == ["P0c", "P0c", "P1c", "P1c"]
    assert body["usage"] == {"prompt_tokens": 21, "completion_tokens": 4, "total_tokens": 25,
                             "prompt_tokens_details": {"cached_tokens": 2}}
    assert ans.opening_chunk(4)["choices"][2] == {"index": 2, "text": "P1", "logprobs": None, "finish_reason": None}


def test_step_latency_histogram():
    h = Histogram(STEP_BUCKETS)
    for seconds in (0.0005, 0.003, 0.003, 20.0):
        h.observe(seconds)
    assert h.cumulative()[:3] == [1, 1, 3] and h.cumulative()[-1] == 3 and h.count == 4


def test_echo_with_logprobs_leads_with_the_prompts_tokens_whole_and_streamed():
    """Completions with echo and logprobs (scoring a text): the prompt's tokens come first in the choice's
    logprobs, the first without a logprob, their offsets from the start of the echoed text; a stream sends them
    once, with its first chunk of logprobs."""
    whole, streamed = state(), state()
    for s in (whole, streamed):  # the prompt's logprobs, as its first delta brings them: "c", "ab" (the echo "cab")
        s.builder.add(StrDelta(rid=s.rid, text="", delta=ReqDelta(
            rid=s.rid, new_ids=[], prompt_tokens=2, input_logprobs=[(None, 6), (-1.5, 5)],
            input_top_logprobs=[[], [(-1.0, 7)]])))
    ans = answer(chat=False, echo=["cab"])
    ans.echo_logprobs = True
    cursor, deltas = StreamCursor(), []
    for token, finish in [(7, None), (6, {"type": "length", "matched": None})]:
        add(whole, token, finish)
        add(streamed, token, finish)
        deltas.append(ans.choice(0, streamed, cursor))
    choice = ans.choice(0, whole)
    assert choice["text"] == "cabdec"
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == ["c", "ab", "de", "c"]
    assert logprobs["token_logprobs"] == [None, -1.5, -0.5, -0.5]
    assert logprobs["text_offset"] == [0, 1, 3, 5]
    assert logprobs["top_logprobs"] == [{}, {"de": -1.0}, {"de": -0.25}, {"c": -0.25}]
    assert [d["logprobs"]["tokens"] for d in deltas] == [["c", "ab", "de"], ["c"]]
    assert [d["logprobs"]["text_offset"] for d in deltas] == [[0, 1, 3], [5]]
