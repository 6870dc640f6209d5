"""Speculative decoding on the default model: with ``--speculative-algorithm NGRAM`` the Engine, the server
and DSL programs give the tokens they give without it (float32: greedy, seeded sampling, stop strings,
logprobs, n > 1, penalties, JSON schemas), while copy-heavy prompts really accept drafts; the counters reach
``meta_info`` and ``/metrics``."""

from __future__ import annotations

import json

import pytest

import radixrt as sgl
from radixrt.server.server_process import ServerProcess

pytestmark = [pytest.mark.model, pytest.mark.slow]

OPTIONS = {"dtype": "float32", "kv_memory_gb": 0.1, "log_interval": 0}
SPECULATIVE = {"speculative_algorithm": "NGRAM", "debug_checks": True}

DOC = ("Invoice 4471 was issued by Northwind Traders, 12 Harbour Road, Portsmouth, to Blue Fin Cafe on 3 March "
       "2024. It lists 40 kg of coffee beans at 18.50 per kg and 12 boxes of paper cups at 9.99 per box.")
TOOL = json.dumps({"files": [{"name": f"src/module_{i}.py", "lines": 100 + 37 * i} for i in range(5)]})


def chat(engine, content: str) -> str:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                add_generation_prompt=True)


@pytest.fixture(scope="module")
def engines(default_model_path):
    plain = sgl.Engine(**OPTIONS)
    speculative = sgl.Engine(**OPTIONS, **SPECULATIVE)
    yield plain, speculative
    speculative.shutdown()
    plain.shutdown()


@pytest.fixture(scope="module")
def prompts(engines):
    engine = engines[0]
    return [chat(engine, f"Repeat this text exactly:\n\n{DOC}"),
            chat(engine, f"Tool result:\n{TOOL}\n\nRepeat the tool result exactly."),
            chat(engine, f"Extract the invoice number, seller and buyer as JSON.\n\n{DOC}"),
            "The capital of France is"]


def both(engines, *args, **kwargs):
    plain, speculative = engines
    return plain.generate(*args, **kwargs), speculative.generate(*args, **kwargs)


def ids(outputs) -> list[list[int]]:
    return [o["output_ids"] for o in outputs]


def test_greedy_tokens_are_the_same_and_copied_text_is_accepted(engines, prompts):
    params = {"max_new_tokens": 48, "temperature": 0}
    plain, spec = both(engines, prompts, params)
    assert ids(spec) == ids(plain)
    for out in spec[:2]:  # copying a document, quoting a tool result: most draft tokens are accepted
        meta = out["meta_info"]
        assert meta["spec_verify_ct"] > 0 and meta["spec_accepted_tokens"] > meta["spec_draft_tokens"] / 2, meta
        assert meta["spec_accept_length"] > 2.0
        assert meta["spec_verify_ct"] + meta["spec_accepted_tokens"] <= meta["completion_tokens"]
    assert "spec_verify_ct" not in plain[0]["meta_info"]


def test_one_at_a_time_equals_batched(engines, prompts):
    """A request verified alone and in a batch of others gives the same tokens (continuous batching)."""
    params = {"max_new_tokens": 24, "temperature": 0}
    alone = [engines[1].generate(p, params)["output_ids"] for p in prompts[:2]]
    assert ids(engines[1].generate(prompts[:2], params)) == alone


def test_seeded_sampling_gives_the_same_tokens(engines, prompts):
    params = [{"max_new_tokens": 32, "temperature": t, "top_p": p, "top_k": k, "seed": s}
              for t, p, k, s in ((0.7, 1.0, -1, 1), (1.0, 0.9, 50, 2), (0.5, 0.95, 20, 3), (1.2, 1.0, -1, 4))]
    plain, spec = both(engines, prompts, params)
    assert ids(spec) == ids(plain)
    assert sum(o["meta_info"].get("spec_verify_ct", 0) for o in spec) > 0


def test_stop_strings_stop_tokens_and_logprobs(engines, prompts):
    stop_at = engines[0].tokenizer.encode("Northwind", add_special_tokens=False)[0]
    params = [{"max_new_tokens": 40, "temperature": 0, "stop": ["Portsmouth"]},
              {"max_new_tokens": 40, "temperature": 0, "stop_token_ids": [stop_at]}]
    plain, spec = both(engines, prompts[:2], params, return_logprob=True, top_logprobs_num=2,
                       token_ids_logprob=[stop_at, 11])
    assert ids(spec) == ids(plain)
    for a, b in zip(plain, spec):
        assert a["text"] == b["text"] and a["meta_info"]["finish_reason"] == b["meta_info"]["finish_reason"]
        got, want = b["meta_info"]["output_token_logprobs"], a["meta_info"]["output_token_logprobs"]
        assert [t for _, t, _ in got] == [t for _, t, _ in want]
        assert all(abs(x - y) < 1e-3 for (x, _, _), (y, _, _) in zip(got, want))
        assert len(b["meta_info"]["output_top_logprobs"]) == len(got)
        got, want = b["meta_info"]["output_token_ids_logprobs"], a["meta_info"]["output_token_ids_logprobs"]
        assert len(got) == len(want) == len(b["output_ids"])  # one row per token, the verified ones too
        assert all(abs(x[0] - y[0]) < 1e-3 for g, w in zip(got, want) for x, y in zip(g, w))
    assert plain[0]["meta_info"]["finish_reason"]["type"] == "stop"


def test_n_samples_penalties_and_min_tokens(engines, prompts):
    params = [{"max_new_tokens": 24, "temperature": 0, "n": 3},
              {"max_new_tokens": 24, "temperature": 0, "frequency_penalty": 0.5, "repetition_penalty": 1.1},
              {"max_new_tokens": 24, "temperature": 0, "min_new_tokens": 20, "presence_penalty": 0.3}]
    plain, spec = both(engines, [prompts[0], prompts[1], prompts[3]], params)
    assert ids(spec) == ids(plain)


def test_json_schema_with_jump_forward(engines):
    schema = {"type": "object", "properties": {"invoice": {"type": "integer"}, "seller": {"type": "string"},
                                               "buyer": {"type": "string"}},
              "required": ["invoice", "seller", "buyer"]}
    prompt = chat(engines[0], f"Extract the invoice number, seller and buyer as JSON.\n\n{DOC}")
    params = {"max_new_tokens": 64, "temperature": 0, "json_schema": json.dumps(schema)}
    plain, spec = both(engines, [prompt, prompt + " "], params)
    assert ids(spec) == ids(plain)
    for out in spec:
        json.loads(out["text"])


@sgl.function
def refine(s, doc):
    s += sgl.user(f"Repeat this text exactly:\n\n{doc}")
    s += sgl.assistant(sgl.gen("first", max_tokens=32, temperature=0))
    s += sgl.user("Repeat it once more.")
    s += sgl.assistant(sgl.gen("second", max_tokens=32, temperature=0))


def test_dsl_programs_give_the_same_text(engines):
    plain, spec = (refine.run(doc=DOC, backend=sgl.EngineBackend(e)) for e in engines)
    assert spec["first"] == plain["first"] and spec["second"] == plain["second"]
    assert spec.get_meta_info("second")["spec_accepted_tokens"] > 0


SERVER_ARGS = ["--dtype", "float32", "--kv-memory-gb", "0.1", "--log-interval", "0", "--debug-checks",
               "--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "6",
               "--speculative-ngram-max-match-window-size", "8"]


@pytest.fixture(scope="module")
def server_url(default_model_path):
    srv = ServerProcess(SERVER_ARGS).start()
    yield srv.url
    srv.stop()


def test_server_gives_the_same_tokens_and_reports_acceptance(engines, prompts, server_url):
    import httpx

    params = {"max_new_tokens": 32, "temperature": 0}
    want = engines[0].generate(prompts[:2], params)
    with httpx.Client(base_url=server_url, timeout=300) as http:
        got = http.post("/generate", json={"text": prompts[:2], "sampling_params": params}).json()
        assert [g["output_ids"] for g in got] == ids(want)
        assert got[0]["meta_info"]["spec_accepted_tokens"] > 0
        chat_reply = http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": f"Repeat this text exactly:\n\n{DOC}"}],
            "max_tokens": 32, "temperature": 0}).json()
        assert chat_reply["choices"][0]["message"]["content"] == want[0]["text"]
        metrics = http.get("/metrics").text
    values = {line.split("{")[0]: float(line.split()[-1]) for line in metrics.splitlines()
              if line.startswith(("radixrt_spec", "sglang:spec"))}
    assert values["radixrt_spec_verify_steps_total"] > 0
    assert 0 < values["radixrt_spec_accepted_tokens_total"] <= values["radixrt_spec_draft_tokens_total"]
    assert values["sglang:spec_accept_length"] > 1.0
