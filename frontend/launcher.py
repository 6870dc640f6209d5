"""Start `radixrt serve` as a child process on a free loopback port and wait until it is ready.

    with ServerProcess(["--dtype", "float32"]) as server:
        httpx.post(server.url + "/generate", json={...})

The child is ``python -m radixrt.cli serve --host 127.0.0.1 --port PORT ARGS``; it is ready when it prints
``READY_LINE`` (radixrt.server.launch prints it; tests keep the two equal). ``die_with_parent=True`` asks the
kernel (Linux ``PR_SET_PDEATHSIG``) to SIGTERM the server when the thread that started it dies, so a killed
program leaves no server behind; the server's own helpers die with the server. Used by ``sgl.Runtime``
(radixrt.frontend.runtime) and, through radixrt.server.server_process, by tests and benchmarks. Imports
nothing of the runtime but its process helpers (radixrt.procs): the server is a command line away.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from radixrt.procs import die_with, free_port

READY_LINE = "radixrt serve: ready at"


class ServerProcess:
    def __init__(self, args: list[str] | None = None, port: int | None = None, timeout: float = 600.0,
                 echo: bool = False, host: str = "127.0.0.1", die_with_parent: bool = False,
                 module: str = "radixrt.cli serve") -> None:
        """``module``: what ``python -m`` runs (``radixrt.launch_server`` takes SGLang's command line)."""
        self.host = host
        self.port = port or free_port()
        self.url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{self.port}"
        self.args = list(args or [])
        self.timeout = timeout
        self.echo = echo
        self.die_with_parent = die_with_parent
        self.module = module
        self.lines: list[str] = []
        self.proc: subprocess.Popen | None = None
        self._ready = threading.Event()

    def start(self) -> "ServerProcess":
        cmd = [sys.executable, "-m", *self.module.split(), "--host", self.host, "--port", str(self.port), *self.args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                     preexec_fn=die_with(os.getpid()) if self.die_with_parent else None)
        reader = threading.Thread(target=self._read, daemon=True)
        reader.start()
        deadline = time.monotonic() + self.timeout
        while not self._ready.wait(0.2):
            if self.proc.poll() is not None:
                reader.join(5.0)  # the output up to the exit, the reason last
                raise RuntimeError(f"radixrt serve exited with {self.proc.returncode}:\n" + "".join(self.lines[-40:]))
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError("radixrt serve did not become ready:\n" + "".join(self.lines[-40:]))
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if self.echo:
                sys.stderr.write(line)
            if READY_LINE in line:
                self._ready.set()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
