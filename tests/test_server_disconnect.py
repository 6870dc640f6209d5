"""A client that closes its connection mid-generation, streaming or not, has its request aborted within a few
scheduler steps: nothing left running, no KV pages held, and /metrics counts the abort.

The first test pins the mechanism without a model (output arriving every few milliseconds, as on a fast
machine, must not hide a disconnect); the others check it end to end on a real server.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest
from starlette.requests import Request

from radixrt.bench.workers import parse_prometheus
from radixrt.response import ResponseBuilder
from radixrt.server.client_wait import ClientGone, gather
from radixrt.client import Handle, LoopWaker

import shared_server

MAX_NEW = 1500  # far more than the steps the test waits: a request left running would still be decoding
LONG = {"max_new_tokens": MAX_NEW, "ignore_eos": True, "temperature": 0}
CASES = {
    "generate": ("/generate", {"text": "Tell me a very long story.", "sampling_params": LONG}),
    "generate-stream": ("/generate", {"text": "Tell me a very long story.", "sampling_params": LONG,
                                      "stream": True}),
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me a long story."}],
                                      "max_tokens": MAX_NEW, "ignore_eos": True, "temperature": 0}),
    "completions-stream": ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": MAX_NEW,
                                               "ignore_eos": True, "temperature": 0, "stream": True}),
}


class AbortRecorder:
    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort_unfinished(self, states: list[Handle]) -> None:
        self.aborted += [s.rid for s in states if not s.finished]


def test_disconnect_of_a_busy_request_aborts_it_at_once():
    async def scenario() -> float:
        state = Handle("busy", ResponseBuilder("busy", False, 0), LoopWaker(), 0)
        gone = asyncio.Event()
        messages = [{"type": "http.request", "body": b"{}", "more_body": False}]

        async def receive() -> dict:
            if messages:
                return messages.pop()
            await gone.wait()
            return {"type": "http.disconnect"}

        async def tokens() -> None:  # a new output every 5 ms, never finishing
            while True:
                await asyncio.sleep(0.005)
                state.waker.wake()

        request = Request({"type": "http", "method": "POST", "path": "/generate", "headers": []}, receive)
        await request.body()
        tm = AbortRecorder()
        ticker = asyncio.create_task(tokens())
        waiter = asyncio.create_task(gather(request, tm, [state], stream=False))
        await asyncio.sleep(0.1)
        assert not waiter.done() and tm.aborted == []
        closed = asyncio.get_running_loop().time()
        gone.set()
        with pytest.raises(ClientGone):
            await asyncio.wait_for(waiter, 0.5)
        ticker.cancel()
        assert tm.aborted == ["busy"]
        return asyncio.get_running_loop().time() - closed

    assert asyncio.run(scenario()) < 0.1


SERVER_ARGS = shared_server.ARGS  # the session's shared server (tests/shared_server.py)


def send_request(port: int, path: str, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def stats(http) -> dict:
    info = http.get("/get_server_info").json()
    return {**info["stats"], "in_flight": info["requests_in_flight"]}


def metric(http, name: str) -> float:
    samples = parse_prometheus(http.get("/metrics").text)
    assert name in samples, f"{name} not in /metrics"
    return samples[name]


@pytest.mark.model
@pytest.mark.parametrize("case", list(CASES))
def test_closed_connection_aborts_within_steps(server, http, case):
    path, body = CASES[case]
    aborted_before = metric(http, "sglang:num_aborted_requests_total")
    sock = send_request(server.port, path, body)
    try:
        deadline = time.monotonic() + 60
        first = None
        while True:  # decoding has begun and gone a few steps
            s = stats(http)
            if s["num_running"] == 1:
                first = s["steps"] if first is None else first
                if s["steps"] >= first + 3:
                    break
            assert time.monotonic() < deadline, s
            time.sleep(0.05)
        steps_at_close = s["steps"]
    finally:
        sock.close()
    closed_at = time.monotonic()
    while True:
        s = stats(http)
        if s["in_flight"] == 0 and s["num_running"] == 0 and s["num_waiting"] == 0:
            break
        assert time.monotonic() - closed_at < 10, f"still running {time.monotonic() - closed_at:.1f}s after close: {s}"
        time.sleep(0.02)
    # a handful of steps: the stats reply's trip to this client, the close, the abort's trip to the scheduler
    assert s["steps"] - steps_at_close <= 8, (steps_at_close, s)
    assert s["pages_private"] == 0 and s["pages_protected"] == 0, s
    assert s["pages_free"] + s["pages_evictable"] == s["pages_total"], s
    assert metric(http, "sglang:num_aborted_requests_total") == aborted_before + 1
    assert metric(http, "radixrt_pages_held") == 0


@pytest.mark.model
def test_serves_normally_after_disconnects(http):
    res = http.post("/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}})
    assert res.status_code == 200 and res.json()["meta_info"]["completion_tokens"] == 3
