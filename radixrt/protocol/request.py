"""The request object and the one request path: a client's generation call -> validated GenerateReqs.

``GenerateInput`` bundles a generation call's arguments, as SGLang's ``GenerateReqInput`` does: exactly one of
text and input_ids (one prompt or a batch), one sampling-params dict or one per prompt, the logprob options,
streaming, SGLang's ``priority``, ``session_params`` and ``lora_path`` (a loaded LoRA adapter's name, or one per
prompt), SGLang's ``extra_key`` and vLLM's ``cache_salt`` (strings, or one per prompt, that keep a request's
prefix cache apart from that of requests without the same ones), and request ids. The Engine builds one from its
keyword arguments, /generate decodes one from its body, the OpenAI routes build one from their mapped fields.

``prepare`` checks everything cheap before any text is tokenized, then validates every sequence
(``validate_request``) before anything is queued; ``expand`` turns each prompt into ``n`` messages (n > 1:
seeds seed, seed+1, ...; the copies share the prompt through the prefix cache). An embedding call (``embed``)
takes the same path as a prefill-only request (``max_new_tokens`` 0, no sampling parameters, no logprobs, no
stream, no session) whose answer is the prompt's pooled hidden state (``dimensions``: cut to that length, for a
Matryoshka model); an embedding model (``ModelLimits.generates`` False) takes embedding calls only. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import msgspec

from radixrt.protocol.errors import RequestError
from radixrt.protocol.limits import NO_LIMITS, ClientLimits, ModelLimits
from radixrt.protocol.messages import GenerateReq, SessionParams
from radixrt.protocol.validation import grammar_of, validate_kind, validate_request
from radixrt.sampling.params import SamplingParams

MAX_PRIORITY = 2**31 - 1
MAX_KEY_CHARS = 4096  # an adapter's name or a cache key
MAX_OFFSET = 2**63 - 1


@dataclass(frozen=True)
class GenerateInput:
    """One generation call's arguments, unchecked: ``prepare`` checks them."""

    text: Any = None  # a prompt or a list of prompts
    input_ids: Any = None  # token ids, or a list of such lists
    sampling_params: Any = None  # a dict, or one per prompt
    return_logprob: Any = False
    logprob_start_len: Any = None
    top_logprobs_num: Any = None
    stream: bool = False
    priority: Any = None
    session_params: Any = None
    rid: Any = None  # a request id, or one per sample: replaces generated ids
    embed: bool = False  # an embedding call: prefill only, the answer a vector
    dimensions: Any = None  # an embedding call's length, for a Matryoshka model
    lora_path: Any = None  # a loaded LoRA adapter's name, or one (or None) per prompt
    extra_key: Any = None  # SGLang's cache isolation key, or one per prompt
    cache_salt: Any = None  # vLLM's, the same way
    token_ids_logprob: Any = None  # SGLang's: token ids whose logprobs each position reports, or a list per prompt

    @classmethod
    def of_call(cls, prompt: Any = None, sampling_params: Any = None, input_ids: Any = None,
                return_logprob: Any = False, logprob_start_len: Any = None, top_logprobs_num: Any = None,
                stream: bool = False, priority: Any = None, session_params: Any = None,
                rid: Any = None, lora_path: Any = None, token_ids_logprob: Any = None) -> "GenerateInput":
        """From the arguments of SGLang's ``Engine.generate`` (positionally, in its order)."""
        return cls(text=prompt, input_ids=input_ids, sampling_params=sampling_params, return_logprob=return_logprob,
                   logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num, stream=stream,
                   priority=priority, session_params=session_params, rid=rid, lora_path=lora_path,
                   token_ids_logprob=token_ids_logprob)


@dataclass
class Prepared:
    ids: list[list[int]]
    params: list[SamplingParams]
    batched: bool  # the caller passed a list of prompts (and gets a list back)
    return_logprob: bool = False
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    priority: int | None = None
    session: SessionParams | None = None
    stream: bool = False
    rids: list[str] | None = None
    embed: bool = False
    lora_paths: list[str | None] | None = None  # per prompt
    cache_keys: list[str | None] | None = None  # per prompt: extra_key and cache_salt together
    dimensions: int | None = None  # an embedding call's length
    token_ids_logprob: list[list[int] | None] | None = None  # per prompt

    @property
    def num_sequences(self) -> int:
        return sum(p.n for p in self.params)


def params_from(values: Any) -> SamplingParams:
    """SamplingParams from a JSON-like dict (SGLang's field names); RequestError on anything else."""
    if values is not None and not isinstance(values, dict):
        raise RequestError("sampling_params must be an object")
    try:
        return SamplingParams.from_dict(values)
    except ValueError as exc:
        raise RequestError(str(exc)) from None


def priority_from(value: Any) -> int | None:
    """SGLang's ``priority``: an integer (None: the default); RequestError on anything else."""
    if value is None:
        return None
    if type(value) is not int or not -MAX_PRIORITY <= value <= MAX_PRIORITY:
        raise RequestError(f"priority must be an integer in [-{MAX_PRIORITY}, {MAX_PRIORITY}]")
    return value


def session_from(value: Any) -> SessionParams | None:
    """SGLang's ``session_params`` ({"id", "rid", "offset", "replace", "drop_previous_output"}) or None."""
    if value is None or isinstance(value, SessionParams):
        return value
    if value == {}:
        return None  # asks for nothing (SGLang clients send it empty)
    if not isinstance(value, dict):
        raise RequestError("session_params must be an object with the session's id")
    try:
        params = msgspec.convert(value, SessionParams)
    except msgspec.ValidationError as exc:
        raise RequestError(f"session_params: {exc}") from None
    if params.offset is not None and not 0 <= params.offset <= MAX_OFFSET:
        raise RequestError(f"session_params.offset must be in [0, {MAX_OFFSET}]")
    return params


def per_prompt(field: str, value: Any, count: int) -> list[str | None] | None:
    """A string field for every prompt, or a list with one (or null) per prompt; an empty string is none. None when
    no prompt has one; RequestError on anything else."""
    if value is None:
        return None
    names = value if isinstance(value, list) else [value] * count
    if len(names) != count or not all(n is None or isinstance(n, str) for n in names):
        raise RequestError(f"{field} must be a string or a list of {count} strings (or nulls), one per prompt")
    names = [n or None for n in names]
    if any(n is not None and len(n) > MAX_KEY_CHARS for n in names):
        raise RequestError(f"{field} is longer than {MAX_KEY_CHARS} characters")
    return names if any(names) else None


def lora_paths_from(value: Any, count: int) -> list[str | None] | None:
    """SGLang's ``lora_path``: a loaded adapter's name for every prompt, or one (or null) per prompt."""
    return per_prompt("lora_path", value, count)


def cache_keys_from(extra_key: Any, cache_salt: Any, count: int) -> list[str | None] | None:
    """Each prompt's cache isolation key: SGLang's ``extra_key`` and vLLM's ``cache_salt`` together (either may be
    given alone); requests share cached prefixes only with requests of the same key."""
    extra, salt = per_prompt("extra_key", extra_key, count), per_prompt("cache_salt", cache_salt, count)
    if extra is None and salt is None:
        return None
    extra, salt = extra or [None] * count, salt or [None] * count
    return [None if e is None and s is None else f"{e or ''}\x00{s or ''}" for e, s in zip(extra, salt)]


def token_ids_logprob_from(value: Any, count: int) -> list[list[int] | None] | None:
    """SGLang's ``token_ids_logprob``: one list of ids for every prompt, or one list (or null) per prompt of a
    batch; each list is checked with the request (``validate_request``)."""
    if value is None:
        return None
    if isinstance(value, list) and value and all(v is None or isinstance(v, list) for v in value):
        if len(value) != count:
            raise RequestError(f"token_ids_logprob has {len(value)} lists for {count} prompts")
        return [None if v is None else list(v) for v in value]
    return [value] * count


def rids_from(value: Any) -> list[str] | None:
    if value is None:
        return None
    rids = [value] if isinstance(value, str) else value
    if not isinstance(rids, list) or not rids or not all(isinstance(r, str) and r for r in rids):
        raise RequestError("rid must be a non-empty string or a list of them")
    return list(rids)


def _token_ids(values: Any) -> list[int]:
    if not isinstance(values, list) or not all(type(t) is int for t in values):
        raise RequestError("input_ids must be a list of token ids or a list of such lists")
    return list(values)


# an embedding request computes its prompt and nothing more
EMBEDDING_PARAMS = SamplingParams(max_new_tokens=0)


def _check_embedding_call(req: GenerateInput) -> None:
    """An embedding call asks for a vector: nothing about sampling, logprobs, streams or sessions."""
    if req.sampling_params not in (None, {}):
        raise RequestError("an embedding request takes no sampling_params")
    if req.return_logprob or req.top_logprobs_num or req.logprob_start_len not in (None, -1) \
            or req.token_ids_logprob is not None:
        raise RequestError("an embedding request returns no logprobs")
    if req.stream:
        raise RequestError("an embedding request cannot be streamed")
    if req.session_params not in (None, {}):
        raise RequestError("an embedding request belongs to no session")


def prepare(req: GenerateInput, *, encode: Callable[[str], list[int]], limits: ModelLimits,
            client_limits: ClientLimits = NO_LIMITS) -> Prepared:
    """Everything cheap is checked before the text is tokenized; then every sequence is validated."""
    priority = priority_from(req.priority)
    session = session_from(req.session_params)
    rids = rids_from(req.rid)
    if (req.text is None) == (req.input_ids is None):
        raise RequestError("pass exactly one of text and input_ids")
    texts: list[str] | None = None
    if req.text is not None:
        batched = isinstance(req.text, list)
        texts = req.text if batched else [req.text]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise RequestError("text must be a string or a non-empty list of strings")
        for t in texts:
            client_limits.check_text(t)
        count = len(texts)
    else:
        if not isinstance(req.input_ids, list):
            raise RequestError("input_ids must be a list of token ids or a list of such lists")
        batched = bool(req.input_ids) and isinstance(req.input_ids[0], list)
        ids = [_token_ids(x) for x in req.input_ids] if batched else [_token_ids(req.input_ids)]
        if not ids:
            raise RequestError("input_ids must not be empty")
        count = len(ids)
    if req.embed:
        _check_embedding_call(req)
    validate_kind(req.embed, req.dimensions, limits)
    if isinstance(req.sampling_params, list):
        if len(req.sampling_params) != count:
            raise RequestError(f"{len(req.sampling_params)} sampling_params for {count} prompts")
        params = [params_from(p) for p in req.sampling_params]
    else:
        params = [params_from(req.sampling_params)] * count
    for one_params in params:
        client_limits.check_params(one_params)
    if req.embed:
        params = [EMBEDDING_PARAMS] * count
    prepared = Prepared([], params, batched, req.return_logprob, req.logprob_start_len, req.top_logprobs_num,
                        priority, session, bool(req.stream), rids, req.embed, lora_paths_from(req.lora_path, count),
                        cache_keys_from(req.extra_key, req.cache_salt, count), req.dimensions,
                        token_ids_logprob_from(req.token_ids_logprob, count))
    if req.stream and (batched or prepared.num_sequences != 1):
        raise RequestError("stream=True takes one prompt with n=1")
    if rids is not None and len(rids) != prepared.num_sequences:
        raise RequestError(f"{len(rids)} rids for {prepared.num_sequences} requests")
    if rids is not None and len(set(rids)) != len(rids):
        raise RequestError("rid must be unique among the requests in flight")
    prepared.ids = [encode(t) for t in texts] if texts is not None else ids
    label_ids = prepared.token_ids_logprob or [None] * count
    for one_ids, one_params, one_labels in zip(prepared.ids, params, label_ids):
        validate_request(one_ids, one_params, limits, return_logprob=req.return_logprob,
                         logprob_start_len=req.logprob_start_len, top_logprobs_num=req.top_logprobs_num,
                         token_ids_logprob=one_labels)
    return prepared


def expand(prepared: Prepared, new_rid: Callable[[], str]) -> list[GenerateReq]:
    """One GenerateReq per sample, in prompt order; the prepared ``rids`` (one per sample) replace generated ids."""
    messages: list[GenerateReq] = []
    loras = prepared.lora_paths or [None] * len(prepared.ids)
    keys = prepared.cache_keys or [None] * len(prepared.ids)
    label_ids = prepared.token_ids_logprob or [None] * len(prepared.ids)
    for one_ids, p, lora, key, labels in zip(prepared.ids, prepared.params, loras, keys, label_ids):
        for i in range(p.n):
            q = p
            if p.n > 1:
                seed = None if p.seed is None else p.seed + i
                q = msgspec.structs.replace(p, n=1, seed=seed)
            messages.append(GenerateReq(
                rid=prepared.rids[len(messages)] if prepared.rids is not None else new_rid(),
                input_ids=one_ids,
                params=q,
                return_logprob=prepared.return_logprob,
                logprob_start_len=-1 if prepared.logprob_start_len is None else prepared.logprob_start_len,
                top_logprobs_num=prepared.top_logprobs_num or 0,
                token_ids_logprob=labels,
                stream=prepared.stream,
                grammar=grammar_of(q),
                priority=prepared.priority,
                session=prepared.session,
                embed=prepared.embed,
                dimensions=prepared.dimensions,
                lora_path=lora,
                cache_key=key,
            ))
    return messages
