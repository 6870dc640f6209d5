"""Greedy outputs do not depend on the cache, the policy, page or chunk size, or concurrency (fp32),
and equal transformers `generate` on the default model."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import radixrt

pytestmark = [pytest.mark.model, pytest.mark.slow]

HEADER = (
    "You are a careful assistant. Answer each question with one short sentence.\n"
    "Q: What color is the sky on a clear day?\nA: It is blue.\n"
    "Q: How many legs does a spider have?\nA: It has eight legs.\n"
)
QUESTIONS = [
    "What is the capital of France?", "Name a large ocean.", "What do bees make?", "Who wrote Hamlet?",
    "What is 2 plus 2?", "What gas do plants absorb?", "Where do penguins live?", "What is ice made of?",
    "How many days are in a week?", "What is the opposite of hot?", "What animal barks?",
    "What is the tallest mountain?", "Why do we sleep?", "What is a triangle?", "Which planet is red?",
    "What do cows drink?",
]
NEW_TOKENS = 10
PARAMS = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}


def prompts(tokenizer) -> list[list[int]]:
    # Every fourth prompt skips the header, so prefixes are shared by most but not all requests.
    texts = [(HEADER if i % 4 else "") + f"Q: {q}\nA:" for i, q in enumerate(QUESTIONS)]
    return [tokenizer.encode(t) for t in texts]


@pytest.fixture(scope="module")
def reference(default_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    model = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32).eval()
    outs = []
    for ids in prompts(tokenizer):
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                                 pad_token_id=tokenizer.pad_token_id)
        outs.append(out[0, len(ids):].tolist())
    return outs


# Each dimension varies at least once; combining some keeps the suite short on two cores.
CONFIGS = {
    "lpm-p16-chunk512": dict(),
    "cache-off": dict(disable_radix_cache=True),
    "dfs-weight-page-size-1": dict(schedule_policy="dfs-weight", page_size=1),
    "fcfs-chunk-16": dict(schedule_policy="fcfs", chunked_prefill_size=16),
    "mixed-chunk-32": dict(chunked_prefill_size=32, enable_mixed_chunk=True),
    "no-partial-reuse-p4": dict(page_size=4, disable_partial_page_reuse=True),
}


def run_engine(engine, batch: list[list[int]], concurrency: int) -> list[list[int]]:
    def one(ids):
        return engine.generate(input_ids=ids, sampling_params=PARAMS)["output_ids"]

    if concurrency == 1:
        return [one(ids) for ids in batch]
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, batch))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_concurrent_batch_equals_transformers(default_model_path, reference, name):
    with radixrt.Engine(dtype="float32", log_interval=0, debug_checks=True, kv_memory_gb=0.2,
                        **CONFIGS[name]) as engine:
        batch = prompts(engine.tokenizer)
        # A list input is submitted at once, so the scheduler sees all of them in the same step.
        outs = [r["output_ids"] for r in engine.generate(input_ids=batch, sampling_params=PARAMS)]
        assert outs == reference
        stats = engine.get_stats()
        assert stats["pages_private"] == 0 and stats["pages_protected"] == 0
        if not CONFIGS[name].get("disable_radix_cache"):
            assert stats["cache_hit_tokens"] > 0


@pytest.mark.parametrize("concurrency", [1, 64])
def test_one_or_64_concurrent_requests(default_model_path, reference, concurrency):
    with radixrt.Engine(dtype="float32", log_interval=0, debug_checks=True, kv_memory_gb=0.2,
                        page_size=4) as engine:
        batch = prompts(engine.tokenizer)
        copies = 4 if concurrency == 64 else 1
        outs = run_engine(engine, batch * copies, concurrency)
        assert outs == reference * copies
