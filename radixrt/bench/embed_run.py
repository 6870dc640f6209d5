"""One offline embedding run of one engine on one workload; prints one `RESULT_JSON` line.

    python -m radixrt.bench.embed_run radixrt MODEL_DIR WORKLOAD.json NAME DTYPE
    /path/to/peer-venv/bin/python /path/to/embed_run.py vllm MODEL_DIR WORKLOAD.json NAME DTYPE

Rules as peer_run.py's: this file runs by path under another engine's python, so it imports nothing of radixrt at
module level. The measurement: engine start-up, a warm-up on four prompts unrelated to the workload, then every
prompt of the workload in one call (radixrt: ``Engine(is_embedding=True).encode``; vLLM: ``LLM(runner="pooling")
.embed``, or ``.classify`` for a reranking workload over a cross-encoder, each with its prefix cache on). Reported:
prompts/s, prompt tokens/s, the prompt tokens served from the cache where the engine says, and the first ``KEPT``
vectors (a reranking workload's: each pair's relevance, a one-label score's sigmoid; the caller compares the
engines' answers).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Callable

KEPT = 8
RERANK_WORKLOADS = ("rerank",)  # (query, passage) pairs through a cross-encoder: the relevance, not a vector
WARM_UP = [[100 + i, 200 + i, 300 + i, 400 + i] for i in range(4)]

# embed(prompts) -> outputs; vectors(outputs) -> lists of floats; cached_tokens(outputs) -> int or None
EngineCalls = tuple[Callable[[list[list[int]]], list], Callable[[list], list], Callable[[list], "int | None"]]


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def radixrt_engine(model: str, dtype: str, rerank: bool) -> EngineCalls:
    import radixrt

    engine = radixrt.Engine(model=model, dtype=dtype, is_embedding=True)

    def answers(outs: list) -> list:
        if rerank:  # a cross-encoder: each pair's relevance, its score's sigmoid (radixrt.rerank)
            return [[_sigmoid(o["embedding"][0])] for o in outs]
        return [o["embedding"] for o in outs]

    return (lambda prompts: engine.encode(input_ids=prompts), answers,
            lambda outs: sum(o["meta_info"].get("cached_tokens", 0) for o in outs))


def vllm_engine(model: str, dtype: str, rerank: bool) -> EngineCalls:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    from vllm import LLM
    from vllm.inputs import TokensPrompt

    engine = LLM(model=model, runner="pooling", dtype=dtype, enable_prefix_caching=True, max_model_len=2048,
                 seed=0)

    def embed(prompts: list[list[int]]) -> list:
        tokens = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        return engine.classify(tokens, use_tqdm=False) if rerank else engine.embed(tokens, use_tqdm=False)

    if rerank:  # vLLM's classify applies a one-label model's sigmoid
        return embed, lambda outs: [list(o.outputs.probs) for o in outs], lambda outs: None
    return embed, lambda outs: [list(o.outputs.embedding) for o in outs], lambda outs: None


ENGINES = {"radixrt": radixrt_engine, "vllm": vllm_engine}


def measure(engine: str, model: str, prompts: list[list[int]], name: str, dtype: str) -> dict:
    started = time.perf_counter()
    embed, vectors, cached_tokens = ENGINES[engine](model, dtype, name in RERANK_WORKLOADS)
    init_s = time.perf_counter() - started
    embed(WARM_UP)
    started = time.perf_counter()
    outs = embed(prompts)
    total_s = time.perf_counter() - started
    got = vectors(outs)
    assert len(got) == len(prompts), f"{len(got)} vectors for {len(prompts)} prompts"
    n_in = sum(len(p) for p in prompts)
    return dict(engine=engine, workload=name, dtype=dtype, init_s=round(init_s, 1), total_s=round(total_s, 2),
                prompts_s=round(len(prompts) / total_s, 1), prompt_tok_s=round(n_in / total_s, 1),
                cached_prompt_tokens=cached_tokens(outs), vectors=[[round(x, 6) for x in v] for v in got[:KEPT]])


def main(argv: list[str]) -> int:
    if len(argv) != 5 or argv[0] not in ENGINES:
        print(__doc__, file=sys.stderr)
        return 2
    engine, model, workload_path, name, dtype = argv
    with open(workload_path) as f:
        prompts = json.load(f)[name]
    print("RESULT_JSON", json.dumps(measure(engine, model, prompts, name, dtype)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
