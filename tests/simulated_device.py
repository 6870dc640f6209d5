"""A stand-in accelerator for machines without one: tensors that compute on the CPU but sit on another device.

Inside ``simulated_device()``, a tensor made on the device ``meta`` (``torch.zeros(..., device="meta")``,
``x.to("meta")``, ``with torch.device("meta")``) is a :class:`OnDevice`: it holds a real CPU tensor and
reports ``meta`` as its device, so code that branches on ``device.type == "cpu"`` takes its accelerator
path, and every value is still computed and can be read back (``.tolist()``, ``.item()``, ``.cpu()``).

Every op is checked the way CUDA checks it, and :class:`DeviceMismatch` is raised where CUDA would raise:

- an op mixing device tensors with CPU tensors that are not 0-dim (CUDA takes CPU scalars, nothing more);
  copies (``copy_``, ``to``) may cross, and indexing (``x[i]``, ``x[i] = v``) may take CPU indices;
- a CPU ``torch.Generator`` drawing into a device tensor.

No generator can live on ``meta``: inside the block, ``torch.Generator(device="meta")`` makes a CPU one.

The mode is per thread: build and run what is checked on the thread that entered it.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

DEVICE = torch.device("meta")
CPU = torch.device("cpu")

aten = torch.ops.aten
# ops that may move data between the devices
_COPIES = {aten.copy_.default, aten._to_copy.default, *(getattr(aten.to, name) for name in aten.to.overloads())}
# ops whose index tensors CUDA accepts on the CPU (it moves them itself)
_INDEXING = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default}


class DeviceMismatch(RuntimeError):
    """A CPU tensor or generator met a device tensor where CUDA would refuse it."""


class OnDevice(torch.Tensor):
    """A tensor on the simulated device; ``inner`` holds its data on the CPU."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> "OnDevice":
        wrapper = torch.Tensor._make_wrapper_subclass(
            cls, inner.shape, strides=inner.stride(), storage_offset=inner.storage_offset(), dtype=inner.dtype,
            device=DEVICE, requires_grad=inner.requires_grad,
        )
        wrapper.inner = inner
        return wrapper

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"{func} ran on a simulated-device tensor outside simulated_device()")

    def tolist(self):  # not dispatched for tensor subclasses
        return self.inner.tolist()

    # Python indexing turns a list index into a tensor on the indexed tensor's device without dispatching an
    # op, which here would be a meta tensor without data: give it a CPU index instead, as CUDA allows.
    def __getitem__(self, index):
        return super().__getitem__(_host_lists(index))

    def __setitem__(self, index, value) -> None:
        super().__setitem__(_host_lists(index), value)

    def __repr__(self) -> str:
        return f"OnDevice({self.inner!r})"


def _host_lists(index):
    if isinstance(index, list):
        return torch.tensor(index, device=CPU)
    if isinstance(index, tuple):
        return tuple(_host_lists(i) for i in index)
    return index


def _target_device(func, args, kwargs) -> torch.device | None:
    """The device an op is asked to put its result on, if it names one."""
    if func is aten.to.other:
        return args[1].device
    device = kwargs.get("device")
    if device is None:
        device = next((a for a in args if isinstance(a, torch.device)), None)
    return None if device is None else torch.device(device)


def _check(func, args, kwargs, on_device: list[OnDevice], on_cpu: list[torch.Tensor]) -> None:
    if any(t.device == DEVICE for t in on_cpu):  # would compute nothing, silently
        raise RuntimeError(f"{func} got a {DEVICE} tensor without data, made where the simulation cannot see")
    if not on_device or func in _COPIES:
        return
    checked = on_cpu
    if func in _INDEXING:
        indices, _ = tree_flatten(args[1])
        checked = [t for t in on_cpu if not any(t is i for i in indices)]
    shapes = [tuple(t.shape) for t in checked if t.dim() > 0]
    if shapes:
        raise DeviceMismatch(f"{func}: CPU tensors of shapes {shapes} meet {DEVICE} tensors")
    leaves, _ = tree_flatten((args, kwargs))
    for leaf in leaves:
        if isinstance(leaf, _GENERATOR) and leaf.device != DEVICE:
            raise DeviceMismatch(f"{func}: a {leaf.device} generator draws into a {DEVICE} tensor")


class _SimulatedDevice(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves, _ = tree_flatten((args, kwargs))
        on_device = [t for t in leaves if isinstance(t, OnDevice)]
        on_cpu = [t for t in leaves if isinstance(t, torch.Tensor) and not isinstance(t, OnDevice)]  # or bare meta
        _check(func, args, kwargs, on_device, on_cpu)
        target = _target_device(func, args, kwargs)
        to_device = bool(on_device) if target is None else target == DEVICE
        if target == DEVICE:
            args, kwargs = tree_map(lambda a: CPU if isinstance(a, torch.device) and a == DEVICE else a, (args, kwargs))
        wrapper_of = {id(t.inner): t for t in on_device}
        args, kwargs = tree_map(lambda a: a.inner if isinstance(a, OnDevice) else a, (args, kwargs))
        out = func(*args, **kwargs)

        def rewrap(result):
            if not isinstance(result, torch.Tensor):
                return result
            if id(result) in wrapper_of:  # an in-place op, or a no-op `to`, returned its input
                return wrapper_of[id(result)] if to_device else result.clone()
            if not to_device:
                return result
            # the wrapper is an inference tensor exactly when its data is (views of it set version counters)
            with torch.inference_mode(result.is_inference()):
                return OnDevice(result)

        return tree_map(rewrap, out)


class _DataConstructors(TorchFunctionMode):
    """``torch.tensor(data, device=...)`` and its kin build a meta tensor without dispatching an op: build
    them on the CPU and move them (a dispatched copy)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FROM_DATA and kwargs.get("device") is not None and torch.device(kwargs["device"]) == DEVICE:
            return func(*args, **{**kwargs, "device": CPU}).to(DEVICE)
        return func(*args, **kwargs)


_FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray}
_GENERATOR = torch.Generator


class _StandInGenerator(_GENERATOR):
    def __new__(cls, device=None):
        if device is None:
            return _GENERATOR.__new__(cls)
        return _GENERATOR.__new__(cls, CPU if torch.device(device) == DEVICE else device)

    def __init__(self, device=None) -> None:
        pass


@contextmanager
def simulated_device() -> Iterator[torch.device]:
    """Run the block with ``meta`` as a checked stand-in accelerator (see the module docstring)."""
    torch.Generator = _StandInGenerator
    try:
        with _SimulatedDevice(), _DataConstructors():
            yield DEVICE
    finally:
        torch.Generator = _GENERATOR
