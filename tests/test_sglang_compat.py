"""SGLang's request fields on a real `radixrt serve`: supported ones take effect, harmless ones are accepted and
logged once, ones asking for what radixrt cannot do are refused with a 400 naming them, misspelt ones are
refused as before; /server_info and /model_info carry what SGLang's router reads. One server for the module.
"""

from __future__ import annotations

import logging
import re

import httpx
import pytest

from radixrt.sampling import compat_fields
from radixrt.sampling.compat_fields import Ignored, Unsupported, check_fields
from radixrt.sampling.params import SamplingParams
from radixrt.server import launch
from radixrt.server.server_process import READY_LINE

pytestmark = pytest.mark.model

SERVER_ARGS = ["--dtype", "float32", "--kv-memory-gb", "0.1", "--log-interval", "0", "--served-model-name", "compat"]
GREEDY = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
PROMPT = "The capital of France is"
# What sglang-router 0.3.2 forwards for {"text", "sampling_params"} and for a minimal chat request.
ROUTER_GENERATE = {"model": None, "return_text_in_logprobs": False, "stream": False, "log_metrics": True,
                   "return_hidden_states": False, "background": False, "no_logs": False, "return_bytes": False,
                   "return_entropy": False}
ROUTER_CHAT = {"model": "compat", "logprobs": False, "stream": False, "no_stop_trim": False, "ignore_eos": False,
               "continue_final_message": False, "skip_special_tokens": True, "separate_reasoning": True,
               "stream_reasoning": True, "return_hidden_states": False}
MESSAGES = [{"role": "user", "content": "Say hi"}]


@pytest.fixture(scope="module")
def reference(http) -> str:
    res = http.post("/generate", json={"text": PROMPT, "sampling_params": GREEDY})
    assert res.status_code == 200, res.text
    return res.json()["text"]


def refused(res: httpx.Response, field: str) -> None:
    assert res.status_code == 400, res.text
    message = res.json()["error"]["message"]
    assert field in message, message


# ----- the rules, in process ----------------------------------------------------------------------------


class Body:
    def __init__(self, **values):
        self.__dict__.update(values)


def test_unsupported_refuses_only_values_that_ask_for_something():
    rules = {"lora": Unsupported("LoRA adapters"), "flag": Unsupported("x", (None, False)),
             "start": Unsupported("y", (None, 0))}
    for off in ({"lora": None, "flag": False, "start": 0}, {"lora": "", "flag": None, "start": None},
                {"lora": [], "flag": False, "start": 0}):
        check_fields(Body(**off), rules)
    for name, value in (("lora", "adapter"), ("flag", True), ("start", 3), ("lora", ["a"]), ("start", False)):
        values = {"lora": None, "flag": None, "start": None, name: value}
        with pytest.raises(ValueError, match=f"^{name} is not supported by radixrt"):
            check_fields(Body(**values), rules)


def test_ignored_fields_are_logged_once_per_name(caplog, monkeypatch):
    monkeypatch.setattr(compat_fields, "_logged", set())
    rules = {"model": Ignored("one model"), "log_metrics": Ignored("a logging switch")}
    with caplog.at_level(logging.INFO, logger="radixrt.compat"):
        for _ in range(3):
            check_fields(Body(model="m", log_metrics=None), rules)
        check_fields(Body(model="m", log_metrics=True), rules)
    lines = [r.getMessage() for r in caplog.records]
    assert sum("'model'" in line for line in lines) == 1
    assert sum("'log_metrics'" in line for line in lines) == 1


def test_sampling_params_take_sglang_fields():
    params = SamplingParams.from_dict({"sampling_seed": 7, "stream_interval": 4, "no_stop_trim": False,
                                       "spaces_between_special_tokens": True, "logit_bias": None})
    assert params.seed == 7 and params.sampling_seed is None and params.stream_interval is None
    with pytest.raises(ValueError, match="no_stop_trim is not supported"):
        SamplingParams.from_dict({"no_stop_trim": True})
    with pytest.raises(ValueError, match="spaces_between_special_tokens is not supported"):
        SamplingParams.from_dict({"spaces_between_special_tokens": False})
    assert SamplingParams.from_dict({"beam_width": 1}).beam_width is None
    with pytest.raises(ValueError, match="beam_width is not supported"):
        SamplingParams.from_dict({"beam_width": 4})
    with pytest.raises(ValueError, match="seed and sampling_seed differ"):
        SamplingParams.from_dict({"seed": 1, "sampling_seed": 2})
    with pytest.raises(ValueError, match="unknown field `no_stop_trimm`"):
        SamplingParams.from_dict({"no_stop_trimm": False})


def test_launcher_waits_for_the_line_the_server_prints():
    assert READY_LINE == launch.READY_LINE


# ----- /generate ---------------------------------------------------------------------------------------


def test_generate_takes_the_routers_body(http, reference):
    res = http.post("/generate", json={"text": PROMPT, "sampling_params": GREEDY, **ROUTER_GENERATE})
    assert res.status_code == 200, res.text
    assert res.json()["text"] == reference


def test_generate_ignores_fields_that_do_not_change_the_result(http, server, reference):
    ignored = {"model": "anything", "log_metrics": False, "data_parallel_rank": 0,
               "routed_dp_rank": 0, "session_id": "s1", "custom_labels": {"team": "a"}, "routing_key": "k",
               "no_logs": True, "conversation_id": "c", "modalities": ["image"]}
    for _ in range(2):
        res = http.post("/generate", json={"text": PROMPT, "sampling_params": {**GREEDY, "stream_interval": 3},
                                           **ignored})
        assert res.status_code == 200, res.text
        assert res.json()["text"] == reference
    logged = [line for line in server.lines if "accepted SGLang field 'routing_key'" in line]
    assert len(logged) == 1, server.output[-2000:]


@pytest.mark.parametrize("field,value", [
    ("image_data", "https://example.com/cat.png"), ("input_embeds", [[0.1, 0.2]]), ("lora_id", "adapter-id"),
    ("custom_logit_processor", "{}"), ("return_hidden_states", True), ("bootstrap_host", "10.0.0.1"),
    ("return_sampling_mask", True), ("return_entropy", True),
    ("routed_experts_start_len", 2), ("return_bytes", True),
])
def test_generate_refuses_what_radixrt_cannot_do(http, field, value):
    refused(http.post("/generate", json={"text": PROMPT, "sampling_params": GREEDY, field: value}), field)


def test_generate_accepts_null_false_and_empty_unsupported_fields(http, reference):
    off = {"image_data": None, "input_embeds": [], "lora_path": None, "custom_logit_processor": "",
           "return_hidden_states": False, "bootstrap_host": None, "bootstrap_port": None, "bootstrap_room": None,
           "session_params": {}, "routed_experts_start_len": 0}
    res = http.post("/generate", json={"text": PROMPT, "sampling_params": {**GREEDY, "logit_bias": None}, **off})
    assert res.status_code == 200, res.text
    assert res.json()["text"] == reference


def test_generate_sampling_fields(http):
    sampled = {"max_new_tokens": 8, "temperature": 1.0, "ignore_eos": True}
    by_seed = http.post("/generate", json={"text": PROMPT, "sampling_params": {**sampled, "seed": 11}}).json()
    by_sglang = http.post("/generate", json={"text": PROMPT, "sampling_params": {**sampled, "sampling_seed": 11}})
    assert by_sglang.status_code == 200, by_sglang.text
    assert by_sglang.json()["text"] == by_seed["text"]
    refused(http.post("/generate", json={"text": PROMPT, "sampling_params": {**GREEDY, "no_stop_trim": True}}),
            "no_stop_trim")


EBNF = 'root ::= " " city "."\ncity ::= "Paris" | "Lyon" | [A-Z] [a-z]{2,6}'


def test_ebnf_grammars_on_every_route(http):
    from radixrt.constrained.ebnf import ebnf_regex

    pattern = re.compile(ebnf_regex(EBNF))
    params = {"max_new_tokens": 12, "temperature": 0, "ebnf": EBNF}
    res = http.post("/generate", json={"text": PROMPT, "sampling_params": params})
    assert res.status_code == 200 and pattern.fullmatch(res.json()["text"]), res.text
    res = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ebnf": EBNF})
    assert res.status_code == 200 and pattern.fullmatch(res.json()["choices"][0]["text"]), res.text
    res = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 12, "ebnf": EBNF})
    assert res.status_code == 200 and pattern.fullmatch(res.json()["choices"][0]["message"]["content"]), res.text
    refused(http.post("/generate", json={"text": PROMPT, "sampling_params": {**GREEDY, "ebnf": 'root ::= "(" root'}}),
            "recursive")
    refused(http.post("/v1/chat/completions", json={"messages": MESSAGES, "ebnf": EBNF, "regex": "a"}),
            "only one of")
    assert http.post("/generate", json={"text": PROMPT, "sampling_params": GREEDY}).status_code == 200


def test_misspelt_fields_are_still_refused(http):
    refused(http.post("/generate", json={"text": PROMPT, "lora_pathh": None}), "unknown field `lora_pathh`")
    refused(http.post("/v1/chat/completions", json={"messages": MESSAGES, "separate_reasonin": True}),
            "unknown field `separate_reasonin`")


# ----- OpenAI routes -----------------------------------------------------------------------------------


def test_chat_takes_the_routers_body(http):
    res = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_completion_tokens": 4, **ROUTER_CHAT})
    assert res.status_code == 200, res.text
    assert res.json()["model"] == "compat"


def test_completion_takes_sglang_extras(http):
    body = {"model": "compat", "prompt": PROMPT, "max_tokens": 4, "echo": False, "no_stop_trim": False,
            "ignore_eos": False, "skip_special_tokens": True, "return_hidden_states": False, "priority": 1,
            "data_parallel_rank": None, "lora_path": None}
    res = http.post("/v1/completions", json=body)
    assert res.status_code == 200, res.text


@pytest.mark.parametrize("field,value", [
    ("no_stop_trim", True), ("continue_final_message", True),
    ("custom_params", {"a": 1}), ("return_hidden_states", True), ("reasoning_effort", "low"),
    ("reasoning", {"effort": "low"}),
])
def test_chat_refuses_what_radixrt_cannot_do(http, field, value):
    refused(http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, field: value}), field)


def test_openai_rid_names_the_requests(http):
    body = {"messages": MESSAGES, "max_tokens": 2, "n": 2}
    refused(http.post("/v1/chat/completions", json={**body, "rid": "one"}), "1 rids for 2 requests")
    res = http.post("/v1/chat/completions", json={**body, "rid": ["a-0", "a-1"]})
    assert res.status_code == 200, res.text


# ----- what the router reads ---------------------------------------------------------------------------


def test_server_and_model_info_carry_the_model_id(http, default_model_path):
    for path in ("/server_info", "/get_server_info"):
        info = http.get(path).json()
        assert info["served_model_name"] == "compat"
        assert info["model_path"] == str(default_model_path)
    info, older = http.get("/model_info").json(), http.get("/get_model_info").json()
    assert info["model_type"] == "llama" and info["architectures"] == ["LlamaForCausalLM"]
    assert info["is_generation"] is True and info["tokenizer_path"] == str(default_model_path)
    assert info == {**older, **info} and older["served_model_name"] == "compat"
    assert http.get("/v1/models").json()["data"][0]["id"] == "compat"


def test_openapi_documents_the_compat_fields(http):
    doc = http.get("/openapi.json").json()
    assert {"/server_info", "/model_info", "/get_server_info", "/get_model_info"} <= set(doc["paths"])
    schemas = doc["components"]["schemas"]
    generate = schemas["GenerateBody"]["properties"]
    assert generate["image_data"]["enum"] == [None, False, "", [], {}]
    assert "ignored" in generate["log_metrics"]["description"]
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert chat["no_stop_trim"]["enum"] == [None, False]
    assert "separate_reasoning" in chat and "rid" in chat
    assert schemas["SamplingParams"]["properties"]["sampling_seed"]["anyOf"][0]["minimum"] == 0


def test_server_keeps_serving_after_refusals(http, reference):
    assert http.get("/health").status_code == 200
    assert http.post("/generate", json={"text": PROMPT, "sampling_params": GREEDY}).json()["text"] == reference
