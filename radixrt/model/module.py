"""The base of radixrt's model layers: an ``nn.Module`` whose call is its ``forward``, and whose parameters,
buffers and submodules are plain attributes once the model is final.

``nn.Module.__call__`` looks for hooks (forward pre-hooks and hooks, global ones, tracing state) around every
forward. radixrt registers none, and a decode step makes about 200 module calls (30 layers of norms,
projections, attention and MLP): at batch 1 on 2 CPU cores those checks cost about 0.5 ms of a 13 ms step
(docs/BENCHMARKS.md). Layers derive from :class:`InferenceModule` instead, so a call is one method call; hooks
registered on them are not run.

nn.Module keeps parameters, buffers and submodules in dicts of its own, found by its ``__getattr__`` only after
the ordinary lookup failed: about half a microsecond each, some 500 times a decode step. ``bind_attributes``
(called once the model is loaded, converted and packed) puts each into its module's instance dict as well, so
``self.weight`` is an ordinary attribute read; ``__setattr__`` and ``__delattr__`` keep the two in step from
then on. ``state_dict``, ``.to()`` (which converts each Parameter in place) and everything else of nn.Module's
are unchanged.
"""

from __future__ import annotations

from typing import Any

from torch import nn


class InferenceModule(nn.Module):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def bind_attributes(self, bound: bool = True) -> None:
        """Every InferenceModule in this tree (this one included) holds its parameters, buffers and submodules
        as instance attributes too (``bound=False``: no longer, as nn.Module keeps them)."""
        for module in self.modules():
            if isinstance(module, InferenceModule):
                object.__setattr__(module, "_attributes_bound", bound)
                for registry in (module._parameters, module._buffers, module._modules):
                    for name, value in registry.items():
                        if bound:
                            object.__setattr__(module, name, value)
                        else:
                            module.__dict__.pop(name, None)

    def _registered(self, name: str) -> bool:
        return self.__dict__.get("_attributes_bound", False) and (
            name in self._parameters or name in self._buffers or name in self._modules)

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if self._registered(name):
            object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        if self._registered(name):
            self.__dict__.pop(name, None)
        super().__delattr__(name)
