"""LoRA adapters over the base model: PEFT's format loaded, and the low-rank updates of a mixed batch.

An adapter is a folder as PEFT's ``save_pretrained`` writes it (``adapter_config.json`` and
``adapter_model.safetensors`` or ``.bin``), or a hub id. It may target any of the decoder's projections
(``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``) in any layers, each
module with its own rank. What PEFT can save and radixrt does not compute is refused with its name (DoRA,
trained biases, ``modules_to_save``, embedding or LM-head adapters, ``alpha_pattern``).

``Adapters`` holds the loaded ones, each under a name and a number that is never reused (``uid``): the radix
cache keeps each adapter's prefixes apart by that number, so an adapter loaded again under an old name never
meets K/V computed with the old weights.

A forward with adapter rows carries a ``LoraBatch`` (``ForwardBatch.lora``, radixrt.model.lora_batch): each
targeted projection adds ``scaling * (x A^T) B^T`` to the adapter's rows, as PEFT does.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from radixrt.model.lora_batch import LoraBatch, StackCache, lora_batch
from radixrt.model.weights import AdapterError, resolve_adapter_path

__all__ = ["AdapterError", "Adapter", "Adapters", "load_adapter", "projection_sizes", "resolve_adapter_path"]

# the checkpoint's projection -> (our merged module, its index among the merged outputs)
TARGETS = {
    "q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0),
}
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.lora_([AB])(?:\.\w+)?\.weight$")
_CONFIG_REFUSALS = (
    ("use_dora", lambda v: bool(v), "DoRA adapters"),
    ("bias", lambda v: v not in (None, "none"), "adapters with trained biases"),
    ("modules_to_save", lambda v: bool(v), "adapters with modules_to_save (whole modules trained beside the LoRA)"),
    ("alpha_pattern", lambda v: bool(v), "adapters with an alpha_pattern"),
    ("fan_in_fan_out", lambda v: bool(v), "fan_in_fan_out adapters (GPT-2 style Conv1D weights)"),
)


@dataclass
class ModuleUpdate:
    """One merged module's update in one layer: ``t = x @ a_t`` is every targeted sub-module's low-rank input at
    once; each part adds ``(t[:, ranks] @ b_t) * scaling`` to its output columns."""

    a_t: torch.Tensor  # [in, sum of ranks], float32
    parts: list[tuple[slice, slice, torch.Tensor, float]]  # (output columns, rank columns, b_t [rank, cols], scaling)


@dataclass
class Adapter:
    name: str
    path: str
    uid: int  # unique for the runtime's life; 0 is the base model
    rank: int  # the largest module rank
    targets: tuple[str, ...]
    updates: dict[tuple[int, str], ModuleUpdate] = field(default_factory=dict)  # (layer, merged module) -> update


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    safetensors = folder / "adapter_model.safetensors"
    if safetensors.is_file():
        from safetensors.torch import load_file

        return load_file(safetensors)
    bin_file = folder / "adapter_model.bin"
    if bin_file.is_file():
        return torch.load(bin_file, map_location="cpu", weights_only=True)
    raise AdapterError(f"{folder} has neither adapter_model.safetensors nor adapter_model.bin")


def _read_config(folder: Path) -> dict:
    try:
        config = json.loads((folder / "adapter_config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{folder}/adapter_config.json cannot be read: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{folder}/adapter_config.json is not a JSON object")
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise AdapterError(f"{folder} is a {peft_type} adapter; radixrt serves LoRA adapters")
    for key, refused, what in _CONFIG_REFUSALS:
        if refused(config.get(key)):
            raise AdapterError(f"radixrt does not serve {what} ({key}={config.get(key)!r})")
    return config


def projection_sizes(model_config) -> dict[str, tuple[int, int]]:
    """Each projection an adapter may target: its (in, out) features."""
    hidden = model_config.hidden_size
    head_dim = getattr(model_config, "head_dim", None) or hidden // model_config.num_attention_heads
    q = model_config.num_attention_heads * head_dim
    kv = model_config.num_key_value_heads * head_dim
    inter = model_config.intermediate_size
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def load_adapter(name: str, path: str, uid: int, model_config, device: torch.device, max_rank: int | None = None,
                 folder: str | None = None) -> Adapter:
    """Read, check and lay out one adapter for ``model_config``'s shapes; ``AdapterError`` says what is wrong.
    ``folder``: where ``path`` (a hub id, say) was already fetched to."""
    folder = resolve_adapter_path(folder or path)
    config = _read_config(folder)
    tensors = _read_tensors(folder)
    sizes = projection_sizes(model_config)
    layers = model_config.num_hidden_layers
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        found = _KEY.search(key)
        if found is None:
            raise AdapterError(f"adapter tensor {key!r} targets no projection radixrt serves adapters on "
                               f"({', '.join(TARGETS)})")
        layer, module, which = int(found[1]), found[2], found[3]
        if module not in TARGETS or layer >= layers:
            raise AdapterError(f"adapter tensor {key!r} has no place in this model")
        pairs.setdefault((layer, module), {})[which] = tensor
    if not pairs:
        raise AdapterError(f"{folder} holds no LoRA weights")
    alpha = float(config.get("lora_alpha", 8))  # PEFT's default
    rslora = bool(config.get("use_rslora"))
    by_merged: dict[tuple[int, str], list[tuple[int, torch.Tensor, torch.Tensor, float]]] = {}
    largest = 0
    for (layer, module), pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"layer {layer} {module}: the adapter has lora_{'A' if 'A' not in pair else 'B'} "
                               "missing")
        a, b = pair["A"], pair["B"]
        rank = a.shape[0]
        fan_in, fan_out = sizes[module]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != fan_in or b.shape != (fan_out, rank):
            raise AdapterError(f"layer {layer} {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do "
                               f"not fit a {fan_in} -> {fan_out} projection")
        if max_rank is not None and rank > max_rank:
            raise AdapterError(f"the adapter's rank {rank} is above --max-lora-rank {max_rank}")
        largest = max(largest, rank)
        scaling = alpha / math.sqrt(rank) if rslora else alpha / rank
        merged, index = TARGETS[module]
        by_merged.setdefault((layer, merged), []).append((index, a, b, scaling))
    adapter = Adapter(name, str(path), uid, largest,
                      tuple(sorted({m for (_, m) in pairs}, key=list(TARGETS).index)))
    for (layer, merged), subs in by_merged.items():
        adapter.updates[(layer, merged)] = _lay_out(merged, subs, sizes, device)
    return adapter


def _lay_out(merged: str, subs: list[tuple[int, torch.Tensor, torch.Tensor, float]],
             sizes: dict[str, tuple[int, int]], device: torch.device) -> ModuleUpdate:
    """One merged module's A matrices stacked (q, k and v's low-rank inputs in one product); each B kept apart with
    its scaling (radixrt.model.lora_batch lays them out for the forwards)."""
    names = [m for m, (target, _) in TARGETS.items() if target == merged]
    offsets, start = [], 0
    for module in names:
        offsets.append(start)
        start += sizes[module][1]
    a_parts, parts, rank_at = [], [], 0
    for index, a, b, scaling in sorted(subs, key=lambda s: s[0]):
        rank = a.shape[0]
        a_parts.append(a.float())
        out = slice(offsets[index], offsets[index] + b.shape[0])
        parts.append((out, slice(rank_at, rank_at + rank), b.float().t().contiguous().to(device), scaling))
        rank_at += rank
    a_t = torch.cat(a_parts).t().contiguous().to(device)
    return ModuleUpdate(a_t, parts)


class Adapters:
    """The loaded adapters, by name and by uid; what ``--lora-paths`` and load/unload calls change."""

    def __init__(self, model_config, device: torch.device, max_rank: int | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        self.model_config = model_config
        self.device = device
        self.max_rank = max_rank
        self.by_name: dict[str, Adapter] = {}
        self.by_uid: dict[int, Adapter] = {}
        self._next_uid = 1
        self.stacks = StackCache(dtype)  # the updates as the forwards use them, in the model's dtype

    def load(self, name: str, path: str, folder: str | None = None) -> Adapter:
        """Load ``path`` (read from ``folder`` when the caller fetched it already) under ``name``."""
        if not name or not isinstance(name, str):
            raise AdapterError("a LoRA adapter needs a non-empty name")
        if name in self.by_name:
            raise AdapterError(f"a LoRA adapter named {name!r} is already loaded")
        adapter = load_adapter(name, path, self._next_uid, self.model_config, self.device, self.max_rank, folder)
        self._next_uid += 1
        self.by_name[name] = adapter
        self.by_uid[adapter.uid] = adapter
        return adapter

    def unload(self, name: str) -> Adapter:
        adapter = self.by_name.pop(name, None)
        if adapter is None:
            raise AdapterError(f"no LoRA adapter named {name!r} is loaded")
        del self.by_uid[adapter.uid]
        self.stacks.forget(adapter.uid)
        return adapter

    def uid_of(self, name: str) -> int:
        adapter = self.by_name.get(name)
        if adapter is None:
            loaded = ", ".join(sorted(self.by_name)) or "none"
            raise AdapterError(f"unknown LoRA adapter {name!r} (loaded: {loaded})")
        return adapter.uid

    def batch(self, spans: list[tuple[int, int, int]] | None, num_rows: int) -> LoraBatch | None:
        """The updates of a forward of ``num_rows`` token rows whose adapter rows ``spans`` lists (see
        radixrt.model.lora_batch)."""
        if not spans:
            return None
        return lora_batch(spans, num_rows, self.by_uid, self.stacks, self.device)
