"""Request bodies of SGLang's native API (/generate, /encode, /abort_request, /open_session, /close_session,
/start_profile, /tokenize, /detokenize), as msgspec structs (unknown fields refused).

``GenerateBody`` also declares every other field of SGLang's GenerateReqInput, from the rule table
``radixrt.server.sglang_compat.GENERATE`` (ignored, or refused unless it asks for nothing); the route checks
them with ``sglang_compat.check``.

The routes decode these, and /openapi.json is generated from them (radixrt.server.openapi), so the schema a
client reads is the one the server enforces. A shape msgspec cannot type (one prompt or a batch of prompts
under one key) is checked by the runtime's request path (radixrt.protocol.request); its JSON schema is given here.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from radixrt.protocol.request import MAX_KEY_CHARS, GenerateInput
from radixrt.sampling.compat_fields import struct_fields
from radixrt.sampling.params import SamplingParams
from radixrt.server.sglang_compat import GENERATE

Key = Annotated[str, msgspec.Meta(max_length=MAX_KEY_CHARS)]  # an adapter's name, a cache isolation key
TOKEN_IDS_SCHEMA = {"type": "array", "items": {"type": "integer"}, "minItems": 1}

InputIds = Annotated[list | None, msgspec.Meta(
    description="one prompt as token ids, or a batch of such prompts",
    extra_json_schema={"anyOf": [TOKEN_IDS_SCHEMA, {"type": "array", "items": TOKEN_IDS_SCHEMA, "minItems": 1},
                                 {"type": "null"}]},
)]

TokenIdsLogprob = Annotated[list | None, msgspec.Meta(
    description="token ids whose logprobs every returned position reports (needs return_logprob), "
                "or one such list (or null) per prompt",
    extra_json_schema={"anyOf": [TOKEN_IDS_SCHEMA, {"type": "array", "items": {"anyOf": [TOKEN_IDS_SCHEMA,
                                                                                          {"type": "null"}]},
                                                    "minItems": 1}, {"type": "null"}]},
)]


class GenerateCore(msgspec.Struct, forbid_unknown_fields=True):
    """The fields of /generate that radixrt serves."""

    text: str | list[str] | None = None
    input_ids: InputIds = None
    sampling_params: SamplingParams | list[SamplingParams] | None = None
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    token_ids_logprob: TokenIdsLogprob = None
    return_text_in_logprobs: bool = False
    rid: str | list[str] | None = None
    priority: int | None = None
    session_params: dict | None = None
    lora_path: Key | list[Key | None] | None = None  # a loaded LoRA adapter's name, or one per prompt
    extra_key: Key | list[Key | None] | None = None  # SGLang's cache isolation key, or one per prompt
    cache_salt: Key | list[Key | None] | None = None  # vLLM's, the same way

    def sampling_dicts(self) -> dict | list[dict] | None:
        """The sampling params as the JSON-like dicts the runtime's request path takes."""
        return None if self.sampling_params is None else msgspec.to_builtins(self.sampling_params)

    def generate_input(self) -> GenerateInput:
        """The request object of the runtime's request path."""
        return GenerateInput(text=self.text, input_ids=self.input_ids, sampling_params=self.sampling_dicts(),
                             return_logprob=self.return_logprob, logprob_start_len=self.logprob_start_len,
                             top_logprobs_num=self.top_logprobs_num, stream=self.stream, priority=self.priority,
                             session_params=self.session_params, rid=self.rid, lora_path=self.lora_path,
                             extra_key=self.extra_key, cache_salt=self.cache_salt,
                             token_ids_logprob=self.token_ids_logprob)


GenerateBody = msgspec.defstruct("GenerateBody", struct_fields(GENERATE), bases=(GenerateCore,),
                                 forbid_unknown_fields=True, kw_only=True, module=__name__)


class EncodeBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """SGLang's EmbeddingReqInput (POST /encode) as radixrt serves it: text prompts only."""

    text: str | list[str] | None = None
    input_ids: InputIds = None
    rid: str | list[str] | None = None
    dimensions: int | None = None  # a Matryoshka model's embedding cut to this length
    priority: int | None = None
    lora_path: Key | list[Key | None] | None = None
    extra_key: Key | list[Key | None] | None = None
    cache_salt: Key | list[Key | None] | None = None

    def generate_input(self) -> GenerateInput:
        return GenerateInput(text=self.text, input_ids=self.input_ids, rid=self.rid, embed=True,
                             dimensions=self.dimensions, priority=self.priority, lora_path=self.lora_path,
                             extra_key=self.extra_key, cache_salt=self.cache_salt)


class AbortBody(msgspec.Struct, forbid_unknown_fields=True):
    rid: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    abort_all: bool = False


class OpenSessionBody(msgspec.Struct, forbid_unknown_fields=True):
    """SGLang's OpenSessionReqInput: the longest prompt (tokens) of the session's requests, and its id (default:
    a generated one)."""

    capacity_of_str_len: Annotated[int, msgspec.Meta(ge=1)] | None = None
    session_id: Annotated[str, msgspec.Meta(min_length=1, max_length=256)] | None = None


class CloseSessionBody(msgspec.Struct, forbid_unknown_fields=True):
    session_id: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]


StepCount = Annotated[str, msgspec.Meta(pattern=r"^[1-9][0-9]{0,5}$")]


class StartProfileBody(msgspec.Struct, forbid_unknown_fields=True):
    """SGLang's ProfileReqInput: the folder of the trace (default: $RADIXRT_TORCH_PROFILER_DIR, else SGLang's
    $SGLANG_TORCH_PROFILER_DIR, else /tmp), the steps to record before stopping by itself (default: until
    /stop_profile), what to record (CPU operators always; GPU: CUDA kernels where there is a GPU; MEM: tensor
    memory), stacks and shapes, the trace file's name prefix. SGLang's other fields are accepted where they ask
    for nothing."""

    output_dir: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)] | None = None
    # sglang.profiler sends the counts as strings ("5")
    num_steps: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] | StepCount | None = None
    activities: list[Literal["CPU", "GPU", "MEM"]] | None = None
    with_stack: bool | None = None
    record_shapes: bool | None = None
    profile_prefix: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.-]{1,64}$")] | None = None  # file names
    start_step: Annotated[int, msgspec.Meta(ge=0, le=0)] | Literal["0"] | None = None  # recording starts now
    profile_by_stage: Literal[False] | None = None
    merge_profiles: Literal[False] | None = None

    @property
    def steps(self) -> int | None:
        return int(self.num_steps) if self.num_steps is not None else None


class TokenizeBody(msgspec.Struct, forbid_unknown_fields=True):
    """SGLang's /tokenize (and vLLM's): a prompt or a list of prompts, or vLLM's chat ``messages`` through the chat
    template; exactly one of ``prompt`` and ``messages``."""

    model: str | None = None
    prompt: str | list[str] | None = None
    messages: list[dict] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


TokenLists = Annotated[list, msgspec.Meta(
    description="token ids, or a list of such lists",
    extra_json_schema={"anyOf": [{"type": "array", "items": {"type": "integer"}},
                                 {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}}]},
)]


class DetokenizeBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """SGLang's /detokenize (and vLLM's): token ids, or a list of such lists (checked by the route)."""

    model: str | None = None
    tokens: TokenLists
    skip_special_tokens: bool = True


class LoadLoraBody(msgspec.Struct, forbid_unknown_fields=True):
    """SGLang's /load_lora_adapter: a PEFT adapter folder or hub id, under a name. ``pinned`` (SGLang's hint to keep
    it in GPU memory) changes nothing: every loaded adapter stays in memory."""

    lora_name: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    lora_path: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
    pinned: bool = False


class UnloadLoraBody(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]


Version = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]


class UpdateWeightsBody(msgspec.Struct, forbid_unknown_fields=True):
    """SGLang's /update_weights_from_disk (radixrt.scheduler.weights). ``load_format``: ``auto`` or
    ``safetensors`` (what radixrt reads); ``torch_empty_cache``, ``recapture_cuda_graph`` and ``token_step`` change
    nothing here (memory is returned as it goes; decode graphs read the updated tensors in place; the step is the
    trainer's bookkeeping); ``is_async``, ``keep_pause`` and ``manifest`` are refused unless they ask for nothing."""

    model_path: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
    load_format: Literal["auto", "safetensors"] | None = None
    abort_all_requests: bool = False
    weight_version: Version | None = None
    flush_cache: bool = True
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    manifest: dict | None = None

    def refusal(self) -> str | None:
        """Why radixrt cannot serve this body as SGLang would, or None."""
        if self.is_async:
            return "is_async: radixrt updates weights synchronously (the call returns once they are served)"
        if self.keep_pause:
            return "keep_pause: pause with /pause_generation before the update instead (a pause outlasts it)"
        if self.manifest is not None:
            return "manifest: radixrt reads the checkpoint's safetensors files as they are"
        return None


GroupName = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]


class InitWeightsGroupBody(msgspec.Struct, forbid_unknown_fields=True):
    """SGLang's /init_weights_update_group: join the trainer's process group (rank 0, hosting the rendezvous at
    ``master_address:master_port``) as rank ``rank_offset`` of ``world_size``."""

    master_address: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    master_port: Annotated[int, msgspec.Meta(ge=1, le=65535)]
    rank_offset: Annotated[int, msgspec.Meta(ge=1)]
    world_size: Annotated[int, msgspec.Meta(ge=2)]
    group_name: GroupName = "weight_update_group"
    backend: Literal["gloo", "nccl"] = "nccl"


class UpdateDistributedBody(msgspec.Struct, forbid_unknown_fields=True):
    """SGLang's /update_weights_from_distributed: the tensors the trainer broadcasts from rank 0 of ``group_name``,
    in this order, under the checkpoint's names."""

    names: list[Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]]
    dtypes: list[Annotated[str, msgspec.Meta(min_length=1, max_length=64)]]
    shapes: list[list[Annotated[int, msgspec.Meta(ge=0)]]]
    group_name: GroupName = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: Version | None = None
    load_format: Literal["auto"] | None = None


class DestroyWeightsGroupBody(msgspec.Struct, forbid_unknown_fields=True):
    group_name: GroupName = "weight_update_group"


class WeightsByNameBody(msgspec.Struct, forbid_unknown_fields=True):
    """SGLang's /get_weights_by_name: the first ``truncate_size`` rows of the served values of checkpoint tensor
    ``name``, in float32."""

    name: Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
    truncate_size: Annotated[int, msgspec.Meta(ge=0)] = 100


class PauseBody(msgspec.Struct, forbid_unknown_fields=True):
    """SGLang's /pause_generation: ``abort`` ends the requests in flight, ``retract`` frees their pages (computed
    again after the pause), ``in_place`` keeps them."""

    mode: Literal["abort", "retract", "in_place"] = "abort"


class MemoryTagsBody(msgspec.Struct, forbid_unknown_fields=True):
    """SGLang's /release_memory_occupation and /resume_memory_occupation: ``tags`` among ``weights``, ``kv_cache``,
    ``cuda_graph`` (none: all)."""

    tags: list[Literal["weights", "kv_cache", "cuda_graph"]] | None = None


class ContinueBody(msgspec.Struct, forbid_unknown_fields=True):
    """SGLang's /continue_generation; ``torch_empty_cache`` changes nothing here."""

    torch_empty_cache: bool = True


class WeightVersionBody(msgspec.Struct, forbid_unknown_fields=True):
    """SGLang's /update_weight_version."""

    new_version: Version
    abort_all_requests: bool = False
