"""Host arrays to device tensors in one copy: the host side of a step never waits for the device.

:func:`stage` packs numpy arrays into one pinned buffer and copies it to the device without blocking; each array
comes back as a view of the device copy with its own dtype and shape. On the CPU the arrays' own memory is used.
torch's pinned-memory cache hands a buffer out again only once the copy that read it has finished, so staging
the next step while the device still works on this one is safe. Imports nothing of the runtime.
"""

from __future__ import annotations

import numpy as np
import torch

# every part starts 64-byte aligned: viewable as any dtype, and always aligned alike for Triton, which compiles a
# variant per pointer alignment (a part at 8 bytes one step and 16 the next would compile on a user's request)
_ALIGN = 64


def stage(arrays: dict[str, np.ndarray], device: str | torch.device) -> dict[str, torch.Tensor]:
    """``arrays`` as tensors on ``device`` (same names, dtypes and shapes)."""
    device = torch.device(device)
    arrays = {name: np.ascontiguousarray(a) for name, a in arrays.items()}
    if device.type == "cpu":
        return {name: torch.from_numpy(a) for name, a in arrays.items()}
    offsets, size = {}, 0
    for name, a in arrays.items():
        offsets[name] = size
        size += -(-a.nbytes // _ALIGN) * _ALIGN
    host = torch.empty(max(size, _ALIGN), dtype=torch.uint8, pin_memory=device.type == "cuda")
    view = host.numpy()
    for name, a in arrays.items():
        view[offsets[name] : offsets[name] + a.nbytes] = a.reshape(-1).view(np.uint8)
    on_device = host.to(device, non_blocking=True)
    return {name: on_device[offsets[name] : offsets[name] + a.nbytes].view(_torch_dtype(a)).view(a.shape)
            for name, a in arrays.items()}


def _torch_dtype(a: np.ndarray) -> torch.dtype:
    return _TORCH_DTYPES.get(a.dtype) or torch.from_numpy(a[:0].reshape(-1)).dtype


# numpy to torch without making a tensor (a staged batch asks for eight at every step)
_TORCH_DTYPES = {np.dtype(n): t for n, t in [(np.int64, torch.int64), (np.int32, torch.int32),
                                             (np.float32, torch.float32), (np.float64, torch.float64),
                                             (np.bool_, torch.bool)]}
