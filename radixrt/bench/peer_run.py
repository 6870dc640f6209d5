"""One offline throughput run of one engine on one workload; prints one `RESULT_JSON` line.

    python -m radixrt.bench.peer_run radixrt MODEL_DIR WORKLOAD.json {a|b|c} {cache|nocache} DTYPE
    /path/to/peer-venv/bin/python /path/to/peer_run.py vllm MODEL_DIR WORKLOAD.json ...

Rules: this file runs by file path under another engine's python, so it imports nothing of radixrt at module level
and each engine side imports only what it needs inside its own function. The measurement: engine init time,
a warm-up on prompts unrelated to b and c (prefixes of the last prompt of a, 8 tokens each), then every wave
of the workload (c is 4 waves sent one after another; a and b are one wave), greedy with EOS ignored; the output
token count is asserted, and out tok/s, total tok/s and the prompt tokens served from the cache are reported.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Callable

WARM_UP_PROMPTS = 4
WARM_UP_OUTPUT_LEN = 8

# run(prompts, max_new_tokens) -> outputs; output_ids(outputs) -> id lists; cached_tokens(outputs) -> int
EngineCalls = tuple[Callable[[list[list[int]], int], list], Callable[[list], list], Callable[[list], int]]


def radixrt_engine(model: str, dtype: str, cache: bool) -> EngineCalls:
    import radixrt

    engine = radixrt.Engine(model=model, dtype=dtype, disable_radix_cache=not cache)
    params = {"temperature": 0.0, "ignore_eos": True}

    def run(prompts: list[list[int]], max_new_tokens: int) -> list:
        return engine.generate(input_ids=prompts, sampling_params={**params, "max_new_tokens": max_new_tokens})

    return (run, lambda outs: [o["output_ids"] for o in outs],
            lambda outs: sum(o["meta_info"].get("cached_tokens", 0) for o in outs))


def vllm_engine(model: str, dtype: str, cache: bool) -> EngineCalls:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    engine = LLM(model=model, dtype=dtype, enable_prefix_caching=cache, max_model_len=2048, max_num_seqs=64, seed=0)

    def run(prompts: list[list[int]], max_new_tokens: int) -> list:
        params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True)
        return engine.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)

    return (run, lambda outs: [o.outputs[0].token_ids for o in outs],
            lambda outs: sum((getattr(o, "num_cached_tokens", 0) or 0) for o in outs))


ENGINES = {"radixrt": radixrt_engine, "vllm": vllm_engine}


def measure(engine: str, model: str, workload: dict, name: str, cache: bool, dtype: str) -> dict:
    """Start `engine`, warm it up, run the workload's waves and return the RESULT_JSON fields."""
    out_len = workload["output_tokens"]
    waves = workload[name] if name == "c" else [workload[name]]  # multi-turn: each turn is a wave after the last
    warm = [workload["a"][-1][:100 + i] for i in range(WARM_UP_PROMPTS)]  # shares no prefix with b or c
    started = time.perf_counter()
    run, output_ids, cached_tokens = ENGINES[engine](model, dtype, cache)
    init_s = time.perf_counter() - started
    run(warm, WARM_UP_OUTPUT_LEN)
    started = time.perf_counter()
    outs = [o for wave in waves for o in run(wave, out_len)]
    total_s = time.perf_counter() - started
    prompts = [p for wave in waves for p in wave]
    n_out = sum(len(ids) for ids in output_ids(outs))
    assert n_out == len(prompts) * out_len, f"{n_out} output tokens, expected {len(prompts) * out_len}"
    n_in = sum(len(p) for p in prompts)
    return dict(engine=engine, workload=name, prefix_caching=cache, dtype=dtype, init_s=round(init_s, 1),
                total_s=round(total_s, 2), out_tok_s=round(n_out / total_s, 1),
                total_tok_s=round((n_in + n_out) / total_s, 1), cached_prompt_tokens=cached_tokens(outs))


def main(argv: list[str]) -> int:
    if len(argv) != 6 or argv[0] not in ENGINES or argv[4] not in ("cache", "nocache"):
        print(__doc__, file=sys.stderr)
        return 2
    engine, model, workload_path, name, cache, dtype = argv
    with open(workload_path) as f:
        workload = json.load(f)
    result = measure(engine, model, workload, name, cache == "cache", dtype)
    print("RESULT_JSON", json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
