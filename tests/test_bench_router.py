"""`radixrt bench serving` through sglang-router: per-worker cache stats add up to the bench's totals.

The router fixture (sglang-router, cache_aware, two `radixrt serve` workers) is test_sglang_router's.
"""

from __future__ import annotations

import json

import pytest

from radixrt.bench.commands import main
from radixrt.bench.workers import WorkerStats, _urls, format_workers, parse_prometheus, router_workers, total
from test_sglang_router import router  # noqa: F401  (the fixture)


def test_parse_prometheus_and_router_listings():
    text = ('# HELP x y\n# TYPE x counter\nsglang:prompt_tokens_total{model_name="m,\\"1"} 12\n'
            'radixrt_x{le="0.5",model_name="m"} 3\nplain 1\n')
    assert parse_prometheus(text) == {"sglang:prompt_tokens_total": 12.0, 'radixrt_x{le="0.5"}': 3.0, "plain": 1.0}
    assert _urls({"urls": ["http://a", "http://b"]}) == ["http://a", "http://b"]
    assert _urls({"workers": [{"url": "http://a"}, {"url": "http://b", "model_id": "m"}]}) == ["http://a", "http://b"]
    assert _urls({"status": "ok"}) == []


def test_worker_stats_hit_rate_and_total():
    a, b = WorkerStats("a", 2, 100, 60), WorkerStats("b", 1, 50, 0)
    t = total([a, b])
    assert (t.requests, t.prompt_tokens, t.cached_tokens) == (3, 150, 60)
    assert t.hit_rate == pytest.approx(0.4)
    assert a.minus(WorkerStats("a", 1, 40, 10)).to_dict() == {"url": "a", "requests": 1, "prompt_tokens": 60,
                                                              "cached_tokens": 50, "hit_rate": 0.833333}
    assert format_workers([a, b]).splitlines()[-1].split("|")[-1].strip() == "0.400"


@pytest.mark.model
@pytest.mark.slow
def test_bench_serving_through_the_router(router, tmp_path, capsys):  # noqa: F811
    url, workers = router
    assert sorted(u.rstrip("/") for u in router_workers(url)) == sorted(w.url for w in workers)
    out = tmp_path / "bench.json"
    code = main(["bench", "serving", "--url", url, "--workload", "shared-prefix", "--num-prompts", "6",
                 "--prefix-len", "48", "--question-len", "8", "--output-len", "3", "--max-concurrency", "2",
                 "--no-progress", "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "failed requests: 0" in printed
    written = json.loads(out.read_text())
    summary, stats = written["runs"][0], written["context"]["worker_stats"][:-1]
    assert written["context"]["worker_stats"][-1]["url"] == "total"
    assert sorted(s["url"].rstrip("/") for s in stats) == sorted(w.url for w in workers)
    assert summary["failed"] == 0 and summary["requests"] == 6
    assert sum(s["requests"] for s in stats) == summary["requests"]
    assert sum(s["prompt_tokens"] for s in stats) == summary["input_tokens"]
    assert sum(s["cached_tokens"] for s in stats) == summary["cached_tokens"]
    assert summary["cached_tokens"] > 0  # six prompts share a 48-token prefix
    for s in stats:
        assert s["hit_rate"] == pytest.approx(s["cached_tokens"] / s["prompt_tokens"] if s["prompt_tokens"] else 0,
                                              abs=1e-6)
