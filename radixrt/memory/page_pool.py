"""The KV cache tensors and the allocator of their fixed-size pages.

Every layer has a K and a V tensor of shape ``[num_pages, page_size, kv_heads, head_dim]``. A page is the
unit of allocation and sharing: it is handed out with a reference count of one, shared by
``incref``, and returns to the free list when ``decref`` brings its count to zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


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
    def __init__(self, layout: KVLayout, num_pages: int, device: str | torch.device = "cpu") -> None:
        if num_pages < 1:
            raise ValueError(f"the KV pool needs at least one page, got {num_pages}")
        if layout.page_size < 1:
            raise ValueError(f"page size must be >= 1, got {layout.page_size}")
        self.layout = layout
        self.page_size = layout.page_size
        self.num_pages = num_pages
        shape = (num_pages, layout.page_size, layout.kv_heads, layout.head_dim)
        self.k_caches = [torch.zeros(shape, dtype=layout.dtype, device=device) for _ in range(layout.num_layers)]
        self.v_caches = [torch.zeros(shape, dtype=layout.dtype, device=device) for _ in range(layout.num_layers)]
        self.ref_counts = np.zeros(num_pages, dtype=np.int32)
        # Popping from the end hands out low page ids first, which keeps small runs easy to read.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))

    @classmethod
    def from_memory_budget(
        cls, layout: KVLayout, memory_gb: float, device: str | torch.device = "cpu"
    ) -> "PagePool":
        num_pages = layout.pages_for_budget(memory_gb * 1024**3)
        if num_pages < 1:
            raise ValueError(
                f"a KV budget of {memory_gb} GB holds no page of {layout.bytes_per_page} bytes; raise --kv-memory-gb"
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

    def slots(self, pages: list[int], num_tokens: int) -> torch.Tensor:
        """Flat slot ids of the first ``num_tokens`` token positions stored in ``pages``."""
        positions = torch.arange(num_tokens)
        page_ids = torch.tensor(pages, dtype=torch.long)[positions // self.page_size]
        return page_ids * self.page_size + positions % self.page_size
