"""Tool calling on /v1/chat/completions of a real `radixrt serve` (default model, float32, greedy) through the
official openai client: required / named / auto / none, parallel_tool_calls, streamed deltas (id and name
first, then argument fragments that concatenate to the whole JSON), conversations carrying assistant
tool_calls and tool results, the tool agent example, and every bad tools request -> 400 while the server
keeps serving.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import openai
import pytest
import shared_server

from radixrt.bench.tool_calls import PROMPTS, TOOLS, answer_problem, ask

pytestmark = pytest.mark.model

HTTP_TIMEOUT = 300
SERVER_ARGS = shared_server.ARGS  # the session's shared server (tests/shared_server.py)
MODEL = "smollm2-135m"
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
WEATHER = [{"role": "user", "content": "What's the weather like in Paris right now?"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def create(client, **kwargs):
    return client.chat.completions.create(**{"model": MODEL, "temperature": 0, "max_tokens": 160, **kwargs})


def test_required_calls_validate_whole_and_streamed(client):
    prompts = PROMPTS[::10]  # one prompt of each tool (the prompts come in tens, a tool each)
    for prompt in prompts:
        whole = ask(client, MODEL, prompt, False, "required", 160)
        streamed = ask(client, MODEL, prompt, True, "required", 160)
        assert answer_problem(whole) is None, (prompt, whole)
        assert streamed == whole, prompt  # greedy: the stream's deltas put together are the same calls


def test_required_answer_shape(client):
    res = create(client, messages=WEATHER, tools=TOOLS, tool_choice="required")
    choice = res.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = choice.message.tool_calls
    assert calls and all(c.type == "function" and c.id.startswith("call_") for c in calls)
    assert len({c.id for c in calls}) == len(calls)


def test_stream_sends_id_and_name_first_then_argument_fragments(client):
    # a free-text argument: its tokens are streamed as they come (forced text arrives in bulk)
    ask_reminder = [{"role": "user", "content": PROMPTS[42]}]
    chunks = list(create(client, messages=ask_reminder, tools=TOOLS, tool_choice="required", stream=True))
    first_seen: dict[int, bool] = {}
    arguments: dict[int, str] = {}
    fragments = 0
    for chunk in chunks:
        for d in chunk.choices[0].delta.tool_calls or []:
            if d.index not in first_seen:
                assert d.id and d.id.startswith("call_") and d.type == "function" and d.function.name
                first_seen[d.index] = True
            else:
                assert d.id is None and not d.function.name
            arguments[d.index] = arguments.get(d.index, "") + (d.function.arguments or "")
            fragments += bool(d.function.arguments)
    assert first_seen and fragments > len(first_seen)  # arguments arrive in pieces, not in one go
    for text in arguments.values():
        json.loads(text)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert all(not c.choices or not c.choices[0].delta.content for c in chunks)


def test_named_tool_choice_calls_that_tool(client):
    named = {"type": "function", "function": {"name": "calculator"}}
    res = create(client, messages=WEATHER, tools=TOOLS, tool_choice=named)
    calls = res.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["calculator"]
    assert answer_problem([(c.function.name, c.function.arguments) for c in calls]) is None


def test_parallel_tool_calls_false_makes_one_call(client):
    res = create(client, messages=[{"role": "user", "content": "Weather in Paris and in Rome?"}], tools=TOOLS,
                 tool_choice="required", parallel_tool_calls=False)
    assert len(res.choices[0].message.tool_calls) == 1


def test_auto_answers_text_or_valid_calls(client):
    for prompt in (PROMPTS[0], "Say hello in one short sentence."):
        for stream in (False, True):
            calls = ask(client, MODEL, prompt, stream, "auto", 160)
            assert not calls or answer_problem(calls) is None, (prompt, calls)


def test_tool_choice_none_answers_in_text(client):
    res = create(client, messages=WEATHER, tools=TOOLS, tool_choice="none", max_tokens=24)
    choice = res.choices[0]
    assert choice.message.tool_calls is None and choice.message.content
    assert choice.finish_reason in ("stop", "length")


def test_conversation_with_calls_and_results(client):
    messages = [*WEATHER,
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 18, "sky": "cloudy"}'}]
    res = create(client, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=32)
    assert res.choices[0].message.content
    assert res.usage.prompt_tokens > 60  # the call and its result are in the prompt


@pytest.mark.parametrize("body,needle", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "wat"}}}}}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "name"),
    ({"tools": [{"type": "retrieval"}]}, "function"),
    ({"tools": TOOLS[:1] * 2}, "already used"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
    ({"tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [*WEATHER, {"role": "tool", "content": "18 degrees"}]}, "tool_call_id"),
    ({"messages": [*WEATHER, {"role": "assistant", "tool_calls": [{"type": "function", "function": 3}]}]},
     "tool_calls"),
])
def test_bad_tool_requests_are_400_and_the_server_keeps_serving(http, body, needle):
    res = http.post("/v1/chat/completions", json={"messages": WEATHER, "max_tokens": 4, **body})
    assert res.status_code == 400, res.text
    assert needle in res.json()["error"]["message"], res.text
    ok = http.post("/v1/chat/completions", json={"messages": WEATHER, "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def test_tool_agent_example(server, http):
    spec = importlib.util.spec_from_file_location("radixrt_example_tool_agent", EXAMPLES / "tool_agent.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    opened = []
    real_agent = module.agent
    module.agent = lambda *a, **kw: opened.append(kw["session_id"]) or real_agent(*a, **kw)
    result = module.main(server.url)
    assert opened and opened[0]  # the loop ran in a session, closed at the end
    stats = http.get("/get_server_info").json()["stats"]
    assert stats["sessions_open"] == 0 and stats["pages_pinned"] == 0
    assert result["calls"], result
    for call in result["calls"]:
        assert call["name"] in module.LOCAL_TOOLS
        json.loads(call["arguments"])
        assert not call["result"].startswith("error: cannot run"), call
    assert isinstance(result["answer"], str)
    roles = [m["role"] for m in result["messages"]]
    assert roles[:4] == ["system", "user", "assistant", "tool"]
