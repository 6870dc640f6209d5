"""Micro-benchmark of constrained decoding's per-step cost: mask fill + application for a batch.

    python -m radixrt.bench.constrained_bench [--batch 32] [--steps 200] [--threads 1]

Per step and batch: (a) no constraint (nothing to do but the check), (b) every row constrained by a
JSON schema: fill the packed bitmask from each request's matcher state and apply it to float32 logits
[batch, vocab]; (c) half the rows constrained. Also the old-style bool ``masked_fill_`` for comparison,
and the compile time of the grammar. ``token_masks_*``: what the scheduler runs on CPU
(``GrammarBackend.apply_masks`` -> ``apply_token_masks``: per-state cached sparse ids or dense rows). Uses the default model's tokenizer only (no forward pass).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 4},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "active"],
}


def _time_us(fn, steps: int) -> float:
    for _ in range(3):
        fn()
    samples = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> dict:
    from radixrt.constrained import (GrammarCompiler, GrammarMatcher, allocate_bitmask, apply_bitmask,
                                     apply_token_masks, fill_bitmasks, unpack_bitmask)
    from radixrt.model.weights import resolve_model_path
    from radixrt.server_args import DEFAULT_MODEL
    from radixrt.tokenizer import eos_token_ids, load_tokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    path = resolve_model_path(DEFAULT_MODEL)
    tokenizer = load_tokenizer(path)
    compiler = GrammarCompiler(tokenizer, eos_token_ids(path, tokenizer))
    start = time.perf_counter()
    grammar = compiler.compile("json_schema", SCHEMA)
    compile_s = time.perf_counter() - start
    vocab = compiler.vocab_size

    # Matchers spread over different states: walk each a random number of allowed tokens.
    rng = random.Random(0)
    matchers = []
    for _ in range(args.batch):
        matcher = GrammarMatcher(grammar)
        for _ in range(rng.randrange(0, 12)):
            allowed = unpack_bitmask(matcher.allowed_row()[None], vocab)[0].nonzero().flatten().tolist()
            allowed = [t for t in allowed if t not in grammar.info.eos_token_ids]
            if not allowed or matcher.is_finished():
                break
            matcher.accept_token(rng.choice(allowed))
        matcher.allowed_row()  # state rows are cached after the first visit
        grammar.token_mask(matcher.state)
        matchers.append(matcher)

    logits = torch.randn(args.batch, vocab)
    bitmask = allocate_bitmask(args.batch, vocab)
    none = [None] * args.batch
    half = [m if i % 2 == 0 else None for i, m in enumerate(matchers)]

    def unconstrained():
        if any(m is not None for m in none):  # what the scheduler does: nothing
            apply_bitmask(logits, bitmask)

    def step(rows_of):
        rows = fill_bitmasks(bitmask, rows_of)
        apply_bitmask(logits, bitmask, rows)

    fill_bitmasks(bitmask, matchers)
    bool_mask = unpack_bitmask(bitmask, vocab)
    from radixrt.constrained.masks import _apply_all

    def apply_boolfill():
        logits[:, :vocab].masked_fill_(~unpack_bitmask(bitmask, vocab), float("-inf"))

    kinds = [grammar.token_mask(m.state)[0] for m in matchers]
    results = {
        "batch": args.batch,
        "vocab": vocab,
        "threads": torch.get_num_threads(),
        "compile_s": round(compile_s, 2),
        "unconstrained_us": round(_time_us(unconstrained, args.steps), 1),
        "fill_only_all_us": round(_time_us(lambda: fill_bitmasks(bitmask, matchers), args.steps), 1),
        "fill_apply_all_us": round(_time_us(lambda: step(matchers), args.steps), 1),
        "fill_apply_half_us": round(_time_us(lambda: step(half), args.steps), 1),
        "token_masks_all_us": round(_time_us(lambda: apply_token_masks(logits, matchers), args.steps), 1),
        "token_masks_half_us": round(_time_us(lambda: apply_token_masks(logits, half), args.steps), 1),
        "token_masks_none_us": round(_time_us(lambda: apply_token_masks(logits, none), args.steps), 1),
        "token_mask_kinds_allowed_disallowed_dense": [kinds.count(k) for k in (0, 1, 2)],
        "apply_only_bias_all_us": round(_time_us(lambda: _apply_all(logits, bitmask, vocab), args.steps), 1),
        "apply_only_unpack_masked_fill_all_us": round(_time_us(apply_boolfill, args.steps), 1),
        "apply_only_prebuilt_bool_masked_fill_all_us": round(
            _time_us(lambda: logits.masked_fill_(~bool_mask, float("-inf")), args.steps), 1
        ),
    }
    print(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
