"""/metrics under SGLang's names with a `model_name` label, and the monitoring example that reads it: every
metric the Grafana dashboard in examples/monitoring queries is in a live server's exposition, and the
Prometheus example scrapes that server's address and path."""

from __future__ import annotations

import json
import pathlib
import re

import openai
import pytest
import yaml

from radixrt.bench.workers import parse_prometheus

pytestmark = pytest.mark.model

SERVER_ARGS = ["--dtype", "float32", "--kv-memory-gb", "0.05", "--log-interval", "0", "--served-model-name",
               "smol-metrics"]
MONITORING = pathlib.Path(__file__).resolve().parents[1] / "examples" / "monitoring"
SGLANG_DOCUMENTED = ["sglang:prompt_tokens_total", "sglang:generation_tokens_total", "sglang:cache_hit_rate",
                     "sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage", "sglang:gen_throughput",
                     "sglang:num_used_tokens", "sglang:time_to_first_token_seconds_bucket",
                     "sglang:time_per_output_token_seconds_bucket", "sglang:e2e_request_latency_seconds_bucket"]
METRIC = re.compile(r"\b((?:sglang:|radixrt_)[a-z0-9_]+)")


@pytest.fixture(scope="module")
def exposition(server, http):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    for _ in range(2):  # the second is served from the prefix cache
        client.chat.completions.create(model="smol-metrics", max_tokens=6, temperature=0,
                                       messages=[{"role": "user", "content": "List three colors."}])
    res = http.get("/metrics")
    assert res.status_code == 200 and res.headers["content-type"].startswith("text/plain")
    return res.text


def _sample_names(text: str) -> set[str]:
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def test_sglang_s_documented_metrics_carry_the_model_name(exposition):
    samples = [line for line in exposition.splitlines() if line and not line.startswith("#")]
    assert samples and all('model_name="smol-metrics"' in line for line in samples)
    names = _sample_names(exposition)
    for name in SGLANG_DOCUMENTED:
        assert name in names, name
    values = parse_prometheus(exposition)
    assert values["sglang:prompt_tokens_total"] > 0 and values["sglang:generation_tokens_total"] == 12
    assert values["sglang:num_requests_total"] == 2 and values["sglang:cached_tokens_total"] > 0
    assert 0 < values["sglang:cache_hit_rate"] < 1 and values["sglang:gen_throughput"] > 0
    assert values["sglang:num_running_reqs"] == values["sglang:num_queue_reqs"] == 0
    assert values["sglang:time_to_first_token_seconds_count"] == 2
    assert values["sglang:time_per_output_token_seconds_count"] == 2
    assert values["sglang:max_total_num_tokens"] == values["radixrt_pages_total"] * 16
    assert 'sglang:time_to_first_token_seconds_bucket{le="+Inf"}' in values
    # what SGLang names is not also exported under radixrt's old names
    assert not {"radixrt_prompt_tokens_total", "radixrt_num_running_reqs", "radixrt_cache_hit_rate"} & names


def test_every_metric_the_dashboard_queries_is_exposed(exposition):
    dashboard = json.loads((MONITORING / "grafana.json").read_text())
    queries = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    queries += [v["definition"] for v in dashboard["templating"]["list"] if v.get("definition")]
    wanted = {name for query in queries for name in METRIC.findall(query)}
    assert len(wanted) >= 20 and set(SGLANG_DOCUMENTED) - {"sglang:num_used_tokens"} <= wanted
    missing = sorted(wanted - _sample_names(exposition))
    assert not missing, f"the dashboard queries metrics /metrics lacks: {missing}"
    labels = {label for query in queries for label in re.findall(r"(\w+)=~", query)}
    assert labels == {"model_name", "instance"}  # model_name from the server, instance from Prometheus


def test_the_prometheus_example_scrapes_the_default_server():
    config = yaml.safe_load((MONITORING / "prometheus.yaml").read_text())
    job = config["scrape_configs"][0]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == ["127.0.0.1:30000"]  # `radixrt serve`'s default host and port
    compose = yaml.safe_load((MONITORING / "compose.yaml").read_text())
    mounts = compose["services"]["grafana"]["volumes"]
    assert any(m.startswith("./grafana.json:") for m in mounts)
