"""`sgl.Runtime`: a `radixrt serve` child launched from Python, used as a DSL backend and as SGLang's Runtime;
its processes end on shutdown() and when the program that started it is killed; bad options fail clearly.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest

import radixrt as sgl
from radixrt.frontend.runtime import server_flags

pytestmark = [pytest.mark.model, pytest.mark.slow]  # four model loads: 45 to 110 s here

OPTIONS = {"dtype": "float32", "kv_memory_gb": 0.05, "log_interval": 0}
GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def wait_gone(pids: list[int], timeout: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def server_pids(runtime) -> list[int]:
    pids = runtime.get_server_info()["pids"]
    return [pids["server"], pids["scheduler"], pids["detokenizer"]]


@sgl.function
def qa(s, question):
    s += "Question: " + question + "\nAnswer:"
    s += sgl.gen("answer", max_tokens=8, temperature=0, ignore_eos=True)


QUESTIONS = [{"question": "What is the capital of France?"}, {"question": "Name a prime number."}]


@pytest.fixture(scope="module")
def runtime(default_model_path):
    rt = sgl.Runtime(model_path="smollm2-135m", mem_fraction_static=0.8, **OPTIONS)
    yield rt
    rt.shutdown()


@pytest.fixture(scope="module")
def engine(runtime):  # after the runtime's server is up, so the two never load the model at once
    with sgl.Engine(dtype="float32", kv_memory_gb=0.05, log_interval=0) as eng:
        yield eng


def test_a_program_on_the_runtime_matches_the_engine(runtime, engine):
    sgl.set_default_backend(runtime)
    try:
        on_runtime = [s["answer"] for s in qa.run_batch(QUESTIONS)]
    finally:
        sgl.set_default_backend(None)
    on_engine = [s["answer"] for s in qa.run_batch(QUESTIONS, backend=engine)]
    on_endpoint = [s["answer"] for s in qa.run_batch(QUESTIONS, backend=sgl.RuntimeEndpoint(runtime.url))]
    assert on_runtime == on_engine == on_endpoint
    assert all(on_runtime)


def test_sglang_runtime_methods(runtime, engine, default_model_path):
    assert runtime.url.startswith("http://127.0.0.1:") and isinstance(runtime.endpoint, sgl.RuntimeEndpoint)
    out = json.loads(runtime.generate("The capital of France is", GREEDY))
    assert out["text"] == engine.generate("The capital of France is", GREEDY)["text"]

    async def stream() -> list[str]:
        return [chunk async for chunk in runtime.async_generate("The capital of France is", GREEDY)]

    chunks = asyncio.run(stream())
    assert "".join(chunks) == out["text"] and all(chunks)
    tokenizer = runtime.get_tokenizer()
    assert tokenizer.decode(tokenizer.encode("hello world")) == "hello world"
    assert runtime.get_model_name() == str(default_model_path)  # a backend method, handed to the endpoint


def test_bad_options_fail_clearly(runtime):
    with pytest.raises(TypeError, match="not_a_radixrt_option"):
        sgl.Runtime(model_path="smollm2-135m", not_a_radixrt_option=3, launch_timeout=120)
    with pytest.raises(TypeError, match="kv_memory$"):  # an abbreviation is not an option's name
        sgl.Runtime(model_path="smollm2-135m", kv_memory=0.05, dtype="float32", log_interval=0)
    for options in ({"quantization": "awq"}, {"kv_cache_dtype": "fp8_e4m3"},
                    {"dtype": "bf15"}):
        with pytest.raises(ValueError, match=next(iter(options))):
            sgl.Runtime(model_path="smollm2-135m", **options)


def test_options_become_server_flags():
    assert server_flags({"model_path": "m", "tp_size": 1, "mem_fraction_static": 0.5, "log_level_http": "info",
                         "disable_radix_cache": True, "enable_mixed_chunk": False, "dp_size": 2,
                         "max_total_tokens": 100, "tokenizer_path": None}) == [
        "--model-path", "m", "--tp-size", "1", "--mem-fraction-static", "0.5", "--log-level-http", "info",
        "--disable-radix-cache", "--dp-size", "2", "--max-total-tokens", "100"]
    # SGLang's lora_paths as a list or as a dict of names to paths
    assert server_flags({"lora_paths": ["/a", "b=/b"]}) == ["--lora-paths", "/a", "b=/b"]
    assert server_flags({"lora_paths": {"a": "/a", "b": "/b"}}) == ["--lora-paths", "a=/a", "b=/b"]


def test_the_default_backend_is_the_runtime_set(runtime):
    sgl.set_default_backend(runtime)
    try:
        assert sgl.global_config.default_backend is runtime
        assert sgl.global_config.default_backend.endpoint is runtime.endpoint  # what SGLang programs read
    finally:
        sgl.set_default_backend(None)


def test_shutdown_leaves_no_process(runtime):
    pids = server_pids(runtime)
    assert all(alive(p) for p in pids)
    runtime.shutdown()
    assert wait_gone(pids) == []
    runtime.shutdown()  # twice is fine


CHILD = """
import sys, radixrt as sgl
rt = sgl.Runtime(model_path="smollm2-135m", dtype="float32", kv_memory_gb=0.05, log_interval=0)
pids = rt.get_server_info()["pids"]
print(pids["server"], pids["scheduler"], pids["detokenizer"], flush=True)
sys.stdin.read()
"""


def test_a_killed_program_leaves_no_server(default_model_path):
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "PYTHONSAFEPATH": "1"})
    try:
        line = child.stdout.readline()
        pids = [int(p) for p in line.split()]
        assert len(pids) == 3 and all(alive(p) for p in pids), line
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        assert wait_gone(pids, timeout=10) == []
    finally:
        if child.poll() is None:
            child.kill()
