"""Server lifecycle on one `radixrt serve`: a bounded queue answers 503, and a dead scheduler process makes
/health fail and the server exit non-zero, leaving no processes or ipc files behind."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import httpx
import pytest

from radixrt.bench.workers import parse_prometheus

pytestmark = pytest.mark.model


SERVER_ARGS = ["--dtype", "float32", "--kv-memory-gb", "0.05", "--log-interval", "0",
               "--max-running-requests", "1", "--max-queued-requests", "1"]


def test_full_queue_answers_503_and_recovers(server):
    body = {"text": "Count slowly:", "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}

    async def burst():
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            return await asyncio.gather(*(client.post("/generate", json=body) for _ in range(6)))

    results = asyncio.run(burst())
    codes = sorted(r.status_code for r in results)
    assert codes.count(200) >= 2 and codes.count(503) >= 1 and set(codes) <= {200, 503}, codes
    rejected = next(r for r in results if r.status_code == 503)
    assert "overloaded" in rejected.json()["error"]["message"]
    ok = httpx.post(server.url + "/generate", json=body, timeout=300)
    assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 4
    metrics = httpx.get(server.url + "/metrics").text
    assert parse_prometheus(metrics)["radixrt_requests_rejected_total"] >= 1


def test_scheduler_death_fails_health_and_exits_nonzero(server):
    info = httpx.get(server.url + "/get_server_info").json()
    scheduler, detokenizer = info["pids"]["scheduler"], info["pids"]["detokenizer"]
    pending: dict = {}

    def long_request():
        try:
            pending["res"] = httpx.post(server.url + "/generate", timeout=60, json={
                "text": "Tell a long story:", "sampling_params": {"max_new_tokens": 500, "ignore_eos": True}})
        except httpx.HTTPError as exc:
            pending["res"] = exc

    thread = threading.Thread(target=long_request)
    thread.start()
    time.sleep(1.0)
    os.kill(scheduler, signal.SIGKILL)
    deadline = time.monotonic() + 20
    unhealthy = False
    while time.monotonic() < deadline and not unhealthy:
        try:
            unhealthy = httpx.get(server.url + "/health", timeout=5).status_code == 503
        except httpx.HTTPError:
            unhealthy = True  # already gone
        time.sleep(0.1)
    assert unhealthy
    code = server.proc.wait(timeout=30)
    assert code != 0
    thread.join(timeout=30)
    res = pending.get("res")
    assert isinstance(res, httpx.HTTPError) or res.status_code == 503, res
    assert not alive(detokenizer) and not alive(scheduler)
    assert not os.path.exists(info["ipc_dir"])


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
