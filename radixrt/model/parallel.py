"""Tensor-parallel building blocks.

Every layer knows how its weight is split over ``tp_size`` ranks and loads only its own shard. With
``tp_size == 1`` the layers are plain linear maps and embeddings; with more ranks they call collectives on
``TPGroup.group`` (None: torch.distributed's default group, set up by ``radixrt.distributed.world``).

* ``ColumnParallelLinear``: output rows split; each stacked sub-matrix (q/k/v, gate/up) is split on its own.
  A sub-matrix with ``replicas`` r > 1 is split in ``size / r`` parts, each held by r consecutive ranks
  (K/V heads when ranks outnumber them, as SGLang does).
* ``RowParallelLinear``: input columns split, partial sums all-reduced, the bias added once after.
* ``VocabParallelEmbedding``: rows split, the vocabulary padded up to a multiple of ``tp_size`` with zero
  rows; a lookup masks ids of other ranks and all-reduces. As the LM head its logits shards are gathered
  by ``gather_logits`` and cut back to the real vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from radixrt.model.cpu_linear import PackedWeight, pack_weight, packed_linear
from radixrt.model.module import InferenceModule


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup; None: the default group

    def shard(self, tensor: torch.Tensor, dim: int, replicas: int = 1) -> torch.Tensor:
        """This rank's slice of ``tensor`` along ``dim``; ``replicas`` consecutive ranks share a slice."""
        if self.size == 1:
            return tensor
        parts = self.size // replicas
        if tensor.shape[dim] % parts:
            raise ValueError(f"a dimension of {tensor.shape[dim]} does not split into {parts} equal shards")
        return tensor.chunk(parts, dim=dim)[self.rank // replicas]

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            torch.distributed.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather_last(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along the last dimension, in rank order."""
        if self.size == 1:
            return tensor
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        torch.distributed.all_gather(parts, tensor, group=self.group)
        return torch.cat(parts, dim=-1)


SINGLE = TPGroup()


def _param(shape: tuple[int, ...]) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape), requires_grad=False)


class PackableLinear(InferenceModule):
    """A linear map whose weight can be swapped, after loading, for a CPU-prepacked copy (cpu_linear)."""

    weight: nn.Parameter | None
    packed: PackedWeight | None = None

    def pack(self, row_invariant: bool = False) -> bool:
        """Prepack the weight for the CPU and free the plain copy; False where this CPU/dtype has no kernel.
        ``row_invariant``: see :func:`cpu_linear.pack_weight`."""
        packed = pack_weight(self.weight, row_invariant)
        if packed is None:
            return False
        self.packed, self.weight = packed, None
        return True

    def product(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x W^T (+ bias)`` with this rank's weight, no collective: under tensor parallelism a row-split layer's
        partial sums (the mixture-of-experts block reduces its experts' at once)."""
        if self.packed is not None:
            return packed_linear(x, self.packed, bias)
        return F.linear(x, self.weight, bias)


class ColumnParallelLinear(PackableLinear):
    """``y = x W^T (+ b)`` with W split along its output rows; the output stays sharded.

    ``output_sizes`` lists the logical sub-matrices stacked in W (q/k/v, gate/up); each is sharded on
    its own so a rank holds matching slices of all of them. ``replicas[i]`` ranks share sub-matrix i's slice.
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, tp: TPGroup = SINGLE,
                 replicas: list[int] | None = None) -> None:
        super().__init__()
        self.replicas = replicas or [1] * len(output_sizes)
        for size, r in zip(output_sizes, self.replicas):
            if tp.size % r or (size * r) % tp.size:
                raise ValueError(f"an output of {size} does not split over {tp.size} ranks ({r} per shard)")
        self.tp = tp
        self.local_sizes = [size * r // tp.size for size, r in zip(output_sizes, self.replicas)]
        self.weight = _param((sum(self.local_sizes), in_features))
        self.bias = _param((sum(self.local_sizes),)) if bias else None

    def load_shard(self, name: str, loaded: torch.Tensor, index: int = 0) -> None:
        param = self.weight if name == "weight" else self.bias
        offset = sum(self.local_sizes[:index])
        size = self.local_sizes[index]
        param.data[offset : offset + size].copy_(self.tp.shard(loaded, 0, self.replicas[index]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.bias)


class RowParallelLinear(PackableLinear):
    """``y = x W^T`` with W split along its input columns; partial sums are all-reduced."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        if in_features % tp.size:
            raise ValueError(f"an input of {in_features} does not split over {tp.size} ranks")
        self.tp = tp
        self.weight = _param((out_features, in_features // tp.size))
        self.bias = _param((out_features,)) if bias else None

    def load_shard(self, name: str, loaded: torch.Tensor, index: int = 0) -> None:
        if name == "weight":
            self.weight.data.copy_(self.tp.shard(loaded, 1))
        else:
            self.bias.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(self.product(x))
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(InferenceModule):
    """Token embedding whose rows (the vocabulary, padded to a multiple of the rank count) are split over ranks."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.rows_per_rank = -(-vocab_size // tp.size)
        self.vocab_start = tp.rank * self.rows_per_rank
        self.weight = _param((self.rows_per_rank, hidden_size))

    def load_shard(self, name: str, loaded: torch.Tensor, index: int = 0) -> None:
        padding = self.rows_per_rank * self.tp.size - loaded.shape[0]
        if padding:
            loaded = F.pad(loaded, (0, 0, 0, padding))
        self.weight.data.copy_(self.tp.shard(loaded, 0))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.rows_per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill(outside[:, None], 0))

    def gather_logits(self, local_logits: torch.Tensor) -> torch.Tensor:
        """Logits over the whole vocabulary from each rank's ``[rows, rows_per_rank]`` shard."""
        return self.tp.all_gather_last(local_logits)[..., : self.vocab_size]
