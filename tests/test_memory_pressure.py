"""A tiny KV pool under 30x oversubscription: eviction and retraction, never a crash or a lost request."""

from concurrent.futures import ThreadPoolExecutor

import pytest

import radixrt

pytestmark = [pytest.mark.model, pytest.mark.slow]


def test_oversubscribed_pool_finishes_everything_with_solo_outputs(default_model_path):
    with radixrt.Engine(dtype="float32", log_interval=0, debug_checks=True, page_size=4, max_total_pages=20,
                        max_running_requests=32) as engine:
        prompts = [f"Story {i}: once upon a time there was a" for i in range(32)]
        params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
        needs = [-(-(len(engine.tokenizer.encode(p)) + 24) // 4) for p in prompts]
        assert sum(needs) >= 10 * 20  # the burst needs at least ten times the pool
        alone = [engine.generate(p, params)["output_ids"] for p in prompts[:4]]
        with ThreadPoolExecutor(32) as pool:
            together = list(pool.map(lambda p: engine.generate(p, params), prompts))
        assert all(len(r["output_ids"]) == 24 for r in together)
        assert [r["output_ids"] for r in together[:4]] == alone
        stats = engine.get_stats()
        assert stats["num_retractions"] > 0
        assert stats["pages_private"] == 0 and stats["pages_protected"] == 0
        assert stats["pages_free"] + stats["pages_evictable"] == stats["pages_total"]


def test_request_larger_than_pool_is_rejected(default_model_path):
    with radixrt.Engine(dtype="float32", log_interval=0, page_size=4, max_total_pages=20) as engine:
        with pytest.raises(ValueError, match="KV pages; the pool has 20"):
            engine.generate("hello", {"max_new_tokens": 200})
        assert engine.generate("hello", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] >= 1
