"""Every message that crosses a process (or thread) boundary, as msgspec structs.

Client -> scheduler: GenerateReq, AbortReq, ControlReq (a control call: its ``body`` is one of ``Control``).
Scheduler -> detokenizer: BatchTokenOut (one per scheduler step, every request that progressed).
Detokenizer -> client: BatchStrOut. Scheduler -> client: ControlOut (the reply of the ControlReq with its id),
and in server mode the start-up handshake (SchedulerReady, DetokenizerReady).
A request's end travels as a FinishReason; SGLang's native ``meta_info.finish_reason`` is its ``to_dict()``.

A new control call is a request struct added to ``Control`` and its reply struct added to ``ControlReply``
here, a handler in the scheduler (``Scheduler.CONTROL``), and whatever calls ``SchedulerClient.call`` with it.
"""

from __future__ import annotations

from typing import Any, Literal, Union

import msgspec

from radixrt.protocol.errors import RequestError
from radixrt.sampling.params import SamplingParams


class SessionParams(msgspec.Struct, forbid_unknown_fields=True):
    """SGLang's ``session_params``: the open session a request belongs to and where it continues from."""

    id: str
    rid: str | None = None  # continue after this earlier request of the session (its prompt + output)
    offset: int | None = None  # keep only this many tokens of that request's context
    replace: bool | None = None
    drop_previous_output: bool | None = None


class GenerateReq(msgspec.Struct, tag=True):
    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: no prompt logprobs
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None  # SGLang's: the logprobs of these ids at every position returned
    stream: bool = False
    grammar: tuple[str, str] | None = None  # (kind, spec) of a constrained request
    priority: int | None = None  # SGLang's request priority (None: the default)
    session: SessionParams | None = None
    embed: bool = False  # prefill only: the answer is the prompt's pooled hidden state, not tokens
    dimensions: int | None = None  # an embedding cut to its first values (a Matryoshka model), then normalized
    lora_path: str | None = None  # the name of a loaded LoRA adapter (SGLang's field name); None: the base model
    cache_key: str | None = None  # shares cached prefixes only with requests of the same key (extra_key, cache_salt)


class AbortReq(msgspec.Struct, tag=True):
    rid: str



class FinishReason(msgspec.Struct, frozen=True, omit_defaults=True):
    """Why a request ended.

    ``stop``: an eos or stop token (``matched`` is its id), a stop string (``matched`` is the string) or the
    grammar's end (``matched`` is None). ``length``: ``max_new_tokens`` or the context length. ``abort``: the
    client's own abort (message "aborted", 499) or an error whose ``status_code`` says whose fault it was: 4xx
    a request the runtime refused, 5xx a failure inside the runtime (no status code counts as 400).
    """

    type: Literal["stop", "length", "abort"]
    matched: int | str | None = None
    message: str | None = None
    status_code: int | None = None

    @classmethod
    def stop(cls, matched: int | str | None = None) -> FinishReason:
        return cls("stop", matched=matched)

    @classmethod
    def length(cls) -> FinishReason:
        return cls("length")

    @classmethod
    def aborted(cls) -> FinishReason:
        """The client's own abort: not an error."""
        return cls("abort", message="aborted", status_code=499)

    @classmethod
    def error(cls, message: str, status_code: int) -> FinishReason:
        return cls("abort", message=message, status_code=status_code)

    @property
    def is_error(self) -> bool:
        """An abort the runtime raised: a refused request or a failure (a client's own abort is not)."""
        return self.type == "abort" and self.message not in (None, "aborted")

    @property
    def is_server_error(self) -> bool:
        """An error inside the runtime (5xx), not the request's fault."""
        return self.is_error and (self.status_code or 400) >= 500

    def to_dict(self) -> dict[str, Any]:
        """SGLang's native form, key for key: ``{"type", "matched"}``, or ``{"type", "message", "status_code"}``
        for an abort."""
        if self.type == "abort":
            return {"type": self.type, "message": self.message, "status_code": self.status_code}
        return {"type": self.type, "matched": self.matched}


# Logprob entries follow SGLang's native API: (logprob or None, token id).
LogprobList = list[tuple[float | None, int]]


class ReqDelta(msgspec.Struct):
    """What one request produced in one step."""

    rid: str
    new_ids: list[int]
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    output_logprobs: LogprobList | None = None
    output_top_logprobs: list[LogprobList] | None = None
    input_logprobs: LogprobList | None = None  # sent once, with the first delta
    input_top_logprobs: list[LogprobList] | None = None
    output_token_ids_logprobs: list[LogprobList] | None = None  # per position, the requested ids' logprobs
    input_token_ids_logprobs: list[LogprobList] | None = None  # sent once, with the first delta
    # Sent with a request's first delta, so a detokenizer that never saw the request can render it.
    stop: list[str] | None = None
    stop_regex: list[str] | None = None
    skip_special_tokens: bool = True
    # Speculative decoding, so far: verify steps, draft tokens verified, draft tokens that became output.
    spec_verify_ct: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    embedding: list[float] | None = None  # an embedding request's vector, with its finish
    weight_version: str | None = None  # with its finish: the version of the weights served then


class BatchTokenOut(msgspec.Struct, tag=True):
    deltas: list[ReqDelta]


class StrDelta(msgspec.Struct):
    rid: str
    text: str  # new text since the previous delta
    delta: ReqDelta


class BatchStrOut(msgspec.Struct, tag=True):
    outputs: list[StrDelta]


class SchedulerStats(msgspec.Struct, tag=True):
    num_running: int
    num_waiting: int
    pages_total: int
    pages_free: int
    pages_evictable: int
    pages_protected: int
    pages_private: int
    cache_hit_tokens: int
    cache_miss_tokens: int
    partial_tokens_reused: int
    evicted_pages: int
    num_retractions: int  # running requests retracted under memory pressure
    last_step_seconds: float
    steps: int
    jump_forwards: int = 0  # constrained decoding: jump-forwards applied
    jump_forward_tokens: int = 0  # output tokens they added net (decode forward steps saved for those requests)
    sessions_open: int = 0  # open sessions (radixrt.scheduler.sessions)
    pages_pinned: int = 0  # KV pages sessions pin in the prefix cache (summed over sessions)
    num_preemptions: int = 0  # running requests retracted to make room for a more urgent one
    num_long_rope_restarts: int = 0  # LongRoPE: requests computed again, rotated long, as they outgrew the context
    decode_seconds: float = 0.0  # time in steps without prefill chunks (decode and verify steps)
    decode_tokens: int = 0  # output tokens those steps gave
    decode_steps: int = 0  # those steps
    decode_requests: int = 0  # requests in those steps, summed over them (/ decode_steps: the mean decode batch)
    spec_verify_steps: int = 0  # speculative decoding: request verify steps
    spec_draft_tokens: int = 0  # draft tokens verified
    spec_accepted_tokens: int = 0  # draft tokens that became output


# ----- control calls: each request with its reply, matched by ControlReq.id / ControlOut.id -------------


class StatsReq(msgspec.Struct, tag=True):
    pass


class StatsOut(msgspec.Struct, tag=True):
    """A scheduler snapshot plus its step latency histogram (cumulative Prometheus buckets)."""

    stats: SchedulerStats
    step_buckets: list[float]
    step_counts: list[int]
    step_sum: float
    step_count: int


class FlushCacheReq(msgspec.Struct, tag=True):
    pass


class FlushCacheOut(msgspec.Struct, tag=True):
    ok: bool  # False: requests were in flight


class OpenSessionReq(msgspec.Struct, tag=True):
    """SGLang's /open_session: a session whose requests' contexts stay pinned in the prefix cache."""

    capacity_of_str_len: int | None = None
    session_id: str | None = None


class OpenSessionOut(msgspec.Struct, tag=True):
    session_id: str


class CloseSessionReq(msgspec.Struct, tag=True):
    session_id: str


class CloseSessionOut(msgspec.Struct, tag=True):
    closed: bool  # False: no such session was open


class StartProfileReq(msgspec.Struct, tag=True):
    """torch.profiler on the scheduler's thread, from its next step on (radixrt.scheduler.profiler)."""

    trace_dir: str | None = None  # where the trace goes when the profile stops without a folder of its own
    num_steps: int | None = None  # stop by itself after this many steps with a forward
    record_shapes: bool = False
    with_stack: bool = False
    profile_memory: bool = False
    cuda: bool = False  # record CUDA kernels too (where CUDA is available)
    prefix: str = "radixrt"  # of the trace file's name: PREFIX-<ns>.trace.json


class StopProfileReq(msgspec.Struct, tag=True):
    trace_dir: str | None = None  # where to write a Chrome trace (else the start's folder, if any)
    operators: bool = True  # the per-operator table in the reply (it walks every recorded event)


class ProfileStateReq(msgspec.Struct, tag=True):
    """Whether a profile runs, and the latest trace written."""


class ProfileStateOut(msgspec.Struct, tag=True):
    running: bool
    last_trace: str | None = None


class ProfileOut(msgspec.Struct, tag=True):
    """Each operator's self CPU seconds and calls while the profiler ran (empty for a start), and the trace written."""

    operators: dict[str, dict[str, float]]
    trace_path: str | None = None


class LoadLoraReq(msgspec.Struct, tag=True):
    """SGLang's /load_lora_adapter: load a PEFT adapter (a folder or a hub id) under a name; ``folder``: where the
    caller fetched it (the scheduler then reads local files only)."""

    lora_name: str
    lora_path: str
    folder: str | None = None


class UnloadLoraReq(msgspec.Struct, tag=True):
    """SGLang's /unload_lora_adapter: refused while a request uses the adapter."""

    lora_name: str


class LoraAdaptersOut(msgspec.Struct, tag=True):
    loaded: dict[str, str]  # every loaded adapter's name -> path, after the call


PauseMode = Literal["abort", "retract", "in_place", "wait"]


class PauseReq(msgspec.Struct, tag=True):
    """SGLang's /pause_generation (and vLLM's /pause): no step runs until ``ContinueReq``; requests that arrive
    meanwhile wait. ``abort``: every request in flight ends (aborted); ``retract``: running requests go back to the
    queue, their pages freed (computed again after the pause); ``in_place``: they keep their pages; ``wait``
    (vLLM's): the requests in flight finish first, the pause answered once they have. ``clear_cache``: then drop
    the prefix cache (not with ``in_place``, whose requests hold cached pages)."""

    mode: PauseMode = "abort"
    clear_cache: bool = False


class ContinueReq(msgspec.Struct, tag=True):
    """SGLang's /continue_generation."""


class PauseOut(msgspec.Struct, tag=True):
    paused: bool  # after the call
    requests: int  # the requests the call aborted (pause in mode abort) or retracted (retract); else 0


# a tensor as (name, dtype, shape, bytes): radixrt.model.reload.tensor_record
TensorRecord = tuple[str, str, list[int], bytes]


class UpdateWeightsReq(msgspec.Struct, tag=True):
    """SGLang's /update_weights_from_disk: serve the weights of the checkpoint at ``model_path`` (a local folder: the
    caller resolves hub ids), the same model with other weights; or with ``tensors`` (SGLang's
    ``update_weights_from_tensor``) those of the served checkpoint's tensors. It waits until the requests already in
    flight have finished (``abort_all_requests``: aborts them) and holds new ones until it is done; paused, it runs
    at once. ``flush_cache``: drop the prefix cache, computed with the old weights (SGLang's default)."""

    model_path: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None  # the new weights' version (else the version stays)
    flush_cache: bool = True
    tensors: list[TensorRecord] | None = None
    broadcast: Broadcast | None = None


class Broadcast(msgspec.Struct, tag=True):
    """SGLang's /update_weights_from_distributed: the tensors the trainer broadcasts from rank 0 of the weight group
    ``group_name`` (see ``InitWeightGroupReq``), in this order, under the checkpoint's names."""

    names: list[str]
    dtypes: list[str]  # as torch names them: bfloat16, float32
    shapes: list[list[int]]
    group_name: str = "weight_update_group"


class InitWeightGroupReq(msgspec.Struct, tag=True):
    """SGLang's /init_weights_update_group: join a trainer's process group (the trainer is rank 0 and hosts the
    rendezvous at ``master_address:master_port``) as rank ``rank_offset`` of ``world_size``; answered once every rank
    has joined. ``backend``: ``gloo`` (tensors in host memory) or ``nccl`` (a runtime on CUDA)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class DestroyWeightGroupReq(msgspec.Struct, tag=True):
    """SGLang's /destroy_weights_update_group."""

    group_name: str = "weight_update_group"


class WeightGroupOut(msgspec.Struct, tag=True):
    message: str


class WeightsByNameReq(msgspec.Struct, tag=True):
    """SGLang's /get_weights_by_name: the first ``truncate_size`` rows of the served values of checkpoint tensor
    ``name`` (its first values, for one of one dimension), in float32."""

    name: str
    truncate_size: int = 100


class WeightsByNameOut(msgspec.Struct, tag=True):
    values: list


class WeightVersionReq(msgspec.Struct, tag=True):
    """The served weights' version (SGLang's /get_weight_version); with ``new_version`` set it first becomes that
    (/update_weight_version), after aborting every request with ``abort_all_requests``."""

    new_version: str | None = None
    abort_all_requests: bool = False


class WeightsOut(msgspec.Struct, tag=True):
    """The served weights after a weights call: where they were read from and their version."""

    model_path: str
    weight_version: str
    message: str = ""
    aborted: int = 0  # requests the call aborted (``abort_all_requests``)


class ReleaseMemoryReq(msgspec.Struct, tag=True):
    """SGLang's /release_memory_occupation: give back the memory of ``tags`` (``weights``, ``kv_cache``,
    ``cuda_graph``; none: all) while nothing runs; requests that arrive meanwhile wait (radixrt.scheduler.occupation).
    ``backup_weights``: keep the weights in host memory to restore them as they were (None: the server's
    ``--enable-weights-cpu-backup``)."""

    tags: list[str] | None = None
    backup_weights: bool | None = None


class ResumeMemoryReq(msgspec.Struct, tag=True):
    """SGLang's /resume_memory_occupation: take the memory of ``tags`` (none: all released) again."""

    tags: list[str] | None = None


def sleep_release(level: int) -> ReleaseMemoryReq:
    """vLLM's sleep ``level`` as a release: 1 discards the KV cache and moves the weights to host memory (a CPU's
    stay where they are), 2 discards both."""
    if level not in (1, 2):
        raise RequestError(f"sleep level {level!r}: 1 (the weights kept in host memory) or 2 (discarded)")
    return ReleaseMemoryReq(["weights", "kv_cache"], backup_weights=level == 1)


class MemoryOut(msgspec.Struct, tag=True):
    released: list[str]  # the tags whose memory is given back, after the call
    weight_version: str  # resumed weights may be their checkpoint's again, named as it was


Control = Union[StatsReq, FlushCacheReq, OpenSessionReq, CloseSessionReq, StartProfileReq, StopProfileReq,
                ProfileStateReq, LoadLoraReq, UnloadLoraReq, PauseReq, ContinueReq, UpdateWeightsReq,
                WeightVersionReq, InitWeightGroupReq, DestroyWeightGroupReq, WeightsByNameReq, ReleaseMemoryReq,
                ResumeMemoryReq]
ControlReply = Union[StatsOut, FlushCacheOut, OpenSessionOut, CloseSessionOut, ProfileOut, ProfileStateOut,
                     LoraAdaptersOut, PauseOut, WeightsOut, WeightGroupOut, WeightsByNameOut, MemoryOut]


class ControlReq(msgspec.Struct, tag=True):
    id: int
    body: Control


class ControlOut(msgspec.Struct, tag=True):
    """The reply to ControlReq ``id``: ``body``, or ``error`` with the status an HTTP client would get."""

    id: int
    body: ControlReply | None = None
    error: str | None = None
    status_code: int = 500


# ----- server mode: the start-up handshake (scheduler / detokenizer -> the HTTP process) ----------------


class SchedulerReady(msgspec.Struct, tag=True):
    """Sent once the model is loaded: what the HTTP process needs to validate requests itself."""

    pid: int
    model_info: dict  # Engine.get_model_info()'s dict
    vocab_size: int
    context_length: int
    page_size: int
    num_pages: int
    generates: bool = True  # ModelLimits' fields of an embedding model
    embedding_size: int = 0
    matryoshka: list[int] | None = None


class DetokenizerReady(msgspec.Struct, tag=True):
    pid: int
