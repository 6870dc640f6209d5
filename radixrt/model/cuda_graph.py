"""Decode steps replayed from captured graphs (CUDA graphs on a GPU): one launch instead of hundreds.

A decode step launches ~10 kernels per layer; from Python each costs more host time than the GPU spends on
it at small batches. :class:`GraphRunner` captures the model's decode forward once per batch-size bucket at
start-up and replays it:

- **Static buffers** sized for the largest bucket: token ids, positions, output slots, sequence lengths, a
  page table as wide as the longest context, and each bucket's logits. A bucket's captured forward reads the
  first ``bucket`` rows; ``run`` copies a batch into them (device to device, no sync) and replays the smallest
  bucket that holds it.
- **Padding rows** (a batch of 5 replays bucket 8) get slot -1 (the K/V store writes nothing), sequence
  length 1 and page 0 (they read one key of page 0, whatever it holds, and their logits are dropped). Rows
  left from an earlier, larger batch are padding again at every replay; page-table columns past a row's
  pages are never read (a row reads only the pages its length covers), so they need no clearing.
- **Exact only where it is exact**: decode-only batches (one new token per request) no larger than the
  largest bucket and no longer than the page table; anything else runs eagerly. Split counts of the decode
  kernel depend on the bucket and the page-table width only, so they are fixed per bucket.
- **Capture** runs each bucket eagerly first (Triton compiles and autotunes there, never during capture or
  on a user's request), largest bucket first so the smaller ones reuse its memory (one pool), under
  :class:`NoHostSync`: an op that would wait for the device or copy between host and device fails the
  capture with its name.

The graph itself comes from an injected factory (:class:`CudaGraphFactory` on a GPU), so tests on a CPU can
substitute one that records the closure and replays it by calling it again over the same static buffers.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from radixrt.model.forward_batch import ForwardBatch

logger = logging.getLogger("radixrt.cuda_graph")
aten = torch.ops.aten


def default_buckets(max_bs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every 8 up to 64 and every 16 beyond (SGLang's spacing)."""
    small = [b for b in (1, 2, 4, 8) if b < max_bs]
    return sorted({*small, *range(8, min(max_bs, 64) + 1, 8), *range(64, max_bs + 1, 16), max_bs})


class CapturedGraph(Protocol):
    output: torch.Tensor

    def replay(self) -> None: ...


GraphFactory = Callable[[Callable[[], torch.Tensor]], CapturedGraph]


class CudaGraphFactory:
    """Captures into ``torch.cuda.CUDAGraph``s that share one memory pool, on a side stream."""

    def __init__(self, device: torch.device) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)

    def __call__(self, fn: Callable[[], torch.Tensor]) -> CapturedGraph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            output = fn()
        return _Cuda(graph, output)


@dataclass
class _Cuda:
    graph: torch.cuda.CUDAGraph
    output: torch.Tensor

    def replay(self) -> None:
        self.graph.replay()


class ReplayByCall:
    """A stand-in factory where no CUDA graph exists (tests and dry runs on a CPU): the capture calls the closure
    once; a replay calls it again over the same static buffers and copies the result into the captured output,
    which is what a graph replay does with them."""

    def __init__(self) -> None:
        self.captured: list[int] = []  # the captured batch sizes, in capture order

    def __call__(self, fn: Callable[[], torch.Tensor]) -> CapturedGraph:
        graph = _Replayed(fn, fn())
        self.captured.append(graph.output.shape[0])
        return graph


@dataclass
class _Replayed:
    fn: Callable[[], torch.Tensor]
    output: torch.Tensor

    def replay(self) -> None:
        self.output.copy_(self.fn())


class HostSyncError(RuntimeError):
    """An op inside a captured region would wait for the device or copy between host and device."""


# ops that read a device value on the host, or whose output size depends on device values
_SYNCING = {
    aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default, aten.nonzero.default,
    aten.masked_select.default, aten._unique2.default, aten.unique_consecutive.default, aten.unique_dim.default,
    aten.repeat_interleave.Tensor, aten.bincount.default,
    aten.lift_fresh.default,  # a tensor made from host data (torch.tensor(...)): a host-to-device copy
}


class NoHostSync(TorchDispatchMode):
    """Fails any op that syncs with the device or moves data between host and device (capture must not)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SYNCING:
            raise HostSyncError(f"{func} syncs with the device inside a captured region")
        if func in (aten._to_copy.default, aten.copy_.default):
            tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            target = kwargs.get("device")
            devices = {t.device for t in tensors} | ({torch.device(target)} if target is not None else set())
            if len(devices) > 1:
                raise HostSyncError(f"{func} copies between {sorted(map(str, devices))} inside a captured region")
        return func(*args, **kwargs)


class GraphRunner:
    """Decode forwards of ``forward`` (a ForwardBatch to logits ``[B, vocab]``) replayed per bucket."""

    def __init__(self, forward: Callable[[ForwardBatch], torch.Tensor], max_bs: int, max_pages: int,
                 device: torch.device, factory: GraphFactory, buckets: list[int] | None = None) -> None:
        self.forward = forward
        self.buckets = sorted(buckets or default_buckets(max_bs))
        self.max_bs = self.buckets[-1]
        self.max_pages = max_pages
        self.device = torch.device(device)
        self.factory = factory
        n, kw = self.max_bs, {"device": self.device}
        self.input_ids = torch.zeros(n, dtype=torch.long, **kw)
        self.positions = torch.zeros(n, dtype=torch.long, **kw)
        self.out_slots = torch.full((n,), -1, dtype=torch.long, **kw)
        self.seq_lens = torch.ones(n, dtype=torch.int32, **kw)
        self.page_table = torch.zeros(n, max_pages, dtype=torch.int32, **kw)
        self.ones = torch.ones(n, dtype=torch.int32, **kw)
        self.rows = torch.arange(n, **kw)
        self.graphs: dict[int, CapturedGraph] = {}
        self.capture_seconds = 0.0
        self.capture_bytes = 0  # device memory the capture took from what the KV pool could have, where reported
        self.replays = 0

    def _static_batch(self, bs: int) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.input_ids[:bs], positions=self.positions[:bs], out_slots=self.out_slots[:bs],
            page_table=self.page_table[:bs], prefix_lens=self.seq_lens[:bs] - self.ones[:bs],
            extend_lens=self.ones[:bs], seq_lens=self.seq_lens[:bs], logits_indices=self.rows[:bs],
            logits_counts=[1] * bs, is_decode=True, max_extend_len=1,
        )

    def capture(self) -> None:
        """Warm every bucket up eagerly, then capture it; largest first."""
        started = time.perf_counter()
        used = self._device_used()
        for bs in reversed(self.buckets):
            self._reset_padding(0)
            self.forward(self._static_batch(bs))  # compiles and autotunes the kernels for this shape
            with NoHostSync():
                # prefix_lens is derived inside the capture, so it follows seq_lens at every replay
                self.graphs[bs] = self.factory(lambda bs=bs: self.forward(self._static_batch(bs)))
        self.capture_seconds = time.perf_counter() - started
        self.capture_bytes = self._device_used() - used

    def can_run(self, batch: ForwardBatch) -> bool:
        # device types: the runner's device may carry no index ("cuda") where its tensors say "cuda:0"
        return (batch.is_decode and batch.batch_size <= self.max_bs and batch.page_table.shape[1] <= self.max_pages
                and batch.input_ids.device.type == self.device.type)

    def bucket_for(self, bs: int) -> int:
        return next(b for b in self.buckets if b >= bs)

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """The batch's logits ``[B, vocab]``: a view of the bucket's output, valid until the next replay."""
        bs = batch.batch_size
        bucket = self.bucket_for(bs)
        self.input_ids[:bs].copy_(batch.input_ids)
        self.positions[:bs].copy_(batch.positions)
        self.out_slots[:bs].copy_(batch.out_slots)
        self.seq_lens[:bs].copy_(batch.seq_lens)
        self.page_table[:bs, : batch.page_table.shape[1]].copy_(batch.page_table)
        self._reset_padding(bs, bucket)
        graph = self.graphs[bucket]
        graph.replay()
        self.replays += 1
        return graph.output[:bs]

    def _reset_padding(self, start: int, end: int | None = None) -> None:
        """Rows ``start:end`` read page 0 for one key and write nothing."""
        end = self.max_bs if end is None else end
        if start < end:
            self.out_slots[start:end].fill_(-1)
            self.seq_lens[start:end].fill_(1)
            self.page_table[start:end, 0].fill_(0)
            self.positions[start:end].fill_(0)
            self.input_ids[start:end].fill_(0)

    def _device_used(self) -> int:
        """Bytes of the device in use, by this process or any (torch's reserve counts a graph pool's memory
        only partly: on the 1.07B shape it fell by 1.3 GB during a capture)."""
        if self.device.type != "cuda":
            return 0
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free
