"""`radixrt serve --dp-size N`: N workers behind sglang-router's cache_aware policy, supervised by one process.

Refusals run in-process; the slow test starts `radixrt serve --dp-size 2` and checks answers and SIGTERM, then
starts the same through `sgl.Runtime(dp_size=2)` and checks an answer and a worker's death (the launcher exits 1
and leaves no process behind).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import time

import httpx
import pytest

import radixrt as sgl
from radixrt.server.dp_launch import check_dp_args, serve_dp, worker_argv
from radixrt.server.server_process import ServerProcess
from radixrt.server_args import ServerArgs

ARGS = ["--dtype", "float32", "--kv-memory-gb", "0.2", "--log-interval", "0", "--served-model-name", "radixrt-dp"]
GREEDY = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}


def test_dp_size_zero_is_refused() -> None:
    assert "at least 1" in check_dp_args(ServerArgs(dp_size=0))
    assert serve_dp(ServerArgs(dp_size=0)) == 1


def test_missing_router_gives_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "sglang_router" else real(name, *a))
    assert "pip install sglang-router==0.3.2" in check_dp_args(ServerArgs(dp_size=2))
    assert serve_dp(ServerArgs(dp_size=2)) == 1


def test_api_key_is_refused_and_workers_get_the_options() -> None:
    assert "--api-key" in check_dp_args(ServerArgs(dp_size=2, api_key="k"))
    assert check_dp_args(ServerArgs(dp_size=2)) is None
    argv = worker_argv(ServerArgs(dp_size=2, port=1234, dtype="float32", disable_radix_cache=True))
    assert "--dp-size" not in argv and "--port" not in argv and "--disable-radix-cache" in argv
    assert argv[argv.index("--dtype") + 1] == "float32"
    assert argv[argv.index("--served-model-name") + 1] == ServerArgs().model
    # a list option reaches every worker as the flag and its values, as the worker's parser reads them back
    lora = ServerArgs(dp_size=2, lora_paths=["a=/x", "b=/y"])
    argv = worker_argv(lora)
    at = argv.index("--lora-paths")
    assert argv[at + 1 : at + 3] == ["a=/x", "b=/y"]
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    assert ServerArgs.from_cli_args(parser.parse_args(argv)).lora_adapters() == [("a", "/x"), ("b", "/y")]


def _children(pid: int) -> set[int]:
    """Every live descendant of ``pid``."""
    found: set[int] = set()
    todo = [pid]
    while todo:
        p = todo.pop()
        for task in os.listdir(f"/proc/{p}/task") if os.path.exists(f"/proc/{p}/task") else []:
            with open(f"/proc/{p}/task/{task}/children") as fh:
                kids = {int(c) for c in fh.read().split()}
            todo += list(kids - found)
            found |= kids
    return found


def _alive(pids: set[int]) -> set[int]:
    left = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                if fh.read().split(")")[-1].split()[0] != "Z":
                    left.add(pid)
        except FileNotFoundError:
            pass
    return left


def _gone(pids: set[int], timeout: float = 30.0) -> set[int]:
    deadline = time.monotonic() + timeout
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return _alive(pids)


@pytest.mark.model
@pytest.mark.slow  # two workers load the model, twice: about 2 to 3 minutes here
def test_dp_size_two_serves_and_stops_cleanly(default_model_path) -> None:
    with sgl.Engine(model_path="smollm2-135m", dtype="float32", kv_memory_gb=0.2, log_interval=0) as engine:
        direct = engine.generate("Paris is", GREEDY)["text"]  # one replica's answer, as a server gives it
    dp = ServerProcess([*ARGS, "--dp-size", "2"], timeout=600).start()
    try:
        kids = _children(dp.proc.pid)
        assert len(kids) >= 3, kids  # two workers and the router, plus the workers' helpers
        with httpx.Client(base_url=dp.url, timeout=120) as http:
            assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["radixrt-dp"]
            for _ in range(2):
                res = http.post("/generate", json={"text": "Paris is", "sampling_params": GREEDY})
                assert res.status_code == 200, res.text
                assert res.json()["text"] == direct
            chat = http.post("/v1/chat/completions", json={"model": "radixrt-dp", "max_tokens": 4, "temperature": 0,
                                                             "messages": [{"role": "user", "content": "Say hi"}]})
            assert chat.status_code == 200, chat.text
            assert chat.json()["choices"][0]["message"]["content"]
        assert dp.stop(signal.SIGTERM, timeout=60) == 0, dp.output[-3000:]
        assert _gone(kids) == set()
    finally:
        dp.stop(signal.SIGKILL)
    # SGLang's way to the same replicas: sgl.Runtime(dp_size=2) launches `radixrt serve --dp-size 2`
    runtime = sgl.Runtime(model_path="smollm2-135m", dp_size=2, dtype="float32", kv_memory_gb=0.2, log_interval=0,
                          served_model_name="radixrt-dp", launch_timeout=600)
    try:
        assert json.loads(runtime.generate("Paris is", GREEDY))["text"] == direct
        launcher = runtime.server.proc
        kids = _children(launcher.pid)
        worker = next(pid for pid in sorted(kids) if b"radixrt.cli" in open(f"/proc/{pid}/cmdline", "rb").read())
        os.kill(worker, signal.SIGKILL)
        assert launcher.wait(60) == 1, runtime.server.output[-3000:]
        assert _gone(kids) == set()
    finally:
        runtime.shutdown()
