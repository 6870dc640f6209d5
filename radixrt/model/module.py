"""The base of radixrt's model layers: an ``nn.Module`` whose call is its ``forward``.

``nn.Module.__call__`` looks for hooks (forward pre-hooks and hooks, global ones, tracing state) around every
forward. radixrt registers none, and a decode step makes about 200 module calls (30 layers of norms,
projections, attention and MLP): at batch 1 on 2 CPU cores those checks cost about 0.5 ms of a 13 ms step
(docs/BENCHMARKS.md). Layers derive from :class:`InferenceModule` instead, so a call is one method call; hooks
registered on them are not run. Parameters, buffers, submodules, ``state_dict`` and ``.to()`` are nn.Module's.
"""

from __future__ import annotations

from typing import Any

from torch import nn


class InferenceModule(nn.Module):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)
