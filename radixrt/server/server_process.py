"""Start `radixrt serve` as a child process on a free loopback port (tests, benchmarks, notebooks).

    with ServerProcess(["--dtype", "float32"]) as server:
        httpx.post(server.url + "/generate", json={...})

The implementation lives in the frontend (radixrt.frontend.launcher), which ``sgl.Runtime`` uses too; this module
is its home on the server side. ``free_port`` comes from radixrt.procs.
"""

from __future__ import annotations

from radixrt.frontend.launcher import READY_LINE, ServerProcess
from radixrt.procs import free_port

__all__ = ["READY_LINE", "ServerProcess", "free_port"]
