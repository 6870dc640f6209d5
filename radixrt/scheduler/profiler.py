"""torch.profiler on the scheduler's thread: the control calls behind ``start_profile`` / ``stop_profile`` (SGLang's
names, on the Engine and as the server's ``/start_profile`` and ``/stop_profile``).

The profiler records the operators of the thread that starts it, and the forward passes run on the scheduler
thread, so both calls run there (as control calls between steps). ``stop`` returns each operator's self CPU
seconds and call count, and writes a Chrome trace (chrome://tracing, Perfetto) into the folder it is given, else
the one the start named. A profile started with ``num_steps`` stops by itself after that many steps with a
forward (``step``, called by the scheduler), writing its trace. The C++ CPU kernels are pybind functions, not
operators: they appear as ``radixrt::<kernel>`` ranges. Starting a second profile or stopping none is the
caller's error (``RequestError``).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from radixrt.protocol.errors import RequestError
from radixrt.protocol.messages import StartProfileReq

logger = logging.getLogger("radixrt.scheduler")


class StepProfiler:
    def __init__(self) -> None:
        self._profile: Any = None
        self._options = StartProfileReq()
        self._steps = 0
        self.last_trace: str | None = None  # the latest trace written

    @property
    def running(self) -> bool:
        return self._profile is not None

    def start(self, options: StartProfileReq | None = None) -> None:
        if self._profile is not None:
            raise RequestError("a profile is already running; stop it first")
        options = options or StartProfileReq()
        if options.num_steps is not None and options.num_steps < 1:
            raise RequestError("num_steps must be >= 1")
        import torch
        import torch.profiler

        activities = [torch.profiler.ProfilerActivity.CPU]
        if options.cuda and torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profile = torch.profiler.profile(activities=activities, record_shapes=options.record_shapes,
                                         with_stack=options.with_stack, profile_memory=options.profile_memory)
        profile.__enter__()
        self._profile, self._options, self._steps = profile, options, 0

    def step(self) -> None:
        """A step with a forward ran: a profile started with ``num_steps`` stops after its last one."""
        if self._profile is None or self._options.num_steps is None:
            return
        self._steps += 1
        if self._steps >= self._options.num_steps:
            try:
                self._end()
                logger.info("profile of %d steps written to %s", self._steps, self.last_trace)
            except RequestError as exc:  # a folder that cannot be made: the profile ends without its trace
                logger.warning("the profile's trace was not written: %s", exc)
            except Exception:  # nor may anything else about a trace stop the scheduler
                logger.exception("writing the profile's trace failed")

    def stop(self, trace_dir: str | None = None, operators: bool = True) -> dict[str, dict[str, float]]:
        """{operator: {"self_cpu_s", "calls"}} since ``start`` (empty without ``operators``: the table walks every
        event); a Chrome trace in ``trace_dir`` (else the start's folder) when there is one (:attr:`last_trace`)."""
        profile = self._end(trace_dir)
        if not operators:
            return {}
        return {event.key: {"self_cpu_s": event.self_cpu_time_total / 1e6, "calls": event.count}
                for event in profile.key_averages()}

    def _end(self, trace_dir: str | None = None) -> Any:
        """Stop recording and write the trace (see ``stop``); the finished profile."""
        if self._profile is None:
            raise RequestError("no profile is running; start one first")
        profile, self._profile = self._profile, None
        profile.__exit__(None, None, None)
        self.last_trace = None
        folder = trace_dir or self._options.trace_dir
        if folder is not None:
            try:
                os.makedirs(folder, exist_ok=True)
            except OSError as exc:
                raise RequestError(f"cannot write the trace into {folder!r}: {exc.strerror or exc}") from None
            path = os.path.join(folder, f"{self._options.prefix}-{time.time_ns()}.trace.json")
            profile.export_chrome_trace(path)
            self.last_trace = path
        return profile
