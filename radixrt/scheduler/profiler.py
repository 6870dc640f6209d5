"""torch.profiler on the scheduler's thread: the control calls behind ``start_profile`` / ``stop_profile`` (SGLang's names).

The profiler records the operators of the thread that starts it, and the Engine's forward passes run on its
scheduler thread, so both calls run there (as control calls between steps). ``stop`` returns each operator's
self CPU seconds and call count, and writes a Chrome trace (chrome://tracing, Perfetto) when given a folder.
The C++ CPU kernels are pybind functions, not operators: they appear as ``radixrt::<kernel>`` ranges.
"""

from __future__ import annotations

import os
import time
from typing import Any


class StepProfiler:
    def __init__(self) -> None:
        self._profile: Any = None

    @property
    def running(self) -> bool:
        return self._profile is not None

    def start(self) -> None:
        if self._profile is not None:
            raise RuntimeError("a profile is already running; stop it first")
        import torch.profiler

        profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        profile.__enter__()
        self._profile = profile

    def stop(self, trace_dir: str | None = None) -> dict[str, dict[str, float]]:
        """{operator: {"self_cpu_s", "calls"}} since ``start``; with ``trace_dir``, also a Chrome trace there."""
        if self._profile is None:
            raise RuntimeError("no profile is running; start one first")
        profile, self._profile = self._profile, None
        profile.__exit__(None, None, None)
        if trace_dir is not None:
            os.makedirs(trace_dir, exist_ok=True)
            profile.export_chrome_trace(os.path.join(trace_dir, f"radixrt-{int(time.time())}.trace.json"))
        return {event.key: {"self_cpu_s": event.self_cpu_time_total / 1e6, "calls": event.count}
                for event in profile.key_averages()}
