"""select(): choice scores from prompt logprobs (never sampling), the three choices methods, token
healing at the prefix boundary, and the exact calls made to the runtime."""

import math

import pytest

import radixrt as sgl
from radixrt.frontend.backend.engine import EngineBackend
from fake_engine import FakeEngine

# Conditional logprob of a token given the text before it (the fake's scoring function).
TABLE = {"True": -2.0, "False": -1.0, "Not": -0.1, " sure": -2.5, "Yes": -3.0, " indeed": -0.2,
         " True": -0.5, " False": -0.7}


def scripted_logprob(context: str, token: str) -> float:
    # Unconditional scores (the choice alone): the second tokens are unlikely without the prompt.
    if context == "Not" and token == " sure":
        return -3.0
    if context == "Yes" and token == " indeed":
        return -4.0
    return TABLE.get(token, -1.0)


PREFIX = "Statement: the sky is blue.\nAnswer:"
CHOICES = ["True", "False", "Not sure", "Yes indeed"]
# The choices' own tokens in the fake's tokenizer (after ":" nothing merges).
CHOICE_TOKENS = [["True"], ["False"], ["Not", " sure"], ["Yes", " indeed"]]


def expected(method: str) -> str:
    """The decision computed independently from TABLE."""
    cond = [[TABLE[t] for t in toks] for toks in CHOICE_TOKENS]
    if method == "token_length_normalized":
        scores = [sum(c) / len(c) for c in cond]
    elif method == "unconditional_likelihood_normalized":
        # The choice alone: its first token has no context (counts 0).
        uncond = [[0.0], [0.0], [0.0, -3.0], [0.0, -4.0]]
        scores = [sum(a - b for a, b in zip(c, u)) / len(c) for c, u in zip(cond, uncond)]
    else:  # greedy: the best first token wins outright here
        scores = [c[0] for c in cond]
    return CHOICES[max(range(len(CHOICES)), key=lambda i: scores[i])]


@pytest.fixture
def engine():
    return FakeEngine(logprob_fn=scripted_logprob)


@pytest.mark.parametrize(
    "method_name",
    ["token_length_normalized", "greedy_token_selection", "unconditional_likelihood_normalized"],
)
def test_select_picks_the_best_choice_by_each_method(engine, method_name):
    method = getattr(sgl, method_name)

    @sgl.function
    def prog(s):
        s += PREFIX + sgl.select("answer", CHOICES, choices_method=method)

    state = prog.run(backend=EngineBackend(engine))
    want = expected(method_name)
    assert state["answer"] == want
    assert state.text() == PREFIX + want
    meta = state.get_meta_info("answer")
    assert meta["normalized_prompt_logprobs"] == pytest.approx([-2.0, -1.0, -1.3, -1.6])
    assert [[e[0] for e in row] for row in meta["input_token_logprobs"]] == [
        [TABLE[t] for t in toks] for toks in CHOICE_TOKENS
    ]
    # The three methods disagree on this example, so each is really being applied.
    assert len({expected(m) for m in ("token_length_normalized", "greedy_token_selection",
                                      "unconditional_likelihood_normalized")}) == 3


def test_select_calls_prompt_logprobs_in_one_shared_prefix_batch(engine):
    @sgl.function
    def prog(s):
        s += PREFIX + sgl.select("answer", CHOICES)

    prog.run(backend=EngineBackend(engine)).sync()
    reqs = engine.requests
    prompt_len = len(engine.tokenizer.encode(PREFIX))
    # 1) the prefix alone, max_new_tokens=0 (caches it, reports its token count)
    assert reqs[0]["text"] == PREFIX and reqs[0]["sampling_params"] == {"max_new_tokens": 0}
    assert not reqs[0]["return_logprob"]
    # 2) one batch: the prefix again + prefix+choice each, prompt logprobs from P-2, no sampling
    batch = reqs[1:]
    assert [r["text"] for r in batch] == [PREFIX] + [PREFIX + c for c in CHOICES]
    for r in batch:
        assert r["sampling_params"] == {"max_new_tokens": 0, "temperature": 0}
        assert r["return_logprob"] and r["logprob_start_len"] == prompt_len - 2
        assert r["cached_tokens"] >= prompt_len - 1  # the prefix is served from the cache
    assert all(r["sampling_params"].get("max_new_tokens") == 0 for r in reqs)  # never samples


def test_unconditional_method_scores_the_choices_alone(engine):
    @sgl.function
    def prog(s):
        s += PREFIX + sgl.select("answer", CHOICES, choices_method=sgl.unconditional_likelihood_normalized)

    state = prog.run(backend=EngineBackend(engine))
    state.sync()
    last = engine.requests[-4:]
    ids = [engine.tokenizer.encode(c, add_bos=False) for c in CHOICES]
    assert [engine.tokenizer.encode(r["text"], add_bos=False) for r in last] == ids
    assert all(r["return_logprob"] and r["logprob_start_len"] == 0 for r in last)
    meta = state.get_meta_info("answer")
    assert meta["normalized_unconditional_prompt_logprobs"] == pytest.approx([-2.0, -1.0, 0.2, 0.4])


def test_token_healing_at_the_boundary(engine):
    # The prefix ends with a space: "Answer: " + "True" tokenizes as ":" + " True", so the space
    # token is healed into the choice and " True" is scored given "...Answer:".
    seen = []

    def logprob(context, token):
        seen.append((context, token))
        return scripted_logprob(context, token)

    engine.logprob_fn = logprob

    @sgl.function
    def prog(s):
        s += "Statement: the sky is blue.\nAnswer: " + sgl.select("answer", ["True", "False"])

    state = prog.run(backend=EngineBackend(engine))
    assert state["answer"] == "True"
    meta = state.get_meta_info("answer")
    rows = meta["input_token_logprobs"]
    assert [len(r) for r in rows] == [1, 1]
    assert rows[0][0][1] == engine.tokenizer.token_id(" True")
    assert meta["normalized_prompt_logprobs"] == pytest.approx([-0.5, -0.7])
    assert ("Statement: the sky is blue.\nAnswer:", " True") in seen
    assert state.text() == "Statement: the sky is blue.\nAnswer: True"


def test_select_at_the_start_and_with_an_empty_choice():
    for add_bos in (True, False):
        engine = FakeEngine(logprob_fn=scripted_logprob, add_bos=add_bos)

        @sgl.function
        def prog(s):
            s += sgl.select("x", ["Not sure", "", "False"])
            s += sgl.select("y", [" True", " False"], choices_method=sgl.greedy_token_selection)

        state = prog.run(backend=EngineBackend(engine))
        assert state.error() is None
        meta = state.get_meta_info("x")
        assert meta["normalized_prompt_logprobs"][1] == -math.inf  # no tokens: never preferred
        # Without a BOS the first choice token has no logprob (position 0) and is left out.
        assert state["x"] == ("False" if add_bos else "Not sure")
        assert state["y"] == " True"


def test_select_variants_and_errors(engine):
    backend = EngineBackend(engine)

    @sgl.function
    def prog(s):
        s += PREFIX + sgl.gen("a", choices=CHOICES)  # gen(choices=...) is a select
        s += "\n" + PREFIX + sgl.select(name=None, choices=["True", "False"])

    state = prog.run(backend=backend)
    assert state["a"] == "False"
    assert "None" not in str(state.stream_executor.variables)
    assert state.text() == PREFIX + "False\n" + PREFIX + "False"
    with pytest.raises(ValueError):
        sgl.select("x", [])
