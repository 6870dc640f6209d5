"""The metadata of one forward pass: which new tokens each request computes and where their K/V go.

``ForwardBatch.build`` computes it on the host with numpy and reaches the device in one non-blocking copy
from pinned memory (``radixrt.device_copy.stage``), so building a batch never waits for the device. The host also keeps what
kernels need to size their grids (``max_extend_len``, ``max_seq_len``), so a forward reads nothing back.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from radixrt.device_copy import stage


@dataclass
class SeqChunk:
    """One request's share of a forward: ``tokens`` are new, at positions ``prefix_len ...``.

    ``pages`` must already cover ``prefix_len + len(tokens)`` positions. ``logits_from`` is the offset inside
    ``tokens`` of the first position whose next-token logits are wanted (default: only the last one).
    """

    tokens: list[int]
    prefix_len: int
    pages: list[int]
    logits_from: int | None = None
    lora_uid: int = 0  # the LoRA adapter its tokens go through (radixrt.model.lora; 0: the base model)
    long_rope: bool = False  # rotated long: a LongRoPE model's sequence past the original context (rope_table_rows)


# the tensors of a ForwardBatch, and their dtypes
TENSOR_FIELDS = {
    "input_ids": np.int64, "positions": np.int64, "out_slots": np.int64, "page_table": np.int32,
    "prefix_lens": np.int32, "extend_lens": np.int32, "seq_lens": np.int32, "logits_indices": np.int64,
}
# what else a ForwardBatch carries (plain host values; sent along to tensor-parallel followers)
HOST_FIELDS = ("logits_counts", "is_decode", "max_extend_len", "max_seq_len")
PageTable = tuple[np.ndarray, np.ndarray]  # [batch, width] int32 page ids (zero past each row's), each row's count


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] new tokens of all requests back to back
    positions: torch.Tensor  # [T] each token's row of the rotary tables: its position (LongRoPE: rope_table_rows)
    out_slots: torch.Tensor  # [T] flat cache slot that receives each new token's K/V (< 0: write nothing)
    page_table: torch.Tensor  # [B, max_pages] int32, padded with 0
    prefix_lens: torch.Tensor  # [B] int32
    extend_lens: torch.Tensor  # [B] int32
    seq_lens: torch.Tensor  # [B] int32, prefix + extend
    logits_indices: torch.Tensor  # rows of the hidden states that become logits
    logits_counts: list[int] = field(default_factory=list)  # logits rows per request
    is_decode: bool = False  # every request computes exactly one token
    max_extend_len: int = 0  # the host's copies of max(extend_lens) and max(seq_lens)
    max_seq_len: int = 0
    attn_cache: dict = field(default_factory=dict)  # what the attention backend derives once per forward
    # Embedding requests: the forward also keeps the final norm's output at the logits rows (rank 0 only).
    return_hidden: bool = False
    hidden_states: torch.Tensor | None = None  # [logits rows, hidden], set by the forward when return_hidden
    # LoRA: (adapter uid, first token row, end row) of each request with an adapter; None when none has one.
    # The runner turns them into ``lora`` (radixrt.model.lora.LoraBatch), which the projections read.
    lora_spans: list[tuple[int, int, int]] | None = None
    lora: object | None = None

    @property
    def batch_size(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    @classmethod
    def build(cls, chunks: list[SeqChunk], page_size: int, device: str | torch.device = "cpu",
              long_rope_from: int | None = None, page_table: PageTable | None = None) -> "ForwardBatch":
        """``long_rope_from``: a LongRoPE model's original context (``RotaryEmbedding.long_from``), which maps
        positions to rows of its rotary tables. ``page_table``: the chunks' pages already laid out, a row each
        (radixrt.scheduler.page_rows gathers it), in place of their lists."""
        if not chunks:
            raise ValueError("a forward batch needs at least one request")
        batch = len(chunks)
        extend = np.fromiter((len(c.tokens) for c in chunks), np.int64, batch)
        if extend.min() < 1:
            raise ValueError("every request in a forward batch must compute at least one token")
        prefix = np.fromiter((c.prefix_len for c in chunks), np.int64, batch)
        if page_table is not None:
            page_table, num_pages = page_table
        else:
            num_pages = np.fromiter((len(c.pages) for c in chunks), np.int64, batch)
            page_table = np.zeros((batch, int(num_pages.max())), np.int32)
            for row, c in zip(page_table, chunks):
                row[: len(c.pages)] = c.pages
        if ((prefix + extend + page_size - 1) // page_size > num_pages).any():
            raise ValueError("a request's pages do not cover its new tokens")
        total = int(extend.sum())
        is_decode = total == batch
        starts = np.cumsum(extend) - extend
        if is_decode:  # one token each: no per-token expansion needed
            request_of_token = np.arange(batch)
            positions = prefix
        else:
            request_of_token = np.repeat(np.arange(batch), extend)
            positions = prefix[request_of_token] + np.arange(total) - starts[request_of_token]
        out_slots = page_table[request_of_token, positions // page_size].astype(np.int64) * page_size + positions % page_size

        firsts = np.fromiter((n - 1 if c.logits_from is None else c.logits_from for c, n in zip(chunks, extend)),
                             np.int64, batch)
        counts = extend - firsts
        if is_decode:
            logits_indices = np.arange(batch)
        else:
            owner = np.repeat(np.arange(batch), counts)
            logits_indices = (starts + firsts)[owner] + np.arange(int(counts.sum())) - (np.cumsum(counts) - counts)[owner]
        input_ids = np.fromiter((t for c in chunks for t in c.tokens), np.int64, total)
        seq_lens = prefix + extend
        if long_rope_from is not None:
            long = np.fromiter((c.long_rope for c in chunks), bool, batch)[request_of_token]
            positions = rope_table_rows(positions, long, long_rope_from)
        host = {"input_ids": input_ids, "positions": positions, "out_slots": out_slots,
                "page_table": page_table, "prefix_lens": prefix, "extend_lens": extend, "seq_lens": seq_lens,
                "logits_indices": logits_indices}
        tensors = stage({name: np.asarray(a, dtype=TENSOR_FIELDS[name]) for name, a in host.items()}, device)
        lora_spans = None
        if any(c.lora_uid for c in chunks):
            lora_spans = [(c.lora_uid, int(s), int(s + n)) for c, s, n in zip(chunks, starts, extend) if c.lora_uid]
        return cls(**tensors, logits_counts=counts.tolist(), is_decode=is_decode, max_extend_len=int(extend.max()),
                   max_seq_len=int(seq_lens.max()), lora_spans=lora_spans)

    @classmethod
    def build_decode(cls, tokens: list[int], prefix_lens: list[int], pages: list[list[int]] | PageTable,
                     page_size: int, device: str | torch.device = "cpu", lora_uids: list[int] | None = None,
                     long_rope: list[bool] | None = None, long_rope_from: int | None = None) -> "ForwardBatch":
        """``build`` of one new token per request, from parallel lists: what the overlap scheduler runs at every step
        of a large batch, without a ``SeqChunk`` per request. ``pages``: each request's pages, or the page table
        already laid out with each row's page count (``PageTable``: radixrt.scheduler.page_rows gathers it)."""
        batch = len(tokens)
        if batch == 0:
            raise ValueError("a forward batch needs at least one request")
        prefix = np.fromiter(prefix_lens, np.int64, batch)
        if isinstance(pages, tuple):
            page_table, num_pages = pages
        else:
            num_pages = np.fromiter(map(len, pages), np.int64, batch)
            page_table = np.zeros((batch, int(num_pages.max())), np.int32)
            page_table[np.arange(page_table.shape[1]) < num_pages[:, None]] = np.fromiter(
                itertools.chain.from_iterable(pages), np.int32, int(num_pages.sum()))
        if (prefix // page_size >= num_pages).any():
            raise ValueError("a request's pages do not cover its new tokens")
        rows = np.arange(batch)
        out_slots = page_table[rows, prefix // page_size].astype(np.int64) * page_size + prefix % page_size
        positions = prefix
        if long_rope_from is not None:
            long = np.fromiter(long_rope, bool, batch) if long_rope is not None else np.zeros(batch, bool)
            positions = rope_table_rows(prefix, long, long_rope_from)
        host = {"input_ids": np.fromiter(tokens, np.int64, batch), "positions": positions, "out_slots": out_slots,
                "page_table": page_table, "prefix_lens": prefix, "extend_lens": np.ones(batch, np.int64),
                "seq_lens": prefix + 1, "logits_indices": rows}
        tensors = stage({name: np.asarray(a, dtype=TENSOR_FIELDS[name]) for name, a in host.items()}, device)
        spans = [(uid, row, row + 1) for row, uid in enumerate(lora_uids or ()) if uid] or None
        return cls(**tensors, logits_counts=[1] * batch, is_decode=True, max_extend_len=1,
                   max_seq_len=int(prefix.max()) + 1, lora_spans=spans)

    def host_fields(self) -> dict:
        return {name: getattr(self, name) for name in HOST_FIELDS}


def rope_table_rows(positions: np.ndarray, long: np.ndarray, long_from: int) -> np.ndarray:
    """The rows of a LongRoPE model's rotary tables (``RotaryEmbedding``: short rows below ``long_from``, then the
    long rows) for tokens at ``positions``, ``long`` for the tokens of requests that rotate long (their sequence
    outgrew the original context; transformers then rotates every position long). A request rotated short never
    computes a position past the original context (the scheduler computes it again, long, first)."""
    if (positions[~long] >= long_from).any():
        raise ValueError(f"a request rotated short computes a position past the original context ({long_from})")
    return positions + long_from * long
