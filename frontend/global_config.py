"""Process-wide settings of the frontend (SGLang exposes the same object as `sgl.global_config`)."""

from __future__ import annotations

from typing import Any, Optional


class GlobalConfig:
    def __init__(self) -> None:
        # The backend a program runs on when run() gets no backend=.
        self.default_backend: Optional[Any] = None
        # 0: quiet; 2: print each finished program's text.
        self.verbosity = 0
        # run_batch: trace the program, prefill its constant prefix once before fanning out.
        self.enable_precache_with_tracing = True
        # The shortest constant prefix (characters) worth a separate prefill call.
        self.precache_min_chars = 64
        # select(): how many prompt tokens before the boundary are re-scored for token healing.
        self.select_healing_tokens = 2


global_config = GlobalConfig()
