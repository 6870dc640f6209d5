"""`radixrt bench startup`: the seconds from a server's command to its first answer, each server stopped after."""

import json
import subprocess
import sys
import textwrap
import time

import pytest

from radixrt.bench.startup import time_to_first_answer
from radixrt.procs import free_port, stop_processes

# answers 404 until DELAY seconds after its start, then 200 on /v1/models; writes its pid and folder first
FAKE_SERVER = textwrap.dedent("""
    import http.server, os, sys, time
    port, delay, pid_file = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
    open(pid_file, "w").write(f"{os.getpid()} {os.getcwd()}")
    started = time.monotonic()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            ready = time.monotonic() - started >= delay and self.path == "/v1/models"
            self.send_response(200 if ready else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
""")


def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie its new parent has not reaped yet."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_the_figure_is_the_time_to_the_first_200_and_the_server_is_stopped_after(tmp_path):
    port, pid_file = free_port(), tmp_path / "pid"
    seconds = time_to_first_answer([sys.executable, "-c", FAKE_SERVER, str(port), "0.6", str(pid_file)], port, 30,
                                   cwd=str(tmp_path))
    assert 0.6 <= seconds < 10
    pid, folder = pid_file.read_text().split(" ", 1)
    assert _gone(int(pid)) and folder == str(tmp_path)


def test_a_server_that_exits_first_or_never_answers_is_an_error_with_its_log(tmp_path):
    port = free_port()
    with pytest.raises(RuntimeError, match="exited with code 3: bad flag"):
        time_to_first_answer([sys.executable, "-c", "import sys; print('bad flag'); sys.exit(3)"], port, 30)
    pid_file = tmp_path / "pid"
    with pytest.raises(RuntimeError, match="did not answer within 1 s"):
        time_to_first_answer([sys.executable, "-c", FAKE_SERVER, str(port), "60", str(pid_file)], port, 1)
    assert _gone(int(pid_file.read_text().split()[0]))


def test_a_process_group_is_stopped_whole(tmp_path):
    """``stop_processes(group=True)``, as the bench stops a server: the children it started go with it (vLLM's
    server runs its engine in one)."""
    pid_file = tmp_path / "child"
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open({str(pid_file)!r}, "w").write(str(child.pid))
        time.sleep(600)
    """)], start_new_session=True)
    deadline = time.monotonic() + 30
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    stop_processes([parent], grace=5, group=True)
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10  # the child is init's to reap once its parent is gone
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert parent.returncode is not None and _gone(child)


@pytest.mark.model
def test_the_command_times_radixrt_serve(default_model_path):
    done = subprocess.run([sys.executable, "-m", "radixrt.cli", "bench", "startup", "--rounds", "1"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(done.stdout.split("RESULT_JSON ", 1)[1])
    assert list(result["seconds"]) == ["radixrt"] and len(result["seconds"]["radixrt"]) == 1
    assert 0 < result["seconds"]["radixrt"][0] < 300 and "| radixrt |" in done.stdout
