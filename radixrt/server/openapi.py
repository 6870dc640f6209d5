"""The server's OpenAPI 3 document (GET /openapi.json), generated from the msgspec structs the routes decode.

Request bodies come from ``msgspec.json.schema_components`` of GenerateBody, AbortBody, CompletionRequest and
ChatCompletionRequest (SamplingParams and StreamOptions come along as referenced components). The numeric
bounds the runtime enforces are then written into those schemas: the static ones from ``BOUNDS`` (kept equal
to SamplingParams.validate and the routes' checks by tests/test_server_fuzz.py), the model's from ``ApiLimits``
(context length, vocabulary) and the server's per-request caps, and every other integer gets the 64-bit
range ``http_common.decode_request`` enforces, so a schema-driven client or fuzzer knows which values are served.
SGLang's fields that radixrt accepts without serving (radixrt.server.sglang_compat) carry their own schema: any
value for an ignored one, only the values that ask for nothing for a refused one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from radixrt.protocol.messages import SessionParams
from radixrt.protocol.request import MAX_PRIORITY
from radixrt.protocol.validation import MAX_TOKEN_IDS_LOGPROB
from radixrt.rerank import MAX_RERANK_DOCUMENTS
from radixrt.scoring import MAX_SCORE_ITEMS
from radixrt.sampling.params import MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_ENTRIES
from radixrt.sampling.stop_regex import MAX_PATTERN_CHARS
from radixrt.server import openai_protocol as oai
from radixrt.server.json_numbers import INT64_MAX, INT64_MIN
from radixrt.server.native_protocol import (
    AbortBody,
    CloseSessionBody,
    DestroyWeightsGroupBody,
    DetokenizeBody,
    EncodeBody,
    GenerateBody,
    InitWeightsGroupBody,
    LoadLoraBody,
    ContinueBody,
    OpenSessionBody,
    MemoryTagsBody,
    PauseBody,
    StartProfileBody,
    TokenizeBody,
    UnloadLoraBody,
    UpdateDistributedBody,
    UpdateWeightsBody,
    WeightsByNameBody,
    WeightVersionBody,
)

REF = "#/components/schemas/{name}"
MAX_SEED = 2**63 - 1
MAX_N = 128


@dataclass(frozen=True)
class ApiLimits:
    """The model's limits and the server's own (None: no bound beyond the static ones)."""

    context_length: int
    vocab_size: int
    max_top_logprobs: int = oai.MAX_TOP_LOGPROBS
    max_n: int | None = None
    max_prompt_chars: int | None = None
    max_stop_strings: int | None = None
    max_stop_string_chars: int | None = None
    model_names: tuple[str, ...] = ()  # every name the server knows its model by (GET /v1/models/{model})
    max_messages: int | None = None
    embedding_size: int = 0  # the model's (ModelLimits): the lengths an embedding's ``dimensions`` may take
    matryoshka: tuple[int, ...] | None = None
    classifier: bool = False  # the model is a classifier: /classify and /v1/classify are served
    generates: bool = True  # /v1/score is served
    reranks: bool = False  # /v1/rerank, /rerank and /v2/rerank are served

    @classmethod
    def of_server(cls, context_length: int, vocab_size: int, client_limits: Any = None,
                  model_names: tuple[str, ...] = (), max_messages: int | None = None,
                  model_limits: Any = None, classifier: bool = False, reranks: bool = False) -> "ApiLimits":
        """``client_limits``: the server's per-request caps (radixrt.protocol.limits.ClientLimits), when it has them;
        ``model_limits``: the model's (radixrt.protocol.limits.ModelLimits)."""
        caps = {name: getattr(client_limits, name, None)
                for name in ("max_n", "max_prompt_chars", "max_stop_strings", "max_stop_string_chars")}
        return cls(context_length=context_length, vocab_size=vocab_size, model_names=tuple(sorted(model_names)),
                   max_messages=max_messages, embedding_size=getattr(model_limits, "embedding_size", 0),
                   matryoshka=getattr(model_limits, "matryoshka", None), classifier=classifier,
                   generates=getattr(model_limits, "generates", True), reranks=reranks, **caps)

    def dimensions_schema(self) -> dict[str, Any]:
        """The ``dimensions`` an embedding request may ask for: null unless the model is a Matryoshka model."""
        if self.matryoshka is None:
            return {"type": "null", "description": "not supported: this model is not a Matryoshka model"}
        sizes = ({"enum": list(self.matryoshka)} if self.matryoshka
                 else {"type": "integer", "minimum": 1, "maximum": self.embedding_size})
        return {"anyOf": [sizes, {"type": "null"}]}


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(msgspec.Struct):
    """Every 4xx/5xx answer: OpenAI's error shape."""

    error: ErrorDetail


# Static bounds, by field name, of every request struct that has the field (SGLang and OpenAI names alike).
BOUNDS: dict[str, dict[str, Any]] = {
    "temperature": {"minimum": 0, "maximum": 100},
    "top_p": {"exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"minimum": -1, "not": {"const": 0}},
    "min_p": {"minimum": 0, "maximum": 1},
    "repetition_penalty": {"exclusiveMinimum": 0, "maximum": 2},
    "frequency_penalty": {"minimum": -2, "maximum": 2},
    "presence_penalty": {"minimum": -2, "maximum": 2},
    "n": {"minimum": 1, "maximum": MAX_N},
    "seed": {"minimum": 0, "maximum": MAX_SEED},
    "logprob_start_len": {"minimum": -1},
    "priority": {"minimum": -MAX_PRIORITY, "maximum": MAX_PRIORITY},
}
TOKEN_COUNTS = ("max_new_tokens", "min_new_tokens", "max_tokens", "max_completion_tokens", "min_tokens")
STRUCTS = [GenerateBody, AbortBody, OpenSessionBody, CloseSessionBody, StartProfileBody, oai.CompletionRequest,
           oai.ChatCompletionRequest, TokenizeBody, DetokenizeBody, oai.EmbeddingRequest, EncodeBody, oai.ClassifyRequest,
           oai.ScoreRequest, oai.RerankRequest, oai.PairScoreRequest, LoadLoraBody, UnloadLoraBody, UpdateWeightsBody,
           InitWeightsGroupBody, UpdateDistributedBody, DestroyWeightsGroupBody, PauseBody, ContinueBody,
           WeightsByNameBody, WeightVersionBody, MemoryTagsBody, ErrorResponse]

UPDATE_ANSWER = {"type": "object", "required": ["success", "message", "num_paused_requests"], "properties": {
    "success": {"type": "boolean"}, "message": {"type": "string"}, "num_paused_requests": {"type": "integer"}}}
SUCCESS_ANSWER = {"type": "object", "required": ["success", "message"], "properties": {
    "success": {"type": "boolean"}, "message": {"type": "string"}}}
LORA_ANSWER = {"type": "object", "required": ["success", "loaded_adapters"], "properties": {
    "success": {"type": "boolean"}, "error_message": {"type": ["string", "null"]},
    "loaded_adapters": {"type": "object", "additionalProperties": {"type": "string"}}}}


MESSAGE_SCHEMA = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"enum": sorted(oai.ROLES)},
        "content": {"anyOf": [
            {"type": "string"},
            {"type": "array", "items": {"type": "object", "required": ["type", "text"], "properties": {
                "type": {"const": "text"}, "text": {"type": "string"}}}},
            {"type": "null"},
        ]},
        "name": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    },
    # a tool result names the call it answers
    "if": {"required": ["role"], "properties": {"role": {"const": "tool"}}},
    "then": {"required": ["tool_call_id"], "properties": {"tool_call_id": {"type": "string"}}},
}


def _branches(prop: dict[str, Any], kinds: tuple[str, ...]) -> list[dict[str, Any]]:
    """The parts of a property schema of the given JSON types (``X | None`` is an anyOf of X and null)."""
    options = prop.get("anyOf", [prop])
    return [o for o in options if o.get("type") in kinds]


def _constrain(prop: dict[str, Any], bounds: dict[str, Any]) -> None:
    for branch in _branches(prop, ("integer", "number")):
        branch.update(bounds)


def _max(key: str, value: int | None) -> dict[str, int]:
    return {} if value is None else {key: value}


def _token_ids(vocab_size: int) -> dict[str, Any]:
    return {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}, "minItems": 1}


def _int64(node: Any) -> None:
    """Every integer the server takes is a 64-bit one (decode_request refuses others)."""
    if isinstance(node, list):
        for item in node:
            _int64(item)
    elif isinstance(node, dict):
        if node.get("type") == "integer":
            node.setdefault("minimum", INT64_MIN)
            node.setdefault("maximum", INT64_MAX)
        for value in node.values():
            _int64(value)


def _apply_limits(components: dict[str, dict[str, Any]], limits: ApiLimits) -> None:
    token = {"minimum": 0, "maximum": limits.vocab_size - 1}
    for struct in components.values():
        props = struct.get("properties", {})
        for name, prop in props.items():
            if name in BOUNDS:
                _constrain(prop, BOUNDS[name])
            elif name == "sampling_seed":  # SGLang's name of seed
                _constrain(prop, BOUNDS["seed"])
            elif name in TOKEN_COUNTS:
                _constrain(prop, {"minimum": 0, "maximum": limits.context_length})
        if "n" in props and limits.max_n is not None:
            _constrain(props["n"], {"maximum": min(limits.max_n, MAX_N)})
        if "stop" in props:
            stop = {"type": "string", "minLength": 1, **_max("maxLength", limits.max_stop_string_chars)}
            for branch in _branches(props["stop"], ("string",)):
                branch.update(stop)
            for branch in _branches(props["stop"], ("array",)):
                branch.update({"items": stop, **_max("maxItems", limits.max_stop_strings)})
        if "rid" in props:  # request ids: non-empty strings, one or a list
            for branch in _branches(props["rid"], ("string",)):
                branch.update(RID)
            for branch in _branches(props["rid"], ("array",)):
                branch.update({"items": RID, "minItems": 1})
        if "regex" in props:  # a pattern, so at least one character
            for branch in _branches(props["regex"], ("string",)):
                branch["minLength"] = 1
        if "logit_bias" in props:  # token ids (below the vocabulary size: checked by the server) to a bias
            props["logit_bias"] = {"anyOf": [LOGIT_BIAS, {"type": "null"}]}
        if "stop_regex" in props:  # one pattern or a list (radixrt.sampling.stop_regex)
            pattern = {"type": "string", "minLength": 1, "maxLength": MAX_PATTERN_CHARS}
            for branch in _branches(props["stop_regex"], ("string",)):
                branch.update(pattern)
            for branch in _branches(props["stop_regex"], ("array",)):
                branch["items"] = pattern
        if "stop_token_ids" in props:
            for branch in _branches(props["stop_token_ids"], ("array",)):
                branch["items"] = {"type": "integer", **token}
        if "choices" in props:
            for branch in _branches(props["choices"], ("array",)):
                branch["minItems"] = 1

    generate = components["GenerateBody"]["properties"]
    _constrain(generate["top_logprobs_num"], {"minimum": 0, "maximum": limits.vocab_size})
    prompt_text = {"type": "string", "minLength": 1, **_max("maxLength", limits.max_prompt_chars)}
    for branch in _branches(generate["text"], ("string",)):
        branch.update(prompt_text)
    for branch in _branches(generate["text"], ("array",)):
        branch.update({"items": prompt_text, "minItems": 1})
    ids = _token_ids(limits.vocab_size)
    generate["input_ids"]["anyOf"] = [ids, {"type": "array", "items": ids, "minItems": 1}, {"type": "null"}]
    labels = {**ids, "maxItems": MAX_TOKEN_IDS_LOGPROB, "uniqueItems": True}
    generate["token_ids_logprob"]["anyOf"] = [
        labels, {"type": "array", "items": {"anyOf": [labels, {"type": "null"}]}, "minItems": 1}, {"type": "null"}]
    # token_ids_logprob asks for logprobs: absent or null, or return_logprob true
    components["GenerateBody"]["allOf"] = [{"anyOf": [
        {"properties": {"token_ids_logprob": {"type": "null"}}},
        {"required": ["return_logprob"], "properties": {"return_logprob": {"const": True}}}]}]
    # exactly one of text and input_ids (the other absent or null)
    components["GenerateBody"]["oneOf"] = [
        {"required": [one], "properties": {one: {"not": {"type": "null"}}, other: {"type": "null"}}}
        for one, other in (("text", "input_ids"), ("input_ids", "text"))]
    # a rid to abort, or abort_all
    components["AbortBody"]["anyOf"] = [{"required": ["rid"], "properties": {"rid": {"type": "string"}}},
                                        {"required": ["abort_all"], "properties": {"abort_all": {"const": True}}}]

    completion = components["CompletionRequest"]["properties"]
    completion["suffix"] = {"anyOf": [{"const": ""}, {"type": "null"}], "description": "not supported: empty or null"}
    _constrain(completion["logprobs"], {"minimum": 0, "maximum": limits.max_top_logprobs})
    completion["prompt"] = {"anyOf": [
        prompt_text,
        {"type": "array", "items": prompt_text, "minItems": 1},
        ids,
        {"type": "array", "items": ids, "minItems": 1},
    ]}

    chat = components["ChatCompletionRequest"]["properties"]
    _constrain(chat["top_logprobs"], {"minimum": 0, "maximum": limits.max_top_logprobs})
    chat["messages"] = {"type": "array", "items": MESSAGE_SCHEMA, "minItems": 1}
    _, session = msgspec.json.schema_components([SessionParams], ref_template=REF)
    components.update(session)
    _constrain(components["SessionParams"]["properties"]["offset"], {"minimum": 0})
    for name in ("GenerateBody", "CompletionRequest", "ChatCompletionRequest"):
        components[name]["properties"]["session_params"] = {"anyOf": [{"$ref": REF.format(name="SessionParams")},
                                                                      {"type": "null"}]}
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        components[name].update(_stream_options_need_stream())
        components[name]["properties"]["response_format"] = {"anyOf": [RESPONSE_FORMAT, {"type": "null"}]}
    chat["tool_choice"] = {"anyOf": [{"enum": ["none", "auto", "required"]}, TOOL_CHOICE, {"type": "null"}]}
    chat_rules = components["ChatCompletionRequest"].setdefault("allOf", [])
    chat_rules.append({"if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},
                       "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}})
    _apply_utility_limits(components, limits, prompt_text, ids)
    for name, schema in components.items():
        if not name.startswith("Error"):  # every request body: the server takes 64-bit integers only
            _int64(schema)


def _apply_utility_limits(components: dict[str, dict[str, Any]], limits: ApiLimits, prompt_text: dict[str, Any],
                          ids: dict[str, Any]) -> None:
    """/tokenize, /detokenize, /v1/embeddings and /encode: what each takes."""
    any_text = {"type": "string", **_max("maxLength", limits.max_prompt_chars)}  # "" has no tokens: fine here
    tokenize = components["TokenizeBody"]
    tokenize["properties"]["prompt"] = {"anyOf": [any_text, {"type": "array", "items": any_text}, {"type": "null"}]}
    tokenize["properties"]["messages"] = {"anyOf": [
        {"type": "array", "items": MESSAGE_SCHEMA, "minItems": 1, **_max("maxItems", limits.max_messages)},
        {"type": "null"}]}
    tokenize["oneOf"] = [  # exactly one of prompt and messages
        {"required": [one], "properties": {one: {"not": {"type": "null"}}, other: {"type": "null"}}}
        for one, other in (("prompt", "messages"), ("messages", "prompt"))]
    vocab_ids = {"type": "array", "items": ids["items"]}
    components["DetokenizeBody"]["properties"]["tokens"] = {"anyOf": [vocab_ids, {"type": "array",
                                                                                  "items": vocab_ids}]}
    embedding = components["EmbeddingRequest"]["properties"]
    prompt_ids = {**ids, "maxItems": limits.context_length}
    embedding["input"] = {"anyOf": [
        prompt_text,
        {"type": "array", "items": prompt_text, "minItems": 1, "maxItems": oai.MAX_EMBEDDING_INPUTS},
        prompt_ids,
        {"type": "array", "items": prompt_ids, "minItems": 1, "maxItems": oai.MAX_EMBEDDING_INPUTS},
    ]}
    embedding["dimensions"] = limits.dimensions_schema()
    components["ClassifyRequest"]["properties"]["input"] = embedding["input"]
    _score_and_rerank_limits(components, ids, prompt_text)
    encode = components["EncodeBody"]
    encode["properties"]["text"] = {"anyOf": [prompt_text, {"type": "array", "items": prompt_text, "minItems": 1},
                                              {"type": "null"}]}
    encode["properties"]["input_ids"] = {"anyOf": [prompt_ids, {"type": "array", "items": prompt_ids, "minItems": 1},
                                                   {"type": "null"}]}
    encode["properties"]["dimensions"] = limits.dimensions_schema()
    encode["oneOf"] = [  # exactly one of text and input_ids
        {"required": [one], "properties": {one: {"not": {"type": "null"}}, other: {"type": "null"}}}
        for one, other in (("text", "input_ids"), ("input_ids", "text"))]


RID = {"type": "string", "minLength": 1}
TOOL_CHOICE = {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}}
LOGIT_BIAS = {"type": "object", "maxProperties": MAX_LOGIT_BIAS_ENTRIES, "propertyNames": {"pattern": "^[0-9]{1,10}$"},
              "additionalProperties": {"type": "number", "minimum": -MAX_LOGIT_BIAS, "maximum": MAX_LOGIT_BIAS}}

RESPONSE_FORMAT = {"type": "object", "required": ["type"], "properties": {
    "type": {"enum": ["text", "json_object", "json_schema", "regex"]},
    "json_schema": {"type": "object"}, "regex": {"type": "string", "minLength": 1}},
    "allOf": [{"if": {"properties": {"type": {"const": "json_schema"}}},
               "then": {"required": ["json_schema"]}},
              {"if": {"properties": {"type": {"const": "regex"}}}, "then": {"required": ["regex"]}}]}


def _stream_options_need_stream() -> dict[str, Any]:
    return {"if": {"required": ["stream_options"], "properties": {"stream_options": {"type": "object"}}},
            "then": {"required": ["stream"], "properties": {"stream": {"const": True}}}}


def _json_body(name: str) -> dict[str, Any]:
    return {"required": True, "content": {"application/json": {"schema": {"$ref": REF.format(name=name)}}}}


def _responses(ok: dict[str, Any], *errors: int) -> dict[str, Any]:
    error = {"content": {"application/json": {"schema": {"$ref": REF.format(name="ErrorResponse")}}}}
    out: dict[str, Any] = {"200": {"description": "OK", "content": ok}}
    for code in errors:
        out[str(code)] = {"description": {400: "bad request", 404: "unknown model, session or LoRA adapter",
                                          405: "method not allowed",
                                          409: "a session id or LoRA adapter name in use, or an adapter in use",
                                          503: "overloaded or the runtime is down"}[code], **error}
    return out


def _score_and_rerank_limits(components: dict[str, Any], ids: dict[str, Any], text: dict[str, Any]) -> None:
    """/v1/score: query and items both text or both token ids, the query not empty; /v1/rerank: a query and
    documents."""
    score = components["ScoreRequest"]
    score["properties"]["label_token_ids"] = {**ids, "maxItems": MAX_TOKEN_IDS_LOGPROB}
    many = {"minItems": 1, "maxItems": MAX_SCORE_ITEMS}
    item_text = {k: v for k, v in text.items() if k != "minLength"}  # an item may be empty, the query not
    item_ids = {k: v for k, v in ids.items() if k != "minItems"}
    score["properties"]["query"] = {"anyOf": [text, ids]}
    score["properties"]["items"] = {"anyOf": [item_text, {"type": "array", "items": item_text, **many},
                                              {"type": "array", "items": item_ids, **many}]}
    score["oneOf"] = [
        {"properties": {"query": {"type": "string"}, "items": {"anyOf": [{"type": "string"},
                                                                         {"type": "array", "items": item_text}]}}},
        {"properties": {"query": {"type": "array"}, "items": {"type": "array", "items": item_ids}}}]
    rerank = components["RerankRequest"]["properties"]
    rerank["query"] = text
    rerank["documents"] = {"type": "array", "items": text, "minItems": 1, "maxItems": MAX_RERANK_DOCUMENTS}
    _constrain(rerank["top_n"], {"minimum": 0})
    texts = {"anyOf": [text, {"type": "array", "items": text, "minItems": 1, "maxItems": MAX_RERANK_DOCUMENTS}]}
    components["PairScoreRequest"]["properties"].update(text_1=texts, text_2=texts)


def build_openapi(limits: ApiLimits, version: str) -> dict[str, Any]:
    _, components = msgspec.json.schema_components(STRUCTS, ref_template=REF)
    assert "SamplingParams" in components, "GenerateBody must reference SamplingParams"
    _apply_limits(components, limits)
    json_ok = {"application/json": {"schema": {}}}
    event = {"type": "object", "properties": {"data": {"type": "string"}}}  # each server-sent event
    stream_ok = {"application/json": {"schema": {}}, "text/event-stream": {"schema": event}}
    text_ok = {"text/plain": {"schema": {"type": "string"}}}

    def get(summary: str, ok: dict[str, Any] = json_ok, *errors: int) -> dict[str, Any]:
        return {"summary": summary, "responses": _responses(ok, *errors)}

    def post(summary: str, body: str, ok: dict[str, Any], *errors: int) -> dict[str, Any]:
        return {"summary": summary, "requestBody": _json_body(body), "responses": _responses(ok, *errors)}

    def lora_change(summary: str, body: str) -> dict[str, Any]:
        """SGLang's answer to a LoRA load or unload, success or not (radixrt.server.lora_routes)."""
        answer = {"description": "the adapters loaded after the call, or why it failed",
                  "content": {"application/json": {"schema": LORA_ANSWER}}}
        return {"summary": summary, "requestBody": _json_body(body),
                "responses": {str(code): answer for code in (200, 400, 404, 409)}}

    def optional_body(summary: str, body: str) -> dict[str, Any]:
        return {**post(summary, body, json_ok, 400, 503), "requestBody": {**_json_body(body), "required": False}}

    update_answer = {"description": "whether the served weights are the new ones, and why not",
                     "content": {"application/json": {"schema": UPDATE_ANSWER}}}

    def success_call(summary: str, body: str, *errors: int, required: bool = True) -> dict[str, Any]:
        """SGLang's ``{"success", "message"}`` (radixrt.server.weights_routes); a body that does not parse, or a
        runtime that is down: the error object."""
        either = {"anyOf": [SUCCESS_ANSWER, {"$ref": REF.format(name="ErrorResponse")}]}
        answer = {"description": "whether the call succeeded, and why not",
                  "content": {"application/json": {"schema": either}}}
        return {"summary": summary, "requestBody": {**_json_body(body), "required": required},
                "responses": {str(code): answer for code in (200, *errors, 503)}}

    flush = get("drop the prefix cache (refused while requests are in flight)", text_ok, 400, 503)
    paths = {
        "/generate": {"post": post("generate (SGLang's native API)", "GenerateBody", stream_ok, 400, 404, 503)},
        "/v1/completions": {"post": post("OpenAI completions", "CompletionRequest", stream_ok, 400, 404, 503)},
        "/v1/chat/completions": {"post": post("OpenAI chat completions", "ChatCompletionRequest", stream_ok,
                                              400, 404, 503)},
        "/v1/models": {"get": get("the served model")},
        "/model_info": {"get": get("model path, served name, limits, model type and architectures")},
        "/get_model_info": {"get": get("model path, served name and limits (the Engine's get_model_info)")},
        "/server_info": {"get": get("model path and served name, server args, scheduler stats, pids and ipc dir",
                                    json_ok, 503)},
        "/get_server_info": {"get": get("the same as /server_info (SGLang's older name)", json_ok, 503)},
        "/flush_cache": {"get": flush, "post": flush},
        "/abort_request": {"post": post("abort one request by rid, or all", "AbortBody", json_ok, 400)},
        "/open_session": {"post": post("open a session (its requests' contexts stay pinned in the prefix cache); "
                                       "returns its id as a JSON string", "OpenSessionBody", json_ok, 400, 409, 503)},
        "/close_session": {"post": post("close a session (an unknown one too)", "CloseSessionBody",
                                        {"text/plain": {"schema": {"type": "string"}}}, 400, 503)},
        "/start_profile": {
            "get": get("start torch.profiler on the scheduler (trace in $RADIXRT_TORCH_PROFILER_DIR, else /tmp)",
                       text_ok, 400, 503),
            "post": {**post("start torch.profiler on the scheduler: its trace's folder, steps and activities",
                            "StartProfileBody", text_ok, 400, 503),
                     "requestBody": {**_json_body("StartProfileBody"), "required": False}}},
        "/stop_profile": {m: get("stop the profiler and write its trace (400 when none runs)", text_ok, 400, 503)
                          for m in ("get", "post")},
        "/load_lora_adapter": {"post": lora_change("load a LoRA adapter (a PEFT folder or hub id) under a name",
                                                   "LoadLoraBody")},
        "/unload_lora_adapter": {"post": lora_change("unload a LoRA adapter no request uses", "UnloadLoraBody")},
        "/update_weights_from_disk": {"post": {
            "summary": "serve the weights of another checkpoint of the same model, once the requests in flight are "
                       "done (new ones wait)", "requestBody": _json_body("UpdateWeightsBody"),
            "responses": {str(code): update_answer for code in (200, 400, 409)}}},
        "/init_weights_update_group": {"post": success_call(
            "join a trainer's process group (rank 0, hosting the rendezvous) for updates by broadcast; answered once "
            "every rank has joined", "InitWeightsGroupBody", 400, 409)},
        "/update_weights_from_distributed": {"post": success_call(
            "serve the tensors the trainer broadcasts through its group, once the requests in flight are done (new "
            "ones wait)", "UpdateDistributedBody", 400, 404, 409)},
        "/destroy_weights_update_group": {"post": success_call("leave a trainer's process group",
                                                               "DestroyWeightsGroupBody", 400, 404, required=False)},
        "/get_weights_by_name": {m: post("the first rows of the served values of one checkpoint tensor, in "
                                         "float32", "WeightsByNameBody", json_ok, 400, 404, 503) for m in ("get", "post")},
        "/pause_generation": {"post": optional_body("pause: no step runs, new requests wait (abort, retract or keep "
                                                    "the requests in flight)", "PauseBody")},
        "/continue_generation": {"post": optional_body("end a pause", "ContinueBody")},
        "/pause": {"post": {**get("vLLM's pause: abort, wait for or keep the requests in flight; new ones wait",
                                  json_ok, 400, 409, 503),
                            "parameters": [{"name": "mode", "in": "query", "required": False,
                                            "schema": {"enum": ["abort", "wait", "keep"]}},
                                           *({"name": flag, "in": "query", "required": False,
                                              "schema": {"type": "boolean"}}
                                             for flag in ("wait_for_inflight_requests", "clear_cache"))]}},
        "/resume": {"post": get("vLLM's: end a pause", json_ok, 503)},
        "/is_paused": {"get": get("vLLM's: whether generation is paused", json_ok, 503)},
        **{path: {m: {**post(summary, "MemoryTagsBody", json_ok, 400, 409, 503),
                      "requestBody": {**_json_body("MemoryTagsBody"), "required": False}} for m in ("get", "post")}
           for path, summary in (
               ("/release_memory_occupation", "give back the memory of the weights, the KV cache or the decode "
                                              "graphs while nothing runs; new requests wait"),
               ("/resume_memory_occupation", "take released memory again (the weights as their checkpoint's)"))},
        "/sleep": {"post": {**get("vLLM's: give back the KV cache (level 1) and the weights (level 2)", json_ok,
                                  400, 409, 503),
                            "parameters": [{"name": "level", "in": "query", "required": False,
                                            "schema": {"enum": ["1", "2"]}}]}},
        "/wake_up": {"post": {**get("vLLM's: take back what /sleep gave", json_ok, 400, 503),
                              "parameters": [{"name": "tags", "in": "query", "required": False,
                                              "schema": {"type": "array",
                                                         "items": {"enum": ["weights", "kv_cache", "cuda_graph"]}}}]}},
        "/is_sleeping": {"get": get("vLLM's: whether memory is given back", json_ok, 503)},
        "/get_weight_version": {"get": get("the served weights' version", json_ok, 503)},
        "/update_weight_version": {"post": post("name the served weights", "WeightVersionBody", json_ok, 400, 503)},
        "/health": {"get": get("200 while every process is alive", json_ok, 503)},
        "/health_generate": {"get": get("200 once a one-token generation went through the scheduler", json_ok,
                                        503)},
        "/v1/embeddings": {"post": post("OpenAI embeddings: each input's final hidden states, pooled as the model "
                                        "says (by default the last token's, unit length)", "EmbeddingRequest",
                                        json_ok, 400, 404, 503)},
        "/encode": {m: post("embeddings (SGLang's native API): the Engine's encode", "EncodeBody", json_ok, 400, 404,
                            503) for m in ("post", "put")},
        "/v1/models/{model}": {"get": {**get("the served model, by any name the server knows it by", json_ok,
                                             404),
                                       "parameters": [{"name": "model", "in": "path", "required": True,
                                                       "schema": {"enum": list(limits.model_names)}
                                                       if limits.model_names else {"type": "string"}}]}},
        "/metrics": {"get": get("Prometheus text exposition", text_ok)},
        "/openapi.json": {"get": get("this document")},
    }
    for prefix in ("", "/v1"):
        paths[f"{prefix}/tokenize"] = {"post": post("token ids of a prompt, prompts or chat messages",
                                                    "TokenizeBody", json_ok, 400, 404)}
        paths[f"{prefix}/detokenize"] = {"post": post("the text of token ids", "DetokenizeBody", json_ok, 400, 404)}
    if limits.generates:
        paths["/v1/score"] = {"post": post("the probabilities of label tokens after a query and each item (SGLang's "
                                           "scoring API)", "ScoreRequest", json_ok, 400, 404, 503)}
    if limits.reranks:
        paths["/v1/rerank"] = {"post": post("documents ranked by relevance to a query (SGLang's rerank API)",
                                            "RerankRequest", json_ok, 400, 404, 503)}
        for path in ("/rerank", "/v2/rerank"):
            paths[path] = {"post": post("documents ranked by relevance to a query (vLLM's and Cohere's rerank API)",
                                        "RerankRequest", json_ok, 400, 404, 503)}
        paths["/score"] = {"post": post("the relevance of text pairs (vLLM's score API)", "PairScoreRequest",
                                        json_ok, 400, 404, 503)}
    if limits.classifier:
        paths["/classify"] = {m: post("a classifier's scores at each prompt's last token (SGLang's native API)",
                                      "EncodeBody", json_ok, 400, 404, 503) for m in ("post", "put")}
        paths["/v1/classify"] = {"post": post("each input's label and probabilities (vLLM's classify API)",
                                              "ClassifyRequest", json_ok, 400, 404, 503)}
    return {
        "openapi": "3.1.0",
        "info": {"title": "radixrt", "version": version,
                 "description": "SGLang's native API and the OpenAI-compatible API of one radixrt runtime"},
        "paths": paths,
        "components": {"schemas": components},
    }

