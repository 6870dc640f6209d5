"""``logit_bias`` (OpenAI's: token id -> bias in [-100, 100], added to the logits before sampling) through a real
server: /v1/completions, /v1/chat/completions (the `openai` client) and /generate. +100 makes a token the only
choice of every step, -100 bans the greedy choice; bad maps are 400 and the server keeps serving.
"""

from __future__ import annotations

import openai
import pytest
import shared_server

from radixrt.sampling.params import SamplingParams

pytestmark = pytest.mark.model

SERVER_ARGS = shared_server.ARGS  # the session's shared server (tests/shared_server.py)
PROMPT = "The capital of France is"
MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def generate(http, **params) -> dict:
    res = http.post("/generate", json={"text": PROMPT, "sampling_params": {"max_new_tokens": 4, "temperature": 0,
                                                                            "ignore_eos": True, **params}})
    assert res.status_code == 200, res.text
    return res.json()


def token_of(http, text: str) -> int:
    res = http.post("/tokenize", json={"prompt": text})
    assert res.status_code == 200, res.text
    (token,) = res.json()["tokens"]
    return token


def test_generate_forces_and_bans_tokens(http):
    greedy = generate(http)["output_ids"]
    banana = token_of(http, " banana")
    forced = generate(http, logit_bias={str(banana): 100})["output_ids"]
    assert forced == [banana] * 4  # every step, not only the first
    banned = generate(http, logit_bias={str(greedy[0]): -100})["output_ids"]
    assert banned[0] != greedy[0]
    assert generate(http, logit_bias={str(banana): 0.0})["output_ids"] == greedy


def test_completions_and_chat_apply_logit_bias(http, client):
    banana = token_of(http, " banana")
    done = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0,
                                     logit_bias={str(banana): 100}, extra_body={"ignore_eos": True})
    assert done.choices[0].text == " banana" * 3
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0)
    first = generate(http)["output_ids"][0]  # the same greedy token
    other = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0,
                                      logit_bias={str(first): -100})
    assert other.choices[0].text != plain.choices[0].text
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name a fruit."}],
                                          max_tokens=2, temperature=0, logit_bias={str(banana): 100})
    assert chat.choices[0].message.content == " banana" * 2
    streamed = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name a fruit."}],
                                              max_tokens=2, temperature=0, logit_bias={str(banana): 100},
                                              stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == " banana" * 2


@pytest.mark.parametrize("bias,needle", [
    ({"abc": 1}, "decimal integers"), ({"-1": 1}, "decimal integers"), ({"5": 101}, "[-100, 100]"),
    ({"5": -100.5}, "[-100, 100]"), ({"99999999": 1}, "outside the vocabulary"), ({"5": "x"}, "logit_bias"),
])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/generate"])
def test_bad_logit_bias_is_400_and_the_server_keeps_serving(http, path, bias, needle):
    if path == "/generate":
        body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 1, "logit_bias": bias}}
    elif path == "/v1/completions":
        body = {"prompt": PROMPT, "max_tokens": 1, "logit_bias": bias}
    else:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "logit_bias": bias}
    res = http.post(path, json=body)
    assert res.status_code == 400, res.text
    assert needle in res.text
    assert http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}).status_code == 200


def test_sampling_params_check_logit_bias_without_a_server():
    assert SamplingParams.from_dict({"logit_bias": {"3": 5}}).validate(10).logit_bias == {"3": 5.0}
    with pytest.raises(ValueError, match="outside the vocabulary"):
        SamplingParams.from_dict({"logit_bias": {"10": 5}}).validate(10)
    with pytest.raises(ValueError, match="at most 1024"):
        SamplingParams.from_dict({"logit_bias": {str(i): 1 for i in range(1025)}}).validate()
