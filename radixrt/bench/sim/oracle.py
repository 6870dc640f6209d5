"""Building a Scheduler over a FakeRunner from the knobs, and the solo reference a simulated output must equal.

``SoloOracle.run`` runs one request alone: a fresh pool large enough for it, the radix cache off, one
prefill chunk, so nothing another request does (sharing, eviction, retraction, chunking, batching) can
reach it. Results are memoized per process by everything that decides them (prompt, parameters, grammar,
logprob options, jump-forward), so repeated prompts across seeds cost one run.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

import msgspec

from radixrt.bench.sim.fake_runner import FakeRunner
from radixrt.bench.sim.workload import Knobs, SimRequest
from radixrt.bench.sim.world import World
from radixrt.model.pooling import Pooling
from radixrt.protocol.messages import BatchTokenOut, ControlOut, FinishReason, GenerateReq, ReqDelta, SessionParams
from radixrt.scheduler.scheduler import Scheduler
from radixrt.server_args import ServerArgs

SOLO_PAGE_SIZE = 16
LOGPROB_TOLERANCE = 1e-5
EMBEDDING_TOLERANCE = 1e-5  # a mean pooled over other chunks adds its float32 sums in another order
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(ReqDelta)


def server_args(knobs: Knobs, num_pages: int) -> ServerArgs:
    known = {f.name for f in dataclasses.fields(ServerArgs)}
    seed_option = "random_seed" if "random_seed" in known else "seed"
    return ServerArgs(
        page_size=knobs.page_size,
        max_total_pages=num_pages,
        schedule_policy=knobs.schedule_policy,
        chunked_prefill_size=knobs.chunked_prefill_size,
        enable_mixed_chunk=knobs.enable_mixed_chunk,
        max_running_requests=knobs.max_running_requests,
        disable_radix_cache=not knobs.radix_cache,
        disable_partial_page_reuse=not knobs.partial_page_reuse,
        disable_jump_forward=not knobs.jump_forward,
        enable_overlap_schedule=knobs.overlap,
        speculative_algorithm="NGRAM" if knobs.speculative else None,
        max_loras_per_batch=knobs.max_loras_per_batch,
        log_interval=0,
        **{seed_option: knobs.seed},
    )


def build_scheduler(world: World, knobs: Knobs, num_pages: int, sink: Callable[[BatchTokenOut], None],
                    vocab_size: int) -> tuple[Scheduler, FakeRunner]:
    runner = FakeRunner(vocab_size, world.word_ids + world.punctuation_ids, world.eos_id,
                        knobs.page_size, num_pages, copying=knobs.copying, long_rope_from=knobs.long_rope_from or None,
                        pooling=Pooling(knobs.embeddings) if knobs.embeddings else None)
    args = server_args(knobs, num_pages)
    scheduler = Scheduler(args, runner, world.tokenizer, world.eos_ids, sink, world.grammars(knobs.jump_forward))
    if scheduler.speculator is not None:
        # Speculation sizes drafts by the steps' times; wall times would make a seed replay differently run after
        # run, so it is told what a cost model says a step of its tokens took.
        observe = scheduler.speculator.step_timed
        scheduler.speculator.step_timed = lambda plan, seconds: observe(plan, _modelled_step_seconds(plan))
    return scheduler, runner


def _modelled_step_seconds(plan) -> float:
    """A decode or verify step's time on a made-up device: 1 ms a step plus 0.2 ms a token."""
    return 1e-3 + 2e-4 * sum(n for _, n in plan)


def generate_req(spec: SimRequest, prompt: list[int], session: SessionParams | None = None) -> GenerateReq:
    return GenerateReq(rid=spec.rid, input_ids=list(prompt), params=spec.params, return_logprob=spec.return_logprob,
                       logprob_start_len=spec.logprob_start_len, top_logprobs_num=spec.top_logprobs_num,
                       token_ids_logprob=spec.token_ids_logprob, grammar=spec.grammar, priority=spec.priority,
                       session=session, lora_path=spec.lora_path, cache_key=spec.cache_key, embed=spec.embed)


@dataclass
class Outcome:
    output_ids: list[int]
    finish_reason: FinishReason | None
    output_logprobs: list | None = None
    input_logprobs: list | None = None
    embedding: list[float] | None = None
    output_token_ids_logprobs: list | None = None  # a row per position: (logprob, id) per requested id
    input_token_ids_logprobs: list | None = None


def _logprobs_differ(a: list | None, b: list | None) -> bool:
    a, b = a or [], b or []
    if len(a) != len(b):
        return True
    for (x, tx), (y, ty) in zip(a, b):
        if tx != ty or (x is None) != (y is None) or (x is not None and abs(x - y) > LOGPROB_TOLERANCE):
            return True
    return False


def same_outcome(got: Outcome, alone: Outcome) -> str | None:
    """None when ``got`` equals ``alone``; else what differs."""
    if got.output_ids != alone.output_ids:
        return f"output {got.output_ids} != alone {alone.output_ids}"
    if got.finish_reason != alone.finish_reason:
        return f"finish {got.finish_reason} != alone {alone.finish_reason}"
    if _logprobs_differ(got.output_logprobs, alone.output_logprobs):
        return f"output logprobs {got.output_logprobs} != alone {alone.output_logprobs}"
    if _logprobs_differ(got.input_logprobs, alone.input_logprobs):
        return f"input logprobs {got.input_logprobs} != alone {alone.input_logprobs}"
    for name in ("output_token_ids_logprobs", "input_token_ids_logprobs"):
        rows, alone_rows = getattr(got, name) or [], getattr(alone, name) or []
        if len(rows) != len(alone_rows) or any(_logprobs_differ(a, b) for a, b in zip(rows, alone_rows)):
            return f"{name} {rows} != alone {alone_rows}"
    if (got.embedding is None) != (alone.embedding is None):
        return f"embedding {'none' if got.embedding is None else 'given'}, alone the other way"
    if got.embedding is not None:
        if len(got.embedding) != len(alone.embedding):
            return f"embedding of {len(got.embedding)} values != alone {len(alone.embedding)}"
        worst = max(abs(x - y) for x, y in zip(got.embedding, alone.embedding))
        if worst > EMBEDDING_TOLERANCE:
            return f"embedding differs from alone by up to {worst:.3g}"
    return None


class DeltaSink:
    """Collects the scheduler's deltas as they were when emitted (a copy, as the server's IPC makes one).

    Problems: a delta after its request's finish, and a delta the scheduler changed after emitting it (the
    in-process Engine reads deltas on another thread, later: it would see the change). ``check_unchanged``
    compares the emitted objects with the copies.
    """

    def __init__(self) -> None:
        self.deltas: dict[str, list[ReqDelta]] = {}
        self.finished: dict[str, FinishReason] = {}
        self.problems: list[str] = []
        self.newly_finished: list[str] = []
        self.replies: list[ControlOut] = []  # answers to control calls (flushes)
        self._emitted: list[tuple[ReqDelta, bytes]] = []

    def __call__(self, batch: BatchTokenOut | ControlOut) -> None:
        if isinstance(batch, ControlOut):
            self.replies.append(batch)
            return
        for delta in batch.deltas:
            if delta.rid in self.finished:
                self.problems.append(f"{delta.rid}: a delta after its finish ({delta.finish_reason})")
                continue
            encoded = _ENCODER.encode(delta)
            self._emitted.append((delta, encoded))
            delta = _DECODER.decode(encoded)
            self.deltas.setdefault(delta.rid, []).append(delta)
            if delta.finish_reason is not None:
                self.finished[delta.rid] = delta.finish_reason
                self.newly_finished.append(delta.rid)

    def check_unchanged(self) -> None:
        for delta, encoded in self._emitted:
            if _ENCODER.encode(delta) != encoded:
                now = _DECODER.decode(_ENCODER.encode(delta))
                then = _DECODER.decode(encoded)
                changed = [f for f in ReqDelta.__struct_fields__ if getattr(now, f) != getattr(then, f)]
                self.problems.append(f"{delta.rid}: the scheduler changed {changed} of a delta after emitting it")

    def output(self, rid: str) -> list[int]:
        return [t for d in self.deltas.get(rid, []) for t in d.new_ids]

    def outcome(self, rid: str) -> Outcome:
        deltas = self.deltas.get(rid, [])
        input_logprobs = next((d.input_logprobs for d in deltas if d.input_logprobs is not None), None)
        output_logprobs = [x for d in deltas for x in (d.output_logprobs or [])]
        embedding = next((d.embedding for d in deltas if d.embedding is not None), None)
        ids_rows = [row for d in deltas for row in (d.output_token_ids_logprobs or [])]
        input_ids_rows = next((d.input_token_ids_logprobs for d in deltas if d.input_token_ids_logprobs is not None),
                              None)
        return Outcome(self.output(rid), self.finished.get(rid), output_logprobs, input_logprobs, embedding,
                       ids_rows, input_ids_rows)


class SoloOracle:
    def __init__(self, world: World) -> None:
        self.world = world
        self.memo: dict[tuple, Outcome] = {}
        self.runs = 0

    def run(self, spec: SimRequest, prompt: list[int], jump_forward: bool, vocab_size: int,
            copying: bool = False, long_rope_from: int = 0, pooling: str = "") -> Outcome:
        """``vocab_size``: the logits' width in the run compared (sampling noise is drawn over the whole row);
        ``copying``, ``long_rope_from`` and ``pooling``: the fake model's (the solo run never speculates)."""
        key = (tuple(prompt), msgspec.json.encode(spec.params), spec.grammar, spec.return_logprob,
               spec.logprob_start_len, spec.top_logprobs_num, str(spec.token_ids_logprob), jump_forward, vocab_size,
               copying, spec.lora_path, long_rope_from, spec.embed and pooling)
        outcome = self.memo.get(key)
        if outcome is None:
            outcome = self.memo[key] = self._run(spec, prompt, jump_forward, vocab_size, copying, long_rope_from,
                                                 pooling)
        return outcome

    def _run(self, spec: SimRequest, prompt: list[int], jump_forward: bool, vocab_size: int,
             copying: bool, long_rope_from: int, pooling: str) -> Outcome:
        self.runs += 1
        num_pages = math.ceil((len(prompt) + spec.params.max_new_tokens) / SOLO_PAGE_SIZE) + 4
        knobs = Knobs(page_size=SOLO_PAGE_SIZE, radix_cache=False, partial_page_reuse=False,
                      chunked_prefill_size=len(prompt) + spec.params.max_new_tokens + 1, jump_forward=jump_forward,
                      copying=copying, long_rope_from=long_rope_from, embeddings=pooling)
        sink = DeltaSink()
        scheduler, _ = build_scheduler(self.world, knobs, num_pages, sink, vocab_size)
        scheduler.submit(generate_req(spec, prompt))
        for _ in range(10 * (spec.params.max_new_tokens + 10)):
            scheduler.step()
            if scheduler.idle:
                break
        else:
            raise RuntimeError(f"{spec.rid} did not finish alone")
        return sink.outcome(spec.rid)
