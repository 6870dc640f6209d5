"""One offline throughput run of one engine on one workload; prints one `RESULT_JSON` line.

    python -m radixrt.bench.peer_run radixrt MODEL_DIR WORKLOAD.json {a|b|c} {cache|nocache} DTYPE [--profile]
        [--lora DIR,DIR,...]
    /path/to/peer-venv/bin/python /path/to/peer_run.py vllm MODEL_DIR WORKLOAD.json ...

``--lora``: the engine serves these LoRA adapters (PEFT folders) and prompt i of every wave goes through adapter
i mod their count (both engines: every adapter fits one batch).

Rules: this file runs by file path under another engine's python, so it imports nothing of radixrt at module level
and each engine side imports only what it needs inside its own function. The measurement: engine init time,
a warm-up on prompts unrelated to b and c (prefixes of the last prompt of a, 8 tokens each), then every wave
of the workload (c is 4 waves sent one after another; a and b are one wave), greedy with EOS ignored; the output
token count is asserted, and out tok/s, total tok/s and the prompt tokens served from the cache are reported.

``--profile`` runs the measured waves under ``torch.profiler`` and also prints one ``PROFILE_JSON`` line: the
self CPU time of every operator, summed by class (``OP_CLASSES``: GEMM, attention, sampling, compiled regions,
the rest), and the wall time; vLLM then runs its engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
so that its operators are seen. Profiling slows both engines: compare classes, not throughput, of such runs.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Callable

WARM_UP_PROMPTS = 4
WARM_UP_OUTPUT_LEN = 8

# run(prompts, max_new_tokens) -> outputs; output_ids(outputs) -> id lists; cached_tokens(outputs) -> int;
# (start_profile(), stop_profile() -> {operator: {"self_cpu_s", "calls"}}) on the thread that runs the forwards
Profiler = tuple[Callable[[], None], Callable[[], dict]]
EngineCalls = tuple[Callable[[list[list[int]], int], list], Callable[[list], list], Callable[[list], int], Profiler]


def _this_thread_profiler() -> Profiler:
    """torch.profiler around calls that run their forwards on this thread (vLLM without multiprocessing)."""
    import torch.profiler

    state: dict = {}

    def start() -> None:
        state["profile"] = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        state["profile"].__enter__()

    def stop() -> dict:
        profile = state.pop("profile")
        profile.__exit__(None, None, None)
        return {e.key: {"self_cpu_s": e.self_cpu_time_total / 1e6, "calls": e.count} for e in profile.key_averages()}

    return start, stop


def radixrt_engine(model: str, dtype: str, cache: bool, loras: list[str]) -> EngineCalls:
    import radixrt

    lora = {"lora_paths": [f"lora{k}={path}" for k, path in enumerate(loras)],
            "max_loras_per_batch": len(loras)} if loras else {}
    engine = radixrt.Engine(model=model, dtype=dtype, disable_radix_cache=not cache, **lora)
    params = {"temperature": 0.0, "ignore_eos": True}

    def run(prompts: list[list[int]], max_new_tokens: int) -> list:
        names = [f"lora{i % len(loras)}" for i in range(len(prompts))] if loras else None
        return engine.generate(input_ids=prompts, sampling_params={**params, "max_new_tokens": max_new_tokens},
                               lora_path=names)

    return (run, lambda outs: [o["output_ids"] for o in outs],
            lambda outs: sum(o["meta_info"].get("cached_tokens", 0) for o in outs),
            (engine.start_profile, engine.stop_profile))


def vllm_engine(model: str, dtype: str, cache: bool, loras: list[str]) -> EngineCalls:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    lora = {}
    if loras:
        with open(os.path.join(loras[0], "adapter_config.json")) as f:
            rank = json.load(f)["r"]
        lora = {"enable_lora": True, "max_loras": len(loras), "max_lora_rank": rank}
    engine = LLM(model=model, dtype=dtype, enable_prefix_caching=cache, max_model_len=2048, max_num_seqs=64, seed=0,
                 **lora)

    def run(prompts: list[list[int]], max_new_tokens: int) -> list:
        params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True)
        requests = None
        if loras:
            from vllm.lora.request import LoRARequest

            adapters = [LoRARequest(f"lora{k}", k + 1, path) for k, path in enumerate(loras)]
            requests = [adapters[i % len(adapters)] for i in range(len(prompts))]
        return engine.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False,
                               lora_request=requests)

    return (run, lambda outs: [o.outputs[0].token_ids for o in outs],
            lambda outs: sum((getattr(o, "num_cached_tokens", 0) or 0) for o in outs), _this_thread_profiler())


ENGINES = {"radixrt": radixrt_engine, "vllm": vllm_engine}

# Operator name fragments -> class, first match wins (names lower-cased; torch ops, vLLM's _C ops, ours).
OP_CLASSES = (
    ("attention", ("attention", "attn", "scaled_dot_product", "flash", "paged", "cascade")),
    ("gemm", ("linear", "onednn_mm", "addmm", "matmul", "::mm", "bmm", "gemm", "mkldnn")),
    ("sampling", ("sort", "topk", "argmax", "multinomial", "softmax", "exponential", "cumsum")),
    ("compiled region", ("compiled", "torch-compiled", "inductor", "graph")),
)


def op_class(name: str) -> str:
    lowered = name.lower()
    for label, fragments in OP_CLASSES:
        if any(f in lowered for f in fragments):
            return label
    return "other"


def profile_totals(ops: dict[str, dict], wall_s: float) -> dict:
    """Self CPU seconds per operator class, the ten heaviest operators, and the wall time."""
    by_class: dict[str, float] = {}
    rows = []
    for name, op in ops.items():
        by_class[op_class(name)] = by_class.get(op_class(name), 0.0) + op["self_cpu_s"]
        rows.append((op["self_cpu_s"], name, op["calls"]))
    rows.sort(reverse=True)
    return dict(wall_s=round(wall_s, 2), self_cpu_s={k: round(v, 2) for k, v in sorted(by_class.items())},
                top=[dict(op=name, self_s=round(sec, 2), calls=count) for sec, name, count in rows[:10]])


def measure(engine: str, model: str, workload: dict, name: str, cache: bool, dtype: str,
            profile: bool = False, loras: list[str] | None = None) -> dict:
    """Start `engine`, warm it up, run the workload's waves and return the RESULT_JSON fields (with
    ``profile``, also a ``profile`` entry: see ``profile_totals``)."""
    out_len = workload["output_tokens"]
    waves = workload[name] if name == "c" else [workload[name]]  # multi-turn: each turn is a wave after the last
    warm = [workload["a"][-1][:100 + i] for i in range(WARM_UP_PROMPTS)]  # shares no prefix with b or c
    started = time.perf_counter()
    run, output_ids, cached_tokens, (start_profile, stop_profile) = ENGINES[engine](model, dtype, cache, loras or [])
    init_s = time.perf_counter() - started
    run(warm, WARM_UP_OUTPUT_LEN)
    if profile:
        start_profile()
    started = time.perf_counter()
    outs = [o for wave in waves for o in run(wave, out_len)]
    total_s = time.perf_counter() - started
    ops = stop_profile() if profile else None
    prompts = [p for wave in waves for p in wave]
    n_out = sum(len(ids) for ids in output_ids(outs))
    assert n_out == len(prompts) * out_len, f"{n_out} output tokens, expected {len(prompts) * out_len}"
    n_in = sum(len(p) for p in prompts)
    label = f"{name}+{len(loras)}lora" if loras else name
    result = dict(engine=engine, workload=label, prefix_caching=cache, dtype=dtype, init_s=round(init_s, 1),
                  total_s=round(total_s, 2), out_tok_s=round(n_out / total_s, 1),
                  total_tok_s=round((n_in + n_out) / total_s, 1), cached_prompt_tokens=cached_tokens(outs))
    if ops is not None:
        result["profile"] = profile_totals(ops, total_s)
    return result


def main(argv: list[str]) -> int:
    profile = "--profile" in argv
    argv = [a for a in argv if a != "--profile"]
    loras: list[str] = []
    if "--lora" in argv:
        at = argv.index("--lora")
        loras = [p for p in argv[at + 1].split(",") if p] if at + 1 < len(argv) else []
        argv = argv[:at] + argv[at + 2:]
    if len(argv) != 6 or argv[0] not in ENGINES or argv[4] not in ("cache", "nocache"):
        print(__doc__, file=sys.stderr)
        return 2
    engine, model, workload_path, name, cache, dtype = argv
    if profile and engine == "vllm":
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core's operators in this process
    with open(workload_path) as f:
        workload = json.load(f)
    result = measure(engine, model, workload, name, cache == "cache", dtype, profile, loras)
    profiled = result.pop("profile", None)
    print("RESULT_JSON", json.dumps(result), flush=True)
    if profiled is not None:
        print("PROFILE_JSON", json.dumps(profiled), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
