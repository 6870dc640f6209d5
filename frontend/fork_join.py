"""Fork and join: ProgramStateGroup, the n states that `s.fork(n)` returns.

Each branch is an independent state that starts with the parent's text, variables and messages
(StreamExecutor.fork copies them). `forks += x` appends to every branch. `join()` waits for the
branches, brings their results back to the parent (their variables as lists, or their new text
appended) and ends them; a branch cannot be appended to after its join. The tracer builds groups
of its own tracing states with this class too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional

from .ir import SglConcateAndAppend, SglExpr

if TYPE_CHECKING:
    from .program_state import ProgramState


class ProgramStateGroup:
    """What s.fork(n) returns: n independent states sharing the parent's text."""

    def __init__(self, states: List[ProgramState], src_state: Optional[ProgramState] = None):
        self.states = states
        self.src_state = src_state

    def join(self, mode: str = "gather_variable") -> None:
        """gather_variable: each variable first set in the branches becomes, in the parent, the
        list of the branches' values. concate_and_append: the branches' new text is appended to
        the parent, in order."""
        if mode == "gather_variable":
            src_vars = self.src_state.stream_executor.variables
            existing = set(src_vars)
            for child in self.states:
                child.stream_executor.sync()
                for k, v in child.stream_executor.variables.items():
                    if k in existing:
                        continue
                    src_vars.setdefault(k, []).append(v)
        elif mode == "concate_and_append":
            self.src_state += SglConcateAndAppend(self.states)
            self.src_state.stream_executor.sync()
        else:
            raise ValueError(f"unknown join mode {mode!r} (gather_variable, concate_and_append)")
        for s in self.states:
            s.stream_executor.end()

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __setitem__(self, i: int, value) -> None:
        if self.states[i] is not value:
            raise ValueError("forks[i] += ... must append to the same fork")

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self):
        return iter(self.states)

    def __iadd__(self, other):
        if callable(other) and not isinstance(other, SglExpr):
            for i, s in enumerate(self.states):
                s += other(i)
        elif isinstance(other, (SglExpr, str)):
            for s in self.states:
                s += other
        elif isinstance(other, (list, tuple)):
            if len(other) != len(self.states):
                raise ValueError("forks += list: one item per fork")
            for s, x in zip(self.states, other):
                s += x
        else:
            raise TypeError(f"cannot append {type(other).__name__} to forks")
        return self
