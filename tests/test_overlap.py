"""The overlap scheduler through the Engine on the default model: the same outputs as the synchronous loop.

On a GPU it is on by default (decode step N+1 launched before step N's tokens are read back); here
``enable_overlap_schedule`` turns it on over the CPU path, and every kind of request must come out exactly as
without it: greedy and seeded sampling, stop strings and tokens, length limits, and the requests that keep the
synchronous loop (constraints, logprobs, penalties, min_new_tokens), alone and mixed in one batch.
"""

import pytest

import radixrt

pytestmark = pytest.mark.model

OPTIONS = dict(dtype="float32", log_interval=0, debug_checks=True, kv_memory_gb=0.3)
PROMPTS = ["The capital of France is", "List three colors:", "def fibonacci(n):", "Once upon a time",
           "The sky is", "1, 2, 3, 4,"]
PARAMS = [
    {"max_new_tokens": 24, "temperature": 0},
    {"max_new_tokens": 16, "temperature": 0.8, "top_p": 0.9, "seed": 11, "ignore_eos": True},
    {"max_new_tokens": 30, "temperature": 0, "stop": ["\n\n"]},
    {"max_new_tokens": 20, "temperature": 1.0, "top_k": 20, "min_p": 0.05, "seed": 3},
    {"max_new_tokens": 12, "temperature": 0, "regex": "(blue|grey|black)[.]"},
    {"max_new_tokens": 10, "temperature": 0, "frequency_penalty": 0.5, "min_new_tokens": 6},
]


def _outputs(engine, prompts, params, **kw):
    results = engine.generate(prompts, params, **kw)
    return [(r["output_ids"], r["meta_info"]["finish_reason"]) for r in results]


@pytest.fixture(scope="module")
def engines(default_model_path):
    with radixrt.Engine(**OPTIONS) as sync, radixrt.Engine(**OPTIONS, enable_overlap_schedule=True) as overlap:
        yield sync, overlap


def test_overlap_is_on_only_where_asked(engines):
    sync, overlap = engines
    assert not sync.scheduler.overlap and overlap.scheduler.overlap


def test_mixed_batch_equals_the_synchronous_loop(engines):
    sync, overlap = engines
    assert _outputs(overlap, PROMPTS, PARAMS) == _outputs(sync, PROMPTS, PARAMS)


def test_simple_batch_launches_ahead_and_equals_the_synchronous_loop(engines):
    sync, overlap = engines
    simple = PARAMS[:4]
    before = overlap.scheduler.launched_steps
    assert _outputs(overlap, PROMPTS[:4], simple) == _outputs(sync, PROMPTS[:4], simple)
    assert overlap.scheduler.launched_steps - before >= 10


def test_a_step_continuing_every_row_reuses_the_sampling_parameters(engines, monkeypatch):
    """A continued step that keeps every row of the launched one samples with that step's parameter tensors (no
    rebuild, no copy to the device); one that drops a finished row builds them anew, and the tokens stay right."""
    from radixrt.sampling.sampler import SamplingBatch

    sync, overlap = engines
    builds = []
    real = SamplingBatch.build.__func__
    monkeypatch.setattr(SamplingBatch, "build", classmethod(lambda cls, *a, **kw: builds.append(1) or real(cls, *a, **kw)))
    params = [{"max_new_tokens": 16, "temperature": 0.8, "seed": 5, "ignore_eos": True},
              {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True},
              {"max_new_tokens": 10, "temperature": 1.0, "top_k": 20, "seed": 9, "ignore_eos": True}]
    before = overlap.scheduler.launched_steps
    ours = _outputs(overlap, PROMPTS[:3], params)
    launched = overlap.scheduler.launched_steps - before
    assert launched >= 12 and len(builds) <= 4, (launched, len(builds))
    monkeypatch.undo()
    assert ours == _outputs(sync, PROMPTS[:3], params)


def test_logprob_requests_equal_the_synchronous_loop(engines):
    sync, overlap = engines
    kw = dict(return_logprob=True, top_logprobs_num=2)
    params = {"max_new_tokens": 8, "temperature": 0}
    ours, ref = (e.generate(PROMPTS[:2], params, **kw) for e in (overlap, sync))
    assert [r["meta_info"]["output_token_logprobs"] for r in ours] == \
        [r["meta_info"]["output_token_logprobs"] for r in ref]


def test_streaming_and_aborts_under_overlap(engines):
    sync, overlap = engines
    params = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
    chunks = [c["output_ids"] for c in overlap.generate(PROMPTS[0], params, stream=True)]
    assert all(a == b[: len(a)] for a, b in zip(chunks, chunks[1:]))  # each chunk extends the previous
    assert chunks[-1] == sync.generate(PROMPTS[0], params)["output_ids"]
    stream = overlap.generate(PROMPTS[1], {**params, "max_new_tokens": 200}, stream=True)
    for _ in range(3):
        next(stream)
    stream.close()  # the client goes away: the request is aborted with a step in flight
    assert overlap.generate(PROMPTS[2], params)["output_ids"] == sync.generate(PROMPTS[2], params)["output_ids"]
    assert overlap.flush_cache()  # nothing left running or holding pages
