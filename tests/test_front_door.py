"""One table of requests, good and bad, answered by both hosts of the scheduler client: the in-process Engine
and `radixrt serve`'s /generate must give the same outputs for the good ones (greedy, fp32) and the same
refusal, word for word, for the bad ones (a ValueError from the Engine, a 400 from the server).

Both go through radixrt.client.SchedulerClient and radixrt.protocol.request.prepare; only the transport
differs. Cases are the semantic checks of the request path and the scheduler (types JSON cannot carry the way
Python does are the server's own decoding, tested in tests/test_server_errors.py and the fuzzing).
"""

from __future__ import annotations

import pytest
import shared_server

import radixrt

pytestmark = pytest.mark.model

SERVER_ARGS = shared_server.ARGS  # the session's shared server (tests/shared_server.py)
GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}

# (name, the call's arguments as /generate's body names them, None for a good request or the error's words)
CASES = [
    ("text", {"text": "The capital of France is", "sampling_params": GREEDY}, None),
    ("input-ids", {"input_ids": [1, 504, 3458, 314, 4649], "sampling_params": GREEDY}, None),
    ("batch", {"text": ["One, two,", "Red, green,"], "sampling_params": GREEDY}, None),
    ("per-prompt-params", {"text": ["A", "B"], "sampling_params": [GREEDY, {**GREEDY, "max_new_tokens": 2}]}, None),
    ("n-seeded", {"text": "Pick a word:", "sampling_params": {**GREEDY, "temperature": 1.0, "n": 2, "seed": 5}},
     None),
    ("stop-string", {"text": "1, 2, 3,", "sampling_params": {**GREEDY, "stop": [" 5"], "ignore_eos": False}}, None),
    ("logprobs", {"text": "Hello", "sampling_params": GREEDY, "return_logprob": True, "top_logprobs_num": 2,
                  "logprob_start_len": 0}, None),
    ("regex", {"text": "Answer yes or no:", "sampling_params": {**GREEDY, "regex": "(yes|no)"}}, None),
    ("rids", {"text": ["x", "y"], "sampling_params": GREEDY, "rid": ["front-a", "front-b"]}, None),
    ("neither", {"sampling_params": GREEDY}, "pass exactly one of text and input_ids"),
    ("both", {"text": "a", "input_ids": [1, 2], "sampling_params": GREEDY}, "pass exactly one of text and input_ids"),
    ("empty-batch", {"text": [], "sampling_params": GREEDY}, "text must be a string or a non-empty list"),
    ("out-of-vocab", {"input_ids": [1, 10**6], "sampling_params": GREEDY}, "outside the vocabulary"),
    ("params-count", {"text": ["a", "b"], "sampling_params": [GREEDY]}, "1 sampling_params for 2 prompts"),
    ("temperature", {"text": "a", "sampling_params": {**GREEDY, "temperature": -1}}, "temperature"),
    ("too-long", {"text": "a", "sampling_params": {**GREEDY, "max_new_tokens": 10**6}},
     "exceeds the context length"),
    ("stream-batch", {"text": ["a", "b"], "sampling_params": GREEDY, "stream": True},
     "stream=True takes one prompt with n=1"),
    ("bad-regex", {"text": "a", "sampling_params": {**GREEDY, "regex": "(unclosed"}}, "invalid grammar"),
    ("logprob-start", {"text": "a", "sampling_params": GREEDY, "return_logprob": True, "logprob_start_len": -5},
     "logprob_start_len must be >= -1"),
    ("top-logprobs", {"text": "a", "sampling_params": GREEDY, "return_logprob": True, "top_logprobs_num": 10**7},
     "top_logprobs_num must be in"),
    ("rid-count", {"text": "a", "sampling_params": GREEDY, "rid": ["r1", "r2"]}, "2 rids for 1 requests"),
    ("rid-twice", {"text": ["a", "b"], "sampling_params": GREEDY, "rid": ["same", "same"]}, "rid must be unique"),
    ("priority", {"text": "a", "sampling_params": GREEDY, "priority": 2**40}, "priority must be an integer"),
    ("no-session", {"text": "a", "sampling_params": GREEDY, "session_params": {"id": "no-such-session"}},
     "no-such-session"),
]
ENGINE_NAMES = {"text": "prompt", "input_ids": "input_ids", "sampling_params": "sampling_params", "rid": "rid",
                "return_logprob": "return_logprob", "top_logprobs_num": "top_logprobs_num", "stream": "stream",
                "logprob_start_len": "logprob_start_len", "priority": "priority", "session_params": "session_params"}


@pytest.fixture(scope="module")
def engine(default_model_path):
    with radixrt.Engine(dtype="float32", log_interval=0, kv_memory_gb=0.2) as eng:
        yield eng


def _outcome(results) -> tuple:
    results = results if isinstance(results, list) else [results]
    return ("ok", [(r["output_ids"], r["text"], r["meta_info"]["finish_reason"],
                    [t for _, t, _ in r["meta_info"].get("output_token_logprobs", [])]) for r in results])


def via_engine(engine, body: dict) -> tuple:
    try:
        out = engine.generate(**{ENGINE_NAMES[k]: v for k, v in body.items()})
    except ValueError as exc:
        return ("refused", str(exc))
    if body.get("stream"):
        out = list(out)[-1]
    return _outcome(out)


def via_server(http, body: dict) -> tuple:
    r = http.post("/generate", json=body)
    if r.status_code in (400, 404):  # 404: it names something the runtime does not have (a session)
        return ("refused", r.json()["error"]["message"])
    assert r.status_code == 200, r.text
    return _outcome(r.json())


@pytest.mark.parametrize("name, body, refusal", CASES, ids=[c[0] for c in CASES])
def test_engine_and_server_answer_alike(engine, http, name, body, refusal):
    ours, theirs = via_engine(engine, body), via_server(http, body)
    assert ours == theirs
    if refusal is None:
        assert ours[0] == "ok"
    else:
        assert ours[0] == "refused" and refusal in ours[1]
