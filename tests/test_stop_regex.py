"""``stop_regex`` (SGLang's sampling parameter): a match in the output ends it, the text cut where the match starts,
as at a stop string. Unit checks of the shared stop mechanism (radixrt.detokenize.TextStream) with tokens cut at
every position; then through the Engine, the DSL's gen(stop_regex=...), /generate and the OpenAI routes of a real
server; bad patterns are 400 and the server keeps serving.
"""

from __future__ import annotations

import re

import openai
import pytest

import radixrt
import radixrt as sgl
from radixrt.detokenize import TextStream
from radixrt.frontend.backend.engine import EngineBackend
from radixrt.sampling.params import SamplingParams

import shared_server

SERVER_ARGS = shared_server.ARGS  # the session's shared server (tests/shared_server.py)
PROMPT = "Numbers: 1, 2, 3, 4, 5, 6, 7, 8"
GREEDY = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}


def chars(ids, skip_special_tokens):  # a tokenizer whose token i is the character chr(i)
    return "".join(map(chr, ids))


def stream_text(text, pieces, stop=None, stop_regex=None):
    """(what a stream sends, piece by piece, folded; the stream's stop) for ``text`` arriving in ``pieces``."""
    stream = TextStream(None, stop, decode=chars, stop_regex=stop_regex)
    sent, start = [], 0
    for end in [*pieces, len(text)]:
        stream.add([ord(c) for c in text[start:end]])
        start = end
        sent.append(stream.take(final=stream.stopped_at is not None))
    stream.finish()
    sent.append(stream.take(final=True))
    return "".join(sent), stream.stopped_at, sent


CASES = [  # (text, stop_regex, the text sent, the pattern that stopped it)
    ("The answer is 42. Done.", [r"\d+\."], "The answer is ", r"\d+\."),
    ("abc abd abe", [r"ab[de]"], "abc ", r"ab[de]"),
    ("no match here", [r"\d"], "no match here", None),
    ("x END y", [r"Z+", r"E.D"], "x ", r"E.D"),
    ("café ☕ done", [r"☕"], "café ", r"☕"),
]


@pytest.mark.parametrize("text,patterns,sent,matched", CASES)
def test_stream_cut_at_every_position_sends_the_text_before_the_match(text, patterns, sent, matched):
    for cut in range(len(text) + 1):
        folded, stopped, _ = stream_text(text, [cut], stop_regex=patterns)
        assert (folded, stopped) == (sent, matched), cut
    folded, stopped, pieces = stream_text(text, list(range(1, len(text))), stop_regex=patterns)
    assert (folded, stopped) == (sent, matched)


def test_text_that_may_still_match_is_held_back_until_decided():
    stream = TextStream(None, decode=chars, stop_regex=[r"ab+c"])
    stream.add([ord(c) for c in "xyabb"])
    assert stream.take(final=False) == "xy"  # "abb" may become "abbc"
    stream.add([ord("d")])
    assert stream.take(final=False) == "abbd"
    stream.add([ord(c) for c in "zabc"])
    assert stream.stopped_at == r"ab+c" and stream.take(final=True) == "z"


def test_stop_strings_and_regexes_end_at_the_earliest_match():
    text = "one two three"
    assert stream_text(text, [], stop=["three"], stop_regex=[r"t\w+"])[:2] == ("one ", r"t\w+")
    assert stream_text(text, [], stop=["one"], stop_regex=[r"t\w+"])[:2] == ("", "one")


@pytest.mark.parametrize("value,needle", [
    ("(unclosed", "invalid stop_regex"), ("a*", "matches the empty string"), ([""], "non-empty"),
    ("x" * 1001, "at most 1000"),
])
def test_bad_patterns_are_refused(value, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingParams.from_dict({"stop_regex": value}).validate()
    assert SamplingParams.from_dict({"stop_regex": r"\d"}).stop_regex == [r"\d"]


# ----- the runtime ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(default_model_path):
    with radixrt.Engine(dtype="float32", log_interval=0, debug_checks=True, kv_memory_gb=0.1) as eng:
        yield eng


@pytest.fixture(scope="module")
def reference(engine) -> str:
    return engine.generate(PROMPT, GREEDY)["text"]


def regex_in(text: str) -> tuple[str, str]:
    """A stop regex that first matches mid-``text`` (two digits around a separator), and the text before it."""
    m = re.search(r"\d\D+\d", text[2:])
    assert m, text
    pattern = re.escape(m.group(0)[0]) + r"\D+" + re.escape(m.group(0)[-1])
    return pattern, text[: re.search(pattern, text).start()]


@pytest.mark.model
def test_engine_stops_at_the_match_whole_and_streamed(engine, reference):
    pattern, before = regex_in(reference)
    cut = engine.generate(PROMPT, {**GREEDY, "stop_regex": pattern})
    assert cut["text"] == before
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    assert len(cut["output_ids"]) < len(engine.generate(PROMPT, GREEDY)["output_ids"])
    streamed = list(engine.generate(PROMPT, {**GREEDY, "stop_regex": [pattern]}, stream=True))
    assert streamed[-1]["text"] == before
    with pytest.raises(ValueError, match="invalid stop_regex"):
        engine.generate(PROMPT, {**GREEDY, "stop_regex": "(x"})


@pytest.mark.model
def test_dsl_gen_stop_regex(engine, reference):
    pattern, before = regex_in(reference)

    @sgl.function
    def prog(s):
        s += PROMPT + sgl.gen("rest", max_tokens=16, temperature=0, ignore_eos=True, stop_regex=pattern)

    state = prog.run(backend=EngineBackend(engine))
    assert state["rest"] == before


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


@pytest.mark.model
def test_server_generate_and_openai_routes_stop_at_the_match(http, client, reference):
    pattern, before = regex_in(reference)
    res = http.post("/generate", json={"text": PROMPT, "sampling_params": {**GREEDY, "stop_regex": pattern}})
    assert res.status_code == 200, res.text
    assert res.json()["text"] == before
    done = client.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=16, temperature=0,
                                     extra_body={"stop_regex": pattern, "ignore_eos": True})
    assert done.choices[0].text == before and done.choices[0].finish_reason == "stop"
    chunks = client.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=16, temperature=0, stream=True,
                                       extra_body={"stop_regex": [pattern], "ignore_eos": True})
    assert "".join(c.choices[0].text for c in chunks if c.choices) == before
    chat = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "Count to 9: 1, 2,"}],
                                          max_tokens=12, temperature=0, extra_body={"stop_regex": r"\d"})
    assert not re.search(r"\d", chat.choices[0].message.content)


@pytest.mark.model
@pytest.mark.parametrize("path,body", [
    ("/generate", {"text": PROMPT, "sampling_params": {"stop_regex": "(x"}}),
    ("/generate", {"text": PROMPT, "sampling_params": {"stop_regex": ".*"}}),
    ("/v1/completions", {"prompt": PROMPT, "stop_regex": ["ok", "[z"]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stop_regex": 5}),
])
def test_bad_stop_regex_is_400_and_the_server_keeps_serving(http, path, body):
    res = http.post(path, json=body)
    assert res.status_code == 400, res.text
    assert "stop_regex" in res.text
    assert http.post("/generate", json={"text": PROMPT, "sampling_params": {"max_new_tokens": 2}}).status_code == 200
