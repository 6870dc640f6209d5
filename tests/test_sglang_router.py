"""Data parallel behind SGLang's router: sglang-router (cache_aware) in front of two `radixrt serve` workers.

The router registers each worker (it reads /server_info and /model_info), lists the workers' model id on
/v1/models, and forwards /generate and /v1/chat/completions with SGLang's full request bodies.
"""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from radixrt.server.server_process import ServerProcess, free_port


pytestmark = [pytest.mark.model, pytest.mark.slow]  # two workers load the model: 50 to 75 s here

WORKER_ARGS = ["--dtype", "float32", "--kv-memory-gb", "0.05", "--log-interval", "0",
               "--served-model-name", "radixrt-dp"]
GREEDY = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}


def wait_for_model(url: str, model: str, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            res = httpx.get(url + "/v1/models", timeout=5)
            last = res.text
            if res.status_code == 200 and [m["id"] for m in res.json()["data"]] == [model]:
                return res.json()
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(0.5)
    raise TimeoutError(f"the router never listed {model}: {last}")


@pytest.fixture(scope="module")
def router(default_model_path):
    workers = [ServerProcess(WORKER_ARGS) for _ in range(2)]
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda w: w.start(), workers))
    port = free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
           "--prometheus-port", str(free_port()), "--policy", "cache_aware", "--log-level", "warn",
           "--worker-urls", *[w.url for w in workers]]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_model(url, "radixrt-dp")
        yield url, workers
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        for w in workers:
            w.stop()


def test_router_lists_the_workers_model(router):
    url, _ = router
    assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == ["radixrt-dp"]


def test_generate_and_chat_through_the_router(router):
    url, workers = router
    with httpx.Client(base_url=url, timeout=120) as http:
        direct = httpx.post(workers[0].url + "/generate", json={"text": "Paris is", "sampling_params": GREEDY},
                            timeout=120).json()["text"]
        for prompt in ("Paris is", "def add(a, b):", "Once upon a time"):
            res = http.post("/generate", json={"text": prompt, "sampling_params": GREEDY})
            assert res.status_code == 200, res.text
            if prompt == "Paris is":
                assert res.json()["text"] == direct
        chat = http.post("/v1/chat/completions", json={"model": "radixrt-dp", "max_tokens": 4,
                                                         "messages": [{"role": "user", "content": "Say hi"}]})
        assert chat.status_code == 200, chat.text
        assert chat.json()["model"] == "radixrt-dp"
        assert chat.json()["choices"][0]["message"]["content"]
