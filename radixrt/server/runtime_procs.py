"""The runtime's two helper processes, started the same way for `radixrt serve` and for an Engine whose
scheduler runs apart (``engine_scheduler="process"``): the scheduler first (it loads the model while the caller
loads its tokenizer), then the detokenizer, given that tokenizer.

- the scheduler process (``radixrt.server.scheduler_process``) gets the machine's compute threads and the
  options without the API keys (a command line is visible to ``ps``; the scheduler needs none);
- the detokenizer process (``radixrt.server.detokenizer_process``) gets one thread and no OpenMP spinning, and
  the tokenizer the caller loaded as its Rust half alone where that decodes the same text (a file in the ipc
  folder), so it starts in a fraction of a second instead of importing transformers and torch for seconds.

Both die with the process that started them (PR_SET_PDEATHSIG, and a check of their parent every second).
``dead_helper`` names the first that exited; ``stop_processes`` (radixrt.procs) stops them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

from radixrt.detokenize import decoder_json
from radixrt.procs import HELPER_THREAD_ENV
from radixrt.server_args import ServerArgs

DECODER_FILE = "decoder.json"  # the Rust tokenizer the detokenizer decodes with, in the ipc folder


def spawn_scheduler(args: ServerArgs, ipc_dir: str, compute_env: dict[str, str] | None = None) -> subprocess.Popen:
    """The scheduler process, which loads the model (the longest part of a start: spawn it first)."""
    options = {**dataclasses.asdict(args), **{name: None for name in ServerArgs.SECRETS}}
    return _spawn("radixrt.server.scheduler_process", [json.dumps(options), ipc_dir, str(os.getpid())],
                  dict(os.environ) if compute_env is None else compute_env)


def spawn_detokenizer(args: ServerArgs, ipc_dir: str, tokenizer, tokenizer_path: str,
                      compute_env: dict[str, str] | None = None) -> subprocess.Popen:
    """The detokenizer process, given ``tokenizer`` (loaded here) as the Rust tokenizer alone where that decodes
    the same text (radixrt.detokenize.decoder_json; it then starts without transformers and torch), else the
    path to load it from."""
    source = tokenizer_path
    rust = decoder_json(tokenizer)
    if rust is not None:
        source = os.path.join(ipc_dir, DECODER_FILE)
        with open(source, "w") as file:
            file.write(rust)
    env = {**(dict(os.environ) if compute_env is None else compute_env), **HELPER_THREAD_ENV}
    return _spawn("radixrt.server.detokenizer_process", [source, ipc_dir, str(os.getpid()), args.log_level], env)


def dead_helper(procs: dict[str, subprocess.Popen]) -> str | None:
    """What went wrong, once a helper has exited: ``the NAME process exited with code N``."""
    for name, p in procs.items():
        rc = p.poll()
        if rc is not None:
            return f"the {name} process exited with code {rc}"
    return None


def _spawn(module: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", module, *argv], env=env, stdin=subprocess.DEVNULL)
