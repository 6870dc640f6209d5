"""A model's parameters moved to host memory and back, in place (SGLang's ``--enable-weights-cpu-backup``, vLLM's
sleep level 1): each parameter storage is copied to host memory (pinned where the device is a GPU) and shrunk to
nothing, so the device memory is free; ``restore`` allocates every storage again and copies its bytes back. The
tensors stay the same objects (views, tied weights and attributes bound to them still hold), their addresses change
(decode graphs must be captured again). Buffers (rotary tables) stay where they are. Tensors that are not parameters,
such as weights packed for the CPU's kernels, are not moved: on a CPU weights are in host memory already.
"""

from __future__ import annotations

import torch


def offload(model: torch.nn.Module) -> list[tuple[torch.UntypedStorage, torch.UntypedStorage]]:
    """Move every parameter storage of ``model`` to host memory; returns each with its host copy, for ``restore``."""
    saved, seen = [], set()
    for param in model.parameters():
        storage = param.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:  # tied weights share one
            continue
        seen.add(storage.data_ptr())
        host = torch.UntypedStorage(storage.nbytes(), device="cpu")
        if storage.device.type == "cuda":
            host = host.pin_memory()
        host.copy_(storage)
        storage.resize_(0)
        saved.append((storage, host))
    return saved


def restore(saved: list[tuple[torch.UntypedStorage, torch.UntypedStorage]]) -> None:
    """Give each storage ``offload`` emptied its bytes back."""
    for storage, host in saved:
        storage.resize_(host.nbytes())
        storage.copy_(host)
