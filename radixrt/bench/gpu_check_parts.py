"""The parts of the GPU check (radixrt/bench/gpu_check.py) but graphs and speed: each runs its steps and fills a
``Part``."""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

# Triton vs torch_ref: max abs difference over max(1, max abs output); bf16 outputs of 2 to 4 have an ulp of 0.016
TOL = {"float32": 1e-5, "bfloat16": 2e-2}
LOGPROB_TOL = {"float32": 1e-3, "bfloat16": 1.0}  # Engine vs transformers (bf16: a sanity bound)
TIE = {"float32": 1e-3, "bfloat16": 0.25}  # logprob gap under which a greedy step may go either way
CHAT_PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
                "Explain what a radix tree is in one sentence."]
PHONE = r"[0-9]{3}-[0-9]{4}"


@dataclass
class Sizes:
    """How big each part runs: real sizes on CUDA, tiny ones for the CPU dry run."""

    kernel_shapes: list[tuple[str, int, int, int, list[str], list[int]]]  # name, heads, kv heads, dim, dtypes, pages
    decode_lens: list[int]
    extend_lens: list[tuple[int, int]]  # (prefix, new tokens) per request
    window: int
    engine_prompts: int
    new_tokens: int
    bandwidth_shape: tuple[int, int, int]
    bandwidth_cases: list[tuple[int, int]]  # (batch, context)
    server_dtype: str
    # graphs: the largest captured batch, the pool, the longest context and the prompts of the token check
    graph_max_bs: int = 4
    graph_pages: int = 64
    graph_context: int = 40
    graph_prompts: int = 2
    # speed: batch-1 tokens; random prompts (count, length, output); shared-prefix groups (count, size, prefix)
    speed_latency_tokens: int = 4
    speed_batch: int = 2
    speed_prompt: int = 8
    speed_output: int = 4
    speed_groups: int = 2
    speed_per_group: int = 2
    speed_prefix: int = 16
    speed_kv_gb: float = 0.2


@dataclass
class Part:
    name: str
    ok: bool = True
    error: str | None = None
    seconds: float = 0.0
    failures: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # steps left out, and why
    figures: dict = field(default_factory=dict)

    def expect(self, condition: bool, message: str) -> None:
        if not condition:
            self.ok = False
            self.failures.append(message)


@dataclass
class Context:
    device: str
    sizes: Sizes
    model: str
    autotune: bool


def _dtype(name: str):
    import torch

    return getattr(torch, name)


# ----- kernels -------------------------------------------------------------------------------------------


def check_kernels(ctx: Context, part: Part) -> None:
    import torch

    from radixrt.kernels import torch_ref, triton_ops
    from radixrt.kernels.bench import paged_cache

    device = torch.device(ctx.device)
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    rows = []
    for name, heads, kv_heads, dim, dtypes, page_sizes in ctx.sizes.kernel_shapes:
        for dtype_name in dtypes:
            dtype, tol = _dtype(dtype_name), TOL[dtype_name]
            for page in page_sizes:
                where = f"{name} {dtype_name} page {page}"
                caches = paged_cache(ctx.sizes.decode_lens, page, kv_heads, dim, dtype, device, gen)
                slots = torch.randperm(caches[0].shape[0] * page, device=device)[:11]
                k = torch.randn(11, kv_heads, dim, dtype=dtype, device=device)
                ours, ref = [c.clone() for c in caches[:2]], [c.clone() for c in caches[:2]]
                triton_ops.store_kv(*ours, slots, k, -k)
                torch_ref.store_kv(*ref, slots, k, -k)
                part.expect(all(torch.equal(a, b) for a, b in zip(ours, ref)), f"store_kv {where}: not bit-exact")
                for window in (0, ctx.sizes.window):
                    for kernel, (diff, scale) in (
                        ("decode", _decode_diff(caches, ctx.sizes.decode_lens, heads, dim, window)),
                        ("extend", _extend_diff(ctx.sizes.extend_lens, page, heads, kv_heads, dim, dtype, device,
                                                gen, window)),
                    ):
                        rows.append({"kernel": kernel, "shape": name, "dtype": dtype_name, "page": page,
                                     "window": window, "max_abs_diff": diff, "max_abs_output": scale})
                        part.expect(diff <= tol * max(1.0, scale),
                                    f"{kernel} {where} window {window}: {diff:.2e} > {tol:g} x max(1, {scale:.2f})")
    part.figures["cases"] = rows
    part.figures["worst"] = {kind: max(r["max_abs_diff"] for r in rows if r["kernel"] == kind)
                             for kind in ("decode", "extend")}
    _check_draws(device, part)


def _check_draws(device, part: Part) -> None:
    """The sampler's counter-based draws on the device equal their reference in Python's integers (int64 products
    must wrap modulo 2**64 there as on the CPU)."""
    import random

    import torch

    from radixrt.sampling import draws

    rng = random.Random(0)
    seeds = [0, -1, 2**63 - 1, -(2**63)] + [rng.getrandbits(64) for _ in range(252)]
    counters = [rng.randrange(0, 2**40) for _ in seeds]
    got = draws.uniforms(torch.tensor([draws.seed_word(s) for s in seeds], device=device),
                         torch.tensor(counters, device=device)).tolist()
    want = [draws.reference_uniform(s, c) for s, c in zip(seeds, counters)]
    part.figures["draws_checked"] = len(seeds)
    part.expect(got == want, f"sampling draws: {sum(a != b for a, b in zip(got, want))} of {len(seeds)} differ "
                             "from the reference")


def _compare(ours, ref) -> tuple[float, float]:
    """(max abs difference, max abs reference output)."""
    ref = ref.float()
    return (ours.float() - ref).abs().max().item(), ref.abs().max().item()


def _decode_diff(caches, seq_lens: list[int], heads: int, dim: int, window: int) -> tuple[float, float]:
    import torch

    from radixrt.kernels import torch_ref, triton_ops

    k_cache, v_cache, table = caches
    q = torch.randn(len(seq_lens), heads, dim, dtype=k_cache.dtype, device=k_cache.device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=k_cache.device)
    args = (q, k_cache, v_cache, table, lens, dim**-0.5, window)
    return _compare(triton_ops.decode_attention(*args), torch_ref.decode_attention(*args))


def _extend_diff(cases, page: int, heads: int, kv_heads: int, dim: int, dtype, device, gen,
                 window: int) -> tuple[float, float]:
    import torch

    from radixrt.kernels import torch_ref, triton_ops
    from radixrt.kernels.bench import paged_cache

    k_cache, v_cache, table = paged_cache([p + n for p, n in cases], page, kv_heads, dim, dtype, device, gen)
    q = torch.randn(sum(n for _, n in cases), heads, dim, dtype=dtype, device=device)
    prefix = torch.tensor([p for p, _ in cases], dtype=torch.int32, device=device)
    extend = torch.tensor([n for _, n in cases], dtype=torch.int32, device=device)
    args = (q, k_cache, v_cache, table, prefix, extend, dim**-0.5, window)
    return _compare(triton_ops.extend_attention(*args), torch_ref.extend_attention(*args))


# ----- engine against transformers ---------------------------------------------------------------------


def check_engine(ctx: Context, part: Part) -> None:
    for dtype_name in ("float32", "bfloat16"):
        part.figures[dtype_name] = _engine_against_transformers(ctx, part, dtype_name)
    fp32 = part.figures["float32"]
    if fp32["attention_backend"] == "torch":
        part.skipped.append("torch attention backend against the triton one: the torch backend is the only one here")
        return
    # The torch backend (torch_ref and the cascade over the chat prompts' shared header) on the same device.
    started = time.perf_counter()
    ids = _greedy_ids(ctx, "float32", fp32["prompts"], "torch")
    part.expect(ids == fp32["output_ids"], "float32: the torch attention backend's tokens differ from triton's")
    part.figures["torch_backend"] = {"tokens_equal_to_triton": ids == fp32["output_ids"],
                                     "seconds": round(time.perf_counter() - started, 2)}


def _greedy_ids(ctx: Context, dtype_name: str, prompts: list[list[int]], backend: str) -> list[list[int]]:
    from radixrt.engine import Engine

    engine = Engine(model=ctx.model, device=ctx.device, dtype=dtype_name, kv_memory_gb=0.5, log_interval=0.0,
                    attention_backend=backend)
    try:
        outs = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": ctx.sizes.new_tokens,
                                                                   "temperature": 0, "ignore_eos": True})
        return [o["output_ids"] for o in outs]
    finally:
        engine.shutdown()
        _free_cuda_cache()


def _engine_against_transformers(ctx: Context, part: Part, dtype_name: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from radixrt.engine import Engine
    from radixrt.tokenizer import apply_chat_template

    n = ctx.sizes.new_tokens
    started = time.perf_counter()
    engine = Engine(model=ctx.model, device=ctx.device, dtype=dtype_name, kv_memory_gb=0.5, log_interval=0.0,
                    engine_scheduler="thread")  # its runner and grammars are read here
    try:
        figures = {"attention_backend": engine.runner.attention.backend,
                   "load_seconds": round(time.perf_counter() - started, 2)}
        tokenizer = engine.tokenizer
        prompts = [apply_chat_template(tokenizer, [{"role": "user", "content": p}])
                   for p in CHAT_PROMPTS[: ctx.sizes.engine_prompts]]
        started = time.perf_counter()
        ours = engine.generate(input_ids=prompts, return_logprob=True, logprob_start_len=0,
                               sampling_params={"max_new_tokens": n, "temperature": 0, "ignore_eos": True})
        figures["generate_seconds"] = round(time.perf_counter() - started, 3)
        started = time.perf_counter()
        _mixed_batch(engine, prompts[0], part, dtype_name)
        figures["mixed_batch_seconds"] = round(time.perf_counter() - started, 3)
    finally:
        engine.shutdown()
    started = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(engine.model_path, dtype=_dtype(dtype_name)).to(ctx.device).eval()
    worst, compared, near_ties = 0.0, 0, []
    for index, (ids, out) in enumerate(zip(prompts, ours)):
        with torch.inference_mode():
            gen = hf.generate(torch.tensor([ids], device=ctx.device), max_new_tokens=n, do_sample=False,
                              attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=ctx.device),
                              eos_token_id=None, pad_token_id=tokenizer.pad_token_id)
            want = gen[0, len(ids):].tolist()
            ref = torch.log_softmax(hf(torch.tensor([ids + out["output_ids"]], device=ctx.device)).logits[0].float(), -1)
        got = out["output_ids"]
        same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
        if same < len(want):  # a divergence: allowed only where the reference saw a near-tie
            gap = (ref[len(ids) + same - 1, want[same]] - ref[len(ids) + same - 1, got[same]]).item()
            near_ties.append({"prompt": index, "step": same, "logprob_gap": gap})
            part.expect(gap <= TIE[dtype_name], f"{dtype_name} prompt {index}: tokens differ at step {same} "
                                                f"(ours {got[same]}, transformers {want[same]}, gap {gap:.3g})")
        meta = out["meta_info"]
        pairs = [(lp, ref[len(ids) + i - 1, t].item()) for i, (lp, t, _) in enumerate(meta["output_token_logprobs"][:same])]
        pairs += [(lp, ref[j - 1, t].item()) for j, (lp, t, _) in enumerate(meta["input_token_logprobs"]) if j > 0]
        worst = max([worst] + [abs(a - b) for a, b in pairs])
        compared += same
    part.expect(worst <= LOGPROB_TOL[dtype_name], f"{dtype_name}: logprob max diff {worst:.3g}")
    del hf
    _free_cuda_cache()
    figures.update(prompts=prompts, output_ids=[o["output_ids"] for o in ours])
    figures.update(tokens_compared=compared, tokens_equal=not near_ties, near_ties=near_ties,
                   logprob_max_abs_diff=worst, transformers_seconds=round(time.perf_counter() - started, 2))
    return figures


def _mixed_batch(engine, prompt_ids: list[int], part: Part, dtype_name: str) -> None:
    """Every sampling feature in one batch on the device; seeded twins must agree."""
    seeded = {"max_new_tokens": 12, "temperature": 0.8, "top_p": 0.9, "top_k": 40, "seed": 7, "ignore_eos": True}
    params = [seeded, dict(seeded),
              {"max_new_tokens": 12, "min_p": 0.1, "repetition_penalty": 1.3, "frequency_penalty": 0.5,
               "presence_penalty": 0.5, "ignore_eos": True}]
    if engine.grammars is not None:
        params.append({"max_new_tokens": 12, "temperature": 0, "regex": PHONE})
    elif f"{dtype_name}: regex" not in " ".join(part.skipped):
        part.skipped.append(f"{dtype_name}: regex-constrained request: constrained decoding is unavailable "
                            "(outlines-core is not installed)")
    outs = engine.generate(input_ids=[prompt_ids] * len(params), sampling_params=params, return_logprob=True,
                           logprob_start_len=len(prompt_ids) - 3, top_logprobs_num=3)
    part.expect(outs[0]["output_ids"] == outs[1]["output_ids"], f"{dtype_name}: seeded twins differ")
    part.expect(all(len(o["output_ids"]) == 12 for o in outs[:3]), f"{dtype_name}: a sampled row ended early")
    if len(outs) > 3:
        part.expect(re.fullmatch(PHONE, outs[3]["text"]) is not None,
                    f"{dtype_name}: regex output {outs[3]['text']!r} does not match {PHONE}")
    logprobs = [lp for o in outs for lp, _, _ in o["meta_info"]["output_token_logprobs"]]
    part.expect(all(lp is not None and math.isfinite(lp) and lp <= 1e-4 for lp in logprobs),
                f"{dtype_name}: a sampled token has no finite logprob")


def _free_cuda_cache() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ----- a mixture of experts -------------------------------------------------------------------------------


def check_moe(ctx: Context, part: Part) -> None:
    """The engine part's comparison with transformers over a mixture of experts: a seeded random Qwen3-MoE of the
    engine model's width and tokenizer (its first 4 layers; 8 experts, 2 a token, of half its MLP width)."""
    import dataclasses
    import tempfile

    with tempfile.TemporaryDirectory(prefix="radixrt-gpu-check-moe-") as scratch:
        moe = _random_moe(ctx.model, Path(scratch))
        moe_ctx = dataclasses.replace(ctx, model=str(moe))
        for dtype_name in ("float32", "bfloat16"):
            part.figures[dtype_name] = _engine_against_transformers(moe_ctx, part, dtype_name)


def _random_moe(model: str, target: Path) -> Path:
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen3MoeConfig

    from radixrt.model.llama import head_dim_of
    from radixrt.model.weights import resolve_model_path

    source = resolve_model_path(model)
    dense = AutoConfig.from_pretrained(source)
    config = Qwen3MoeConfig(
        vocab_size=dense.vocab_size, hidden_size=dense.hidden_size, num_hidden_layers=min(4, dense.num_hidden_layers),
        num_attention_heads=dense.num_attention_heads, num_key_value_heads=dense.num_key_value_heads,
        head_dim=head_dim_of(dense), num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=dense.intermediate_size // 2, intermediate_size=dense.intermediate_size,
        norm_topk_prob=True, max_position_embeddings=dense.max_position_embeddings, rms_norm_eps=dense.rms_norm_eps,
        tie_word_embeddings=dense.tie_word_embeddings, bos_token_id=dense.bos_token_id,
        eos_token_id=dense.eos_token_id)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in hf.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.05)
    hf.save_pretrained(target)
    for file in Path(source).iterdir():
        if file.is_file() and file.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(file, target / file.name)
    return target


# ----- server ----------------------------------------------------------------------------------------------


def check_server(ctx: Context, part: Part) -> None:
    import httpx

    from radixrt.server.server_process import ServerProcess

    args = ["--model", ctx.model, "--device", ctx.device, "--dtype", ctx.sizes.server_dtype,
            "--kv-memory-gb", "0.5", "--log-interval", "0"]
    started = time.perf_counter()
    with ServerProcess(args, timeout=240.0) as server:
        part.figures["startup_seconds"] = round(time.perf_counter() - started, 1)
        with httpx.Client(base_url=server.url, timeout=120.0) as http:
            sent = time.perf_counter()
            r = http.post("/generate", json={"text": "The capital of France is",
                                             "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
            part.expect(r.status_code == 200 and r.json().get("text"), f"/generate: {r.status_code} {r.text[:200]}")
            part.figures["generate_seconds"] = round(time.perf_counter() - sent, 3)
            model = http.get("/v1/models").json()["data"][0]["id"]
            sent = time.perf_counter()
            r = http.post("/v1/chat/completions", json={
                "model": model, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8,
                "temperature": 0})
            ok = r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
            part.expect(bool(ok), f"/v1/chat/completions: {r.status_code} {r.text[:200]}")
            part.figures["chat_seconds"] = round(time.perf_counter() - sent, 3)


# ----- decode bandwidth ----------------------------------------------------------------------------------


def check_bandwidth(ctx: Context, part: Part) -> None:
    import torch

    from radixrt.kernels import torch_ref, triton_ops
    from radixrt.kernels.bench import paged_cache, peak_bandwidth, timed
    from radixrt.kernels.triton_decode import choose_num_splits, multiprocessors

    device = torch.device(ctx.device)
    heads, kv_heads, dim = ctx.sizes.bandwidth_shape
    dtype, page = torch.bfloat16, 16
    peak, peak_text = peak_bandwidth(device)
    part.figures.update(shape={"heads": heads, "kv_heads": kv_heads, "head_dim": dim, "dtype": "bfloat16",
                               "page_size": page}, peak=peak_text, cases=[])
    if device.type != "cuda":
        part.skipped.append("timing: needs CUDA (each size is only checked against torch_ref here)")
    gen = torch.Generator().manual_seed(1)
    for batch, context in ctx.sizes.bandwidth_cases:
        k_cache, v_cache, table = paged_cache([context] * batch, page, kv_heads, dim, dtype, device, gen)
        q = torch.randn(batch, heads, dim, dtype=dtype, device=device)
        lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        call = (q, k_cache, v_cache, table, lens, dim**-0.5)
        diff, scale = _compare(triton_ops.decode_attention(*call), torch_ref.decode_attention(*call))
        part.expect(diff <= TOL["bfloat16"] * max(1.0, scale),
                    f"decode {batch}x{context}: {diff:.2e} > {TOL['bfloat16']:g} x max(1, {scale:.2f})")
        case = {"batch": batch, "context": context, "max_abs_diff": diff,
                "splits": choose_num_splits(batch, kv_heads, table.shape[1] * page, multiprocessors(device))}
        if device.type == "cuda":
            from triton.testing import do_bench_cudagraph

            kv_bytes = batch * context * kv_heads * dim * 2 * k_cache.element_size()
            ms = timed(lambda: triton_ops.decode_attention(*call), device)
            # under a CUDA graph (as decode steps run): the kernels alone, without their launch cost
            graph_ms = float(do_bench_cudagraph(lambda: triton_ops.decode_attention(*call), rep=40))
            case.update(ms=round(ms, 4), gb_per_s=round(kv_bytes / (ms * 1e-3) / 1e9, 1),
                        graph_ms=round(graph_ms, 4), graph_gb_per_s=round(kv_bytes / (graph_ms * 1e-3) / 1e9, 1))
            if peak:
                case["percent_of_peak"] = round(100 * kv_bytes / (ms * 1e-3) / peak, 1)
                case["graph_percent_of_peak"] = round(100 * kv_bytes / (graph_ms * 1e-3) / peak, 1)
            if batch <= 64:  # split-KV up to mid batches: each power of two, under graphs
                from radixrt.kernels.triton_decode import decode_attention as split_decode

                case["graph_ms_by_splits"] = {
                    n: round(float(do_bench_cudagraph(lambda n=n: split_decode(*call, num_splits=n), rep=20)), 4)
                    for n in ((1, 2, 4, 8, 16, 32, 64) if batch <= 8 else (1, 2, 4, 8, 16))}
        part.figures["cases"].append(case)
        del k_cache, v_cache, table, q
    _free_cuda_cache()


PARTS: dict[str, Callable[[Context, Part], None]] = {
    "kernels": check_kernels, "engine": check_engine, "moe": check_moe, "server": check_server,
    "bandwidth": check_bandwidth,
}
