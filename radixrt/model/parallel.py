"""Tensor-parallel building blocks.

Every linear layer knows how its weight is split over ``tp_size`` ranks and loads only its own shard, so
sharding a model over ``torch.distributed`` needs a process group, not a rewrite of the model. This
release runs one rank (``tp_size == 1``), where the layers are plain linear maps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from radixrt.model.cpu_linear import pack_weight, packed_linear


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1

    def shard(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        if self.size == 1:
            return tensor
        return tensor.chunk(self.size, dim=dim)[self.rank]

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            torch.distributed.all_reduce(tensor)
        return tensor


SINGLE = TPGroup()


def _param(shape: tuple[int, ...]) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape), requires_grad=False)


class PackableLinear(nn.Module):
    """A linear map whose weight can be swapped, after loading, for a CPU-prepacked copy (cpu_linear)."""

    weight: nn.Parameter | None
    packed: torch.Tensor | None = None

    def pack(self) -> bool:
        """Prepack the weight for the CPU and free the plain copy; False where this CPU/dtype has no kernel."""
        packed = pack_weight(self.weight)
        if packed is None:
            return False
        self.packed, self.weight = packed, None
        return True

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.packed is not None:
            return packed_linear(x, self.packed, bias)
        return F.linear(x, self.weight, bias)


class ColumnParallelLinear(PackableLinear):
    """``y = x W^T (+ b)`` with W split along its output rows; the output stays sharded.

    ``output_sizes`` lists the logical sub-matrices stacked in W (q/k/v, gate/up); each is sharded on
    its own so a rank holds matching slices of all of them.
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        assert all(size % tp.size == 0 for size in output_sizes)
        self.tp = tp
        self.local_sizes = [size // tp.size for size in output_sizes]
        self.weight = _param((sum(self.local_sizes), in_features))
        self.bias = _param((sum(self.local_sizes),)) if bias else None

    def load_shard(self, name: str, loaded: torch.Tensor, index: int = 0) -> None:
        param = self.weight if name == "weight" else self.bias
        offset = sum(self.local_sizes[:index])
        size = self.local_sizes[index]
        param.data[offset : offset + size].copy_(self.tp.shard(loaded, 0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)


class RowParallelLinear(PackableLinear):
    """``y = x W^T`` with W split along its input columns; partial sums are all-reduced."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        assert in_features % tp.size == 0
        self.tp = tp
        self.weight = _param((out_features, in_features // tp.size))
        self.bias = _param((out_features,)) if bias else None

    def load_shard(self, name: str, loaded: torch.Tensor, index: int = 0) -> None:
        if name == "weight":
            self.weight.data.copy_(self.tp.shard(loaded, 1))
        else:
            self.bias.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(self._matmul(x))
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    """Token embedding whose rows (the vocabulary) are split over ranks."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        assert vocab_size % tp.size == 0
        self.tp = tp
        self.vocab_start = tp.rank * (vocab_size // tp.size)
        self.weight = _param((vocab_size // tp.size, hidden_size))

    def load_shard(self, name: str, loaded: torch.Tensor, index: int = 0) -> None:
        self.weight.data.copy_(self.tp.shard(loaded, 0))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill(outside[:, None], 0))
