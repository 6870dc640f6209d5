"""Reasoning output split into the reasoning block and the answer (radixrt.reasoning, radixrt.server.openai_parsed,
the DSL's separate_reasoning), model-free: each format's rules on whole outputs, the same split from a stream cut
at every character position (and fed one character at a time), the constraint that lets a constrained answer
think first, reasoning and tool calls in one answer, and chat_template_kwargs' checks.
"""

from __future__ import annotations

import re

import pytest

import radixrt as sgl
from fake_engine import FakeEngine
from radixrt.frontend.backend.engine import EngineBackend
from radixrt.protocol.errors import RequestError
from radixrt.reasoning import REASONING_FORMATS, reasoning_format, split_reasoning
from radixrt.reasoning.constraint import reasoning_prefix, with_reasoning
from radixrt.server.openai_parsed import ParsedStream, parsed_message
from radixrt.server.openai_reasoning import ReasoningPlan, constrain_after_reasoning, template_kwargs
from radixrt.tools.formats import choose_format

CALL = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'

# (format, starts in reasoning (None: the format's default), output, reasoning, answer)
CASES = [
    ("deepseek-r1", None, "Let me think.</think>The answer is 4.", "Let me think.", "The answer is 4."),
    ("deepseek-r1", None, "<think>abc</think>\n\nxyz", "abc", "\n\nxyz"),
    ("deepseek-r1", None, "  <think>abc</think>x", "abc", "x"),
    ("deepseek-r1", None, "never closed </th ink", "never closed </th ink", ""),
    ("deepseek-r1", None, "a </th b</think></think>c", "a </th b", "</think>c"),
    ("deepseek-r1", None, "", "", ""),
    ("deepseek-r1", None, "思考中…</think>答えは４", "思考中…", "答えは４"),
    ("qwen3", None, "plain answer", None, "plain answer"),
    ("qwen3", None, "<thin", None, "<thin"),
    ("qwen3", None, "\n <think>a</think>b", "a", "b"),
    ("qwen3", None, "x <think>a</think>b", None, "x <think>a</think>b"),
    ("qwen3", True, "a</think>b", "a", "b"),
    ("qwen3", None, "<think>plan" + CALL, "plan", CALL),
    ("qwen3-thinking", None, "plan</think>" + CALL, "plan", CALL),
    ("qwen3-thinking", None, "<think></think>", "", ""),
]


@pytest.mark.parametrize("name,start,text,reasoning,answer", CASES)
def test_whole_output_split(name, start, text, reasoning, answer):
    assert split_reasoning(reasoning_format(name), text, start) == (reasoning, answer)


def fold(parser, pieces):
    reasoning, content = "", ""
    for piece in pieces:
        delta = parser.feed(piece)
        reasoning, content = reasoning + delta.reasoning, content + delta.content
    last = parser.finish()
    return reasoning + last.reasoning, content + last.content


@pytest.mark.parametrize("name,start,text,reasoning,answer", CASES)
def test_stream_split_at_every_position_folds_to_the_whole_split(name, start, text, reasoning, answer):
    fmt = reasoning_format(name)
    whole = (reasoning or "", answer)
    for cut in range(len(text) + 1):
        assert fold(fmt.parser(start), [text[:cut], text[cut:]]) == whole, cut
    for cut in range(len(text) + 1):  # three pieces: a marker cut twice
        for cut2 in range(cut, len(text) + 1, 3):
            assert fold(fmt.parser(start), [text[:cut], text[cut:cut2], text[cut2:]]) == whole, (cut, cut2)
    assert fold(fmt.parser(start), list(text)) == whole


def test_stream_never_sends_a_marker_or_its_prefix_as_reasoning():
    parser = reasoning_format("deepseek-r1").parser()
    assert parser.feed("abc</th").reasoning == "abc"  # "</th" is held: it may be the end marker
    delta = parser.feed("ank>d<")
    assert (delta.reasoning, delta.content) == ("</thank>d", "")  # not the marker after all; "<" held
    assert parser.in_reasoning
    delta = parser.feed("/think>e")
    assert (delta.reasoning, delta.content) == ("", "e") and not parser.in_reasoning


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match="deepseek-r1"):
        reasoning_format("nope")
    assert set(REASONING_FORMATS) == {"deepseek-r1", "qwen3", "qwen3-thinking"}


def test_qwen3_starts_in_reasoning_only_after_a_prompt_that_opens_the_block():
    fmt = reasoning_format("qwen3")
    assert fmt.starts_in_reasoning("<|im_start|>assistant\n<think>\n")
    assert not fmt.starts_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert reasoning_format("deepseek-r1").starts_in_reasoning("")


# ----- the constraint after the reasoning block -------------------------------------------------------------


@pytest.mark.parametrize("name,start", [("deepseek-r1", True), ("qwen3", False), ("qwen3", True),
                                        ("qwen3-thinking", True)])
def test_constraint_admits_exactly_a_block_then_the_answer(name, start):
    fmt = reasoning_format(name)
    pattern = re.compile(with_reasoning(fmt, start, "(yes|no)"), re.S)
    opener = "" if start else "<think>"
    assert pattern.fullmatch(opener + "a < b </thi </think>\n yes")
    assert not pattern.fullmatch(opener + "a </think> b </think>yes")  # the block ends at the first marker
    assert not pattern.fullmatch(opener + "a</think>maybe")
    if fmt.interrupt:  # a block with a tool-call marker would end there
        assert not pattern.fullmatch(opener + "a <tool_call> b</think>yes")
    assert bool(pattern.fullmatch("yes")) == (not start)  # without a block only where it is optional
    assert re.compile(reasoning_prefix(fmt, start), re.S).fullmatch(opener + "x</think>")


def test_constrain_after_reasoning_rewrites_regex_and_json_schema():
    plan = ReasoningPlan(reasoning_format("deepseek-r1"), True, True, True)
    sampling = {"json_schema": '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'}
    constrain_after_reasoning(sampling, plan)
    assert set(sampling) == {"regex"}
    assert re.fullmatch(sampling["regex"], 'hmm</think>{"a":1}', re.S)
    plain = {"regex": "x+"}
    constrain_after_reasoning(plain, None)
    assert plain == {"regex": "x+"}
    with pytest.raises(RequestError, match="invalid grammar"):
        constrain_after_reasoning({"regex": "(unclosed"}, plan)


def test_template_kwargs_are_passed_but_may_not_set_the_servers_arguments():
    assert template_kwargs({"enable_thinking": False}) == {"enable_thinking": False}
    assert template_kwargs(None) == {}
    with pytest.raises(RequestError, match="tools"):
        template_kwargs({"tools": [], "enable_thinking": True})


# ----- a chat answer: reasoning, content and tool calls -----------------------------------------------------


HERMES = choose_format("hermes", None)
ANSWERS = [
    ("qwen3", True, "I should call f.</think>\n\n" + CALL),
    ("qwen3", False, "<think>plan</think>Sure: " + CALL + "\n" + CALL),
    ("deepseek-r1", True, "think</think>no call here  "),
    ("qwen3-thinking", True, "think" + CALL),
]


def fold_stream(plan, tools, pieces):
    stream = ParsedStream(plan, tools)
    reasoning, content, args, names = "", "", {}, {}
    for i, piece in enumerate(pieces):
        delta = stream.delta(piece, finished=i == len(pieces) - 1)
        reasoning += delta.get("reasoning_content", "")
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            args[call["index"]] = args.get(call["index"], "") + call["function"]["arguments"]
            if "name" in call["function"]:
                names[call["index"]] = call["function"]["name"]
    return reasoning, content, [(names[i], args[i]) for i in sorted(args)], stream.called


@pytest.mark.parametrize("name,start,text", ANSWERS)
def test_reasoning_and_tool_calls_in_one_answer_whole_and_streamed_at_every_cut(name, start, text):
    plan = ReasoningPlan(reasoning_format(name), start, True, True)
    message, called = parsed_message(text, plan, HERMES)
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
    assert message["reasoning_content"]
    assert called == bool(calls) == ("<tool_call>" in text)
    whole = (message["reasoning_content"], message["content"] or "", calls, called)
    for cut in range(len(text) + 1):
        assert fold_stream(plan, HERMES, [text[:cut], text[cut:]]) == whole, cut
    assert fold_stream(plan, HERMES, list(text) + [""]) == whole


def test_answer_shapes_separate_reasoning_off_and_stream_reasoning_off():
    text = "<think>step one, step two</think>done"
    on = ReasoningPlan(reasoning_format("qwen3"), False, True, True)
    assert parsed_message(text, on, None) == ({"role": "assistant", "reasoning_content": "step one, step two",
                                               "content": "done"}, False)
    off = ReasoningPlan(reasoning_format("qwen3"), False, False, True)
    assert parsed_message(text, off, None) == ({"role": "assistant", "content": text}, False)
    assert fold_stream(off, None, [text[:9], text[9:]])[:2] == ("", text)
    held = ParsedStream(ReasoningPlan(reasoning_format("qwen3"), False, True, False), None)
    deltas = [held.delta(piece, False) for piece in ("<think>step one", ", step ", "two</thi", "nk>do")]
    deltas.append(held.delta("ne", True))
    assert deltas[:3] == [{}, {}, {}]  # the block arrives whole once it ends
    assert deltas[3] == {"reasoning_content": "step one, step two", "content": "do"}
    assert deltas[4] == {"content": "ne"}


# ----- the DSL's separate_reasoning -------------------------------------------------------------------------


def thinking_responder(prompt, sp):
    return "<think>The user greets me.</think>Hello there!"


def test_dsl_separate_reasoning_keeps_the_answer_and_names_the_reasoning():
    backend = EngineBackend(FakeEngine(responder=thinking_responder))

    @sgl.function
    def prog(s):
        s += "Hi!\n"
        s += sgl.separate_reasoning(sgl.gen("answer", max_tokens=30), model_type="qwen3")
        s += "\nAfter: " + sgl.gen("more", max_tokens=30)

    state = prog.run(backend=backend)
    assert state["answer"] == "Hello there!"
    assert state["answer_reasoning_content"] == "The user greets me."
    assert state["more"] == "<think>The user greets me.</think>Hello there!"  # an unseparated gen stays whole
    assert state.text().startswith("Hi!\n<think>The user greets me.</think>Hello there!\nAfter: ")


def test_dsl_separate_reasoning_deepseek_reads_from_the_first_token_and_streams():
    backend = EngineBackend(FakeEngine(responder=lambda p, sp: "Counting.</think> 4"))

    @sgl.function
    def prog(s):
        s += "2+2="
        s += sgl.separate_reasoning(sgl.gen("sum", max_tokens=30), model_type="deepseek-r1")

    assert prog.run(backend=backend)["sum"] == " 4"
    state = prog.run(backend=backend, stream=True)
    assert "".join(state.text_iter()).endswith("Counting.</think> 4")
    assert state["sum"] == " 4" and state["sum_reasoning_content"] == "Counting."


def test_dsl_separate_reasoning_refuses_an_unknown_format_or_an_unnamed_gen():
    with pytest.raises(ValueError, match="deepseek-r1"):
        sgl.separate_reasoning(sgl.gen("x"), model_type="nope")
    with pytest.raises(ValueError, match="named"):
        sgl.separate_reasoning(sgl.gen(), model_type="qwen3")
