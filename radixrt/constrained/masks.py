"""Token bitmasks for a batch, and applying them to the logits in one vectorised step.

Layout: int32 ``[batch, ceil(vocab / 32)]``, token ``t`` allowed iff bit ``t % 32`` of word ``t // 32``
is set (the layout of outlines-core's and xgrammar's kernels). A row of all ones (``-1``) leaves the
request unconstrained. Packed rows are 32x smaller than bool rows: cached per grammar state, copied per
step (``torch.stack``, one op for the batch) and cheap to move to an accelerator.

Applying on CPU: the bits are expanded into an additive float bias (``+0.0`` allowed, ``-inf`` not) with
integer shifts, and added to the logits. That is branch-free; ``masked_fill`` with a bool mask costs
several times more on CPU (measured by ``python -m radixrt.bench.constrained_bench``). Elsewhere (CUDA)
the bits become a bool mask for ``masked_fill_``.

The scheduler's path (``apply_token_masks``, CPU) avoids touching whole rows where it can: each grammar
state caches its mask in the cheapest of three forms (``Grammar.token_mask``): the allowed ids (structural
JSON states: a few dozen), the disallowed ids (inside strings: nearly everything is allowed), or a dense
0/-inf float row (the rest). A step then costs one gather/fill/scatter for the first kind, one
``index_fill_`` for the second, one ``add_`` per row for the third; unconstrained rows are never touched.
"""

from __future__ import annotations

from typing import Sequence

import torch

_NEG_INF_BITS = int(torch.tensor(float("-inf"), dtype=torch.float32).view(torch.int32).item())
_SHIFTS: dict[torch.device, torch.Tensor] = {}


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_bitmask(batch_size: int, vocab_size: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """An all-allowed bitmask ``[batch_size, ceil(vocab_size / 32)]`` int32."""
    return torch.full((batch_size, bitmask_words(vocab_size)), -1, dtype=torch.int32, device=device)


def fill_bitmasks(bitmask: torch.Tensor, matchers: Sequence) -> list[int]:
    """Fill row i from ``matchers[i]`` (a ``GrammarMatcher``, or None: unconstrained, all ones).
    Returns the indices of the constrained rows (pass them to ``apply_bitmask``)."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if len(rows) < len(matchers):
        bitmask[: len(matchers)].fill_(-1)
    if rows:
        stacked = torch.stack([matchers[i].allowed_row() for i in rows])
        if len(rows) == len(matchers) and bitmask.device.type == "cpu":
            bitmask[: len(rows)].copy_(stacked)
        else:
            bitmask[torch.tensor(rows, device=bitmask.device)] = stacked.to(bitmask.device, non_blocking=True)
    return rows


def _shifts(device: torch.device) -> torch.Tensor:
    shifts = _SHIFTS.get(device)
    if shifts is None:
        shifts = _SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    return shifts


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool ``[B, vocab_size]`` (True: allowed)."""
    bits = (bitmask.unsqueeze(-1) >> _shifts(bitmask.device)) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def bitmask_bias(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Float32 ``[B, vocab_size]``: 0.0 where allowed, -inf where not (branch-free integer ops)."""
    bits = (bitmask.unsqueeze(-1) >> _shifts(bitmask.device)) & 1
    bits -= 1  # 0 allowed, -1 (all bits) disallowed
    bits &= _NEG_INF_BITS
    return bits.view(torch.float32).view(bitmask.shape[0], -1)[:, :vocab_size]


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | torch.Tensor | None = None) -> torch.Tensor:
    """Set disallowed logits to -inf, in place, in one vectorised step; returns ``logits``.

    ``logits`` ``[B, V]``; ``bitmask`` ``[B, words]`` (row i masks logits row i). ``rows``: only these
    rows are constrained (others are left untouched); None: every row. Ids at or beyond
    ``32 * words`` are disallowed in masked rows.
    """
    if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise ValueError("apply_bitmask wants logits [B, V] and an int32 bitmask [B, words]")
    if rows is not None:
        if len(rows) == 0:
            return logits
        if len(rows) == logits.shape[0]:
            rows = None
    vocab = logits.shape[1]
    width = min(vocab, bitmask.shape[1] * 32)
    if rows is not None:
        index = rows if isinstance(rows, torch.Tensor) else torch.tensor(list(rows), device=logits.device)
        index = index.to(logits.device)
        masked = logits.index_select(0, index)
        _apply_all(masked, bitmask.index_select(0, index.to(bitmask.device)), width)
        logits.index_copy_(0, index, masked)
        return logits
    _apply_all(logits, bitmask[: logits.shape[0]], width)
    return logits


def _apply_all(logits: torch.Tensor, bitmask: torch.Tensor, width: int) -> None:
    bitmask = bitmask.to(logits.device, non_blocking=True)
    if logits.shape[1] > width:
        logits[:, width:] = float("-inf")
    if logits.device.type == "cpu":
        bias = bitmask_bias(bitmask, width)
        logits[:, :width].add_(bias if logits.dtype == torch.float32 else bias.to(logits.dtype))
    else:
        logits[:, :width].masked_fill_(~unpack_bitmask(bitmask, width), float("-inf"))


MASK_ALLOWED, MASK_DISALLOWED, MASK_DENSE = 0, 1, 2
SPARSE_MASK_LIMIT = 4096  # ids in a sparse form; beyond, a dense row is cheaper (index ops are ~6 ns an id)


def token_mask_of_row(row: torch.Tensor, vocab_size: int) -> tuple[int, torch.Tensor]:
    """A packed row -> ``(MASK_ALLOWED | MASK_DISALLOWED, int64 ids)`` or ``(MASK_DENSE, float32 bias)``."""
    allowed = unpack_bitmask(row[None], vocab_size)[0]
    num_allowed = int(allowed.sum())
    if num_allowed <= SPARSE_MASK_LIMIT:
        return MASK_ALLOWED, allowed.nonzero().flatten()
    if vocab_size - num_allowed <= SPARSE_MASK_LIMIT:
        return MASK_DISALLOWED, (~allowed).nonzero().flatten()
    bias = torch.zeros(vocab_size, dtype=torch.float32, device=row.device)
    bias.masked_fill_(~allowed, float("-inf"))
    return MASK_DENSE, bias


def apply_token_masks(logits: torch.Tensor, matchers: Sequence) -> torch.Tensor:
    """Mask row i of ``logits`` by ``matchers[i]`` (None: untouched), in place; returns ``logits``.

    Same result as ``fill_bitmasks`` + ``apply_bitmask`` (tested), from each state's cached
    ``Grammar.token_mask``. Needs contiguous CPU logits exactly as wide as the grammars' masks; anything
    else goes through the bitmask path.
    """
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return logits
    vocab = logits.shape[1]
    if (logits.device.type != "cpu" or logits.dim() != 2 or not logits.is_contiguous()
            or any(matchers[i].grammar.mask_vocab_size != vocab for i in rows)):
        bitmask = allocate_bitmask(len(matchers), max(vocab, 1), logits.device)
        return apply_bitmask(logits, bitmask, fill_bitmasks(bitmask, matchers))
    flat = logits.view(-1)
    allowed_rows, allowed_ids, allowed_counts = [], [], []
    disallowed_ids, disallowed_counts, disallowed_rows = [], [], []
    for i in rows:
        matcher = matchers[i]
        kind, data = matcher.grammar.token_mask(matcher.state)
        if kind == MASK_ALLOWED:
            allowed_rows.append(i)
            allowed_ids.append(data)
            allowed_counts.append(data.numel())
        elif kind == MASK_DISALLOWED:
            disallowed_rows.append(i)
            disallowed_ids.append(data)
            disallowed_counts.append(data.numel())
        else:
            bias = data if logits.dtype == torch.float32 else data.to(logits.dtype)
            logits[i].add_(bias)
    if disallowed_rows:
        index = _flat_index(disallowed_ids, disallowed_rows, disallowed_counts, vocab)
        flat.index_fill_(0, index, float("-inf"))
    if allowed_rows:
        index = _flat_index(allowed_ids, allowed_rows, allowed_counts, vocab)
        kept = flat.index_select(0, index)
        for start, stop in _runs(allowed_rows):  # slice fills: index_fill_ along dim 0 is ~10x slower
            logits[start:stop].fill_(float("-inf"))
        flat.index_copy_(0, index, kept)
    return logits


def _runs(rows: list[int]):
    """Ascending row indices -> (start, stop) of each run of consecutive rows."""
    start = prev = rows[0]
    for row in rows[1:]:
        if row != prev + 1:
            yield start, prev + 1
            start = row
        prev = row
    yield start, prev + 1


def _flat_index(ids: list[torch.Tensor], rows: list[int], counts: list[int], vocab: int) -> torch.Tensor:
    index = torch.cat(ids) if len(ids) > 1 else ids[0].clone()
    offsets = torch.tensor(rows, dtype=torch.int64, device=index.device) * vocab
    index += torch.repeat_interleave(offsets, torch.tensor(counts, device=index.device))
    return index


def apply_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Slow, obvious version (tests): a Python loop over every row and token."""
    out = logits.clone()
    for b in range(out.shape[0]):
        for t in range(out.shape[1]):
            word = t // 32
            allowed = word < bitmask.shape[1] and (int(bitmask[b, word]) >> (t % 32)) & 1
            if not allowed:
                out[b, t] = float("-inf")
    return out
