"""The GPU check's fast-path parts (radixrt/bench/gpu_check.py): ``graphs`` and ``speed``.

- ``graphs``: for every captured batch size (full, and with the most padding rows it ever gets), the logits of a
  graph replay equal, bit for bit in fp32, the eager forward at the same padded shape, and padding rows write nothing
  into the KV pool; then greedy tokens with graphs and overlap scheduling on equal those with both off (fp32;
  bf16 up to a near-tie, judged by the eager run's top logprobs). Capture time and memory are reported. Then the
  runner's memory is released and resumed, with the weights backed up and without: the device memory freed, and a
  replay on the graphs captured again equal to one before. On a CPU the graphs are replayed by calling the captured
  closure again (``ReplayByCall``).
- ``speed``: the Engine with its defaults against transformers' eager ``generate`` on the same weights and
  device: batch-1 ms/token, a batch of random prompts, and groups sharing a long prefix. Timings need CUDA; on
  a CPU the steps run at tiny sizes and report no figures.
"""

from __future__ import annotations

import random
import time

from radixrt.bench.gpu_check_parts import TIE, Context, Part, _free_cuda_cache


def check_graphs(ctx: Context, part: Part) -> None:
    import torch

    from radixrt.model.cuda_graph import ReplayByCall
    from radixrt.model.forward_batch import ForwardBatch, SeqChunk
    from radixrt.model.runner import ModelRunner
    from radixrt.model.weights import resolve_model_path

    device = torch.device(ctx.device)
    page = 16
    cuda = device.type == "cuda"
    # on a CPU: the GPU path's kernels in triton's interpreter, graphs replayed by calling the closure again
    runner = ModelRunner(resolve_model_path(ctx.model), dtype="float32", page_size=page,
                         num_pages=ctx.sizes.graph_pages, device=ctx.device, cuda_graph_max_bs=ctx.sizes.graph_max_bs,
                         attention_backend="auto" if cuda else "triton", graph_factory=None if cuda else ReplayByCall())
    graphs = runner.graphs
    part.figures.update(buckets=graphs.buckets, capture_seconds=round(graphs.capture_seconds, 2),
                        capture_mb=round(graphs.capture_bytes / 2**20, 1))
    rng = random.Random(0)
    vocab = runner.config.vocab_size
    free = list(range(1, runner.pool.num_pages))
    rng.shuffle(free)
    need = graphs.max_bs * -(-(ctx.sizes.graph_context + 1) // page)
    if need > len(free):
        raise ValueError(f"graph_pages {ctx.sizes.graph_pages} cannot hold {graphs.max_bs} requests of "
                         f"{ctx.sizes.graph_context} tokens ({need} pages)")
    checked = []
    for smaller, bucket in zip([0] + graphs.buckets, graphs.buckets):
        for bs in sorted({bucket, smaller + 1}):  # full, and the most padding the bucket ever sees
            lens = [rng.randint(1, ctx.sizes.graph_context) for _ in range(bs)]
            pages = []
            for n in lens:
                need = -(-(n + 1) // page)
                pages.append([free.pop() for _ in range(need)])
            runner.forward(ForwardBatch.build([SeqChunk([rng.randrange(vocab) for _ in range(n)], 0, p)
                                               for n, p in zip(lens, pages)], page, device))
            batch = ForwardBatch.build([SeqChunk([rng.randrange(vocab)], n, p) for n, p in zip(lens, pages)], page,
                                       device)
            before = [t.clone() for t in runner.pool.k_caches[:1] + runner.pool.v_caches[-1:]]
            replayed = runner.forward(batch).clone()
            after = runner.pool.k_caches[:1] + runner.pool.v_caches[-1:]
            slots = batch.out_slots
            for old, new in zip(before, after):
                flat_old, flat_new = old.view(-1, *old.shape[2:]), new.view(-1, *new.shape[2:])
                flat_old[slots] = flat_new[slots]
                part.expect(torch.equal(flat_old, flat_new), f"batch {bs} (bucket {bucket}): a padding row wrote K/V")
            with torch.inference_mode():
                eager = runner._eager_forward(graphs._static_batch(bucket))[:bs]
            part.expect(torch.equal(replayed, eager),
                        f"batch {bs} (bucket {bucket}): replayed logits differ from eager at the padded shape by "
                        f"{(replayed - eager).abs().max().item():.3g}")
            checked.append(bs)
            for p in pages:
                free.extend(p)
    part.figures.update(batches_checked=checked, replays=graphs.replays)
    del graphs
    part.figures["memory_release"] = _release_and_resume(runner, part, device, page)
    del runner
    _free_cuda_cache()
    for dtype_name in ("float32", "bfloat16"):
        part.figures[dtype_name] = _tokens_with_and_without(ctx, part, dtype_name)


def _release_and_resume(runner, part: Part, device, page: int) -> dict:
    """The runner's memory released and resumed (what SGLang's /release_memory_occupation does to it), with the
    weights backed up in host memory and without (read from the checkpoint again): the device memory a release
    frees, and a decode replay after the resume, on graphs captured again, equal bit for bit to one before."""
    import torch

    from radixrt.model.forward_batch import ForwardBatch, SeqChunk

    cuda = device.type == "cuda"
    bs = runner.graphs.buckets[-1]
    prompts = [[7 + row, 11, 13, 17, 19] for row in range(bs)]
    pages = [[1 + row] for row in range(bs)]

    def decode_logits() -> torch.Tensor:
        runner.forward(ForwardBatch.build([SeqChunk(p, 0, pg) for p, pg in zip(prompts, pages)], page, device))
        batch = ForwardBatch.build([SeqChunk([5], len(p), pg) for p, pg in zip(prompts, pages)], page, device)
        return runner.forward(batch).clone()

    before, figures = decode_logits(), {}
    for backup in (True, False):
        old_graphs = runner.graphs
        allocated = torch.cuda.memory_allocated(device) if cuda else 0
        started = time.perf_counter()
        runner.release_memory({"weights", "kv_cache", "cuda_graph"}, backup_weights=backup)
        released = time.perf_counter() - started
        freed = allocated - torch.cuda.memory_allocated(device) if cuda else None
        started = time.perf_counter()
        runner.resume_memory({"weights", "kv_cache", "cuda_graph"})
        resumed = time.perf_counter() - started
        name = "backup" if backup else "checkpoint"
        part.expect(runner.graphs is not None and runner.graphs is not old_graphs,
                    f"memory release ({name}): the decode graphs were not captured again")
        after = decode_logits()
        part.expect(torch.equal(after, before), f"memory release ({name}): replayed logits after the resume differ "
                                                f"by {(after - before).abs().max().item():.3g}")
        figures[name] = {"freed_mb": None if freed is None else round(freed / 2**20, 1),
                         "release_s": round(released, 3), "resume_s": round(resumed, 3)}
        if cuda:
            part.expect(freed > 0, f"memory release ({name}): no device memory was freed")
    return figures


def _tokens_with_and_without(ctx: Context, part: Part, dtype_name: str) -> dict:
    """Greedy tokens with graphs and overlap (the defaults) against both off; divergences judged as near-ties
    by the eager run's top logprobs."""
    from radixrt.engine import Engine

    rng = random.Random(1)
    prompts = [[rng.randrange(200, 20000) for _ in range(rng.randint(5, 60))] for _ in range(ctx.sizes.graph_prompts)]
    params = {"max_new_tokens": ctx.sizes.new_tokens, "temperature": 0, "ignore_eos": True}
    runs = {}
    fast = {} if ctx.device.startswith("cuda") else {"enable_overlap_schedule": True}  # no graphs on a CPU
    for name, options in (("fast", fast), ("eager", {"disable_cuda_graph": True, "disable_overlap_schedule": True})):
        engine = Engine(model=ctx.model, device=ctx.device, dtype=dtype_name, kv_memory_gb=0.5, log_interval=0.0,
                        cuda_graph_max_bs=ctx.sizes.graph_max_bs, engine_scheduler="thread", **options)
        try:
            kw = {"return_logprob": True, "top_logprobs_num": 5} if name == "eager" else {}
            runs[name] = engine.generate(input_ids=prompts, sampling_params=params, **kw)
            if name == "fast":
                scheduler, graphs = engine.scheduler, engine.runner.graphs
                figures = {"overlap": scheduler.overlap, "launched_steps": scheduler.launched_steps,
                           "graph_replays": graphs.replays if graphs else 0}
        finally:
            engine.shutdown()
            _free_cuda_cache()
    compared, near_ties = 0, []
    for index, (fast, eager) in enumerate(zip(runs["fast"], runs["eager"])):
        got, want = fast["output_ids"], eager["output_ids"]
        same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
        compared += same
        if same < len(want):
            top = dict((t, lp) for lp, t, _ in eager["meta_info"]["output_top_logprobs"][same])
            gap = top[want[same]] - top.get(got[same], float("-inf"))
            near_ties.append({"prompt": index, "step": same, "logprob_gap": gap})
            part.expect(dtype_name != "float32" and gap <= TIE[dtype_name],
                        f"{dtype_name} prompt {index}: graphs+overlap and eager differ at step {same} (gap {gap:.3g})")
    if ctx.device.startswith("cuda"):
        part.expect(figures["graph_replays"] > 0, f"{dtype_name}: no decode step replayed a graph")
        part.expect(figures["launched_steps"] > 0, f"{dtype_name}: no decode step was launched ahead (overlap)")
    return {**figures, "tokens_compared": compared, "near_ties": near_ties}


def check_speed(ctx: Context, part: Part) -> None:
    import torch

    from radixrt.engine import Engine

    s = ctx.sizes
    rng = random.Random(0)
    tokens = lambda n: [rng.randrange(200, 20000) for _ in range(n)]  # noqa: E731
    prefixes = [tokens(s.speed_prefix) for _ in range(s.speed_groups)]
    workloads = {
        "batch1": ([tokens(16)], s.speed_latency_tokens),
        "random": ([tokens(s.speed_prompt) for _ in range(s.speed_batch)], s.speed_output),
        "shared_prefix": ([prefixes[i % s.speed_groups] + tokens(64) for i in range(s.speed_groups * s.speed_per_group)],
                          64 if ctx.device.startswith("cuda") else 4),
    }
    cuda = ctx.device.startswith("cuda")
    if not cuda:
        part.skipped.append("timing: needs CUDA (the steps run at tiny sizes here)")
    started = time.perf_counter()
    engine = Engine(model=ctx.model, device=ctx.device, dtype="bfloat16", log_interval=0.0,
                    max_running_requests=max(s.speed_batch, 1), chunked_prefill_size=8192,
                    kv_memory_gb=s.speed_kv_gb)
    results: dict[str, dict] = {"radixrt": {"init_seconds": round(time.perf_counter() - started, 2)}}
    try:
        engine.generate(input_ids=[tokens(20)] * 2, sampling_params={"max_new_tokens": 4, "ignore_eos": True})
        for name, (prompts, out) in workloads.items():
            engine.flush_cache()
            results["radixrt"][name] = _timed_generate(lambda: engine.generate(
                input_ids=prompts, sampling_params={"max_new_tokens": out, "temperature": 0, "ignore_eos": True}),
                len(prompts), out, cuda)
    finally:
        engine.shutdown()
        _free_cuda_cache()
    results["transformers"] = _transformers_speed(ctx, workloads, cuda)
    part.figures.update(results)
    for name in workloads:
        ours, theirs = results["radixrt"][name], results["transformers"].get(name)
        part.expect(ours["tokens"] == len(workloads[name][0]) * workloads[name][1], f"{name}: tokens missing")
        if cuda and theirs:
            part.figures.setdefault("speedup", {})[name] = round(ours["tok_s"] / theirs["tok_s"], 2)
    del torch


def _timed_generate(call, requests: int, out: int, cuda: bool) -> dict:
    import torch

    if cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    results = call()
    seconds = time.perf_counter() - started
    results = results if isinstance(results, list) else [results]
    made = sum(len(r["output_ids"]) for r in results)
    figures = {"seconds": round(seconds, 3), "tokens": made, "tok_s": round(made / seconds, 1)}
    if requests == 1:
        figures["ms_per_token"] = round(1000 * seconds / out, 3)
    return figures


def _transformers_speed(ctx: Context, workloads: dict, cuda: bool) -> dict:
    """transformers' eager generate on the same weights: batch 1 and the random prompts (the shared-prefix
    batch would only repeat the random one's figure: transformers shares nothing)."""
    import torch
    from transformers import AutoModelForCausalLM

    from radixrt.model.weights import resolve_model_path

    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(ctx.model), dtype=torch.bfloat16)
    model = model.to(ctx.device).eval()
    figures = {}
    try:
        for name in ("batch1", "random"):
            prompts, out = workloads[name]
            ids = torch.tensor(prompts, device=ctx.device)
            run = lambda: _hf_generate(model, ids, out)  # noqa: E731
            if name == "batch1":
                run()  # warm-up
            figures[name] = _timed_generate(run, len(prompts), out, cuda)
    finally:
        del model
        _free_cuda_cache()
    return figures


def _hf_generate(model, ids, out: int) -> list[dict]:
    import torch

    with torch.inference_mode():
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=out, min_new_tokens=out,
                             do_sample=False, pad_token_id=0)
    if gen.is_cuda:
        torch.cuda.synchronize()
    return [{"output_ids": row[ids.shape[1]:].tolist()} for row in gen]
