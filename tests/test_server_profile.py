"""The server's profiler routes, SGLang's /start_profile and /stop_profile: torch.profiler on the scheduler's
thread, a Chrome trace written where the request (or the environment) says, stopped by /stop_profile or after
``num_steps`` steps; misuse and bad bodies are a 400 and the server goes on serving."""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from shared_server import ARGS

pytestmark = pytest.mark.model

SERVER_ARGS = ARGS


def generate(http, tokens: int = 4) -> dict:
    response = http.post("/generate", json={"text": "The capital of France is",
                                            "sampling_params": {"max_new_tokens": tokens, "temperature": 0}})
    assert response.status_code == 200, response.text
    return response.json()


def traces(folder: Path) -> list[Path]:
    return sorted(folder.glob("radixrt-*.trace.json"))


@pytest.fixture
def no_profile_left(http):
    yield
    http.post("/stop_profile")  # whatever a failed test left running


def test_start_and_stop_write_a_trace_where_asked(http, tmp_path, no_profile_left):
    start = http.post("/start_profile", json={"output_dir": str(tmp_path), "activities": ["CPU"],
                                              "record_shapes": True, "with_stack": False})
    assert start.status_code == 200 and start.text == "Start profiling.\n"
    again = http.post("/start_profile", json={"output_dir": str(tmp_path)})
    assert again.status_code == 400 and "already running" in again.json()["error"]["message"]
    expected = generate(http)["text"]
    stop = http.post("/stop_profile")
    assert stop.status_code == 200, stop.text
    [trace] = traces(tmp_path)
    assert str(trace) in stop.text
    events = json.loads(trace.read_text())["traceEvents"]
    assert any("linear" in str(e.get("name", "")) for e in events)  # the forwards ran on the profiled thread
    none = http.get("/stop_profile")
    assert none.status_code == 400 and "no profile is running" in none.json()["error"]["message"]
    assert generate(http)["text"] == expected


def start_with_steps(http, body: dict, tokens: int = 6) -> httpx.Response:
    """A ``num_steps`` start is answered once its profile ended: it runs beside the traffic that ends it."""
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(http.post, "/start_profile", json=body)
        time.sleep(0.5)
        while not answer.done():
            generate(http, tokens=tokens)
        return answer.result()


def test_a_profile_of_num_steps_stops_by_itself_and_answers_then(http, tmp_path, no_profile_left):
    answer = start_with_steps(http, {"output_dir": str(tmp_path), "num_steps": 2})
    assert answer.status_code == 200, answer.text
    [trace] = traces(tmp_path)
    assert answer.text == f"Start profiling.\nThe trace is in {trace}.\n"
    assert http.post("/stop_profile").status_code == 400  # it stopped already
    assert start_with_steps(http, {"output_dir": str(tmp_path), "num_steps": 1}, tokens=2).status_code == 200
    assert len(traces(tmp_path)) == 2
    unwritable = tmp_path / "a-file"
    unwritable.write_text("")
    failed = start_with_steps(http, {"output_dir": str(unwritable / "traces"), "num_steps": 1}, tokens=2)
    assert failed.status_code == 400 and "could not be written" in failed.json()["error"]["message"]


def test_what_sglang_profiler_sends_is_taken(http, tmp_path, no_profile_left):
    """sglang.profiler's body: counts as strings, every field named, a file-name prefix."""
    body = {"output_dir": str(tmp_path), "num_steps": "1", "activities": ["CPU", "GPU"], "profile_by_stage": False,
            "merge_profiles": False, "profile_prefix": "bench-1", "start_step": "0"}
    assert start_with_steps(http, body, tokens=2).status_code == 200
    assert len(list(tmp_path.glob("bench-1-*.trace.json"))) == 1


def test_without_a_folder_the_trace_goes_to_the_default_one(http, no_profile_left):
    assert http.get("/start_profile").status_code == 200  # no body: SGLang's defaults
    generate(http, tokens=2)
    stop = http.get("/stop_profile")
    assert stop.status_code == 200
    path = Path(stop.text.removeprefix("Stop profiling. The trace is in ").removesuffix(".\n"))
    folder = os.environ.get("RADIXRT_TORCH_PROFILER_DIR") or os.environ.get("SGLANG_TORCH_PROFILER_DIR") or "/tmp"
    assert path.parent == Path(folder) and path.exists()
    path.unlink()


@pytest.mark.parametrize("body", [
    {"num_steps": 0}, {"num_steps": "0"}, {"num_steps": "two"}, {"activities": ["CPU", "TPU"]},
    {"activities": "CPU"}, {"profile_by_stage": True}, {"merge_profiles": True}, {"start_step": 3},
    {"start_step": "3"}, {"output_dir": ""}, {"with_stack": "yes"}, {"profile_prefix": "../up"},
    {"profile_everything": True},
], ids=lambda body: next(iter(body)))
def test_bad_bodies_are_a_400_and_start_nothing(http, tmp_path, body, no_profile_left):
    response = http.post("/start_profile", json=body)
    assert response.status_code == 400, response.text
    assert http.post("/stop_profile").status_code == 400  # nothing was started


def test_a_folder_that_cannot_be_made_is_a_400_and_the_profile_ends(http, tmp_path, no_profile_left):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert http.post("/start_profile", json={"output_dir": str(blocker / "traces")}).status_code == 200
    stop = http.post("/stop_profile")
    assert stop.status_code == 400 and "cannot write the trace" in stop.json()["error"]["message"]
    assert http.post("/stop_profile").status_code == 400  # the profile ended all the same
    assert generate(http)["meta_info"]["completion_tokens"] == 4
