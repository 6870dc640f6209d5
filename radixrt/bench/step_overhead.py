"""The scheduler's host time per decode step, without a model: what a GPU step must hide.

    python -m radixrt.bench.step_overhead [--batch 1 64 256] [--steps 200] [--prompt-len 200] [--temperature 0]
                                          [--seeded] [--profile]
    python -m radixrt.bench.step_overhead --engine --vocab 1024 [--batch 64 256]
    python -m radixrt.bench.step_overhead --engine-modes [--batch 64 256]
    python -m radixrt.bench.step_overhead --prefill-chunk 8192 --prompt-len 512 --vocab 1024 [--batch 256]
                                          [--max-running 256]

A model-free runner (its forward costs next to nothing: logits pick a token from the inputs) stands in for the
model, so each step's time is the scheduler's own: planning, pages, the forward batch, sampling, finish checks,
emitting, and (``--detokenize``) turning ids into text as the Engine does. Reported per batch size, with the
overlap scheduler off and on. ``--temperature`` above 0 samples (``--seeded``: each request with its own seed)
instead of taking the argmax. ``--profile`` prints cProfile's top functions of the largest batch.

``--prefill-chunk`` times the prefill of the batch's prompts instead, in chunks of that many tokens: a prefill step
is not launched ahead, so its host time adds to the device's.

``--engine-modes`` times the Engine over a tiny real model (one layer of width 64; its forward costs little) with
its scheduler on a thread of the caller's process and in a process of its own (``engine_scheduler``), modes
alternating, one compute thread each.

``--engine`` times the whole Engine instead (overlap on): its scheduler thread, its detokenizer thread and the
caller's ``generate``, which share one GIL, over ``--steps`` decode steps of the batch, best of three runs. On a GPU
that is what one decode step must hide. ``--vocab`` sets the stand-in model's vocabulary: the argmax over it runs on
the CPU here, where a GPU runs it on the device, so a small one (1024) leaves the host's own work.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import torch

from radixrt.memory.page_pool import KVLayout, PagePool
from radixrt.model.forward_batch import ForwardBatch
from radixrt.model.pooling import Pooling

VOCAB = 49152


def token(seed: int, vocab: int) -> int:
    """A token id in ``[300, vocab)`` (below 300 sit the special tokens)."""
    return seed % (vocab - 300) + 300


class NullRunner:
    """What the scheduler uses of a ModelRunner, with a forward that only picks a next token per row."""

    def __init__(self, num_pages: int, page_size: int = 16, context_length: int = 8192, vocab: int = VOCAB) -> None:
        self.config = SimpleNamespace(vocab_size=vocab, hidden_size=2)
        self.vocab = vocab
        self.context_length = context_length
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.pool = PagePool(KVLayout(num_layers=1, kv_heads=1, head_dim=2, page_size=page_size,
                                      dtype=torch.float32), num_pages)
        self.page_size = page_size
        self.long_rope_from = None
        self.embedding_only, self.pooling, self.matryoshka = False, Pooling(), None  # a generating model
        self._logits = torch.zeros(0, vocab)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        rows = batch.logits_indices.shape[0]
        if self._logits.shape[0] < rows:
            self._logits = torch.zeros(rows, self.vocab)
        logits = self._logits[:rows].zero_()
        seeds = batch.input_ids[batch.logits_indices] * 31 + batch.positions[batch.logits_indices]
        logits[torch.arange(rows), seeds % (self.vocab - 300) + 300] = 1.0
        return logits

    def close(self) -> None:
        pass


PROMPT_LEN = 200


def _runner_and_prompts(batch: int, steps: int, vocab: int, prompt_len: int = PROMPT_LEN
                        ) -> tuple[NullRunner, list[list[int]]]:
    """A stand-in runner with pages for ``batch`` requests of ``steps`` tokens, and their prompts."""
    runner = NullRunner(num_pages=batch * (prompt_len + steps + 32) // 16 + 64, vocab=vocab,
                        context_length=max(8192, prompt_len + steps + 64))
    return runner, [[token(i * 7919 + j * 31, vocab) for j in range(prompt_len)] for i in range(batch)]


@contextmanager
def _profiled(profile: bool) -> Iterator[None]:
    """cProfile over the block (when ``profile``), its top functions printed after."""
    if not profile:
        yield
        return
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        yield
    finally:
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
        print(text.getvalue())


def measure(batch: int, steps: int, overlap: bool, detokenize: bool, profile: bool = False,
            temperature: float = 0.0, seeded: bool = False, vocab: int = VOCAB, prompt_len: int = PROMPT_LEN) -> dict:
    from radixrt.bench.sim.world import load_world
    from radixrt.detokenize import Detokenizer
    from radixrt.protocol.messages import GenerateReq
    from radixrt.sampling.params import SamplingParams
    from radixrt.scheduler.scheduler import Scheduler
    from radixrt.server_args import ServerArgs

    world = load_world()
    detokenizer = Detokenizer(world.tokenizer)
    sink = (lambda out: detokenizer.process(out)) if detokenize else (lambda out: None)
    runner, prompts = _runner_and_prompts(batch, steps, vocab, prompt_len)
    args = ServerArgs(max_running_requests=batch, chunked_prefill_size=batch * prompt_len, log_interval=0,
                      enable_overlap_schedule=overlap)
    scheduler = Scheduler(args, runner, world.tokenizer, world.eos_ids, sink)
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_new_tokens=steps + 2, temperature=temperature, ignore_eos=True,
                                seed=i if seeded else None)
        scheduler.submit(GenerateReq(rid=f"r{i}", input_ids=prompt, params=params))
    while any(r.num_computed < len(r.prompt_ids) for r in scheduler.running) or not scheduler.running:
        scheduler.step()  # prefill
    scheduler.step()
    with _profiled(profile):
        started = time.perf_counter()
        for _ in range(steps):
            scheduler.step()
        seconds = time.perf_counter() - started
    return {"batch": batch, "prompt_len": prompt_len, "overlap": overlap, "detokenize": detokenize,
            "temperature": temperature, "seeded": seeded, "ms_per_step": round(1000 * seconds / steps, 3), "us_per_request": round(1e6 * seconds / steps / batch, 2)}


def measure_prefill(batch: int, prompt_len: int, chunk: int, vocab: int = VOCAB, profile: bool = False,
                    max_running: int | None = None) -> dict:
    """The scheduler's host time over the prefill of ``batch`` prompts of ``prompt_len`` tokens in chunks of
    ``chunk`` tokens (admission, prefix matching, the forward batch, caching the prompts' pages, sampling each
    prompt's first token), with the stand-in runner: what each prefill step adds to the device's time, as a
    prefill step is not launched ahead. ``max_running`` below ``batch`` leaves the rest queued (each request
    decodes 8 tokens, then leaves its slot): the steps until every prompt was prefilled, decode steps included."""
    from radixrt.bench.sim.world import load_world
    from radixrt.protocol.messages import GenerateReq
    from radixrt.sampling.params import SamplingParams
    from radixrt.scheduler.scheduler import Scheduler
    from radixrt.server_args import ServerArgs

    world = load_world()
    runner, prompts = _runner_and_prompts(batch, 8, vocab, prompt_len)
    args = ServerArgs(max_running_requests=max_running or batch, chunked_prefill_size=chunk, log_interval=0,
                      enable_overlap_schedule=True)
    scheduler = Scheduler(args, runner, world.tokenizer, world.eos_ids, lambda out: None)
    for i, prompt in enumerate(prompts):
        scheduler.submit(GenerateReq(rid=f"r{i}", input_ids=prompt,
                                     params=SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)))
    with _profiled(profile):
        started, steps = time.perf_counter(), 0
        while (scheduler.inbox or scheduler.admission.waiting
               or any(r.num_computed < len(r.prompt_ids) for r in scheduler.running)):
            scheduler.step()
            steps += 1
        seconds = time.perf_counter() - started
    return {"batch": batch, "max_running": max_running or batch, "prompt_len": prompt_len, "chunk": chunk,
            "prefill_steps": steps,
            "ms_per_step": round(1000 * seconds / steps, 3), "prefill_ms": round(1000 * seconds, 1)}


def measure_engine(batch: int, steps: int, vocab: int = VOCAB, runs: int = 3) -> dict:
    """The Engine's wall time per decode step (the best of ``runs``), the stand-in runner in the model's place."""
    from unittest import mock

    from radixrt.engine import Engine
    from radixrt.model.runner import ModelRunner

    runner, prompts = _runner_and_prompts(batch, steps, vocab)
    with mock.patch.object(ModelRunner, "from_args", lambda *args, **kwargs: runner):
        engine = Engine(max_running_requests=batch, chunked_prefill_size=batch * PROMPT_LEN, log_interval=0,
                        enable_overlap_schedule=True)
    try:
        best = float("inf")
        for _ in range(runs):
            engine.flush_cache()
            # the prefill alone first, so that the timed call is decode steps
            engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 1, "ignore_eos": True})
            started = time.perf_counter()
            engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": steps, "temperature": 0,
                                                                "ignore_eos": True})
            best = min(best, time.perf_counter() - started)
    finally:
        engine.shutdown()
    return {"batch": batch, "engine": True, "vocab": vocab, "ms_per_step": round(1000 * best / steps, 3),
            "us_per_request": round(1e6 * best / steps / batch, 2)}


# A model whose forward costs little next to the host's work: one layer of width 64 over a 1,024-token vocabulary.
TINY = {"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 1024, "tie_word_embeddings": True}


def measure_engine_modes(batches: list[int], steps: int, rounds: int = 2) -> list[dict]:
    """The Engine's wall time per decode step with the scheduler on a thread and in a process of its own
    (``engine_scheduler``), over a tiny real model (:data:`TINY`, seeded weights), one compute thread each, modes
    alternating ``rounds`` times; the best of each mode's runs."""
    import os
    import tempfile

    from radixrt.bench.gpu_check import synthetic_model
    from radixrt.engine import Engine
    from radixrt.model.weights import resolve_model_path

    os.environ["OMP_NUM_THREADS"] = "1"  # the scheduler process's too: a forward must not spin against the host
    results = []
    with tempfile.TemporaryDirectory(prefix="radixrt-tiny-") as folder:
        model = synthetic_model(resolve_model_path("smollm2-135m"), Path(folder), overrides=TINY)
        for batch in batches:
            prompts = [[token(i * 7919 + j * 31, TINY["vocab_size"]) for j in range(PROMPT_LEN)] for i in range(batch)]
            best = {"thread": float("inf"), "process": float("inf")}
            for _ in range(rounds):
                for mode in best:
                    engine = Engine(model=str(model), dtype="float32", engine_scheduler=mode, log_interval=0,
                                    max_running_requests=batch, chunked_prefill_size=batch * PROMPT_LEN,
                                    enable_overlap_schedule=True, kv_memory_gb=1.0)
                    try:
                        engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 1, "ignore_eos": True})
                        started = time.perf_counter()
                        engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": steps,
                                                                            "temperature": 0, "ignore_eos": True})
                        best[mode] = min(best[mode], time.perf_counter() - started)
                    finally:
                        engine.shutdown()
            for mode, seconds in best.items():
                results.append({"batch": batch, "engine_scheduler": mode, "model": "tiny",
                                "ms_per_step": round(1000 * seconds / steps, 3)})
                print(results[-1], flush=True)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--prompt-len", type=int, default=PROMPT_LEN, help="each request's prompt, in tokens")
    parser.add_argument("--detokenize", action="store_true", help="also turn ids into text, as the Engine does")
    parser.add_argument("--temperature", type=float, default=0.0, help="above 0: sample instead of the argmax")
    parser.add_argument("--seeded", action="store_true", help="with --temperature: a seed for each request")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--engine", action="store_true", help="time the whole Engine (its threads and the caller)")
    parser.add_argument("--vocab", type=int, default=VOCAB, help="the stand-in model's vocabulary (>= 1024)")
    parser.add_argument("--prefill-chunk", type=int, default=0,
                        help="time the prefill of the batch's prompts in chunks of this many tokens instead")
    parser.add_argument("--max-running", type=int, default=None,
                        help="with --prefill-chunk: slots for this many requests, the rest queued")
    parser.add_argument("--engine-modes", action="store_true",
                        help="time the Engine over a tiny real model with its scheduler on a thread and in a process")
    args = parser.parse_args(argv)
    if args.vocab < 1024:
        parser.error("--vocab must be at least 1024")
    torch.set_num_threads(1)
    if args.engine_modes:
        measure_engine_modes(args.batch, args.steps)
        return
    if args.prefill_chunk:
        for batch in args.batch:
            print(measure_prefill(batch, args.prompt_len, args.prefill_chunk, args.vocab, args.profile,
                                  args.max_running), flush=True)
        return
    if args.engine:
        for batch in args.batch:
            print(measure_engine(batch, args.steps, args.vocab), flush=True)
        return
    for batch in args.batch:
        for overlap in (False, True):
            profile = args.profile and batch == max(args.batch) and overlap
            print(measure(batch, args.steps, overlap, args.detokenize, profile, args.temperature, args.seeded,
                          args.vocab, args.prompt_len), flush=True)


if __name__ == "__main__":
    main()
