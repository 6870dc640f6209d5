"""Where the interpreter's parts live; every name stays importable from here (SGLang's place for them).

- executor.py: StreamExecutor, the worker thread that runs a state's nodes in order
- program_state.py: ProgramState, the `s` of a program
- fork_join.py: ProgramStateGroup, what `s.fork(n)` returns, and join
- run.py: resolve_backend, run_program, run_program_batch, cache_program
"""

from __future__ import annotations

from .executor import StreamExecutor
from .fork_join import ProgramStateGroup
from .program_state import ProgramState
from .run import cache_program, resolve_backend, run_program, run_program_batch

__all__ = [
    "StreamExecutor", "ProgramState", "ProgramStateGroup", "resolve_backend", "run_program",
    "run_program_batch", "cache_program",
]
