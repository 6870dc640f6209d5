"""New weights for the served model without a restart (SGLang's ``update_weights_from_disk``).

``update_tensors`` takes some of the checkpoint's tensors by name instead (SGLang's ``update_weights_from_tensor``, as
a trainer sends its parameters a bucket at a time, or broadcasts them: radixrt.model.weight_group): each must be a
tensor of the served checkpoint, of its shape, all checked before any is loaded. Each is then copied into its place
(``update_weights_in_place``): a plain parameter keeps its address (CUDA's decode graphs replay it); a layer packed
for the CPU's kernels is loaded and packed again (read back through its kernel first where the bucket fills only
some of a merged weight), so a bucket costs about its own size and no checkpoint file is read. Where weights are
fp8, the runner keeps every tensor sent since its checkpoint was read (``ModelRunner.overlay``: host memory up to
the model's size) and builds the model from the checkpoint with those in their places; an update from disk clears
them. ``tensor_record`` and
``tensors_from_records`` carry tensors across a process boundary as bytes; ``ModelRunner.read_weight`` reads a
tensor's served values back (SGLang's ``get_weights_by_name``).

The new checkpoint must be the served model with other weights: its config, read as the served one is
(``--json-model-override-args`` applied), equals the served config but for ``METADATA``, fields that cannot change a
forward (names, versions, the dtype it was saved in, special token ids). The tokenizer, the chat template and the
ids that end generation stay those loaded at start.

``ModelRunner.update_weights`` builds a complete model from the new checkpoint first, so a failure (no such folder,
a tensor missing or of another shape, another config) leaves the served weights as they were. Then the new weights
take the old ones' place:

- where the served model holds plain tensors only (CUDA; a CPU with packed linear layers turned off),
  ``copy_parameters`` copies each parameter into the served one: CUDA graphs captured over those tensors stay
  valid, and the new model is built in host memory, so the device needs no room for a second copy;
- where linear layers are packed for the CPU's kernels, the new model replaces the old one (host memory holds both
  while it is built).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

# Config fields that cannot change what a forward computes.
METADATA = frozenset({
    "_name_or_path", "_model_name_or_path", "_commit_hash", "transformers_version", "dtype", "torch_dtype",
    "use_cache", "output_attentions", "output_hidden_states", "return_dict", "bos_token_id", "eos_token_id",
    "pad_token_id",
})


def check_same_model(served, new) -> None:
    """A ``ValueError`` naming the fields where config ``new`` differs from ``served`` (``METADATA`` aside)."""
    old_fields, new_fields = served.to_dict(), new.to_dict()
    differ = sorted(k for k in (old_fields.keys() | new_fields.keys()) - METADATA
                    if old_fields.get(k) != new_fields.get(k))
    if differ:
        shown = ", ".join(f"{k}: {old_fields.get(k)!r} -> {new_fields.get(k)!r}" for k in differ[:4])
        more = f" and {len(differ) - 4} more" if len(differ) > 4 else ""
        raise ValueError(f"the new checkpoint is not the served model with other weights: its config differs in "
                         f"{shown}{more}; start a server for another model instead")


def copy_parameters(served: torch.nn.Module, new: torch.nn.Module) -> int:
    """Copy every parameter of ``new`` into the same parameter of ``served`` (any device), after checking that both
    have the same parameters with the same shapes and dtypes; returns how many were copied."""
    pairs = list(zip(served.named_parameters(), new.named_parameters()))
    served_names = [name for name, _ in served.named_parameters()]
    new_names = [name for name, _ in new.named_parameters()]
    if served_names != new_names:
        raise ValueError(f"the new model's parameters differ: {sorted(set(served_names) ^ set(new_names))[:4]}")
    for (name, old), (_, value) in pairs:
        if old.shape != value.shape or old.dtype != value.dtype:
            raise ValueError(f"parameter {name}: {tuple(value.shape)} {value.dtype} where the served model has "
                             f"{tuple(old.shape)} {old.dtype}")
    with torch.no_grad():
        for (_, old), (_, value) in pairs:
            old.copy_(value)
    return len(pairs)


def checkpoint_shapes(model_path: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint at ``model_path`` and its shape, read from the files' headers."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(file, framework="pt") as handle:
            for name in handle.keys():
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return shapes


def check_tensor_names(shapes: dict[str, tuple[int, ...]], tensors: dict[str, torch.Tensor]) -> None:
    """A ``ValueError`` for no tensor, or one the checkpoint lacks or holds in another shape."""
    if not tensors:
        raise ValueError("no tensor to update")
    for name, tensor in tensors.items():
        if name not in shapes:
            raise ValueError(f"{name!r} is not a tensor of the served checkpoint (names as in its safetensors files)")
        if tuple(tensor.shape) != shapes[name]:
            raise ValueError(f"{name!r} has shape {tuple(tensor.shape)}; the served checkpoint's is {shapes[name]}")


def tensor_record(name: str, tensor: torch.Tensor) -> tuple[str, str, list[int], bytes]:
    """``(name, dtype, shape, bytes)``: a tensor as plain values (msgpack carries them between processes)."""
    tensor = tensor.detach().to("cpu").contiguous()
    data = tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
    return name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), data


def tensors_from_records(records) -> dict[str, torch.Tensor]:
    """``tensor_record``'s values back as tensors (a ``ValueError`` for a dtype or size that does not fit)."""
    out: dict[str, torch.Tensor] = {}
    for name, dtype, shape, data in records:
        kind = getattr(torch, dtype, None)
        if not isinstance(kind, torch.dtype):
            raise ValueError(f"{name!r}: unknown dtype {dtype!r}")
        flat = torch.frombuffer(bytearray(data), dtype=kind) if data else torch.empty(0, dtype=kind)
        if flat.numel() != math.prod(shape):
            raise ValueError(f"{name!r}: {len(data)} bytes do not hold a {dtype} tensor of shape {shape}")
        out[name] = flat.reshape(shape)
    return out
