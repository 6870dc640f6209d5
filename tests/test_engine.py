"""The in-process Engine on the default model: API, sampling, stop conditions, logprobs, errors."""

import asyncio
import threading

import pytest
import torch

import radixrt
from radixrt.tokenizer import apply_chat_template

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def engine(default_model_path):
    with radixrt.Engine(dtype="float32", log_interval=0, debug_checks=True, kv_memory_gb=0.3) as eng:
        yield eng


def chat(engine, text):
    return apply_chat_template(engine.tokenizer, [{"role": "user", "content": text}])


def test_single_and_batch_shapes(engine):
    one = engine.generate("The sky is", {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
    assert isinstance(one, dict) and len(one["output_ids"]) == 4
    assert one["meta_info"]["completion_tokens"] == 4 and one["meta_info"]["finish_reason"]["type"] == "length"
    assert one["text"] == engine.tokenizer.decode(one["output_ids"])
    many = engine.generate(["a", "b", "c"], {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True})
    assert [len(r["output_ids"]) for r in many] == [2, 2, 2]
    by_ids = engine.generate(input_ids=engine.tokenizer.encode("The sky is"),
                             sampling_params={"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
    assert by_ids["output_ids"] == one["output_ids"]


def test_seeded_sampling_is_reproducible_across_batches(engine):
    params = {"max_new_tokens": 12, "temperature": 1.0, "top_p": 0.9, "seed": 1234, "ignore_eos": True}
    alone = engine.generate("Once upon a time", params)
    crowd = engine.generate(["Once upon a time", "Something else", "Once upon a time"],
                            [params, {**params, "seed": 7}, params])
    assert crowd[0]["output_ids"] == alone["output_ids"] == crowd[2]["output_ids"]
    other = engine.generate("Once upon a time", {**params, "seed": 99})
    assert other["output_ids"] != alone["output_ids"]


def test_n_samples_share_prompt(engine):
    prompt = "List some colors: " * 8
    out = engine.generate(prompt, {"max_new_tokens": 6, "temperature": 1.0, "n": 3, "seed": 5, "ignore_eos": True})
    assert len(out) == 3 and len({tuple(o["output_ids"]) for o in out}) > 1
    assert max(o["meta_info"]["cached_tokens"] for o in out) >= 32


def test_stop_token_ids_and_eos(engine):
    base = engine.generate("1, 2, 3, 4,", {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
    stop_id = base["output_ids"][2]
    cut = engine.generate("1, 2, 3, 4,", {"max_new_tokens": 8, "temperature": 0, "stop_token_ids": [stop_id]})
    first = base["output_ids"].index(stop_id)
    assert cut["output_ids"] == base["output_ids"][: first + 1]
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}


def test_stop_strings_cut_text_exactly(engine):
    prompt = "Numbers: 1, 2, 3, 4, 5, 6, 7, 8"
    full = engine.generate(prompt, {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True})
    text = full["text"]
    stop = text[5:8]
    assert stop and stop in text
    cut = engine.generate(prompt, {"max_new_tokens": 16, "temperature": 0, "stop": stop})
    assert cut["text"] == text[: text.index(stop)]
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    streamed = list(engine.generate(prompt, {"max_new_tokens": 16, "temperature": 0, "stop": [stop]}, stream=True))
    assert streamed[-1]["text"] == cut["text"]
    assert all(stop not in s["text"] for s in streamed)


def test_min_new_tokens_and_max_new_tokens_zero(engine):
    prompt = chat(engine, "Say OK.")
    short = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 64, "temperature": 0})
    n = len(short["output_ids"])
    assert short["meta_info"]["finish_reason"]["type"] == "stop"
    longer = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 64, "temperature": 0,
                                                                "min_new_tokens": n + 3})
    assert len(longer["output_ids"]) >= n + 3
    assert not set(longer["output_ids"][: n + 2]) & engine.eos_ids
    zero = engine.generate("Hello there", {"max_new_tokens": 0})
    assert zero["output_ids"] == [] and zero["meta_info"]["finish_reason"]["type"] == "length"


def test_penalties_change_output(engine):
    prompt = "1 1 1 1 1 1 1 1 1 1 1 1"
    plain = engine.generate(prompt, {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True})
    penalised = engine.generate(prompt, {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True,
                                         "repetition_penalty": 1.5, "frequency_penalty": 1.5,
                                         "presence_penalty": 1.0})
    most_repeated = lambda ids: max(ids.count(t) for t in set(ids))  # noqa: E731
    assert most_repeated(penalised["output_ids"]) < most_repeated(plain["output_ids"])


def test_logprobs_match_transformers(engine, hf_model):
    ids = chat(engine, "Name a fruit.")
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
                          return_logprob=True, logprob_start_len=3, top_logprobs_num=3)
    meta = out["meta_info"]
    full = ids + out["output_ids"]
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([full])).logits[0].float(), -1)
    # output logprobs: token t at position len(ids)+i was predicted from position len(ids)+i-1
    for i, (logprob, token, _) in enumerate(meta["output_token_logprobs"]):
        assert token == out["output_ids"][i]
        assert abs(logprob - ref[len(ids) + i - 1, token].item()) < 1e-3
    assert len(meta["output_top_logprobs"]) == 5
    assert meta["output_top_logprobs"][0][0][1] == out["output_ids"][0]  # greedy picks the top entry
    # prompt logprobs from position 3
    entries = meta["input_token_logprobs"]
    assert [t for _, t, _ in entries] == ids[3:]
    for j, (logprob, token, _) in enumerate(entries):
        assert abs(logprob - ref[3 + j - 1, token].item()) < 1e-3
    assert len(meta["input_top_logprobs"]) == len(entries)


def test_prompt_logprobs_from_zero_despite_cache(engine):
    prompt = "A long shared sentence that will be cached by the first request. " * 3
    engine.generate(prompt, {"max_new_tokens": 1})
    out = engine.generate(prompt, {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0)
    entries = out["meta_info"]["input_token_logprobs"]
    assert entries[0][0] is None and len(entries) == out["meta_info"]["prompt_tokens"]
    assert all(lp is not None and lp <= 0 for lp, _, _ in entries[1:])


def test_bad_requests_raise_clear_errors(engine):
    cases = [
        (dict(prompt=""), "empty"),
        (dict(prompt="hi", sampling_params={"temperature": -1}), "temperature"),
        (dict(prompt="hi", sampling_params={"top_p": 0}), "top_p"),
        (dict(prompt="hi", sampling_params={"max_new_tokens": 10**9}), "context length"),
        (dict(prompt="hi", sampling_params={"bogus": 1}), "unknown field"),
        (dict(input_ids=[10**7]), "outside the vocabulary"),
        (dict(prompt="hi", input_ids=[1]), "exactly one"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            engine.generate(**kwargs)
    assert engine.generate("still serving", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] >= 1


def test_async_and_threads_batch_together(engine):
    async def run():
        results = await asyncio.gather(*[
            engine.async_generate(f"Question {i}:", {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
            for i in range(6)
        ])
        chunks = [c async for c in await engine.async_generate(
            "Stream me", {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}, stream=True)]
        return results, chunks

    results, chunks = asyncio.run(run())
    assert all(len(r["output_ids"]) == 4 for r in results)
    assert len(chunks) >= 1 and chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    outputs = {}

    def worker(i):
        outputs[i] = engine.generate(f"Thread {i}", {"max_new_tokens": 3, "ignore_eos": True, "temperature": 0})

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outputs) == [0, 1, 2, 3]


def test_abort_mid_stream_releases_pages(engine):
    stream = engine.generate("Write a long story.", {"max_new_tokens": 200, "ignore_eos": True}, stream=True)
    next(stream)
    stream.close()  # abandoning the iterator aborts the request
    engine.generate("sync point", {"max_new_tokens": 1})
    stats = engine.get_stats()
    assert stats["num_running"] == 0 and stats["pages_private"] == 0 and stats["pages_protected"] == 0


def test_stats_count_decode_steps_and_their_requests(engine):
    """Steps without prefill chunks: their output tokens, the steps, and the requests in them summed (over the
    steps: the mean decode batch, which falls as a batch's requests finish)."""
    before = engine.get_stats()
    engine.generate(["Count me", "Count me too"], [{"max_new_tokens": n, "ignore_eos": True, "temperature": 0}
                                                  for n in (5, 3)])
    after = engine.get_stats()
    delta = {k: after[k] - before[k] for k in ("decode_tokens", "decode_steps", "decode_requests")}
    # the prefill step gives each its first token; then 2 steps of both, 2 of the longer one alone
    assert delta == {"decode_tokens": 6, "decode_steps": 4, "decode_requests": 6}


def test_flush_cache(engine):
    engine.generate("Flush me " * 10, {"max_new_tokens": 1})
    assert engine.get_stats()["pages_evictable"] > 0
    assert engine.flush_cache() is True
    stats = engine.get_stats()
    assert stats["pages_evictable"] == 0 and stats["pages_free"] == stats["pages_total"]


def test_model_info_has_chat_roles(engine):
    info = engine.get_model_info()
    roles = info["chat_template"]["role_prefix_and_suffix"]
    assert roles["user"] == ["<|im_start|>user\n", "<|im_end|>\n"]
    assert info["chat_template"]["default_system_prompt"].startswith("You are a helpful AI assistant")


def test_prefix_in_chunked_prefill_is_computed_once(default_model_path):
    """A request sharing a prefix with one still in chunked prefill waits for it instead of recomputing it."""
    prefix = [1000 + i for i in range(200)]
    prompts = [prefix + [5, 6, 7], prefix + [8, 9]]
    params = {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}
    with radixrt.Engine(dtype="float32", log_interval=0, debug_checks=True, kv_memory_gb=0.1,
                        chunked_prefill_size=64) as eng:
        out = eng.generate(input_ids=prompts, sampling_params=params)
        # the first request caches its prefix 64 tokens at a time; the second must not start on the rest
        first, second = sorted(o["meta_info"]["cached_tokens"] for o in out)
        assert first == 0 and second >= len(prefix) - 16  # whole pages of the prefix (page size 16)
        alone = eng.generate(input_ids=prompts[1], sampling_params=params)
        assert alone["output_ids"] == out[1]["output_ids"]


@pytest.mark.parametrize("mixed", [False, True])
def test_decodes_wait_for_prefill_unless_mixed_chunk(default_model_path, mixed):
    """Prefill first by default (SGLang's order); --enable-mixed-chunk puts decodes in the prefill steps."""
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    prompts = [[1000 + i for i in range(40)]] + [[2000 + 100 * r + i for i in range(60)] for r in range(3)]
    with radixrt.Engine(dtype="float32", log_interval=0, kv_memory_gb=0.1, chunked_prefill_size=48,
                        enable_mixed_chunk=mixed) as eng:
        steps = []
        forward = eng.runner.forward

        def recording(batch):
            steps.append(batch.extend_lens.tolist())
            return forward(batch)

        eng.runner.forward = recording
        out = eng.generate(input_ids=prompts, sampling_params=params)
        assert [len(o["output_ids"]) for o in out] == [6] * 4
        both = [lens for lens in steps if 1 in lens and max(lens) > 1]
        assert bool(both) == mixed, steps


def test_profile_sees_the_scheduler_threads_operators(engine, tmp_path):
    with pytest.raises(ValueError, match="no profile is running"):
        engine.stop_profile()
    engine.start_profile()
    with pytest.raises(ValueError, match="already running"):
        engine.start_profile()
    engine.generate("The capital of France is", {"max_new_tokens": 4, "temperature": 0})
    ops = engine.stop_profile(trace_dir=str(tmp_path))
    assert sum(op["self_cpu_s"] for name, op in ops.items() if "linear" in name) > 0  # forwards ran on that thread
    assert list(tmp_path.glob("*.trace.json"))
    assert engine.generate("Hi", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2  # serving goes on
