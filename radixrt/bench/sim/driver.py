"""Runs one workload through the real Scheduler over a FakeRunner, step by step, and checks it.

After every step: ``scheduler.check()`` (page accounting and the radix tree's own invariants), and the KV
read-back check: every running request's computed positions, and every tree page, hold exactly the token
ids the scheduler believes they hold. At the end: every request finished (stop/length) or was aborted with
a reason it was expected to get; no delta after a request's finish; each request's deltas concatenate to
its final output; once idle nothing is private, locked or leaked (free + evictable == total, and a flush
frees everything); and every finished request's output (ids, finish reason, logprobs) equals the same
request run alone on a large pool with the radix cache off (``SoloOracle``). An aborted request's emitted
tokens must be a prefix of its solo output (its text, for a constrained request under jump-forward). With
``pauses`` the run is paused (in place or retracting) and its weights updated (to the same rules) between steps, and
its memory released and resumed while paused; no control call fails but as its caller's error.

The first crash or broken invariant ends the run; ``SeedResult.failures`` lists what went wrong as
``(kind, message)``, ``kind`` being what the shrinker keeps constant while it simplifies the knobs.
"""

from __future__ import annotations

import logging
import traceback
from dataclasses import dataclass, field

from radixrt.bench.sim.fake_runner import stored_id
from radixrt.bench.sim.oracle import DeltaSink, SoloOracle, build_scheduler, generate_req, same_outcome
from radixrt.bench.sim.workload import Knobs, SimRequest, Workload, generate
from radixrt.bench.sim.world import World, load_world
from radixrt.memory.radix_cache import LONG_ROPE_BIT, NAMESPACE_STRIDE
from radixrt.protocol.messages import (
    AbortReq,
    ContinueReq,
    ControlReq,
    FinishReason,
    FlushCacheReq,
    PauseReq,
    ReleaseMemoryReq,
    ResumeMemoryReq,
    SessionParams,
    UpdateWeightsReq,
)

LATE_ABORT_STEPS = 5  # a "late" abort with k fires 5 * k + 1 steps after submission, whatever the state


class SimFailure(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message


@dataclass
class SeedResult:
    knobs: Knobs
    steps: int = 0  # scheduler steps taken, idle ones included
    busy_steps: int = 0  # steps that ran a forward
    tokens: int = 0  # tokens the fake model computed
    requests: int = 0
    aborts: int = 0  # requests that ended aborted (by an AbortReq or an expected error)
    retractions: int = 0  # under memory pressure
    preemptions: int = 0  # for a more urgent request
    evicted_pages: int = 0
    pages_leaked: int = 0
    jump_forwards: int = 0
    launched_steps: int = 0  # decode steps the overlap scheduler launched ahead of their tokens
    spec_verify_steps: int = 0  # speculative decoding: request verify steps
    spec_accepted_tokens: int = 0  # draft tokens that became output
    session_turns: int = 0  # conversation turns that continued a session's earlier turn by rid
    long_rope_restarts: int = 0  # requests computed again, rotated long, when their outputs outgrew the context
    embeddings: int = 0  # embedding requests that finished with their vector
    token_id_logprobs: int = 0  # finished requests that reported token_ids_logprob rows
    weight_updates: int = 0  # updates of weights that ran (``pauses``)
    memory_releases: int = 0  # releases of memory that ran (``pauses``)
    seconds: float = 0.0
    failures: list[tuple[str, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def crashed(self) -> bool:
        return any(kind.startswith("crash") for kind, _ in self.failures)


class _ErrorLog(logging.Handler):
    """Keeps the traceback of each error the scheduler logs (it turns request faults into 500 aborts)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.errors: dict[str | None, str] = {}

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info and record.exc_info[1] is not None:
            rid = record.args[0] if isinstance(record.args, tuple) and record.args else None
            self.errors[rid if isinstance(rid, str) else None] = "at " + _short_trace(record.exc_info[1])


class Simulation:
    def __init__(self, workload: Workload, world: World, oracle: SoloOracle, max_steps: int) -> None:
        self.workload = workload
        self.knobs = workload.knobs
        self.world = world
        self.oracle = oracle
        self.max_steps = max_steps
        self.sink = DeltaSink()
        self.vocab_size = workload.vocab_size(world)
        self.scheduler, self.runner = build_scheduler(world, self.knobs, workload.num_pages, self.sink, self.vocab_size)
        self.result = SeedResult(self.knobs, requests=len(workload.requests))
        self.due: list[tuple[int, int, SimRequest]] = sorted(
            (r.arrival, i, r) for i, r in enumerate(workload.requests) if r.parent is None)
        self.children = {r.parent: r for r in workload.requests if r.parent is not None}
        self.prompts: dict[str, list[int]] = {}
        self.submitted_at: dict[str, int] = {}
        self.armed: dict[str, tuple[str, int]] = {}
        self.gate_events = list(workload.gate_events)
        self.reqs: dict = {}  # rid -> the scheduler's Req, captured while it is queued or running
        self.session_of: dict[str, str] = {}  # rid of a conversation's turn -> its session (``sessions``)
        self.step = 0

    # ----- driving --------------------------------------------------------------------------------

    def run(self) -> SeedResult:
        logger = logging.getLogger("radixrt.scheduler")
        log, propagate = _ErrorLog(), logger.propagate
        self.errors = log.errors
        logger.addHandler(log)
        logger.propagate = False  # the failure report carries the traceback
        try:
            return self._run()
        finally:
            logger.removeHandler(log)
            logger.propagate = propagate

    def _run(self) -> SeedResult:
        try:
            while self.due or self.armed or self.gate_events or not self.scheduler.idle:
                if self.step >= self.max_steps:
                    raise SimFailure("hang", f"not idle after {self.max_steps} steps: "
                                     f"{len(self.scheduler.running)} running, {len(self.scheduler.waiting)} waiting")
                self._submit_due()
                self._fire_aborts()
                self._step()
            self._check_idle()
            self._check_outputs()
            self._check_replies()
        except SimFailure as failure:
            self.result.failures.append((failure.kind, failure.message))
        self.sink.check_unchanged()
        self.result.failures.extend(("delta", p) for p in self.sink.problems)
        self.result.steps = self.step
        self.result.tokens = self.runner.tokens
        self.result.retractions = self.scheduler.num_retractions
        self.result.preemptions = self.scheduler.admission.num_preemptions
        self.result.evicted_pages = self.scheduler.cache.stats.evicted_pages
        self.result.jump_forwards = self.scheduler.jump_forwards
        self.result.launched_steps = self.scheduler.launched_steps
        self.result.long_rope_restarts = self.scheduler.admission.num_long_rope_restarts
        stats = self.scheduler.stats()
        self.result.spec_verify_steps = stats.spec_verify_steps
        self.result.spec_accepted_tokens = stats.spec_accepted_tokens
        self.result.aborts = sum(1 for r in self.sink.finished.values() if r.type == "abort")
        outcomes = [self.sink.outcome(rid) for rid in self.sink.finished]
        self.result.embeddings = sum(1 for o in outcomes if o.embedding is not None)
        self.result.token_id_logprobs = sum(1 for o in outcomes if o.output_token_ids_logprobs)
        self.result.weight_updates = self.runner.weight_updates
        self.result.memory_releases = self.runner.memory_releases
        return self.result

    def _submit_due(self) -> None:
        while self.due and self.due[0][0] <= self.step:
            _, _, spec = self.due.pop(0)
            prompt = spec.prompt
            if spec.parent is not None:
                prompt = self.prompts[spec.parent] + self.sink.output(spec.parent) + spec.prompt
            self.prompts[spec.rid] = prompt
            self.submitted_at[spec.rid] = self.step
            session = self._session(spec)
            sent = spec.prompt if session is not None and session.rid is not None else prompt
            self.scheduler.submit(generate_req(spec, sent, session))
            if spec.abort is not None:
                if spec.abort[0] == "arrival":
                    self.scheduler.submit(AbortReq(rid=spec.rid))
                else:
                    self.armed[spec.rid] = spec.abort
        if self.step in self.workload.flush_steps:
            self.scheduler.submit(ControlReq(id=self.step, body=FlushCacheReq()))
        while self.gate_events and self.gate_events[0][0] <= self.step:
            _, event = self.gate_events.pop(0)
            kind, _, mode = event.partition(":")
            body = {"pause": lambda: PauseReq(mode), "continue": ContinueReq,
                    "update": lambda: UpdateWeightsReq("sim", flush_cache=mode != "keep-cache"),
                    "release": lambda: ReleaseMemoryReq(None if mode == "all" else mode.split("+")),
                    "resume": ResumeMemoryReq}[kind]()
            self.scheduler.submit(ControlReq(id=self.step, body=body))

    def _session(self, spec: SimRequest) -> SessionParams | None:
        """With ``sessions``, a conversation's turns run in a session: the first opens it; a later turn continues
        the previous one by rid (it sends only its message), or, where that one ended without a record (aborted,
        refused), sends its whole prompt in the session. The world's messages never start with a BOS, which a
        session would drop."""
        if not self.knobs.sessions or (spec.parent is None and spec.rid not in self.children):
            return None
        if spec.parent is None:
            self.session_of[spec.rid] = self.scheduler.open_session()
            return SessionParams(id=self.session_of[spec.rid])
        session_id = self.session_of[spec.rid] = self.session_of[spec.parent]
        if self.sink.finished[spec.parent].type in ("stop", "length"):
            self.result.session_turns += 1
            return SessionParams(id=session_id, rid=spec.parent)
        return SessionParams(id=session_id)

    def _fire_aborts(self) -> None:
        where = {r.rid: ("waiting", r) for r in self.scheduler.waiting}
        where.update({r.rid: ("running", r) for r in self.scheduler.running})
        for rid, (kind, k) in list(self.armed.items()):
            place, req = where.get(rid, (None, None))
            if kind == "late":
                fire = self.step >= self.submitted_at[rid] + LATE_ABORT_STEPS * k + 1
            elif rid in self.sink.finished:
                del self.armed[rid]
                continue
            elif kind == "queued":
                fire = place == "waiting" and req.num_retractions == 0
            elif kind == "retracted":
                fire = place == "waiting" and req.num_retractions > 0
            elif kind == "prefill":
                fire = place == "running" and req.num_computed < len(req.prompt_ids)
            else:  # decode
                fire = place == "running" and len(req.output_ids) >= max(k, 1)
            if fire:
                self.scheduler.submit(AbortReq(rid=rid))
                del self.armed[rid]

    def _step(self) -> None:
        scheduler = self.scheduler
        try:
            busy = scheduler.step()
        except Exception as exc:  # noqa: BLE001 - a scheduler crash is what the simulation is after
            raise SimFailure(f"crash:{type(exc).__name__}", f"step {self.step}: {_short_trace(exc)}") from None
        self.step += 1
        self.result.busy_steps += bool(busy)
        try:
            scheduler.check()
        except AssertionError as exc:
            raise SimFailure("invariant", f"after step {self.step}: {exc}") from None
        self._check_kv()
        for req in scheduler.waiting + scheduler.running:
            self.reqs.setdefault(req.rid, req)
        for rid in self.sink.newly_finished:
            child = self.children.get(rid)
            if child is not None:
                self.due.append((self.step + child.arrival, 0, child))
                self.due.sort(key=lambda item: item[0])
            elif rid in self.session_of:  # the conversation's last turn: its session closes, its pin goes
                scheduler.close_session(self.session_of[rid])
        self.sink.newly_finished.clear()

    # ----- checks ---------------------------------------------------------------------------------

    def _check_kv(self) -> None:
        runner = self.runner
        for req in self.scheduler.running:
            # under overlap scheduling the token in flight is computed before the host knows it
            ids = [stored_id(t, req.lora_uid) for t in req.fill_ids] if req.lora_uid else req.fill_ids
            bad = runner.kv_mismatches(ids, req.pages, min(req.num_computed, req.total_len), long_rope=req.long_rope)
            if bad:
                raise SimFailure("kv-corruption", f"after step {self.step}: {req.rid} reads wrong KV at positions "
                                 f"{bad[:8]} (pages {req.pages}, {req.num_tree_pages} from the tree)")
        stack = [(node, []) for node in self.scheduler.cache.root.children.values()]
        while stack:
            node, prefix = stack.pop()
            tokens = prefix + list(node.key)
            # a key holds token + namespace * NAMESPACE_STRIDE; the namespace's low 31 bits are the adapter's uid,
            # its bit 31 says the sequence rotates long
            namespace = tokens[0] // NAMESPACE_STRIDE % NAMESPACE_STRIDE
            ids = [stored_id(k % NAMESPACE_STRIDE, namespace % LONG_ROPE_BIT) for k in tokens]
            bad = runner.kv_mismatches(ids, [0] * (len(prefix) // self.knobs.page_size) + node.pages,
                                       len(tokens), first=len(prefix), long_rope=bool(namespace & LONG_ROPE_BIT))
            if bad:
                raise SimFailure("kv-corruption", f"after step {self.step}: tree node {node!r} holds wrong KV at "
                                 f"positions {bad[:8]}")
            stack.extend((child, tokens) for child in node.children.values())

    def _check_idle(self) -> None:
        scheduler, pool, cache = self.scheduler, self.scheduler.pool, self.scheduler.cache
        leaked = pool.num_pages - pool.num_free - cache.evictable_pages
        self.result.pages_leaked = leaked
        if leaked or cache.protected_pages:
            raise SimFailure("leak", f"idle with {leaked} pages in use ({cache.protected_pages} locked in the tree, "
                             f"{pool.num_free} free, {cache.evictable_pages} evictable of {pool.num_pages})")
        try:
            cache.check([])
        except AssertionError as exc:
            raise SimFailure("invariant", f"idle: {exc}") from None
        scheduler.submit(ControlReq(id=-1, body=FlushCacheReq()))
        self._step()
        if pool.num_free != pool.num_pages:
            raise SimFailure("leak", f"a flush while idle left {pool.num_pages - pool.num_free} pages in use")

    def _check_replies(self) -> None:
        """Control calls fail only as the caller's error (an update that would flush pages paused in place)."""
        for reply in self.sink.replies:
            if reply.error is not None and reply.status_code >= 500:
                raise SimFailure("control", f"control call at step {reply.id} failed: {reply.error}")

    def _check_outputs(self) -> None:
        for spec in self.workload.requests:
            rid = spec.rid
            if rid not in self.prompts:
                raise SimFailure("unfinished", f"{rid} was never submitted (its parent never finished)")
            reason = self.sink.finished.get(rid)
            if reason is None:
                raise SimFailure("unfinished", f"{rid} never finished")
            emitted = self.sink.output(rid)
            final = self.sink.deltas[rid][-1]
            if final.completion_tokens != len(emitted):
                raise SimFailure("delta", f"{rid}: deltas hold {len(emitted)} ids, completion_tokens says "
                                 f"{final.completion_tokens}")
            req = self.reqs.get(rid)
            if req is not None and req.output_ids != emitted:
                raise SimFailure("delta", f"{rid}: deltas {emitted} != final output {req.output_ids}")
            if reason.type == "abort":
                self._check_abort(spec, reason, emitted)
            elif reason.type not in ("stop", "length"):
                raise SimFailure("finish", f"{rid}: finish reason {reason}")
            else:
                solo = self.oracle.run(spec, self.prompts[rid], self.knobs.jump_forward, self.vocab_size,
                                       self.knobs.copying, self.knobs.long_rope_from, self.knobs.embeddings)
                problem = same_outcome(self.sink.outcome(rid), solo)
                if problem:
                    raise SimFailure("mismatch", f"{rid}: {problem} (prompt {len(self.prompts[rid])} tokens)")

    def _check_abort(self, spec: SimRequest, reason: FinishReason, emitted: list[int]) -> None:
        message = str(reason.message)
        if reason.status_code == 500 or message.startswith("internal error"):
            where = self.errors.get(spec.rid) or (self.errors.get(None) or "")
            raise SimFailure("crash:isolated", f"{spec.rid} ended in a server error: {message} {where}".strip())
        if spec.expect_error is not None and spec.expect_error in message:
            return
        if message != "aborted" or spec.abort is None:
            raise SimFailure("unexpected-abort", f"{spec.rid}: {reason}")
        if emitted:
            solo = self.oracle.run(spec, self.prompts[spec.rid], self.knobs.jump_forward, self.vocab_size,
                                   self.knobs.copying, self.knobs.long_rope_from, self.knobs.embeddings)
            if spec.grammar is not None and self.knobs.jump_forward:
                # An abort sends the tokens held back for jump-forward as they are; run on, jump-forward
                # may have re-tokenised them ("alpha beta " + "delta" -> "alpha beta" + " delta"): same text.
                decode = self.world.tokenizer.decode
                same = decode(solo.output_ids).startswith(decode(emitted))
            else:
                same = solo.output_ids[: len(emitted)] == emitted
            if not same:
                raise SimFailure("mismatch", f"{spec.rid} (aborted): emitted {emitted}, alone {solo.output_ids}")


def _short_trace(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)[-4:]
    where = " <- ".join(f"{f.name} ({f.filename.rsplit('/', 1)[-1]}:{f.lineno})" for f in reversed(frames))
    return f"{type(exc).__name__}: {exc} in {where}"


def run_seed(knobs: Knobs, world: World | None = None, oracle: SoloOracle | None = None,
             max_steps: int = 20_000) -> SeedResult:
    """Generate the workload of ``knobs`` and simulate it (see the module doc)."""
    import time

    world = world or load_world()
    started = time.perf_counter()
    workload = generate(knobs, world)
    result = Simulation(workload, world, oracle or SoloOracle(world), max_steps).run()
    result.seconds = time.perf_counter() - started
    return result
