"""The KV cache tensors and the allocator of their fixed-size pages.

Every layer has a K and a V tensor of shape ``[num_pages, page_size, kv_heads, head_dim]``. A page is the
unit of allocation and sharing: it is handed out with a reference count of one, shared by
``incref``, and returns to the free list when ``decref`` brings its count to zero.

On the CPU the tensors live in one anonymous memory map: the kernel hands its pages out zeroed and only when
first written, so a pool sized to a share of the machine's memory (:func:`default_budget_bytes`) costs
nothing at start-up and only as much resident memory as the cache has ever held.

``release_memory`` gives the tensors' memory back while their contents are not needed (SGLang's
``release_memory_occupation``): on the CPU the map's pages are removed (its addresses stay, zero when next read), on
a GPU each tensor's storage shrinks to nothing and ``restore_memory`` allocates it again, zeroed, at new addresses
(captured CUDA graphs must be captured again). The allocator's state is untouched: its caller frees every page first.
"""

from __future__ import annotations

import logging
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger(__name__)

CPU_SHARE_OF_AVAILABLE = 0.4  # of the memory available at start-up, for the default CPU pool
CUDA_SHARE_OF_FREE = 0.85  # of the device memory still free once the weights are loaded


class OutOfPagesError(RuntimeError):
    """Raised when more pages are requested than are free."""


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype

    @property
    def bytes_per_page(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.page_size * self.kv_heads * self.head_dim * element

    def pages_for_budget(self, memory_bytes: float) -> int:
        return int(memory_bytes // self.bytes_per_page)


class PagePool:
    def __init__(self, layout: KVLayout, num_pages: int, device: str | torch.device = "cpu",
                 lazy: bool | None = None) -> None:
        """``lazy`` (the default on a CPU, which only it can be): the tensors in one anonymous map, see the module
        doc."""
        if num_pages < 1:
            raise ValueError(f"the KV pool needs at least one page, got {num_pages}")
        if layout.page_size < 1:
            raise ValueError(f"page size must be >= 1, got {layout.page_size}")
        self.layout = layout
        self.page_size = layout.page_size
        self.num_pages = num_pages
        shape = (num_pages, layout.page_size, layout.kv_heads, layout.head_dim)
        self._region: mmap.mmap | None = None
        if lazy if lazy is not None else torch.device(device).type == "cpu":
            self._region, whole = _zeroed_on_first_touch((2 * layout.num_layers, *shape), layout.dtype)
            caches = list(whole)
        else:
            caches = [torch.zeros(shape, dtype=layout.dtype, device=device) for _ in range(2 * layout.num_layers)]
        self.released = False
        self.k_caches, self.v_caches = caches[: layout.num_layers], caches[layout.num_layers :]
        self.ref_counts = np.zeros(num_pages, dtype=np.int32)
        # Popping from the end hands out low page ids first, which keeps small runs easy to read.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))

    @classmethod
    def from_memory_budget(
        cls, layout: KVLayout, memory_gb: float | None, device: str | torch.device = "cpu"
    ) -> "PagePool":
        """A pool of ``memory_gb`` GB, or with None the default share of the device's memory."""
        if memory_gb is None:
            budget = default_budget_bytes(torch.device(device))
            logger.info("KV pool: %.1f GB by default (--kv-memory-gb sets it)", budget / 1024**3)
        else:
            budget = memory_gb * 1024**3
        num_pages = layout.pages_for_budget(budget)
        if num_pages < 1:
            raise ValueError(
                f"a KV budget of {budget / 1024**3:.3g} GB holds no page of {layout.bytes_per_page} bytes; raise "
                "--kv-memory-gb"
            )
        return cls(layout, num_pages, device)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def free_page_ids(self) -> list[int]:
        """A copy of the free list, in the order pages leave it last to first (for invariant checks)."""
        return list(self._free)

    def alloc(self, n: int) -> list[int]:
        """Take ``n`` free pages, each with a reference count of one."""
        if n > len(self._free):
            raise OutOfPagesError(f"asked for {n} pages, {len(self._free)} free of {self.num_pages}")
        if n == 0:
            return []
        pages = self._free[-n:]
        del self._free[-n:]
        self.ref_counts[pages] = 1
        return pages

    def incref(self, pages: list[int]) -> None:
        if len(pages) == 0:
            return
        if (self.ref_counts[pages] <= 0).any():
            raise RuntimeError(f"incref of a free page among {pages}")
        np.add.at(self.ref_counts, pages, 1)

    def decref(self, pages: list[int]) -> list[int]:
        """Drop one reference from each page; return the pages that became free."""
        if len(pages) == 0:
            return []
        np.subtract.at(self.ref_counts, pages, 1)
        counts = self.ref_counts[pages]
        if (counts < 0).any():
            np.add.at(self.ref_counts, pages, 1)
            raise RuntimeError(f"decref of a free page among {pages}")
        freed = [p for p, c in zip(pages, counts.tolist()) if c == 0]
        # A page listed twice reaches zero once; free it once.
        freed = list(dict.fromkeys(freed))
        self._free.extend(freed)
        return freed

    def copy_page_prefix(self, src: int, dst: int, num_tokens: int) -> None:
        """Copy the first ``num_tokens`` slots of page ``src`` into page ``dst`` in every layer."""
        for k, v in zip(self.k_caches, self.v_caches):
            k[dst, :num_tokens] = k[src, :num_tokens]
            v[dst, :num_tokens] = v[src, :num_tokens]

    def release_memory(self) -> None:
        """Give the K/V tensors' memory back (the module doc says how); every page must be free."""
        if self.num_used:
            raise RuntimeError(f"{self.num_used} KV pages are in use: free them before releasing the pool's memory")
        if self.released:
            return
        if self._region is not None:
            self._region.madvise(mmap.MADV_REMOVE)
        else:
            for cache in self.k_caches + self.v_caches:
                cache.untyped_storage().resize_(0)
        self.released = True

    def restore_memory(self) -> None:
        """Make the K/V tensors usable again after ``release_memory`` (zero wherever they are read first)."""
        if not self.released:
            return
        if self._region is None:
            for cache in self.k_caches + self.v_caches:
                cache.untyped_storage().resize_(cache.numel() * cache.element_size())
                cache.zero_()
        self.released = False

    def slots(self, pages: list[int], num_tokens: int) -> torch.Tensor:
        """Flat slot ids of the first ``num_tokens`` token positions stored in ``pages``."""
        positions = torch.arange(num_tokens)
        page_ids = torch.tensor(pages, dtype=torch.long)[positions // self.page_size]
        return page_ids * self.page_size + positions % self.page_size


def default_budget_bytes(device: torch.device) -> int:
    """The KV budget when none is given: a share of the memory available at start-up on the CPU (the pool
    only takes what it uses, see the module doc), of the memory still free on a GPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * CUDA_SHARE_OF_FREE)
    return int(available_memory_bytes() * CPU_SHARE_OF_AVAILABLE)


def fraction_budget_bytes(device: torch.device, fraction: float) -> int:
    """SGLang's ``--mem-fraction-static``: weights plus pool take ``fraction`` of the device's memory, so the pool
    gets what is left of that share after what is in use now (the weights, loaded before the pool). On a CPU the
    share is of the memory available at start-up, which the weights have already taken from."""
    if not 0 < fraction <= 1:
        raise ValueError(f"mem_fraction_static must be in (0, 1], got {fraction}")
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return max(int(total * fraction) - (total - free), 0)
    return int(available_memory_bytes() * fraction)


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux), else the physical memory."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _zeroed_on_first_touch(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[mmap.mmap, torch.Tensor]:
    """A CPU tensor in a fresh anonymous map: zero, and backed by memory only where it is written.

    It stays in 4 KB pages. Transparent huge pages (a private map with MADV_HUGEPAGE; a shared one only gets them
    where shmem huge pages are on) were measured on a 2-core Zen 4 VM: decode attention ran no faster, and the
    first writes into the pool, where Linux compacts memory to find each 2 MB page, took 7x longer (a multi-turn
    benchmark's rotary-and-store went from 0.44 s to 3.05 s, its throughput from 369 to 327 tokens/s)."""
    count = int(np.prod(shape))
    region = mmap.mmap(-1, max(count * torch.empty((), dtype=dtype).element_size(), 1))
    return region, torch.frombuffer(region, dtype=dtype, count=count).view(shape)
