"""Where a decode step's time goes on a GPU: device time against wall time, kernel by kernel.

    python -m radixrt.bench.gpu_step_profile --synthetic-weights CFG_DIR [--shapes 1b,small]

For each model shape (``small``: CFG_DIR's config as is; ``1b``: a Llama-3.2-1B-like shape, 16 layers, hidden
2048, 32/8 heads of 64), seeded random weights, bf16, the Engine's defaults:

- ``latency``: one request, 16 tokens -> 256 out, twice (ms per token), and the wall time between forwards;
- ``replay``: a captured decode graph replayed alone (CUDA events) per bucket at a fixed context: the device's
  time for one step, against the eager forward of the same batch (device time, host time);
- ``kernels``: the kernels of a graph replay at batch 1 and 256 and of a prefill chunk (16 prompts x 512 tokens)
  (torch.profiler), by device time;
- ``throughput``: 256 prompts x 512 tokens -> 128, twice, with prefill and decode forwards timed apart;
- ``traces``: a Chrome trace (CPU and CUDA) of a few Engine steps at batch 256, gzipped.

Figures go to stdout and ``$OUT/gpu_step_profile.json``, traces to ``$OUT``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import shutil
import time
from pathlib import Path

OUT = Path(os.environ.get("OUT", "/tmp/gpu_step_profile"))
RESULTS: dict = {}


def record(shape: str, key: str, value) -> None:
    RESULTS.setdefault(shape, {})[key] = value
    print(f"[{shape}] {key}: {json.dumps(value)}", flush=True)
    (OUT / "gpu_step_profile.json").write_text(json.dumps(RESULTS, indent=1))


# a Llama-3.2-1B-like shape on the default model's vocabulary
ONE_B = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
         "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 8192, "rope_theta": 500000.0}


def cuda_ms(fn, reps: int = 50, warm: int = 3) -> float:
    """Median device milliseconds of ``fn`` (events around each call)."""
    import torch

    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def host_ms(fn, reps: int = 50) -> float:
    """Mean wall milliseconds per call of ``fn`` launched back to back, synchronized at the end only."""
    import torch

    fn()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - started) / reps


class ForwardLog:
    """Wraps the runner's forward: when each one started and what it was."""

    def __init__(self, runner) -> None:
        self.runner, self.inner, self.rows = runner, runner.forward, []
        runner.forward = self

    def __call__(self, batch):
        self.rows.append((time.perf_counter(), bool(batch.is_decode), batch.batch_size, int(batch.input_ids.shape[0])))
        return self.inner(batch)

    def split(self, ended: float) -> dict:
        """Wall seconds from each forward to the next (the last to ``ended``), summed by kind."""
        out = {"decode_s": 0.0, "decode_steps": 0, "extend_s": 0.0, "extend_steps": 0}
        stamps = [r[0] for r in self.rows] + [ended]
        for (t, decode, _, _), nxt in zip(self.rows, stamps[1:]):
            kind = "decode" if decode else "extend"
            out[f"{kind}_s"] += nxt - t
            out[f"{kind}_steps"] += 1
        out = {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}
        if out["decode_steps"]:
            out["decode_ms_per_step"] = round(1000 * out["decode_s"] / out["decode_steps"], 3)
        self.rows = []
        return out

    def close(self) -> None:
        self.runner.forward = self.inner


def fill_static(graphs, bs: int, context: int, num_pages: int, page: int) -> None:
    """The graph runner's static buffers as a decode batch of ``bs`` rows at ``context`` tokens that writes
    nothing (slots -1): each row reads its own pages."""
    import torch

    per_row = -(-context // page)
    dev = graphs.device
    graphs.input_ids[:bs].copy_(torch.randint(100, 10000, (bs,), device=dev))
    graphs.positions[:bs].fill_(context - 1)
    graphs.out_slots[:bs].fill_(-1)
    graphs.seq_lens[:bs].fill_(context)
    table = (torch.arange(bs * per_row, device=dev, dtype=torch.int32) % num_pages).view(bs, per_row)
    graphs.page_table[:bs, :per_row].copy_(table)


def kernel_table(prof, limit: int = 30) -> dict:
    """The profile's kernels by self device time: the total, and the ``limit`` largest."""
    events = [e for e in prof.key_averages() if getattr(e, "self_device_time_total", 0) > 0]
    events.sort(key=lambda e: -e.self_device_time_total)
    rows = [[round(e.self_device_time_total, 1), e.count, e.key[:90]] for e in events]
    return {"total_device_us": round(sum(r[0] for r in rows), 1), "kernels": rows[:limit]}


def profile_shape(shape: str, cfg_dir: Path, kv_gb: float) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    import radixrt
    from radixrt.bench.gpu_check import synthetic_model
    from radixrt.model.forward_batch import ForwardBatch, SeqChunk
    from radixrt.protocol.messages import StartProfileReq, StopProfileReq

    model_dir = synthetic_model(cfg_dir, Path(f"/tmp/gsp-{shape}"), overrides=ONE_B if shape == "1b" else None,
                                device="cuda", dtype="bfloat16")
    torch.cuda.empty_cache()
    started = time.perf_counter()
    eng = radixrt.Engine(model=str(model_dir), device="cuda", dtype="bfloat16", kv_memory_gb=kv_gb,
                         max_running_requests=256, chunked_prefill_size=8192, log_interval=0.0,
                         engine_scheduler="thread")  # its runner and scheduler are read here
    runner = eng.runner
    graphs = runner.graphs
    record(shape, "init", {"seconds": round(time.perf_counter() - started, 2),
                           "capture_s": round(graphs.capture_seconds, 2) if graphs else None,
                           "capture_mb": round(graphs.capture_bytes / 2**20) if graphs else None,
                           "buckets": graphs.buckets if graphs else None, "pages": runner.pool.num_pages})
    rng = random.Random(0)
    tok = lambda n: [rng.randrange(200, 20000) for _ in range(n)]  # noqa: E731
    greedy = lambda out: {"max_new_tokens": out, "temperature": 0, "ignore_eos": True}  # noqa: E731
    log = ForwardLog(runner)
    try:
        eng.generate(input_ids=[tok(20 + i) for i in range(8)], sampling_params=greedy(8))
        log.split(time.perf_counter())
        prompt = tok(16)
        for attempt in (1, 2):
            eng.flush_cache()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            eng.generate(input_ids=[prompt], sampling_params=greedy(256))
            ended = time.perf_counter()
            record(shape, f"latency_{attempt}", {"ms_per_token": round((ended - t0) * 1000 / 256, 3),
                                                 "forwards": log.split(ended)})
        # the device's time for a step: graphs replayed alone, eager forwards of the same batch
        page, pages = runner.page_size, runner.pool.num_pages
        with torch.inference_mode():
            for bs, context in ((1, 272), (8, 640), (64, 640), (256, 640), (64, 4096)):
                if graphs is None or bs > graphs.max_bs or -(-context // page) > graphs.max_pages:
                    continue
                fill_static(graphs, bs, context, pages, page)
                bucket = graphs.bucket_for(bs)
                replay = graphs.graphs[bucket].replay
                eager = lambda: runner._eager_forward(graphs._static_batch(bs))  # noqa: E731
                record(shape, f"replay_b{bs}_ctx{context}", {
                    "graph_ms": round(cuda_ms(replay), 4), "graph_host_ms": round(host_ms(replay), 4),
                    "eager_device_ms": round(cuda_ms(eager, reps=10), 4),
                    "eager_host_ms": round(host_ms(eager, reps=10), 4)})
            for bs, context in ((1, 272), (256, 640)):
                fill_static(graphs, bs, context, pages, page)
                replay = graphs.graphs[graphs.bucket_for(bs)].replay
                replay()
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(5):
                        replay()
                    torch.cuda.synchronize()
                record(shape, f"kernels_graph_b{bs}_ctx{context}", kernel_table(prof))
            graphs._reset_padding(0)
        # the kernels of a prefill chunk: 16 prompts x 512 tokens, written into pages no request holds
        per = -(-512 // page)
        chunks = [SeqChunk(tok(512), 0, list(range(pages - (i + 1) * per, pages - i * per))) for i in range(16)]
        extend = ForwardBatch.build(chunks, page, runner.device)
        with torch.inference_mode():
            record(shape, "extend_16x512_ms", round(cuda_ms(lambda: runner._eager_forward(extend), reps=10), 3))
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    runner._eager_forward(extend)
                torch.cuda.synchronize()
        record(shape, "kernels_extend_16x512", kernel_table(prof))
        # throughput
        for attempt in (1, 2):
            prompts = [tok(512) for _ in range(256)]
            eng.flush_cache()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            eng.generate(input_ids=prompts, sampling_params=greedy(128))
            ended = time.perf_counter()
            record(shape, f"throughput_{attempt}", {"tok_s": round(256 * 128 / (ended - t0), 1),
                                                    "seconds": round(ended - t0, 3), "forwards": log.split(ended)})
        # traces of Engine steps
        for bs, out in ((256, 8),):
            eng.flush_cache()
            eng.generate(input_ids=[tok(100) for _ in range(bs)], sampling_params=greedy(2))
            folder = OUT / f"trace_{shape}_b{bs}"
            eng._call(StartProfileReq(cuda=True))
            eng.generate(input_ids=[tok(100) for _ in range(bs)], sampling_params=greedy(out))
            eng._call(StopProfileReq(trace_dir=str(folder), operators=False))
            for trace in folder.glob("*.json"):
                with open(trace, "rb") as src, gzip.open(OUT / f"trace_{shape}_b{bs}.json.gz", "wb") as dst:
                    shutil.copyfileobj(src, dst)
            shutil.rmtree(folder, ignore_errors=True)
    finally:
        log.close()
        eng.shutdown()
        del eng
        torch.cuda.empty_cache()


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--synthetic-weights", type=Path, required=True, help="a model's config + tokenizer files")
    parser.add_argument("--shapes", default="1b,small")
    parser.add_argument("--kv-memory-gb", type=float, default=20.0)
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    RESULTS["device"] = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    for shape in args.shapes.split(","):
        try:
            profile_shape(shape, args.synthetic_weights, args.kv_memory_gb)
        except Exception as exc:  # the other shape still reports
            import traceback

            record(shape, "error", traceback.format_exc()[-3000:])
            print(exc, flush=True)


if __name__ == "__main__":
    main()
