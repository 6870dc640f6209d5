"""The scheduler's host time per decode step, without a model: what a GPU step must hide.

    python -m radixrt.bench.step_overhead [--batch 1 64 256] [--steps 200] [--temperature 0] [--seeded] [--profile]

A model-free runner (its forward costs next to nothing: logits pick a token from the inputs) stands in for the
model, so each step's time is the scheduler's own: planning, pages, the forward batch, sampling, finish checks,
emitting, and (``--detokenize``) turning ids into text as the Engine does. Reported per batch size, with the
overlap scheduler off and on. ``--temperature`` above 0 samples (``--seeded``: each request with its own seed)
instead of taking the argmax. ``--profile`` prints cProfile's top functions of the largest batch.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from types import SimpleNamespace

import torch

from radixrt.memory.page_pool import KVLayout, PagePool
from radixrt.model.forward_batch import ForwardBatch

VOCAB = 49152


class NullRunner:
    """What the scheduler uses of a ModelRunner, with a forward that only picks a next token per row."""

    def __init__(self, num_pages: int, page_size: int = 16, context_length: int = 8192) -> None:
        self.config = SimpleNamespace(vocab_size=VOCAB)
        self.context_length = context_length
        self.device = torch.device("cpu")
        self.pool = PagePool(KVLayout(num_layers=1, kv_heads=1, head_dim=2, page_size=page_size,
                                      dtype=torch.float32), num_pages)
        self.page_size = page_size
        self._logits = torch.zeros(0, VOCAB)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        rows = batch.logits_indices.shape[0]
        if self._logits.shape[0] < rows:
            self._logits = torch.zeros(rows, VOCAB)
        logits = self._logits[:rows].zero_()
        tokens = (batch.input_ids[batch.logits_indices] * 31 + batch.positions[batch.logits_indices]) % 20000 + 300
        logits[torch.arange(rows), tokens] = 1.0
        return logits


def measure(batch: int, steps: int, overlap: bool, detokenize: bool, profile: bool = False,
            temperature: float = 0.0, seeded: bool = False) -> dict:
    from radixrt.bench.sim.world import load_world
    from radixrt.detokenize import Detokenizer
    from radixrt.protocol.messages import GenerateReq
    from radixrt.sampling.params import SamplingParams
    from radixrt.scheduler.scheduler import Scheduler
    from radixrt.server_args import ServerArgs

    world = load_world()
    detokenizer = Detokenizer(world.tokenizer)
    sink = (lambda out: detokenizer.process(out)) if detokenize else (lambda out: None)
    prompt_len = 200
    runner = NullRunner(num_pages=batch * (prompt_len + steps + 32) // 16 + 64)
    args = ServerArgs(max_running_requests=batch, chunked_prefill_size=batch * prompt_len, log_interval=0,
                      enable_overlap_schedule=overlap)
    scheduler = Scheduler(args, runner, world.tokenizer, world.eos_ids, sink)
    for i in range(batch):
        prompt = [(i * 7919 + j * 31) % 20000 + 300 for j in range(prompt_len)]
        params = SamplingParams(max_new_tokens=steps + 2, temperature=temperature, ignore_eos=True,
                                seed=i if seeded else None)
        scheduler.submit(GenerateReq(rid=f"r{i}", input_ids=prompt, params=params))
    while any(r.num_computed < len(r.prompt_ids) for r in scheduler.running) or not scheduler.running:
        scheduler.step()  # prefill
    scheduler.step()
    profiler = cProfile.Profile() if profile else None
    if profiler:
        profiler.enable()
    started = time.perf_counter()
    for _ in range(steps):
        scheduler.step()
    seconds = time.perf_counter() - started
    if profiler:
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
        print(text.getvalue())
    return {"batch": batch, "overlap": overlap, "detokenize": detokenize, "temperature": temperature, "seeded": seeded,
            "ms_per_step": round(1000 * seconds / steps, 3), "us_per_request": round(1e6 * seconds / steps / batch, 2)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--detokenize", action="store_true", help="also turn ids into text, as the Engine does")
    parser.add_argument("--temperature", type=float, default=0.0, help="above 0: sample instead of the argmax")
    parser.add_argument("--seeded", action="store_true", help="with --temperature: a seed for each request")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    for batch in args.batch:
        for overlap in (False, True):
            profile = args.profile and batch == max(args.batch) and overlap
            print(measure(batch, args.steps, overlap, args.detokenize, profile, args.temperature, args.seeded),
                  flush=True)


if __name__ == "__main__":
    main()
