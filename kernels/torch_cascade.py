"""Attention that reads a prefix shared by many requests once (cascade attention, CPU path).

When the radix cache gives a group of requests the same leading pages (a few-shot header, a system prompt,
the trunk of a fork), plain paged attention copies those pages once per request and runs one small
attention per request over them. Here each group's shared pages are gathered once, all the group's queries
attend to them in one GEMM, and each request then attends only to its own remaining keys; the two partial
results are merged exactly through their log-sum-exps (the split-KV merge of flash-decoding). Decode
(:func:`cascade_decode_attention`) and prefill (:func:`cascade_extend_attention`, a burst of questions
about one cached document) share the grouping and the merge. Where the C++ kernel is built, decode needs
neither copy nor merge: the kernel walks a group's shared pages once per chunk of its requests, carrying
each query's online softmax on into the request's own pages.

The plans are derived from the page table alone, once per forward (:func:`plan_decode`, :func:`plan_extend`),
and are the same for every layer. Sliding-window layers are not planned (their window would cut the
shared part).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from radixrt.kernels import cpu_kernels
from radixrt.kernels.torch_ref import _extend_bias, decode_attention, decode_metadata, extend_attention, gather_pages

MAX_GROUPS = 8  # past this, per-group overhead outweighs the copies saved


@dataclass
class SharedGroup:
    rows: torch.Tensor  # [n] batch rows of the requests in the group
    pages: torch.Tensor  # [S] the pages they share, in order (all full)

    def keys_values(self, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The shared keys and values, gathered once, as ``[1, kv_heads, S * page_size, head_dim]``."""
        _, page_size, kv_heads, head_dim = k_cache.shape
        length = len(self.pages) * page_size
        return tuple(gather_pages(cache, self.pages).view(length, kv_heads, head_dim).transpose(0, 1)[None].to(dtype)
                     for cache in (k_cache, v_cache))


@dataclass
class DecodePlan:
    """Where each request's keys are: ``groups`` (shared, read once) and its own ``pages`` after them."""

    groups: list[SharedGroup]
    pages: torch.Tensor  # [B, P'] int64: each request's pages after its group's shared ones
    allowed: torch.Tensor  # [B, 1, 1, P' * page_size] bool: which of those slots hold its keys
    own_lens: torch.Tensor  # [B] int32: how many keys each request has in ``pages``
    own_table: torch.Tensor  # ``pages`` as int32, for the C++ kernel
    _biases: dict = field(default_factory=dict, repr=False)
    _chunks: dict = field(default_factory=dict, repr=False)  # joint -> the kernel's chunks

    def bias(self, dtype: torch.dtype) -> torch.Tensor:
        """``allowed`` as an additive mask (0 / -inf) of ``dtype``, made once per forward."""
        if dtype not in self._biases:
            zeros = torch.zeros(self.allowed.shape, dtype=dtype, device=self.allowed.device)
            self._biases[dtype] = zeros.masked_fill_(~self.allowed, float("-inf"))
        return self._biases[dtype]


    def kernel_chunks(self, kv_heads: int, joint: bool = False) -> cpu_kernels.CascadeChunks | None:
        """The groups as the C++ kernel's chunks (made once per forward), or None where every request would be a
        chunk of its own with nothing shared. With ``joint`` (the kernel walks a chunk's requests that read the
        same pages together: :func:`cpu_kernels.decode_tiles_usable`), consecutive requests outside a group with
        the same own pages (a verify step's rows of one request) are kept together like a group's. Where a chunk
        per group would leave threads idle, a group is cut into chunks small enough to keep every thread busy
        (about :data:`ITEMS_PER_THREAD` (chunk, kv head) items per thread); each other request is a chunk of its
        own. Many small groups (a verify step's rows, a request each) stay whole."""
        if joint not in self._chunks:
            self._chunks[joint] = self._make_chunks(kv_heads, joint)
        return self._chunks[joint]

    def _make_chunks(self, kv_heads: int, joint: bool) -> cpu_kernels.CascadeChunks | None:
        grouped: set[int] = set()
        units: list[tuple[list[int], int]] = []  # (requests, group or -1)
        for g, shared in enumerate(self.groups):
            members = shared.rows.tolist()
            grouped.update(members)
            units.append((members, g))
        alone = [r for r in range(self.pages.shape[0]) if r not in grouped]
        runs = _same_page_runs(self.own_table, alone) if joint else [[r] for r in alone]
        if not self.groups and all(len(run) == 1 for run in runs):
            return None
        units += [(run, -1) for run in runs]
        target_items = ITEMS_PER_THREAD * torch.get_num_threads()
        enough = len(units) * kv_heads >= target_items
        rows, offsets, groups = [], [0], []
        for members, g in units:
            size = min(MAX_CHUNK, len(members) if enough else max(1, -(-len(members) * kv_heads // target_items)))
            for start in range(0, len(members), size):
                rows.extend(members[start : start + size])
                offsets.append(len(rows))
                groups.append(g)
        width = max(1, max((len(shared.pages) for shared in self.groups), default=1))
        shared_table = torch.zeros(max(1, len(self.groups)), width, dtype=torch.int32)
        for g, shared in enumerate(self.groups):
            shared_table[g, : len(shared.pages)] = shared.pages
        as_int = lambda values: torch.tensor(values, dtype=torch.int32)
        return cpu_kernels.CascadeChunks(
            rows=as_int(rows), offsets=as_int(offsets), groups=as_int(groups), shared_table=shared_table,
            shared_pages=as_int([len(shared.pages) for shared in self.groups] or [0]))


def _same_page_runs(table: torch.Tensor, rows: list[int]) -> list[list[int]]:
    """``rows`` (ascending) in runs of consecutive requests whose rows of ``table`` are equal."""
    if not rows:
        return []
    index = torch.tensor(rows)
    picked = table[index]
    same = ((picked[1:] == picked[:-1]).all(dim=1) & (index[1:] == index[:-1] + 1)).tolist()
    runs = [[rows[0]]]
    for row, joins in zip(rows[1:], same):
        if joins:
            runs[-1].append(row)
        else:
            runs.append([row])
    return runs


# Enough items that threads finish together, few enough that chunks stay large: each chunk walks its group's shared
# pages again, and a chunk of few rows fills few of the kernel's row tiles (at 8 a thread, one verify step of 9
# rows on 2 threads ran as 5 chunks of 1-2 rows; at 3, as chunks of 5 and 4).
ITEMS_PER_THREAD = 3
MAX_CHUNK = 16  # requests whose queries walk a shared prefix together: their rows and accumulators stay in L1/L2


def _shared_groups(table: torch.Tensor, limits: torch.Tensor, min_shared_pages: int) -> list[tuple[torch.Tensor, int]]:
    """Requests grouped by their first page, with how many leading pages each group has in common, counting
    at most ``limits[r]`` pages of request r. Kept by pages saved (shared x (members - 1)), at most
    :data:`MAX_GROUPS`: (rows, shared pages) each. In numpy: a verify step has a group per request, and a few
    small torch ops a group took a third of a millisecond a forward at batch 8."""
    pages, most = table.cpu().numpy(), limits.cpu().numpy()
    _, inverse, counts = np.unique(pages[:, 0], return_inverse=True, return_counts=True)
    candidates: list[tuple[int, np.ndarray, int]] = []
    for g in np.flatnonzero(counts >= 2):
        rows = np.flatnonzero(inverse == g)
        limit = int(most[rows].min())
        if limit < min_shared_pages:
            continue
        block = pages[rows, :limit]
        same = (block == block[:1]).all(axis=0)
        shared = limit if same.all() else int(np.argmin(same))  # the leading pages all rows have alike
        if shared >= min_shared_pages:
            candidates.append((shared * (len(rows) - 1), rows, shared))
    candidates.sort(key=lambda c: -c[0])
    return [(torch.from_numpy(rows).to(table.device), shared) for _, rows, shared in candidates[:MAX_GROUPS]]


# The bf16 decode kernel's softmax steps: spans of 8 blocks of up to 16 keys, a page's keys in blocks of its own.
SPAN_BLOCKS, BLOCK_KEYS = 8, 16


def shared_alignment(q: torch.Tensor, k_cache: torch.Tensor) -> int:
    """The multiple of pages a shared prefix is cut to for the decode kernel here: where it walks bf16 in spans
    (:data:`SPAN_BLOCKS` blocks of up to :data:`BLOCK_KEYS` keys, a page's keys in blocks of their own), the fewest
    pages that fill whole spans, so that a shared part ends where a span ends and each query row meets the same
    spans, and so the same rounding, whether its request walks its pages alone or after a prefix it shares with
    others (a verify row gets a decode row's bits, a request its bits in any batch); elsewhere the kernel takes one
    softmax step per block and any page ends one: 1."""
    spans = (q.dtype == k_cache.dtype == torch.bfloat16 and q.shape[-1] in (32, 64, 128) and q.device.type == "cpu"
             and cpu_kernels.bf16_dot_built())
    if not spans:
        return 1
    blocks_per_page = -(-k_cache.shape[1] // BLOCK_KEYS)
    return SPAN_BLOCKS // math.gcd(SPAN_BLOCKS, blocks_per_page)


def plan_decode(page_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int, min_shared_pages: int = 1,
                align_pages: int = 1) -> DecodePlan:
    """Groups requests by their first page, then finds how many leading pages each group has in common, cut to a
    multiple of ``align_pages`` (:func:`shared_alignment`).

    Only full pages before a request's last page are shared, so its current token always lies in its own
    part.
    """
    table = page_table.long()
    lens = seq_lens.long()
    num_pages = (lens + page_size - 1) // page_size
    shift = torch.zeros_like(lens)
    groups = []
    for rows, shared in _shared_groups(table, num_pages - 1, max(min_shared_pages, align_pages)):
        shared -= shared % align_pages
        shift[rows] = shared
        groups.append(SharedGroup(rows=rows, pages=table[rows[0], :shared].clone()))
    own_pages = num_pages - shift
    columns = shift[:, None] + torch.arange(int(own_pages.max()), device=table.device)[None, :]
    pages = torch.gather(table, 1, columns.clamp(max=table.shape[1] - 1))
    own_lens = lens - shift * page_size
    _, allowed = decode_metadata(pages, own_lens, 0, page_size)
    return DecodePlan(groups=groups, pages=pages, allowed=allowed, own_lens=own_lens.int(),
                      own_table=pages.int())


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
            bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of 4-D ``q``/``keys``/``values`` returning (output, log-sum-exp of the scores in fp32).

    ``bias`` is an additive mask broadcast over the scores. On the CPU this is the fused flash kernel that
    ``scaled_dot_product_attention`` uses, called directly because only it returns the log-sum-exp.
    """
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, keys, values, 0.0, False, attn_mask=bias, scale=scale
        )
        return out, lse.float()
    return _attend_unfused(q, keys, values, scale, bias)


def _attend_unfused(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                    bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    scores = torch.matmul(q, keys.transpose(-1, -2)).float() * scale
    if bias is not None:
        scores = scores + bias
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None]).to(values.dtype)
    return torch.matmul(probs, values), lse


def cascade_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DecodePlan, sm_scale: float
) -> torch.Tensor:
    """Same result as :func:`torch_ref.decode_attention` (no sliding window) for ``q`` ``[B, heads, D]``.

    Where the C++ kernel is built (cpu_kernels) it does all of it in place: each chunk of a group walks the
    shared pages once, then each request its own (on AMX tiles, requests that read the same pages together).
    Elsewhere each request's own pages are gathered and read by SDPA, each group's shared pages gathered once and
    read by one SDPA, and the two parts merged.
    """
    batch, heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    if cpu_kernels.usable_for(q, k_cache):
        joint = q.dtype == torch.bfloat16 and cpu_kernels.decode_tiles_usable()
        chunks = plan.kernel_chunks(kv_heads, joint)
        return cpu_kernels.paged_decode(q, k_cache, v_cache, plan.own_table, plan.own_lens, sm_scale, 0, chunks)[0]
    if not plan.groups:
        return decode_attention(q, k_cache, v_cache, plan.pages, None, sm_scale, meta=(plan.pages, plan.allowed))
    own_len = plan.pages.shape[1] * page_size
    keys = gather_pages(k_cache, plan.pages).view(batch, own_len, kv_heads, head_dim).transpose(1, 2).to(q.dtype)
    values = gather_pages(v_cache, plan.pages).view(batch, own_len, kv_heads, head_dim).transpose(1, 2).to(q.dtype)
    out, lse = _attend(q.view(batch, kv_heads, group, head_dim), keys, values, sm_scale, plan.bias(q.dtype))
    q4 = q.view(batch, kv_heads, group, head_dim)
    out = out.float()
    for shared in plan.groups:
        n = len(shared.rows)
        q_s = q4[shared.rows].transpose(0, 1).reshape(kv_heads, n * group, head_dim)
        o_s, lse_s = _attend(q_s[None], *shared.keys_values(k_cache, v_cache, q.dtype), sm_scale)  # [1, KH, n*G, D]
        o_s = o_s.float().view(kv_heads, n, group, head_dim).transpose(0, 1)
        lse_s = lse_s.view(kv_heads, n, group).transpose(0, 1)
        out[shared.rows] = _merge(out[shared.rows], lse[shared.rows], o_s, lse_s)
    return out.to(q.dtype).reshape(batch, heads, head_dim)


def _merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """Softmax attention over the union of two key sets from each part's (fp32) output and log-sum-exp."""
    top = torch.maximum(lse_a, lse_b)
    w_a, w_b = torch.exp(lse_a - top)[..., None], torch.exp(lse_b - top)[..., None]
    return (out_a * w_a + out_b * w_b) / (w_a + w_b)


@dataclass
class ExtendPlan:
    """Groups of extending requests whose cached prefixes begin with the same pages."""

    groups: list[SharedGroup]
    shift: list[int]  # per request: the leading pages its group reads once for all (0 outside a group)
    group_tokens: list[torch.Tensor]  # per group: the q rows of its members' new tokens
    alone: torch.Tensor  # requests in no group
    alone_tokens: torch.Tensor  # their q rows


def plan_extend(page_table: torch.Tensor, prefix_lens: torch.Tensor, extend_lens: torch.Tensor, page_size: int,
                min_shared_pages: int = 1) -> ExtendPlan:
    """Only pages wholly inside every member's cached prefix are shared: all their keys precede all the
    group's new tokens, so that part needs no mask."""
    table = page_table.long()
    prefix, extend = prefix_lens.long().cpu(), extend_lens.long().cpu()
    starts = torch.cumsum(extend, 0) - extend
    shift = [0] * len(extend)
    groups, group_tokens = [], []
    limits = torch.where(extend > 0, prefix // page_size, 0)
    for rows, shared in _shared_groups(table.cpu(), limits, min_shared_pages):
        for r in rows.tolist():
            shift[r] = shared
        groups.append(SharedGroup(rows=rows.to(table.device), pages=table[int(rows[0]), :shared].clone()))
        group_tokens.append(torch.cat([torch.arange(int(starts[r]), int(starts[r] + extend[r])) for r in rows]))
    in_group = torch.tensor([n > 0 for n in shift], dtype=torch.bool)
    alone = torch.nonzero(~in_group).flatten()
    token_alone = torch.repeat_interleave(~in_group, extend)
    device = table.device
    return ExtendPlan(groups=groups, shift=shift, group_tokens=[t.to(device) for t in group_tokens],
                      alone=alone.to(device), alone_tokens=torch.nonzero(token_alone).flatten().to(device))


def cascade_extend_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
    prefix_lens: torch.Tensor, extend_lens: torch.Tensor, plan: ExtendPlan, sm_scale: float,
    mask_cache: dict | None = None,
) -> torch.Tensor:
    """Same result as :func:`torch_ref.extend_attention` (no sliding window) for ``q`` ``[tokens, heads, D]``.

    A group member attends to its keys after the shared pages (the rest of its prefix, causally its new
    tokens) on its own; all the group's new tokens attend to the shared pages in one call.
    """
    if not plan.groups:
        return extend_attention(q, k_cache, v_cache, page_table, prefix_lens, extend_lens, sm_scale, 0, mask_cache)
    tokens, heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    out = torch.empty(tokens, heads, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(tokens, heads, dtype=torch.float32, device=q.device)
    if plan.alone.numel():
        out[plan.alone_tokens] = extend_attention(
            q[plan.alone_tokens], k_cache, v_cache, page_table[plan.alone], prefix_lens[plan.alone],
            extend_lens[plan.alone], sm_scale, 0, mask_cache).float()

    def by_kv_head(x: torch.Tensor) -> torch.Tensor:  # [n, heads, D] -> [1, KH, G * n, D]
        n = x.shape[0]
        return x.view(n, kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(1, kv_heads, group * n, head_dim)

    def by_token(o: torch.Tensor, l: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = o.shape[2] // group
        o = o[0].float().view(kv_heads, group, n, head_dim).permute(2, 0, 1, 3).reshape(n, heads, head_dim)
        return o, l[0].view(kv_heads, group, n).permute(2, 0, 1).reshape(n, heads)

    start = 0
    for r, (prefix, extend) in enumerate(zip(prefix_lens.tolist(), extend_lens.tolist())):
        if extend == 0 or plan.shift[r] == 0:
            start += extend
            continue
        skipped = plan.shift[r] * page_size
        seq_len = prefix + extend
        pages = page_table[r, plan.shift[r] : -(-seq_len // page_size)].long()
        keys = gather_pages(k_cache, pages).view(-1, kv_heads, head_dim)[: seq_len - skipped]
        values = gather_pages(v_cache, pages).view(-1, kv_heads, head_dim)[: seq_len - skipped]
        bias = _extend_bias(prefix - skipped, extend, group, 0, q.dtype, q.device, mask_cache)
        o, l = _attend(by_kv_head(q[start : start + extend]), keys.transpose(0, 1)[None].to(q.dtype),
                       values.transpose(0, 1)[None].to(q.dtype), sm_scale, bias)
        out[start : start + extend], lse[start : start + extend] = by_token(o, l)
        start += extend
    for shared, rows in zip(plan.groups, plan.group_tokens):
        o_s, lse_s = by_token(*_attend(by_kv_head(q[rows]), *shared.keys_values(k_cache, v_cache, q.dtype), sm_scale))
        out[rows] = _merge(out[rows], lse[rows], o_s, lse_s)
    return out.to(q.dtype)
