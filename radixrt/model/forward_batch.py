"""The metadata of one forward pass: which new tokens each request computes and where their K/V go."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] new tokens of all requests back to back
    positions: torch.Tensor  # [T]
    out_slots: torch.Tensor  # [T] flat cache slot that receives each new token's K/V
    page_table: torch.Tensor  # [B, max_pages] int32, padded with 0
    prefix_lens: torch.Tensor  # [B] int32
    extend_lens: torch.Tensor  # [B] int32
    seq_lens: torch.Tensor  # [B] int32, prefix + extend
    logits_indices: torch.Tensor  # rows of the hidden states that become logits
    logits_counts: list[int] = field(default_factory=list)  # logits rows per request
    is_decode: bool = False  # every request computes exactly one token

    @property
    def batch_size(self) -> int:
        return int(self.seq_lens.shape[0])

    @classmethod
    def build(cls, chunks: list[SeqChunk], page_size: int, device: str | torch.device = "cpu") -> "ForwardBatch":
        if not chunks:
            raise ValueError("a forward batch needs at least one request")
        extend_lens = [len(c.tokens) for c in chunks]
        if min(extend_lens) < 1:
            raise ValueError("every request in a forward batch must compute at least one token")
        prefix_lens = [c.prefix_len for c in chunks]
        max_pages = max(len(c.pages) for c in chunks)
        page_table = torch.zeros((len(chunks), max_pages), dtype=torch.int32)
        for row, chunk in enumerate(chunks):
            page_table[row, : len(chunk.pages)] = torch.tensor(chunk.pages, dtype=torch.int32)

        extend_t = torch.tensor(extend_lens, dtype=torch.long)
        prefix_t = torch.tensor(prefix_lens, dtype=torch.long)
        request_of_token = torch.repeat_interleave(torch.arange(len(chunks)), extend_t)
        starts = torch.cumsum(extend_t, 0) - extend_t
        offsets = torch.arange(int(extend_t.sum())) - starts[request_of_token]
        positions = prefix_t[request_of_token] + offsets
        pages = page_table.long()[request_of_token, positions // page_size]
        if ((positions // page_size) >= torch.tensor([len(c.pages) for c in chunks])[request_of_token]).any():
            raise ValueError("a request's pages do not cover its new tokens")
        out_slots = pages * page_size + positions % page_size

        logits_indices: list[torch.Tensor] = []
        counts: list[int] = []
        for chunk, start, extend in zip(chunks, starts.tolist(), extend_lens):
            first = extend - 1 if chunk.logits_from is None else chunk.logits_from
            logits_indices.append(torch.arange(start + first, start + extend))
            counts.append(extend - first)
        input_ids = torch.tensor([t for c in chunks for t in c.tokens], dtype=torch.long)
        return cls(
            input_ids=input_ids.to(device),
            positions=positions.to(device),
            out_slots=out_slots.to(device),
            page_table=page_table.to(device),
            prefix_lens=prefix_t.to(torch.int32).to(device),
            extend_lens=extend_t.to(torch.int32).to(device),
            seq_lens=(prefix_t + extend_t).to(torch.int32).to(device),
            logits_indices=torch.cat(logits_indices).to(device),
            logits_counts=counts,
            is_decode=max(extend_lens) == 1,
        )
