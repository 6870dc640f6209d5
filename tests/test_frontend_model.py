"""The DSL on the default model through the in-process engine: select agrees with transformers."""

import pytest

pytestmark = [pytest.mark.model, pytest.mark.slow]


@pytest.fixture(scope="module")
def engine(default_model_path):
    import radixrt

    eng = radixrt.Engine(dtype="float32")  # compared with fp32 transformers at 2e-3, whatever auto picks
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def hf(engine):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = str(engine.model_path)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return tok, model


def reference_scores(hf, prefix, choices):
    """Mean logprob of each choice's own tokens (healed at the boundary), computed with transformers."""
    import torch

    tok, model = hf
    prefix_ids = tok(prefix)["input_ids"]
    scores = []
    for choice in choices:
        ids = tok(prefix + choice)["input_ids"]
        k = 0
        while k < min(len(ids), len(prefix_ids)) and ids[k] == prefix_ids[k]:
            k += 1
        with torch.no_grad():
            logp = model(torch.tensor([ids])).logits[0].log_softmax(-1)
        values = [logp[i - 1, ids[i]].item() for i in range(max(k, 1), len(ids))]
        scores.append(sum(values) / len(values))
    return scores


@pytest.mark.parametrize(
    "prefix,choices",
    [
        ("The capital of France is", [" Paris", " London", " Berlin"]),
        ("Q: Is the sky blue?\nA: ", ["Yes", "No"]),  # the trailing space heals into the choice
        ("2 + 2 =", [" 4", " 5", " four"]),
    ],
)
def test_select_matches_transformers(engine, hf, prefix, choices):
    import radixrt as sgl

    @sgl.function
    def prog(s):
        s += prefix + sgl.select("x", choices)

    state = prog.run(backend=engine)
    assert state.error() is None
    got = state.get_meta_info("x")["normalized_prompt_logprobs"]
    want = reference_scores(hf, prefix, choices)
    assert got == pytest.approx(want, abs=2e-3)
    assert state["x"] == choices[max(range(len(choices)), key=want.__getitem__)]


def test_chat_gen_stream_and_batch(engine):
    import radixrt as sgl

    @sgl.function
    def qa(s, question):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=12, temperature=0))

    state = qa.run(question="What is the capital of France?", backend=engine)
    assert state.error() is None and "Paris" in state["answer"]
    assert state.text().startswith("<|im_start|>")  # the model's own template markers
    streamed = qa.run(question="What is the capital of France?", backend=engine, stream=True)
    assert "".join(streamed.text_iter("answer")) == state["answer"]
    states = qa.run_batch([{"question": f"What is {i} plus {i}?"} for i in range(4)], backend=engine, temperature=0)
    assert all(s.error() is None and s["answer"] for s in states)
    assert all(s.get_meta_info("answer")["cached_tokens"] > 0 for s in states)
