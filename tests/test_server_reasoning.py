"""A reasoning server (`radixrt serve --reasoning-parser qwen3`) through the official openai client.

The default model is not a reasoning model, so the server gets a chat template that opens a `<think>` block in
the prompt unless `chat_template_kwargs` say `enable_thinking: false` (Qwen3's switch), and answers are
constrained (`regex`): the constraint applies after the reasoning block, and closing it within the token budget
makes the model write `</think>` and then the answer. Checked: `reasoning_content` apart from `content`, whole
and streamed (the deltas fold to the whole answer), `stream_reasoning: false`, `separate_reasoning: false`,
`chat_template_kwargs` reaching the template, bad inputs 400. (Reasoning and tool calls in one answer are
checked on the parsers in tests/test_reasoning.py: a call's constraint is longer than the budget the grammar
closes within, so the default model never reaches a call after thinking.)
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import openai
import pytest

pytestmark = pytest.mark.model

HTTP_TIMEOUT = 300
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is not defined or enable_thinking %}<think>\n{% else %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)
_TEMPLATE_FILE = Path(tempfile.mkdtemp(prefix="radixrt-reasoning-")) / "thinking.jinja"
_TEMPLATE_FILE.write_text(TEMPLATE)
SERVER_ARGS = ["--dtype", "float32", "--kv-memory-gb", "0.1", "--log-interval", "0", "--reasoning-parser", "qwen3",
               "--chat-template", str(_TEMPLATE_FILE)]
MODEL = "smollm2-135m"
QUESTION = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]
YES_NO = {"regex": "(yes|no)"}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def create(client, **kwargs):
    return client.chat.completions.create(**{"model": MODEL, "temperature": 0, "max_tokens": 24,
                                             "messages": QUESTION, **kwargs})


def fold(chunks):
    reasoning, content, pieces = "", "", []
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        part = getattr(delta, "reasoning_content", None) or ""
        reasoning += part
        pieces.append(part)
        content += delta.content or ""
    return reasoning, content, [p for p in pieces if p]


def test_reasoning_content_apart_from_the_answer_whole_and_streamed(client):
    whole = create(client, extra_body=YES_NO)
    message = whole.choices[0].message
    assert message.content in ("yes", "no")
    assert message.reasoning_content and "</think>" not in message.reasoning_content
    reasoning, content, pieces = fold(create(client, extra_body=YES_NO, stream=True))
    assert (reasoning, content) == (message.reasoning_content, message.content)
    assert len(pieces) > 1  # the block arrives as it is written


def test_stream_reasoning_false_sends_the_block_in_one_delta(client):
    message = create(client, extra_body=YES_NO).choices[0].message
    reasoning, content, pieces = fold(create(client, extra_body={**YES_NO, "stream_reasoning": False}, stream=True))
    assert pieces == [message.reasoning_content]
    assert content == message.content


def test_separate_reasoning_false_keeps_the_text_whole(client):
    message = create(client, extra_body={**YES_NO, "separate_reasoning": False}).choices[0].message
    assert getattr(message, "reasoning_content", None) is None
    assert "</think>" in message.content
    assert message.content.rsplit("</think>", 1)[1].strip() in ("yes", "no")


def test_chat_template_kwargs_reach_the_template(client):
    thinking = create(client, max_tokens=8)
    plain = create(client, max_tokens=8, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    # the template renders an empty block into the prompt: more prompt tokens, and the output is the answer
    assert plain.usage.prompt_tokens > thinking.usage.prompt_tokens
    assert getattr(plain.choices[0].message, "reasoning_content", None) is None
    assert plain.choices[0].message.content
    assert thinking.choices[0].message.reasoning_content  # the prompt opened the block: all of it is reasoning
    assert thinking.choices[0].message.content == ""


@pytest.mark.parametrize("body,needle", [
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ({"separate_reasoning": "yes"}, "separate_reasoning"),
    ({"stream_reasoning": 1}, "stream_reasoning"),
    ({"regex": "(unclosed"}, "grammar"),
])
def test_bad_reasoning_requests_are_400_and_the_server_keeps_serving(http, body, needle):
    res = http.post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 2, **body})
    assert res.status_code == 400, res.text
    assert needle in res.json()["error"]["message"], res.text
    assert http.post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 2}).status_code == 200
