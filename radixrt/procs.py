"""Process helpers of the runtime's processes and launchers: a free port, dying with one's parent, quiet helpers.

Every child process of radixrt (the server's scheduler and detokenizer, tensor-parallel followers, ``radixrt
serve`` started by ``sgl.Runtime`` or a benchmark, data-parallel workers and their router) dies with the process
that started it, through Linux's ``PR_SET_PDEATHSIG``: ``die_with_parent`` in the child, or ``die_with`` as the
pre-exec step of ``subprocess.Popen``. Imports nothing of the runtime (the frontend's launcher uses it too).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Callable

PR_SET_PDEATHSIG = 1


def free_port() -> int:
    """A TCP port free on the loopback interface (free now; a race with another process remains possible)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with(parent_pid: int) -> Callable[[], None]:
    """A pre-exec step (``Popen(preexec_fn=...)``): the child gets SIGTERM when ``parent_pid`` goes, or at once
    if it has gone already. SIGTERM's default action ends a process even inside a blocking collective."""

    def arm() -> None:
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        except OSError:  # not Linux: the parent's own clean-up is all there is
            return
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return arm


def die_with_parent(parent_pid: int) -> None:
    """In a child already running: SIGTERM this process when ``parent_pid`` goes."""
    die_with(parent_pid)()


def parent_alive(parent_pid: int) -> bool:
    return os.getppid() == parent_pid


# A helper process's environment: one compute thread, no OpenMP spin-waiting, no tokenizer thread pool.
HELPER_THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
                     "NUMEXPR_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false"}


def pin_helper_threads() -> None:
    """For the HTTP and detokenizer processes: one compute thread, no OpenMP spin-waiting.

    Must run before torch is imported (transformers' tokenizer classes import it when it is installed).
    """
    os.environ.update(HELPER_THREAD_ENV)


def stop_processes(procs: list[subprocess.Popen], grace: float = 5.0, group: bool = False) -> None:
    """SIGTERM each process still running, then SIGKILL those that outlive ``grace`` seconds; ``group``: signal
    each one's whole process group (a process started with ``start_new_session=True``, its children with it)."""

    def signal_(p: subprocess.Popen, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            if group:
                os.killpg(p.pid, sig)
            else:
                p.send_signal(sig)

    for p in procs:
        if p.poll() is None:
            signal_(p, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.05))
        except subprocess.TimeoutExpired:
            signal_(p, signal.SIGKILL)
            p.wait()


def torch_single_thread() -> None:
    """If something imported torch anyway, keep it to one thread."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:
            pass
