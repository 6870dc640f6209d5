"""A forward's LoRA updates: each projection adds ``scaling * (x A^T) B^T`` to the rows of each adapter in the batch.

Each module's update is laid out once per set of adapters (``Stack``, in the model's dtype): their A side by side
(``x @ a_t`` is every adapter's low-rank input at once) and their B stacked below each other, each scaled, so
the update is ``(x @ a_t) @ b``. The products accumulate in float32; in bfloat16 the low-rank input and (in
decode steps) the update are rounded to bfloat16 before they are added, where PEFT keeps them in float32: the
same values within bfloat16's rounding. Two ways:

- stacked (decode and verify steps, at most ``STACKED_MAX_ROWS`` rows): every row through the stack of all the
  batch's adapters, the columns of other adapters than its own masked to zero: four operations a module,
  however many adapters share the batch, the two products on the CPU's packed linear kernels
  (radixrt.model.cpu_linear), which at decode sizes cost less than torch's products;
- grouped (prefill chunks): each adapter's rows, a slice where they are contiguous, through its own stack.

The stacks of the latest sets of adapters are kept (``StackCache``): a decode batch keeps its adapters for many
steps. Rows without an adapter are left as the base projection wrote them: grouped never touches them, stacked
adds exact zeros to them.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from radixrt.model.cpu_linear import PackedWeight, pack_weight, packed_linear

if TYPE_CHECKING:
    from radixrt.model.lora import Adapter

STACKED_MAX_ROWS = 256  # rows up to which every row goes through every adapter of the batch
STACKS_KEPT = 4  # sets of adapters whose stacks are kept

Rows = slice | torch.Tensor


@dataclass
class Stack:
    """One module's updates of a set of adapters, side by side: ``x @ a_t`` is every adapter's low-rank input,
    ``owner[c]`` the adapter (its index in the set) column c belongs to, ``b`` every B scaled, stacked."""

    a_t: torch.Tensor  # [in, columns]
    b: torch.Tensor  # [columns, out]
    owner: torch.Tensor  # [columns], int64
    packed_a: PackedWeight | None = None  # a_t and b packed for the CPU's kernels (None: torch's products)
    packed_b: PackedWeight | None = None

    def low_rank(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.a_t if self.packed_a is None else packed_linear(x, self.packed_a)

    def add_update(self, low: torch.Tensor, y: torch.Tensor) -> None:
        if self.packed_b is None:
            y.addmm_(low, self.b)
        else:
            y.add_(packed_linear(low, self.packed_b))


def build_stacks(adapters: list[Adapter], dtype: torch.dtype) -> dict[tuple[int, str], Stack]:
    """The stacks of every (layer, module) at least one of ``adapters`` targets."""
    keys = sorted({key for adapter in adapters for key in adapter.updates})
    stacks = {}
    for key in keys:
        a_parts, owners, blocks = [], [], []
        for index, adapter in enumerate(adapters):
            update = adapter.updates.get(key)
            if update is None:
                continue
            a_parts.append(update.a_t)
            owners.append(torch.full((update.a_t.shape[1],), index, dtype=torch.int64))
            blocks.append(update)
        out_features = max(columns.stop for update in blocks for columns, _, _, _ in update.parts)
        b = torch.zeros(sum(a.shape[1] for a in a_parts), out_features, device=a_parts[0].device)
        at = 0
        for update in blocks:
            for columns, ranks, b_t, scaling in update.parts:
                b[at + ranks.start : at + ranks.stop, columns] = b_t * scaling
            at += update.a_t.shape[1]
        a_t, b = torch.cat(a_parts, dim=1).to(dtype), b.to(dtype)
        stacks[key] = Stack(a_t, b, torch.cat(owners).to(b.device), pack_weight(a_t.t().contiguous()),
                            pack_weight(b.t().contiguous()))
    return stacks


class StackCache:
    """The stacks of the latest sets of adapters, by their uids; an unloaded adapter's sets are forgotten."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self._sets: OrderedDict[tuple[int, ...], dict[tuple[int, str], Stack]] = OrderedDict()

    def get(self, adapters: list[Adapter]) -> dict[tuple[int, str], Stack]:
        key = tuple(a.uid for a in adapters)
        stacks = self._sets.get(key)
        if stacks is None:
            stacks = self._sets[key] = build_stacks(adapters, self.dtype)
            while len(self._sets) > STACKS_KEPT:
                self._sets.popitem(last=False)
        self._sets.move_to_end(key)
        return stacks

    def forget(self, uid: int) -> None:
        for key in [k for k in self._sets if uid in k]:
            del self._sets[key]


@dataclass
class GroupedLora:
    groups: list[tuple[dict[tuple[int, str], Stack], Rows]]  # each adapter's own stacks, and its rows

    def add(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add the update of ``module`` in ``layer`` to ``y`` (the base projection of ``x``) in place."""
        for stacks, rows in self.groups:
            stack = stacks.get((layer, module))
            if stack is None:
                continue
            if isinstance(rows, slice):
                y[rows].addmm_(x[rows] @ stack.a_t, stack.b)
            else:
                y.index_add_(0, rows, (x[rows] @ stack.a_t) @ stack.b)


@dataclass
class StackedLora:
    stacks: dict[tuple[int, str], Stack]
    row_owner: torch.Tensor  # [rows], the index of each row's adapter in the set; -1: the base model
    _masks: dict[int, torch.Tensor] = field(default_factory=dict)  # by id of a stack's owner: ranks of one layout

    def add(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """As ``GroupedLora.add``."""
        stack = self.stacks.get((layer, module))
        if stack is None:
            return
        mask = self._masks.get(id(stack.owner))
        if mask is None:
            mask = (self.row_owner[:, None] == stack.owner[None, :]).to(y.dtype)
            self._masks[id(stack.owner)] = mask
        stack.add_update(stack.low_rank(x).mul_(mask), y)


LoraBatch = GroupedLora | StackedLora  # what each targeted projection calls ``add`` on


def lora_batch(spans: list[tuple[int, int, int]], num_rows: int, by_uid: dict[int, Adapter], stacks: StackCache,
               device: torch.device) -> LoraBatch | None:
    """The updates of a forward of ``num_rows`` token rows whose adapter rows are the ``(uid, start, end)`` spans
    (uid 0, the base model, left out)."""
    by_adapter: dict[int, list[tuple[int, int]]] = {}
    for uid, start, end in spans:
        if uid:
            by_adapter.setdefault(uid, []).append((start, end))
    if not by_adapter:
        return None
    if num_rows <= STACKED_MAX_ROWS:
        adapters = [by_uid[uid] for uid in sorted(by_adapter)]
        owner = torch.full((num_rows,), -1, dtype=torch.int64)
        for index, adapter in enumerate(adapters):
            for start, end in by_adapter[adapter.uid]:
                owner[start:end] = index
        return StackedLora(stacks.get(adapters), owner.to(device, non_blocking=True))
    return GroupedLora([(stacks.get([by_uid[uid]]), _rows(ranges, device)) for uid, ranges in by_adapter.items()])
def _rows(ranges: list[tuple[int, int]], device: torch.device) -> Rows:
    """Row ranges as one slice where they join up, else as an index tensor."""
    merged = [list(ranges[0])]
    for start, end in ranges[1:]:
        if start == merged[-1][1]:
            merged[-1][1] = end
        else:
            merged.append([start, end])
    if len(merged) == 1:
        return slice(*merged[0])
    index = [i for start, end in merged for i in range(start, end)]
    return torch.tensor(index, dtype=torch.int64).to(device, non_blocking=True)
