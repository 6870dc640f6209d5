"""Randomized workloads for the scheduler simulation: the knobs, and the requests they generate from a seed.

``Knobs`` are what a failure shrinks over (hypothesis strategies draw them; ``Knobs.from_seed`` draws them
for the soak): the server options (page size, policy, chunk size, caches, mixed chunk, jump-forward), the
pool's oversubscription, and switches for each request feature. ``generate(knobs, world)`` is a pure
function of the knobs: the same knobs give the same requests, arrival steps and pool size.

Request shapes (mixed until ``num_requests``): single prompts; few-shot (one long preamble, different
questions); trees (forks of forks of a document); multi-turn conversations (each turn's prompt is the
previous turn's prompt + its output + a new message, submitted some steps after the previous turn ends; with
``sessions``, in a session of their own: a turn sends only its message and continues the previous turn by rid);
``n`` > 1 (n requests with the same prompt, seeds ``seed + i``, as the Engine expands them).
Per request: greedy or seeded sampling (top-k/top-p/min-p), ignore_eos, min_new_tokens, stop strings,
stop_token_ids, penalties, a regex or choices constraint (or one that does not compile), prompt and output
logprobs, an abort: on arrival, while queued, mid-prefill, mid-decode, after a retraction, or late; with
``priorities``, a priority whose gaps exceed the preemption threshold (urgent requests preempt running ones); with
``lora``, one of three LoRA adapters or none (the fake model writes K/V that depends on the adapter, so a prefix
shared across adapters changes the outputs) and a cache isolation key or none, with at most
``max_loras_per_batch`` adapters a batch. With ``long_rope_from``, the fake model rotates long (its K/V differs)
the sequences longer than that: prompts past it, and requests computed again when their outputs outgrow it.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass, field, fields

from radixrt.bench.sim.world import BAD_REGEX, CHOICES, REGEXES, World
from radixrt.sampling.params import SamplingParams

POLICIES = ("lpm", "dfs-weight", "fcfs")
PAGE_SIZES = (1, 4, 16)
PRIORITIES = (None, 0, 0, 5, 20, -20, 40)  # the default preemption threshold is 10
ADAPTERS = (None, "lora1", "lora2", "lora3")  # the fake runner's adapters (fake_runner.FakeAdapters)
CACHE_KEYS = (None, None, "tenant-a", "tenant-b")
CHUNK_SIZES = (8, 16, 32, 64, 256, 2048)
ABORT_KINDS = ("arrival", "queued", "prefill", "decode", "retracted", "late")


@dataclass(frozen=True)
class Knobs:
    seed: int = 0
    num_requests: int = 12
    page_size: int = 4
    oversubscription: float = 10.0  # pages all requests need at once / pages in the pool
    chunked_prefill_size: int = 64
    schedule_policy: str = "lpm"
    enable_mixed_chunk: bool = False
    radix_cache: bool = True
    partial_page_reuse: bool = True
    jump_forward: bool = True
    max_running_requests: int = 16
    max_new_tokens: int = 24  # the longest output a request asks for
    arrival_span: int = 30  # steps over which the first requests of each shape arrive
    aborts: bool = True
    constrained: bool = True
    constrained_share: float = 0.15  # of the requests, when constrained
    stops: bool = True
    sampled: bool = True
    multi_turn: bool = True
    n_samples: bool = True
    logprobs: bool = True
    flushes: bool = True
    priorities: bool = False
    overlap: bool = False  # the overlap scheduler (decode step N+1 launched before step N is read back)
    speculative: bool = False  # speculative decoding (NGRAM drafts verified in the scheduler's batches)
    copying: bool = False  # the fake model often copies earlier text (so drafts get accepted), solo runs too
    sessions: bool = False  # a multi-turn conversation runs in a session: later turns continue it by rid
    lora: bool = False  # requests through LoRA adapters (and with cache isolation keys)
    max_loras_per_batch: int = 8
    long_rope_from: int = 0  # the fake model's LongRoPE original context (0: none): longer sequences rotate long
    # a pooling method ("last", "mean", "cls"): a quarter of the requests no turn continues are embedding requests
    # (not drawn by ``from_seed``: they would lower the memory pressure the other knobs' seeds are known to make)
    embeddings: str = ""
    # pauses (in place or retracting) and updates of weights (to the same rules: outputs stay the solo runs') between
    # steps (radixrt.scheduler.weights)
    pauses: bool = False

    @classmethod
    def from_seed(cls, seed: int, **overrides) -> "Knobs":
        """Every knob drawn from ``seed`` (the soak's workloads); ``overrides`` pin some."""
        rng = random.Random(f"knobs-{seed}")
        knobs = cls(
            seed=seed,
            num_requests=rng.choice((rng.randint(2, 12), rng.randint(12, 24), rng.randint(24, 48))),
            page_size=rng.choice(PAGE_SIZES),
            oversubscription=rng.choice((1.0, 3.0, 10.0, 10.0, 10.0)),
            chunked_prefill_size=rng.choice(CHUNK_SIZES),
            schedule_policy=rng.choice(POLICIES),
            enable_mixed_chunk=rng.random() < 0.5,
            radix_cache=rng.random() < 0.85,
            partial_page_reuse=rng.random() < 0.7,
            jump_forward=rng.random() < 0.7,
            max_running_requests=rng.choice((2, 4, 16, 64)),
            max_new_tokens=rng.choice((4, 16, 24, 40)),
            arrival_span=rng.choice((0, 10, 30, 80)),
            # Grammars widen the logits to the whole vocabulary (see world.py): a quarter of the seeds.
            constrained=rng.random() < 0.25,
            **{name: rng.random() < 0.85 for name in ("aborts", "stops", "sampled", "multi_turn", "n_samples",
                                                        "logprobs", "flushes")},
        )
        # Drawn apart, so that adding the knob left every other knob of a seed as it was.
        knobs = knobs.replace(priorities=random.Random(f"priorities-{seed}").random() < 0.5,
                              overlap=random.Random(f"overlap-{seed}").random() < 0.5)
        speculative = random.Random(f"speculative-{seed}").random() < 0.5
        knobs = knobs.replace(speculative=speculative, copying=speculative,
                              sessions=random.Random(f"sessions-{seed}").random() < 0.5)
        lora = random.Random(f"lora-{seed}")
        knobs = knobs.replace(lora=lora.random() < 0.5, max_loras_per_batch=lora.choice((1, 2, 8)))
        knobs = knobs.replace(long_rope_from=random.Random(f"long-rope-{seed}").choice((0, 0, 24, 64)))
        knobs = knobs.replace(pauses=random.Random(f"pauses-{seed}").random() < 0.5)
        return knobs.replace(**overrides)

    def replace(self, **changes) -> "Knobs":
        return Knobs(**{**asdict(self), **changes})

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Knobs":
        values = json.loads(text)
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})


@dataclass
class SimRequest:
    rid: str
    prompt: list[int]  # the whole prompt; for a follow-up turn, what comes after the parent's prompt + output
    params: SamplingParams
    arrival: int  # the step it is submitted at; for a follow-up, steps after its parent finished
    parent: str | None = None
    grammar: tuple[str, str] | None = None
    abort: tuple[str, int] | None = None  # (ABORT_KINDS member, k): see the module doc
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None
    expect_error: str | None = None  # an abort message it must end with (a grammar that does not compile)
    length_bound: int = 0  # prompt tokens at most (follow-ups: through their parents' outputs)
    priority: int | None = None
    lora_path: str | None = None
    cache_key: str | None = None
    embed: bool = False  # an embedding request: its prompt's pooled vector, no tokens


@dataclass
class Workload:
    knobs: Knobs
    requests: list[SimRequest]
    num_pages: int
    flush_steps: list[int] = field(default_factory=list)
    # (step, event) in step order: "pause:retract", "pause:in_place", "pause:wait", "continue", "update",
    # "update:keep-cache", "release:<tags>" (MEMORY_RELEASES), "resume";
    # every pause's continue comes after it, so the run ends unpaused
    gate_events: list[tuple[int, str]] = field(default_factory=list)

    @property
    def uses_grammars(self) -> bool:
        return any(r.grammar is not None for r in self.requests)

    def vocab_size(self, world: World) -> int:
        return world.vocab_size if self.uses_grammars else world.compact_vocab_size


class _Builder:
    def __init__(self, knobs: Knobs, world: World) -> None:
        self.knobs = knobs
        self.world = world
        self.rng = random.Random(f"workload-{knobs.seed}")
        self.requests: list[SimRequest] = []
        self.vocab = world.word_ids + world.punctuation_ids
        self.priority_rng = random.Random(f"priorities-{knobs.seed}")  # apart: other draws stay as they were
        self.lora_rng = random.Random(f"lora-requests-{knobs.seed}")
        self.labels_rng = random.Random(f"token-ids-logprob-{knobs.seed}")

    @property
    def room(self) -> int:
        return self.knobs.num_requests - len(self.requests)

    def tokens(self, low: int, high: int) -> list[int]:
        return [self.rng.choice(self.vocab) for _ in range(self.rng.randint(low, high))]

    def arrival(self) -> int:
        return self.rng.randint(0, self.knobs.arrival_span)

    def params(self, seed: int | None = None, **fixed) -> tuple[SamplingParams, tuple[str, str] | None, str | None]:
        rng, knobs, world = self.rng, self.knobs, self.world
        values: dict = {"max_new_tokens": rng.randint(1, knobs.max_new_tokens) if rng.random() > 0.03 else 0,
                        "temperature": 0.0, "ignore_eos": rng.random() < 0.3}
        if knobs.sampled and (seed is not None or rng.random() < 0.4):
            values.update(temperature=rng.choice((0.7, 1.0, 1.5)), seed=rng.randint(0, 2**31) if seed is None else seed,
                          top_k=rng.choice((-1, -1, 5, 50)), top_p=rng.choice((1.0, 1.0, 0.9)),
                          min_p=rng.choice((0.0, 0.0, 0.05)))
        if rng.random() < 0.15:
            values["min_new_tokens"] = rng.randint(0, min(3, values["max_new_tokens"]))
        if knobs.stops and rng.random() < 0.3:
            values["stop"] = [self.stop_string() for _ in range(rng.randint(1, 2))]
        if knobs.stops and rng.random() < 0.2:
            values["stop_token_ids"] = rng.sample(self.vocab, 6)
        if rng.random() < 0.1:
            values[rng.choice(("repetition_penalty", "frequency_penalty", "presence_penalty"))] = 1.3
        grammar, error = None, None
        if knobs.constrained and rng.random() < knobs.constrained_share:
            pick = rng.random()
            if pick < 0.45:
                values["regex"] = rng.choice(REGEXES)
                grammar = ("regex", values["regex"])
            elif pick < 0.9:
                values["choices"] = list(rng.choice(CHOICES))
                grammar = ("choices", json.dumps(values["choices"]))
            else:
                grammar, error = ("regex", BAD_REGEX), "invalid grammar"
        values.update(fixed)
        return SamplingParams(**values), grammar, error

    def stop_string(self) -> str:
        text = self.world.word_text(self.rng.choice(self.world.word_ids))
        pick = self.rng.random()
        if pick < 0.4:
            return text  # a whole word, leading space included
        if pick < 0.8:
            start = self.rng.randint(1, len(text) - 2)
            return text[start : start + 2]  # two letters: matches inside many words
        return self.rng.choice((".", ",", "\n", " the"))

    def add(self, prompt: list[int], arrival: int, parent: str | None = None, length_bound: int = 0,
            seed: int | None = None, params=None) -> SimRequest:
        rng, knobs = self.rng, self.knobs
        sampling, grammar, error = params if params is not None else self.params(seed)
        req = SimRequest(rid=f"r{len(self.requests)}", prompt=prompt, params=sampling, arrival=arrival, parent=parent,
                         grammar=grammar, expect_error=error, length_bound=length_bound or len(prompt))
        if knobs.logprobs and rng.random() < 0.1:
            req.return_logprob = True
            req.top_logprobs_num = rng.choice((0, 3))
            req.logprob_start_len = rng.choice((-1, 0, len(prompt) // 2)) if parent is None else rng.choice((-1, 0))
            if self.labels_rng.random() < 0.5:  # SGLang's token_ids_logprob, from a stream of its own
                req.token_ids_logprob = self.labels_rng.sample(self.vocab, 2)
        if knobs.aborts and rng.random() < 0.15:
            req.abort = (rng.choice(ABORT_KINDS), rng.randint(0, 6))
        if knobs.priorities:
            req.priority = self.priority_rng.choice(PRIORITIES)
        if knobs.lora:
            req.lora_path, req.cache_key = self.lora_rng.choice(ADAPTERS), self.lora_rng.choice(CACHE_KEYS)
        self.requests.append(req)
        return req

    # ----- request shapes -------------------------------------------------------------------------

    def single(self) -> None:
        self.add(self.tokens(1, 80), self.arrival())

    def few_shot(self) -> None:
        preamble, start = self.tokens(16, 150), self.arrival()
        for _ in range(min(self.rng.randint(2, 5), self.room)):
            self.add(preamble + self.tokens(1, 12), start + self.rng.randint(0, 6))

    def tree(self) -> None:
        start = self.arrival()
        frontier = [self.tokens(8, 60)]
        for _ in range(self.rng.randint(1, 3)):
            frontier = [node + self.tokens(1, 20) for node in frontier for _ in range(self.rng.randint(1, 3))]
            for prompt in frontier:
                if self.room > 0:
                    self.add(prompt, start + self.rng.randint(0, 10))

    def multi_turn(self) -> None:
        first = self.add(self.tokens(4, 60), self.arrival())
        bound = first.length_bound + first.params.max_new_tokens
        for _ in range(min(self.rng.randint(1, 3), self.room)):
            suffix = self.tokens(2, 15)
            turn = self.add(suffix, self.rng.randint(0, 4), parent=first.rid, length_bound=bound + len(suffix))
            bound = turn.length_bound + turn.params.max_new_tokens
            first = turn

    def n_samples(self) -> None:
        prompt, start = self.tokens(2, 60), self.arrival()
        seed = self.rng.randint(0, 2**31) if self.knobs.sampled else None
        shared = self.params(seed)
        for i in range(min(self.rng.randint(2, 4), self.room)):
            params, grammar, error = shared
            if seed is not None:
                params = SamplingParams(**{**_as_dict(params), "seed": seed + i})
            self.add(prompt, start, params=(params, grammar, error))


def _make_embedding_requests(requests: list[SimRequest], rng: random.Random) -> None:
    """A quarter of the requests no turn continues become embedding requests (their aborts kept)."""
    parents = {r.parent for r in requests}
    for req in requests:
        if req.parent is None and req.rid not in parents and rng.random() < 0.25:
            req.embed, req.params, req.grammar, req.expect_error = True, SamplingParams(max_new_tokens=0), None, None
            req.return_logprob, req.logprob_start_len, req.top_logprobs_num = False, -1, 0
            req.token_ids_logprob = None


def _as_dict(params: SamplingParams) -> dict:
    return {f: getattr(params, f) for f in params.__struct_fields__}


def generate(knobs: Knobs, world: World) -> Workload:
    builder = _Builder(knobs, world)
    shapes = [builder.single, builder.few_shot, builder.tree]
    if knobs.multi_turn:
        shapes.append(builder.multi_turn)
    if knobs.n_samples:
        shapes.append(builder.n_samples)
    while builder.room > 0:
        builder.rng.choice(shapes)()
    requests = builder.requests
    if knobs.embeddings:
        _make_embedding_requests(requests, random.Random(f"embedding-requests-{knobs.seed}"))
    page_size = knobs.page_size
    needs = [math.ceil((r.length_bound + r.params.max_new_tokens) / page_size) for r in requests]
    # Every request must fit alone (the scheduler rejects one that needs more than the pool, plus a page).
    num_pages = max(max(needs) + 2, math.ceil(sum(needs) / knobs.oversubscription))
    flushes = sorted(builder.rng.sample(range(knobs.arrival_span + 40), 3)) if knobs.flushes else []
    return Workload(knobs, requests, num_pages, flushes, _gate_events(knobs))


MEMORY_RELEASES = ("all", "kv_cache", "weights", "weights+kv_cache", "cuda_graph")  # the tags a release names


def _gate_events(knobs: Knobs) -> list[tuple[int, str]]:
    """Two pause windows and two updates of weights within the arrivals' span, from a stream of their own; the first
    update falls within the first pause (at its first step it comes after it: sorted by step, then name). A window
    that retracts mostly releases memory too, as it starts, and resumes it as it ends."""
    if not knobs.pauses:
        return []
    rng = random.Random(f"gate-{knobs.seed}")
    waits = random.Random(f"gate-wait-{knobs.seed}")  # its own stream: the other draws stay those of before
    memory = random.Random(f"gate-memory-{knobs.seed}")  # so is this one
    horizon, events = knobs.arrival_span + 40, []
    for window in range(2):
        start, length = rng.randrange(horizon), rng.randint(1, 12)
        # the first window holds an update (it runs at once there), the second's is anywhere
        update = start + rng.randrange(length) if window == 0 else rng.randrange(horizon)
        mode = rng.choice(("retract", "in_place"))
        if mode == "in_place" and waits.random() < 0.5:
            mode = "wait"  # vLLM's: paused once the requests in flight are done, or called off by the continue
        events += [(start, "pause:" + mode), (start + length, "continue"),
                   (update, rng.choice(("update", "update:keep-cache")))]
        if mode == "retract" and memory.random() < 0.7:  # nothing holds pages then: the memory can be released
            events += [(start, "release:" + memory.choice(MEMORY_RELEASES)), (start + length, "resume")]
    return sorted(events)
