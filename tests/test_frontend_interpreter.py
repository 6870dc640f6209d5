"""Interpreter semantics of the DSL on a deterministic fake engine (no model)."""

import asyncio
import re
import json
import threading
import time

import pytest

import radixrt as sgl
from radixrt.frontend.backend.engine import EngineBackend
from radixrt.frontend.dtype_regex import REGEX_INT, REGEX_STR
from fake_engine import FakeEngine, default_responder


def echo_responder(prompt, sp):
    """Replies ' <last word of the prompt>' then filler, so captures can be checked exactly."""
    if sp.get("regex") is not None or sp.get("json_schema") is not None:
        return default_responder(prompt, sp)
    words = re.findall(r"\w+", prompt)
    return " r_" + (words[-1] if words else "EMPTY") + "\nmore text here"  # " r_<word>" is one token


@pytest.fixture
def engine():
    return FakeEngine(responder=echo_responder)


@pytest.fixture
def backend(engine):
    return EngineBackend(engine)


def test_text_and_variable_capture(engine, backend):
    @sgl.function
    def prog(s, question):
        s += "Q: " + question + "\n"
        s += "A:" + sgl.gen("answer", stop="\n")
        s += "\nAgain:" + sgl.gen("again", max_tokens=1)

    state = prog.run(question="why", backend=backend)
    assert state["answer"] == " r_A"
    assert state["again"] == " r_Again"  # one token
    assert state.text() == "Q: why\nA: r_A\nAgain: r_Again"
    assert "answer" in state and "nope" not in state
    # Each gen sends the text so far, with the run's defaults and the gen's overrides.
    gens = [r for r in engine.requests if r["sampling_params"].get("max_new_tokens")]
    assert [r["text"] for r in gens] == ["Q: why\nA:", "Q: why\nA: r_A\nAgain:"]
    assert gens[0]["sampling_params"]["stop"] == ["\n", "<|im_end|>"]  # + the template's stop_str
    assert gens[0]["sampling_params"]["max_new_tokens"] == 128
    assert gens[1]["sampling_params"]["max_new_tokens"] == 1
    meta = state.get_meta_info("answer")
    assert meta["prompt_tokens"] == len(engine.tokenizer.encode("Q: why\nA:"))
    assert meta["finish_reason"]["type"] == "stop"


def test_run_defaults_and_gen_overrides(engine, backend):
    @sgl.function
    def prog(s):
        s += "x" + sgl.gen("a", temperature=0.5, top_k=5, min_tokens=2, ignore_eos=True)
        s += "y" + sgl.gen("b", max_new_tokens=7, stop_token_ids=[9])

    prog.run(backend=backend, temperature=0.1, top_p=0.9, max_new_tokens=33, stop=["END"]).sync()
    a, b = [r["sampling_params"] for r in engine.requests]
    assert a["temperature"] == 0.5 and a["top_p"] == 0.9 and a["top_k"] == 5
    assert a["min_new_tokens"] == 2 and a["ignore_eos"] is True and a["max_new_tokens"] == 33
    assert a["stop"] == ["END", "<|im_end|>"]
    assert b["temperature"] == 0.1 and b["max_new_tokens"] == 7 and b["stop_token_ids"] == [9]
    assert "regex" not in a and "json_schema" not in a


def test_positional_args_bind_and_call(backend):
    @sgl.function
    def prog(s, a, b="B"):
        s += a + b

    assert prog.run("A", backend=backend).text() == "AB"
    assert prog.bind(b="Z").run(a="A", backend=backend).text() == "AZ"
    with pytest.raises(TypeError):
        prog.bind(c=1)
    sgl.set_default_backend(backend)
    try:
        assert prog(a="1", b="2").text() == "12"  # calling a function runs it
    finally:
        sgl.set_default_backend(None)


def test_no_backend_is_a_clear_error():
    @sgl.function
    def prog(s):
        s += "x"

    sgl.set_default_backend(None)
    with pytest.raises(RuntimeError, match="no backend"):
        prog.run()


def test_roles_use_the_template_markers_and_build_messages(engine, backend):
    @sgl.function
    def chat(s, q):
        s += sgl.system("Be brief.")
        s += sgl.user(q)
        s += sgl.assistant(sgl.gen("a1", stop="\n"))
        with s.user():
            s += "second"
        with s.assistant():
            s += sgl.gen("a2", stop="\n")
        s += sgl.user_begin() + "third" + sgl.user_end()

    state = chat.run(q="hello", backend=backend)
    assert state.text() == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nhello<|im_end|>\n"
        "<|im_start|>assistant\n r_assistant<|im_end|>\n"
        "<|im_start|>user\nsecond<|im_end|>\n"
        "<|im_start|>assistant\n r_assistant<|im_end|>\n"
        "<|im_start|>user\nthird<|im_end|>\n"
    )
    assert state.messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "r_assistant"},
        {"role": "user", "content": "second"},
        {"role": "assistant", "content": "r_assistant"},
        {"role": "user", "content": "third"},
    ]
    # The gen inside the assistant role was sent the text up to the assistant prefix.
    assert engine.requests[0]["text"].endswith("<|im_start|>assistant\n")


def test_default_system_prompt_is_inserted():
    template = {
        "default_system_prompt": "You are helpful.",
        "role_prefix_and_suffix": {"system": ["[S]", "[/S]"], "user": ["[U]", "[/U]"], "assistant": ["[A]", "[/A]"]},
        "stop_str": [],
    }
    backend = EngineBackend(FakeEngine(chat_template=template))

    @sgl.function
    def chat(s):
        s += sgl.user("hi")

    state = chat.run(backend=backend)
    assert state.text() == "[S]You are helpful.[/S][U]hi[/U]"
    assert [m["role"] for m in state.messages()] == ["system", "user"]


def test_nested_roles_and_bad_appends_are_errors(backend):
    @sgl.function
    def nested(s):
        with s.user():
            s += sgl.assistant("x")

    state = nested.run(backend=backend)
    assert isinstance(state.error(), ValueError) and "nested" in str(state.error())

    @sgl.function
    def bad(s):
        s += 5

    with pytest.raises(TypeError):
        bad.run(backend=backend)

    @sgl.function
    def none(s):
        s += None

    with pytest.raises(ValueError):
        none.run(backend=backend)


def test_var_scope_and_set_var(backend):
    @sgl.function
    def prog(s):
        s += "head "
        with s.var_scope("block"):
            s += "{" + sgl.gen("x", stop="\n") + "}"
        s["mine"] = 3

    state = prog.run(backend=backend)
    assert state["block"] == "{ r_head}"
    assert state["x"] == " r_head"
    assert state["mine"] == 3


def test_typed_gens_send_regexes(engine, backend):
    @sgl.function
    def prog(s):
        s += "n=" + sgl.gen_int("n") + " s=" + sgl.gen_string("t") + " j=" + sgl.gen("j", json_schema={"type": "object"})
        s += " r=" + sgl.gen("r", regex=r"\d+", max_tokens=3)

    state = prog.run(backend=backend)
    assert state["n"] == "42" and state["t"] == '"fake"' and state["j"] == '{"name": "fake"}'
    sp = [r["sampling_params"] for r in engine.requests]
    assert sp[0]["regex"] == REGEX_INT and " " in sp[0]["stop"] and "\n" in sp[0]["stop"]
    assert sp[1]["regex"] == REGEX_STR
    assert json.loads(sp[2]["json_schema"]) == {"type": "object"}
    assert sp[3]["regex"] == r"\d+"
    with pytest.raises(Exception):
        sgl.gen("bad", regex="(")


def test_gen_choices_is_select_and_image_is_not_supported():
    assert type(sgl.gen("x", choices=["a", "b"])).__name__ == "SglSelect"
    with pytest.raises(NotImplementedError, match="text-only"):
        sgl.image("cat.png")


def test_errors_surface_in_state_error(backend, engine):
    def failing(prompt, sp):
        if "boom" in prompt:
            raise RuntimeError("model exploded")
        return " ok"

    engine.responder = failing

    @sgl.function
    def prog(s):
        s += "fine" + sgl.gen("a", max_tokens=2)
        s += " boom" + sgl.gen("b")
        s += " after" + sgl.gen("c")

    state = prog.run(backend=backend)
    err = state.error()
    assert isinstance(err, RuntimeError) and "model exploded" in str(err)
    assert state["a"] == " ok"
    with pytest.raises(RuntimeError, match="not produced"):
        state["b"]
    assert state.text() == "fine ok boom"  # nothing ran after the failure
    assert not any("after" in r["text"] for r in engine.requests)

    # A program that reads a failed variable raises (the error chains the backend's).
    @sgl.function
    def reader(s):
        s += "boom" + sgl.gen("b")
        s += s["b"]

    with pytest.raises(RuntimeError) as info:
        reader.run(backend=backend)
    assert "model exploded" in str(info.value.__cause__)


def test_fork_shares_prefix_and_branches_are_independent(engine, backend):
    @sgl.function
    def tree(s):
        s += "Shared context that every branch starts with.\n"
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f"Branch {i}:" + sgl.gen("idea", stop="\n")
        forks.join()
        s += "Ideas:" + "|".join(f["idea"] for f in forks)

    state = tree.run(backend=backend)
    prefix = "Shared context that every branch starts with.\n"
    # The parent's text is prefilled once (max_new_tokens=0) before the branches run ...
    commits = [r for r in engine.requests if r["sampling_params"].get("max_new_tokens") == 0]
    assert [r["text"] for r in commits] == [prefix]
    branch_reqs = [r for r in engine.requests if r["text"].startswith(prefix + "Branch")]
    assert sorted(r["text"] for r in branch_reqs) == [prefix + f"Branch {i}:" for i in range(3)]
    # ... so every branch finds the whole prefix in the cache.
    # (all but the prefix's last token "\n", which merges with "Branch" in the fake's tokenizer)
    prefix_tokens = len(engine.tokenizer.encode(prefix))
    assert all(r["cached_tokens"] >= prefix_tokens - 1 for r in branch_reqs)
    # Branches have their own text and variables; join gathers the new variables as a list.
    assert state["idea"] == [" r_0", " r_1", " r_2"]
    assert state.text() == prefix + "Ideas: r_0| r_1| r_2"


def test_fork_before_any_text_and_fork_group_append(engine, backend):
    @sgl.function
    def prog(s):
        forks = s.fork(2)
        forks += lambda i: f"item {i} "
        forks += ["a", "b"]
        forks += sgl.gen("g", max_tokens=1)
        forks.join()

    state = prog.run(backend=backend)
    assert state.text() == ""
    assert state["g"] == [" r_a", " r_b"]
    assert not any(r["sampling_params"].get("max_new_tokens") == 0 for r in engine.requests)


def test_fork_copies_variables_and_roles(backend):
    @sgl.function
    def prog(s):
        s += "v:" + sgl.gen("v", max_tokens=1)
        with s.user():
            s += "question"
        forks = s.fork(2)
        for f in forks:
            f += sgl.assistant(sgl.gen("ans", max_tokens=1))
        forks.join()
        s += "done"

    state = prog.run(backend=backend)
    f_messages = None
    assert state["v"] == " r_v"
    assert state["ans"] == [" r_assistant", " r_assistant"]
    assert f_messages is None and state.messages()[-1]["role"] == "user"


def test_join_concate_and_append(backend):
    @sgl.function
    def prog(s, contexts):
        s += "Memorize:\n"
        forks = s.fork(len(contexts))
        forks += lambda i: f"S{i}: " + contexts[i] + "\n"
        forks.join(mode="concate_and_append")
        s += "Q?"

    state = prog.run(contexts=["a", "b", "c"], backend=backend)
    assert state.text() == "Memorize:\nS0: a\nS1: b\nS2: c\nQ?"


def test_copy_context_manager(backend):
    @sgl.function
    def prog(s):
        s += "base "
        with s.copy() as c:
            c += "side" + sgl.gen("side", max_tokens=1)
        s += "main"

    state = prog.run(backend=backend)
    assert state["side"] == [" r_side"]
    assert state.text() == "base main"


def slow_engine(delay=0.002):
    return FakeEngine(responder=lambda p, sp: " one two three four five", delay=delay)


def test_streaming_text_iter_order():
    backend = EngineBackend(slow_engine())

    @sgl.function
    def prog(s):
        s += "Start."
        s += sgl.gen("a", max_tokens=5)
        s += " Mid."
        s += sgl.gen("b", max_tokens=3)

    state = prog.run(stream=True, backend=backend)
    chunks = list(state.text_iter())
    assert "".join(chunks) == "Start. one two three four five Mid. one two three"
    assert len(chunks) >= 4  # token by token, not one final blob

    state = prog.run(stream=True, backend=backend)
    pieces = list(state.text_iter("b"))
    assert "".join(pieces) == " one two three"
    assert state["a"] == " one two three four five"
    assert state.get_meta_info("b")["completion_tokens"] == 3


def test_streaming_async_iter():
    backend = EngineBackend(slow_engine())

    @sgl.function
    def prog(s):
        s += sgl.user("hi")
        s += sgl.assistant(sgl.gen("answer", max_tokens=4))

    async def collect(var):
        state = prog.run(stream=True, backend=backend)
        return [c async for c in state.text_async_iter(var)]

    assert "".join(asyncio.run(collect("answer"))) == " one two three four"
    whole = "".join(asyncio.run(collect(None)))
    assert whole.endswith(" one two three four<|im_end|>\n") and whole.startswith("<|im_start|>user\nhi")


def test_text_iter_without_stream_yields_final(backend):
    @sgl.function
    def prog(s):
        s += "x" + sgl.gen("a", max_tokens=1)

    state = prog.run(backend=backend)
    assert list(state.text_iter()) == ["x r_x"]
    assert list(state.text_iter("a")) == [" r_x"]


def test_streaming_program_error_ends_the_stream(engine, backend):
    @sgl.function
    def prog(s):
        s += "a"
        raise KeyError("user bug")

    state = prog.run(stream=True, backend=backend)
    assert list(state.text_iter()) in (["a"], [])
    assert isinstance(state.error(), KeyError)


def test_run_batch_results_order_threads_and_progress(engine, backend):
    @sgl.function
    def prog(s, i):
        s += f"Item {i}:" + sgl.gen("out", max_tokens=1)

    states = prog.run_batch([{"i": i} for i in range(10)], backend=backend, num_threads=4, progress_bar=True)
    assert [st["out"] for st in states] == [f" r_{i}" for i in range(10)]
    states = prog.run_batch([(i,) for i in range(3)], backend=backend, num_threads=1)
    assert [st["out"] for st in states] == [f" r_{i}" for i in range(3)]
    gen = prog.run_batch([{"i": i} for i in range(5)], backend=backend, generator_style=True)
    assert [st["out"] for st in gen] == [f" r_{i}" for i in range(5)]
    assert prog.run_batch([], backend=backend) == []
    with pytest.raises(TypeError):
        prog.run_batch([(1, 2, 3)], backend=backend)


def test_run_batch_prefills_the_shared_prefix_once():
    # A ~1,000-token few-shot header shared by 64 programs.
    header = "".join(f"Example {k}: the answer to question {k} is {k * 7}.\n" for k in range(92))
    engine = FakeEngine(responder=lambda p, sp: " 42\n")
    backend = EngineBackend(engine)

    @sgl.function
    def few_shot(s, question):
        s += header
        s += "Question: " + question + "\nAnswer:" + sgl.gen("answer", stop="\n", max_tokens=4)

    states = few_shot.run_batch([{"question": f"q{i}"} for i in range(64)], backend=backend)
    assert all(st["answer"] == " 42" for st in states)
    hints = [r for r in engine.requests if r["sampling_params"].get("max_new_tokens") == 0]
    # The traced constant prefix (up to the first argument), sent once, first.
    assert [r["text"] for r in hints] == [header + "Question: "]
    assert engine.requests[0]["text"] == header + "Question: "
    header_tokens = len(engine.tokenizer.encode(header))
    assert header_tokens >= 1000
    gens = engine.requests[1:]
    assert len(gens) == 64 and all(r["cached_tokens"] >= header_tokens for r in gens)
    # The header is computed once in all: the rest are the per-program suffixes.
    assert engine.computed_tokens() < header_tokens + 64 * 12


def test_tracer_prefix_extraction(backend):
    from radixrt.frontend.tracer import extract_prefix_by_tracing

    @sgl.function
    def chat(s, q):
        s += sgl.system("sys")
        s += sgl.user("Q: " + q)
        s += sgl.assistant(sgl.gen("a"))

    assert extract_prefix_by_tracing(chat, backend) == "<|im_start|>system\nsys<|im_end|>\n<|im_start|>user\nQ: "

    @sgl.function
    def fstring(s, q):
        s += "intro "
        s += f"about {q}"  # a placeholder argument cannot be formatted: tracing stops here

    assert extract_prefix_by_tracing(fstring, backend) == "intro "

    @sgl.function
    def bound(s, topic, q):
        s += "Topic: " + topic + "\n"
        s += q

    assert extract_prefix_by_tracing(bound.bind(topic="cats"), backend) == "Topic: cats\n"

    side_effects = []

    @sgl.function
    def stops_early(s, q):
        s += "a" + sgl.gen("x")
        side_effects.append(1)

    assert extract_prefix_by_tracing(stops_early, backend) == "a"
    assert side_effects == []


def test_trace_program_records_nodes():
    @sgl.function
    def prog(s, q):
        s += "A" + q
        s += sgl.gen("x")
        forks = s.fork(2)
        forks += "b"

    tracer = prog.trace()
    kinds = [type(n).__name__ for n in tracer.flatten_nodes()]
    assert kinds == ["SglConstantText", "SglArgument", "SglGen"]
    assert len(tracer.child_states) == 2


def test_many_programs_concurrently_do_not_hang(backend):
    @sgl.function
    def prog(s, i):
        for k in range(3):
            s += f" {i}x{k}" + sgl.gen(f"g{k}", max_tokens=1)

    results = {}

    def worker(i):
        results[i] = prog.run(i=i, backend=backend)["g2"]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(20)]
    t0 = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert time.time() - t0 < 10
    assert results == {i: f" r_{i}x2" for i in range(20)}


def test_names_stay_importable_from_the_interpreter_and_ir_modules():
    """SGLang keeps these in lang/interpreter.py and lang/ir.py; programs may import them from there."""
    from radixrt import frontend
    from radixrt.frontend import api, dtype_regex, executor, fork_join, interpreter, ir, program
    from radixrt.frontend import program_state, run, sampling_params

    assert interpreter.StreamExecutor is executor.StreamExecutor
    assert interpreter.ProgramState is program_state.ProgramState is frontend.ProgramState
    assert interpreter.ProgramStateGroup is fork_join.ProgramStateGroup is frontend.ProgramStateGroup
    for name in ("resolve_backend", "run_program", "run_program_batch", "cache_program"):
        assert getattr(interpreter, name) is getattr(run, name)
    assert ir.SglFunction is program.SglFunction is frontend.SglFunction is api.SglFunction
    assert ir.SglSamplingParams is sampling_params.SglSamplingParams
    assert ir.OVERRIDABLE_FIELDS is sampling_params.OVERRIDABLE_FIELDS
    for name in ("REGEX_INT", "REGEX_FLOAT", "REGEX_BOOL", "REGEX_STR"):
        assert getattr(ir, name) == getattr(dtype_regex, name)
