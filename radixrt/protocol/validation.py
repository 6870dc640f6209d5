"""The one check of a generation request, used by the Engine, the HTTP process and the scheduler itself.

Everything a client can send about one sequence (token ids, sampling parameters, constraint, logprob options)
is checked here against the model's limits before it is queued, so a request the runtime cannot serve is
refused with a clear message (``RequestError``: a ``ValueError`` for the Engine, a 400 for the HTTP server)
and never reaches a scheduler step. Torch-free: the HTTP process imports it.
"""

from __future__ import annotations

import json
import math
from typing import Any

from radixrt.protocol.errors import RequestError
from radixrt.protocol.limits import ModelLimits
from radixrt.sampling.params import SamplingParams

MAX_SEED = 2**63 - 1


def validate_kind(embed: bool, dimensions: int | None, limits: ModelLimits) -> None:
    """A generation request needs a model that generates; ``dimensions`` (an embedding cut to its first values)
    needs a Matryoshka model and one of the sizes it allows."""
    if not embed and not limits.generates:
        raise RequestError("this model serves embeddings only (an embedding model, or --is-embedding): it "
                           "answers /v1/embeddings, /encode and Engine.encode, and generates nothing")
    if dimensions is None:
        return
    if not embed:
        raise RequestError("dimensions applies to an embedding request only")
    if type(dimensions) is not int or not 1 <= dimensions <= limits.embedding_size:
        raise RequestError(f"dimensions must be an integer in [1, {limits.embedding_size}]")
    if limits.matryoshka is None:
        raise RequestError("dimensions is not supported: this model is not a Matryoshka model (its config sets "
                           "neither is_matryoshka nor matryoshka_dimensions; --json-model-override-args "
                           "'{\"is_matryoshka\": true}' declares it one)")
    if limits.matryoshka and dimensions not in limits.matryoshka:
        raise RequestError(f"dimensions must be one of this model's matryoshka_dimensions {list(limits.matryoshka)}")


def grammar_of(params: SamplingParams) -> tuple[str, str] | None:
    """The (kind, spec) constraint of a request's parameters, or None."""
    if params.regex is not None:
        return "regex", params.regex
    if params.json_schema is not None:
        return "json_schema", params.json_schema
    if params.choices is not None:
        return "choices", json.dumps(params.choices)
    if params.ebnf is not None:
        return "ebnf", params.ebnf
    if params.structural_tag is not None:
        return "structural_tag", params.structural_tag
    return None


def validate_request(input_ids: list[int], params: SamplingParams, limits: ModelLimits, *,
                     return_logprob: bool = False, logprob_start_len: int | None = -1,
                     top_logprobs_num: int | None = 0, token_ids_logprob: list[int] | None = None) -> None:
    """Raise RequestError naming the first problem of a request that can never be served."""
    if not isinstance(input_ids, list) or not input_ids:
        raise RequestError("the prompt is empty")
    vocab_size = limits.vocab_size
    if set(map(type, input_ids)) != {int}:  # at C speed: a long prompt is checked on the scheduler's thread
        raise RequestError("input_ids must be integers")
    if min(input_ids) < 0 or max(input_ids) >= vocab_size:
        bad = [t for t in input_ids if not 0 <= t < vocab_size]
        raise RequestError(f"input_ids {bad[:5]} are outside the vocabulary (size {vocab_size})")
    try:
        params.validate(vocab_size)
    except ValueError as exc:
        raise RequestError(str(exc)) from None
    if params.seed is not None and not 0 <= params.seed <= MAX_SEED:
        raise RequestError(f"seed must be in [0, {MAX_SEED}]")
    _validate_logprob_options(return_logprob, logprob_start_len, top_logprobs_num, vocab_size)
    if token_ids_logprob is not None:
        validate_token_ids_logprob(token_ids_logprob, return_logprob, vocab_size)
    total = len(input_ids) + params.max_new_tokens
    if total > limits.context_length:
        raise RequestError(
            f"the prompt ({len(input_ids)} tokens) plus max_new_tokens ({params.max_new_tokens}) exceeds "
            f"the context length ({limits.context_length})"
        )
    pages = math.ceil(total / limits.page_size) + 1
    if pages > limits.num_pages:
        raise RequestError(f"the prompt plus max_new_tokens needs {pages} KV pages; the pool has {limits.num_pages}")
    grammar = grammar_of(params)
    if grammar is not None:
        from radixrt.constrained.patterns import validate_grammar

        try:
            validate_grammar(*grammar)
        except ValueError as exc:
            raise RequestError(f"invalid grammar: {exc}") from None


MAX_TOKEN_IDS_LOGPROB = 1024


def validate_token_ids_logprob(ids: Any, return_logprob: bool, vocab_size: int) -> None:
    """SGLang's ``token_ids_logprob``: distinct ids in the vocabulary whose logprobs every returned position
    reports, so it needs ``return_logprob``."""
    if not isinstance(ids, list) or not ids or not all(type(t) is int for t in ids):
        raise RequestError("token_ids_logprob must be a non-empty list of token ids (or one such list per prompt)")
    if len(ids) > MAX_TOKEN_IDS_LOGPROB:
        raise RequestError(f"token_ids_logprob takes at most {MAX_TOKEN_IDS_LOGPROB} ids")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"token_ids_logprob {bad[:5]} are outside the vocabulary (size {vocab_size})")
    if len(set(ids)) != len(ids):
        raise RequestError("token_ids_logprob lists a token id twice")
    if not return_logprob:
        raise RequestError("token_ids_logprob needs return_logprob=true")


def _validate_logprob_options(return_logprob: bool, logprob_start_len: int | None, top_logprobs_num: int | None,
                              vocab_size: int) -> None:
    if not isinstance(return_logprob, bool):
        raise RequestError("return_logprob must be a boolean")
    if top_logprobs_num is not None and (type(top_logprobs_num) is not int
                                         or not 0 <= top_logprobs_num <= vocab_size):
        raise RequestError(f"top_logprobs_num must be in [0, {vocab_size}]")
    if logprob_start_len is not None and (type(logprob_start_len) is not int or logprob_start_len < -1):
        raise RequestError("logprob_start_len must be >= -1")
