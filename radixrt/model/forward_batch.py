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
    attn_cache: dict = field(default_factory=dict)  # what the attention backend derives once per forward

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
        num_pages = [len(c.pages) for c in chunks]
        max_pages = max(num_pages)
        page_table = torch.tensor([c.pages + [0] * (max_pages - len(c.pages)) for c in chunks], dtype=torch.int32)
        page_table = page_table.view(len(chunks), max_pages)
        extend_t = torch.tensor(extend_lens, dtype=torch.long)
        prefix_t = torch.tensor(prefix_lens, dtype=torch.long)
        total = sum(extend_lens)
        is_decode = total == len(chunks)
        if is_decode:  # one token each: no per-token expansion needed
            request_of_token = torch.arange(len(chunks))
            starts = request_of_token
            positions = prefix_t
        else:
            request_of_token = torch.repeat_interleave(torch.arange(len(chunks)), extend_t)
            starts = torch.cumsum(extend_t, 0) - extend_t
            positions = prefix_t[request_of_token] + torch.arange(total) - starts[request_of_token]
        page_of_token = positions // page_size
        if bool((page_of_token >= torch.tensor(num_pages)[request_of_token]).any()):
            raise ValueError("a request's pages do not cover its new tokens")
        out_slots = page_table.long()[request_of_token, page_of_token] * page_size + positions % page_size

        firsts = [n - 1 if c.logits_from is None else c.logits_from for c, n in zip(chunks, extend_lens)]
        counts = [n - f for n, f in zip(extend_lens, firsts)]
        if is_decode:
            logits_indices = torch.arange(len(chunks))
        else:
            counts_t = torch.tensor(counts, dtype=torch.long)
            owner = torch.repeat_interleave(torch.arange(len(chunks)), counts_t)
            first_rows = starts + torch.tensor(firsts, dtype=torch.long)
            logits_indices = first_rows[owner] + torch.arange(int(counts_t.sum())) - (torch.cumsum(counts_t, 0) - counts_t)[owner]
        input_ids = torch.tensor([t for c in chunks for t in c.tokens], dtype=torch.long)
        return cls(
            input_ids=input_ids.to(device),
            positions=positions.to(device),
            out_slots=out_slots.to(device),
            page_table=page_table.to(device),
            prefix_lens=prefix_t.to(torch.int32).to(device),
            extend_lens=extend_t.to(torch.int32).to(device),
            seq_lens=(prefix_t + extend_t).to(torch.int32).to(device),
            logits_indices=logits_indices.to(device),
            logits_counts=counts,
            is_decode=is_decode,
        )
