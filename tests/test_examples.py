"""The examples/ programs, run in-process on the default model through one shared Engine: each
example's `main(backend)` returns its program states; the tests check real properties of them."""

import importlib.util
import json
import re
from pathlib import Path

import pytest

pytestmark = [pytest.mark.model, pytest.mark.slow]

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(f"radixrt_example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def backend(default_model_path):
    import radixrt as sgl

    engine = sgl.Engine(dtype="float32")  # the checks below read greedy answers: one dtype on every CPU
    yield sgl.EngineBackend(engine)
    engine.shutdown()


def test_every_example_has_main_and_url_flag():
    names = sorted(p.stem for p in EXAMPLES.glob("*.py"))
    assert {"quickstart", "few_shot_qa", "multi_turn_chat", "react_agent", "tree_of_thought",
            "json_extraction"} <= set(names)
    for name in names:
        module = load(name)
        assert callable(module.main)
        assert "--url" in (EXAMPLES / f"{name}.py").read_text()


def test_quickstart(backend, capsys):
    ex = load("quickstart")
    states = ex.main(backend)
    assert len(states) == 2
    for state in states:
        assert state.error() is None
        assert state["famous"].strip() and "\n" not in state["famous"]
        assert state["continent"] in ["Europe", "Asia", "Africa", "America"]
        tips = state["tip"]  # gathered from the two forks
        assert isinstance(tips, list) and len(tips) == 2 and tips[0] != tips[1]
        assert [m["role"] for m in state.messages()][:5] == ["system", "user", "assistant", "user", "assistant"]
        # the forks continued from the parent's conversation, served from the cache
        for fork in state.ret_value:
            meta = fork.get_meta_info("tip")
            assert meta["cached_tokens"] >= state.get_meta_info("famous")["prompt_tokens"]
    assert states[0]["continent"] == "Europe"
    out = capsys.readouterr().out
    assert re.search(r"prefix cache \(gens' meta info\): \d+/\d+ = \d+%", out)
    assert re.search(r"engine stats.*\d+/\d+ = \d+%", out)


def test_few_shot_qa(backend):
    ex = load("few_shot_qa")
    states = ex.main(backend)
    answers = [s["answer"].strip() for s in states]
    assert all(a and "\n" not in a for a in answers)
    assert sum(want in a for want, a in zip(["London", "Moscow", "Athens", "Beijing"], answers)) >= 3, answers
    header_tokens = states[0].get_meta_info("answer")["prompt_tokens"] - 20
    assert all(s.get_meta_info("answer")["cached_tokens"] >= header_tokens for s in states)


def test_multi_turn_chat(backend):
    ex = load("multi_turn_chat")
    states = ex.main(backend)
    for turns, state in zip(ex.CONVERSATIONS, states):
        messages = state.messages()
        assert [m["role"] for m in messages] == ["system"] + ["user", "assistant"] * len(turns)
        assert [m["content"] for m in messages[1::2]] == turns
        assert [m["content"] for m in messages[2::2]] == [state[f"answer_{i}"] for i in range(len(turns))]
        cached = [state.get_meta_info(f"answer_{i}")["cached_tokens"] for i in range(len(turns))]
        prompts = [state.get_meta_info(f"answer_{i}")["prompt_tokens"] for i in range(len(turns))]
        # every later turn finds the whole earlier conversation (but the last, partly written, page) cached
        for i in range(1, len(turns)):
            assert cached[i] >= prompts[i - 1] - 16
    assert "Paris" in states[0]["answer_0"]


def test_react_agent(backend):
    ex = load("react_agent")
    state = ex.main(backend)
    steps = state.ret_value
    assert 1 <= steps <= 3
    for i in range(1, steps + 1):
        assert state[f"action_{i}"] in ex.ACTIONS
        assert "]" not in state[f"arg_{i}"] and "\n" not in state[f"arg_{i}"]
        if state[f"action_{i}"] != "finish":
            observation = state[f"observation_{i}"]
            assert f"Observation {i}: {observation}\n" in state.text()
    assert (state[f"action_{steps}"] == "finish") == ("answer" in state)


def test_tree_of_thought(backend):
    ex = load("tree_of_thought")
    state = ex.main(backend)
    plans, answers, verdicts = state["plan"], state["answer"], state["verdict"]
    assert len(plans) == len(ex.APPROACHES) == len(answers) == len(verdicts)
    assert all(len(a) == 2 and len(v) == 2 for a, v in zip(answers, verdicts))
    assert all(v in ("yes", "no") for vs in verdicts for v in vs)
    leaves = [a for group in answers for a in group]
    assert all(p.strip() for p in plans) and len(set(plans)) == len(plans)  # the branches differ
    assert len(leaves) == 4 and len(set(leaves)) >= 2  # sampled leaves (a short answer may repeat)


def test_json_extraction(backend):
    import jsonschema

    ex = load("json_extraction")
    date, person = ex.main(backend)
    assert re.fullmatch(ex.DATE_REGEX, date["date"])
    value = json.loads(person["person"])
    jsonschema.validate(value, ex.PERSON_SCHEMA)
