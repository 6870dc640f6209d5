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

from radixrt.model.cpu_linear import PackedWeight, pack_fp8_weight, pack_weight, packed_linear
from radixrt.model.fp8 import Fp8Weight
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
    """A linear map whose weight can be swapped, after loading, for a CPU-prepacked copy (cpu_linear). Its weight may
    come as fp8 (``model/fp8.py``): bits and per-row scales loaded shard by shard into ``fp8``, the float weight a
    placeholder until :meth:`pack` or :meth:`dequantize_fp8` makes the weight the layer runs."""

    weight: nn.Parameter | None
    packed: PackedWeight | None = None
    fp8: Fp8Weight | None = None

    def pack(self, row_invariant: bool = False, block_k: int = 0) -> bool:
        """Prepack the weight for the CPU and free the plain copy; False where this CPU/dtype has no kernel.
        ``row_invariant``: see :func:`cpu_linear.pack_weight`. An fp8 weight (scales in blocks of ``block_k``
        inputs) takes the fp8 kernel where it runs, else is dequantized and packed as any other."""
        if self.fp8 is not None:
            fp8 = self.fp8
            packed = pack_fp8_weight(fp8.bits, fp8.scales, block_k, fp8.k_offset, self.weight.dtype)
            if packed is not None:
                self.packed, self.weight, self.fp8 = packed, None, None
                return True
            self.dequantize_fp8(block_k)
        packed = pack_weight(self.weight, row_invariant)
        if packed is None:
            return False
        self.packed, self.weight = packed, None
        return True

    def dequantize_fp8(self, block_k: int) -> None:
        """An fp8 weight as a plain one in the layer's dtype (that of its placeholder: the model's)."""
        if self.fp8 is not None:
            self.weight = nn.Parameter(self.fp8.dequantize(block_k, self.weight.dtype), requires_grad=False)
            self.fp8 = None

    def _fp8_target(self, name: str, loaded: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        """Where an fp8 shard goes (``name``: ``weight``, its bits, or ``weight_scale``): the layer's fp8 bits
        ``[rows, cols]`` or its scales ``[rows, blocks]``, made on the first shard (the float weight becomes a
        placeholder then)."""
        if self.fp8 is None:
            if getattr(self, "_float_loaded", False):
                raise ValueError("a merged projection mixes fp8 and unquantized parts")
            device = self.weight.device
            self.fp8 = Fp8Weight(torch.zeros((rows, cols), dtype=torch.uint8, device=device),
                                 torch.zeros((rows, 0), dtype=torch.float32, device=device))
            self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype, device=device), requires_grad=False)
        if name == "weight":
            return self.fp8.bits
        if self.fp8.scales.shape[1] != loaded.shape[1]:
            self.fp8.scales = torch.zeros((rows, loaded.shape[1]), dtype=torch.float32, device=self.fp8.bits.device)
        return self.fp8.scales

    def _float_target(self, name: str) -> torch.Tensor:
        if name == "weight":
            if self.fp8 is not None:
                raise ValueError("a merged projection mixes fp8 and unquantized parts")
            self._float_loaded = True
        return (self.weight if name == "weight" else self.bias).data

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
        self.in_features = in_features
        self.weight = _param((sum(self.local_sizes), in_features))
        self.bias = _param((sum(self.local_sizes),)) if bias else None

    def load_shard(self, name: str, loaded: torch.Tensor, index: int = 0) -> None:
        """``name``: ``weight``, ``bias``, or an fp8 weight's ``weight`` (uint8 bits) and ``weight_scale``."""
        rows = sum(self.local_sizes)
        if name == "weight_scale" or loaded.dtype == torch.uint8:
            target = self._fp8_target(name, loaded, rows, self.in_features)
        else:
            target = self._float_target(name)
        offset = sum(self.local_sizes[:index])
        size = self.local_sizes[index]
        target[offset : offset + size].copy_(self.tp.shard(loaded, 0, self.replicas[index]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.bias)


class RowParallelLinear(PackableLinear):
    """``y = x W^T`` with W split along its input columns; partial sums are all-reduced."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        if in_features % tp.size:
            raise ValueError(f"an input of {in_features} does not split over {tp.size} ranks")
        self.tp = tp
        self.out_features, self.local_in = out_features, in_features // tp.size
        self.weight = _param((out_features, self.local_in))
        self.bias = _param((out_features,)) if bias else None

    def load_shard(self, name: str, loaded: torch.Tensor, index: int = 0) -> None:
        """``name``: ``weight``, ``bias``, or an fp8 weight's ``weight`` (uint8 bits) and ``weight_scale`` (all of
        its blocks: the shard's first input, ``k_offset``, picks its own)."""
        if name == "weight_scale":
            self._fp8_target(name, loaded, self.out_features, self.local_in).copy_(loaded)
        elif loaded.dtype == torch.uint8:
            self._fp8_target(name, loaded, self.out_features, self.local_in).copy_(self.tp.shard(loaded, 1))
            self.fp8.k_offset = self.tp.rank * self.local_in
        else:
            self._float_target(name).copy_(self.tp.shard(loaded, 1) if name == "weight" else loaded)

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
