"""Tool calls in the pythonic format (`--tool-call-parser pythonic`, Llama 3.2 / 4 style: `[f(a=1)]`) through a
real `radixrt serve` (default model, float32, greedy) and the official openai client: the constraint makes the
model write calls in that layout, whose keyword arguments reach the client as JSON valid under each tool's schema,
whole and streamed alike; an earlier call in the conversation is written back in the format; a tool the format
cannot express is a 400 and the server keeps serving."""

from __future__ import annotations

import json

import openai
import pytest
import shared_server

from radixrt.bench.tool_calls import PROMPTS, TOOLS, answer_problem, ask

pytestmark = pytest.mark.model

SERVER_ARGS = [*shared_server.ARGS, "--tool-call-parser", "pythonic"]
MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def test_required_calls_are_valid_whole_and_streamed(client):
    for prompt in PROMPTS[::20]:
        whole = ask(client, MODEL, prompt, False, "required", 160)
        streamed = ask(client, MODEL, prompt, True, "required", 160)
        assert answer_problem(whole) is None, (prompt, whole)
        assert streamed == whole, prompt


def test_a_stream_sends_the_name_then_whole_arguments(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=160, tools=TOOLS, tool_choice="required", stream=True,
        messages=[{"role": "user", "content": PROMPTS[0]}]))
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [] if c.choices else [])]
    assert deltas and deltas[0].id.startswith("call_") and deltas[0].function.name
    assert all(d.id is None and not d.function.name for d in deltas[1:] if d.index == 0)
    fragments = [d.function.arguments for d in deltas if d.index == 0 and d.function.arguments]
    # one fragment when the model writes one argument (it and the closing "}" come at the same ")")
    assert fragments and isinstance(json.loads("".join(fragments)), dict)
    for i in range(1, len(fragments)):  # a fragment ends where an argument does: each prefix closes as JSON
        assert isinstance(json.loads("".join(fragments[:i]) + "}"), dict), fragments[:i]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_history_with_calls_and_a_bad_tool(client, http):
    messages = [{"role": "user", "content": "What's the weather like in Paris right now?"},
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 18}'}]
    res = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=16, messages=messages,
                                         tools=TOOLS, tool_choice="none")
    assert res.choices[0].message.content and res.usage.prompt_tokens > 60
    bad = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"not-a-name": {"type": "string"}}}}}]
    reply = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages[:1], "tools": bad,
                                                    "tool_choice": "required"})
    assert reply.status_code == 400 and "not-a-name" in reply.text
    again = ask(client, MODEL, PROMPTS[0], False, "required", 160)
    assert answer_problem(again) is None
