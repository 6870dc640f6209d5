"""The runtime's two helper processes, started the same way for `radixrt serve` and for an Engine whose
scheduler runs apart (``engine_scheduler="process"``).

- the scheduler process (``radixrt.server.scheduler_process``) gets the machine's compute threads and the
  options without the API keys (a command line is visible to ``ps``; the scheduler needs none);
- the detokenizer process (``radixrt.server.detokenizer_process``) gets one thread and no OpenMP spinning.

Both die with the process that started them (PR_SET_PDEATHSIG, and a check of their parent every second).
``dead_helper`` names the first that exited; ``stop_processes`` (radixrt.procs) stops them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

from radixrt.procs import HELPER_THREAD_ENV
from radixrt.server_args import ServerArgs


def spawn_helpers(args: ServerArgs, ipc_dir: str, tokenizer_path: str,
                  compute_env: dict[str, str] | None = None) -> dict[str, subprocess.Popen]:
    """Start the scheduler and the detokenizer over the ipc sockets in ``ipc_dir`` (radixrt.server.ipc)."""
    compute_env = dict(os.environ) if compute_env is None else compute_env
    pid = str(os.getpid())
    options = {**dataclasses.asdict(args), **{name: None for name in ServerArgs.SECRETS}}
    procs = {"scheduler": _spawn("radixrt.server.scheduler_process", [json.dumps(options), ipc_dir, pid],
                                 compute_env)}
    try:
        procs["detokenizer"] = _spawn("radixrt.server.detokenizer_process",
                                      [tokenizer_path, ipc_dir, pid, args.log_level],
                                      {**compute_env, **HELPER_THREAD_ENV})
    except BaseException:
        procs["scheduler"].kill()
        raise
    return procs


def dead_helper(procs: dict[str, subprocess.Popen]) -> str | None:
    """What went wrong, once a helper has exited: ``the NAME process exited with code N``."""
    for name, p in procs.items():
        rc = p.poll()
        if rc is not None:
            return f"the {name} process exited with code {rc}"
    return None


def _spawn(module: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", module, *argv], env=env, stdin=subprocess.DEVNULL)
