"""One request path: a client's generation call -> validated GenerateReqs. The Engine, /generate and the
OpenAI routes (their prompts tokenized and fields mapped to sampling-params dicts first) all end here.

``prepare`` takes exactly one of text and input_ids (one prompt or a batch), one sampling-params dict or one per
prompt, and the logprob options; it checks every sequence with ``validate_request`` before anything is queued.
``ClientLimits`` are the server's bounds on what one client may ask (prompt characters, checked before the
text is tokenized; ``n``; stop strings); the in-process Engine sets none.
``priority`` and ``session_params`` (SGLang's fields) are checked for shape here and served by the scheduler.
``expand`` turns each prompt into ``n`` messages (n > 1: seeds seed, seed+1, ...; the copies share the prompt
through the prefix cache). Torch-free: the HTTP process runs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import msgspec

from radixrt.messages import GenerateReq, SessionParams
from radixrt.sampling.params import SamplingParams
from radixrt.scheduler.validation import ModelLimits, RequestError, grammar_of, validate_request


@dataclass(frozen=True)
class ClientLimits:
    max_prompt_chars: int | None = None
    max_n: int | None = None
    max_stop_strings: int | None = None
    max_stop_string_chars: int | None = None

    @classmethod
    def of_server(cls, args: Any, context_length: int) -> "ClientLimits":
        """The limits of ``radixrt serve`` (ServerArgs); prompt characters default to 32 per context token."""
        return cls(max_prompt_chars=args.max_prompt_chars or 32 * context_length, max_n=args.max_n,
                   max_stop_strings=args.max_stop_strings, max_stop_string_chars=args.max_stop_string_chars)

    def check_text(self, text: str, what: str = "the prompt") -> None:
        self.check_chars(len(text), what)

    def check_chars(self, chars: int, what: str = "the prompt") -> None:
        if self.max_prompt_chars is not None and chars > self.max_prompt_chars:
            raise RequestError(f"{what} has {chars} characters; this server takes at most "
                               f"{self.max_prompt_chars}")

    def check_params(self, params: SamplingParams) -> None:
        if self.max_n is not None and params.n > self.max_n:
            raise RequestError(f"n must be <= {self.max_n} on this server")
        stops = params.stop or []
        if self.max_stop_strings is not None and len(stops) > self.max_stop_strings:
            raise RequestError(f"at most {self.max_stop_strings} stop strings are allowed")
        if self.max_stop_string_chars is not None and any(len(s) > self.max_stop_string_chars for s in stops):
            raise RequestError(f"stop strings must be at most {self.max_stop_string_chars} characters")


NO_LIMITS = ClientLimits()


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


MAX_PRIORITY = 2**31 - 1


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
        return msgspec.convert(value, SessionParams)
    except msgspec.ValidationError as exc:
        raise RequestError(f"session_params: {exc}") from None


def _token_ids(values: Any) -> list[int]:
    if not isinstance(values, list) or not all(type(t) is int for t in values):
        raise RequestError("input_ids must be a list of token ids or a list of such lists")
    return list(values)


def prepare(prompt: Any, sampling_params: Any, input_ids: Any, *, encode: Callable[[str], list[int]],
            limits: ModelLimits, return_logprob: bool = False, logprob_start_len: int | None = None,
            top_logprobs_num: int | None = None, client_limits: ClientLimits = NO_LIMITS, priority: Any = None,
            session_params: Any = None) -> Prepared:
    """Everything cheap is checked before the text is tokenized; then every sequence is validated."""
    priority = priority_from(priority)
    session = session_from(session_params)
    if (prompt is None) == (input_ids is None):
        raise RequestError("pass exactly one of text and input_ids")
    texts: list[str] | None = None
    if prompt is not None:
        batched = isinstance(prompt, list)
        texts = prompt if batched else [prompt]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise RequestError("text must be a string or a non-empty list of strings")
        for t in texts:
            client_limits.check_text(t)
        count = len(texts)
    else:
        if not isinstance(input_ids, list):
            raise RequestError("input_ids must be a list of token ids or a list of such lists")
        batched = bool(input_ids) and isinstance(input_ids[0], list)
        ids = [_token_ids(x) for x in input_ids] if batched else [_token_ids(input_ids)]
        if not ids:
            raise RequestError("input_ids must not be empty")
        count = len(ids)
    if isinstance(sampling_params, list):
        if len(sampling_params) != count:
            raise RequestError(f"{len(sampling_params)} sampling_params for {count} prompts")
        params = [params_from(p) for p in sampling_params]
    else:
        params = [params_from(sampling_params)] * count
    for one_params in params:
        client_limits.check_params(one_params)
    if texts is not None:
        ids = [encode(t) for t in texts]
    prepared = Prepared(ids, params, batched, return_logprob, logprob_start_len, top_logprobs_num, priority,
                        session)
    for one_ids, one_params in zip(ids, params):
        validate_request(one_ids, one_params, limits, return_logprob=return_logprob,
                         logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num)
    return prepared


def expand(prepared: Prepared, new_rid: Callable[[], str], rids: list[str] | None = None) -> list[GenerateReq]:
    """One GenerateReq per sample, in prompt order; ``rids`` (one per sample) replaces generated ids."""
    messages: list[GenerateReq] = []
    for one_ids, p in zip(prepared.ids, prepared.params):
        for i in range(p.n):
            q = p
            if p.n > 1:
                seed = None if p.seed is None else p.seed + i
                q = msgspec.structs.replace(p, n=1, seed=seed)
            messages.append(GenerateReq(
                rid="",
                input_ids=one_ids,
                params=q,
                return_logprob=prepared.return_logprob,
                logprob_start_len=-1 if prepared.logprob_start_len is None else prepared.logprob_start_len,
                top_logprobs_num=prepared.top_logprobs_num or 0,
                grammar=grammar_of(q),
                priority=prepared.priority,
                session=prepared.session,
            ))
    if rids is not None:
        if len(rids) != len(messages):
            raise RequestError(f"{len(rids)} rids for {len(messages)} requests")
        if len(set(rids)) != len(rids):
            raise RequestError("rid must be unique among the requests in flight")
    for i, msg in enumerate(messages):
        msg.rid = rids[i] if rids is not None else new_rid()
    return messages
