"""Constrained decoding: regex, JSON schema, choices and JSON-object constraints as token masks,
with jump-forward decoding. Built on outlines-core's token ``Index``; nothing reaches the network.

API (what the scheduler and the HTTP layer use)::

    validate_grammar(kind, spec) -> str          # torch-free, for the HTTP process: ValueError -> 400
    backend = GrammarBackend(tokenizer, eos_ids, vocab_size, jump_forward=True)   # the facade below, per engine
    backend.validate / backend.compile_async / backend.apply_masks(logits, [matcher or None]) / backend.jump_forward(...)
    grammar.matcher() -> GrammarMatcher          # per request, once its future is done

    compiler = GrammarCompiler(tokenizer, eos_token_ids, cache_size=64, max_workers=1, vocab_size=V)
    compiler.validate(kind, spec) -> str         # HTTP layer, before queueing: ValueError -> 400
    future = compiler.compile_async(kind, spec)  # Future[Grammar], never blocks; LRU-cached
    kind: "regex" (str) | "json_schema" (str or dict) | "json_object" (spec ignored) | "choices" (list[str])

    matcher = GrammarMatcher(future.result())    # one per request, once the future is done
    bitmask = allocate_bitmask(max_batch, V)     # int32 [B, ceil(V/32)], packed bits
    rows = fill_bitmasks(bitmask, [matcher or None for each row])
    apply_bitmask(logits, bitmask, rows)         # disallowed -> -inf, in place, one vectorised step
    matcher.accept_token(sampled_id) -> bool
    jf = jump_forward(matcher, output_ids, tokenizer)  # JumpForward(num_tokens_to_drop, tokens_to_append) | None

Rules the scheduler follows for a constrained request:
- Admission: a request whose ``future`` is not done waits (it is simply not admitted this step; others
  run). A failed future (``ValueError``) finishes the request with that error; nothing else is affected.
- Each step, before sampling: fill its bitmask row from the matcher and apply the mask to the logits
  (after penalties, before temperature/top-k/top-p). Unconstrained rows stay untouched.
- After sampling: ``matcher.accept_token(token)``. It is always True for a token sampled under the
  mask; False means a bug (or a token not sampled under the mask): finish the request with an error.
- eos is allowed by the mask only in accepting states (``matcher.can_terminate()``): sampling eos there
  ends the request normally. ``matcher.is_finished()`` (accepting and nothing but eos may follow, or eos
  accepted) means the output is complete: finish the request (reason "stop") without another forward.
  ``ignore_eos`` must not apply to constrained requests in accepting states with no continuation.
- Jump-forward (optional, on by default): after accepting a token and when not finished, call
  ``jump_forward``; if it returns a ``JumpForward``, drop/append as its docstring says (KV of dropped
  tokens is recomputed; the appended tokens need one extend forward) then check ``is_finished()`` again.
  Off: never call it; the output is a valid match either way.
- Retraction/abort: the matcher's state is plain Python; ``rollback(n)`` undoes n tokens, ``copy()`` forks.
"""

import importlib

from radixrt.constrained.patterns import KINDS, validate_grammar

# Everything else pulls in torch: imported on first use, so the HTTP process can ``validate_grammar``
# without loading torch.
_LAZY = {
    "GrammarBackend": "grammar_backend",
    "Grammar": "grammar",
    "GrammarCompiler": "grammar",
    "GrammarMatcher": "matcher",
    "JumpForward": "jump_forward",
    "jump_forward": "jump_forward",
    "allocate_bitmask": "masks",
    "apply_bitmask": "masks",
    "apply_bitmask_reference": "masks",
    "apply_token_masks": "masks",
    "bitmask_words": "masks",
    "fill_bitmasks": "masks",
    "unpack_bitmask": "masks",
    "TokenizerInfo": "vocabulary",
    "build_vocabulary": "vocabulary",
    "get_tokenizer_info": "vocabulary",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'radixrt.constrained' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"radixrt.constrained.{module}"), name)
    globals()[name] = value
    return value


__all__ = ["KINDS", "validate_grammar", *_LAZY]
