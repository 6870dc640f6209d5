"""Decode attention that reads a prefix shared by many requests once (cascade attention, CPU path).

When the radix cache gives a group of decoding requests the same leading pages (a few-shot header, a system
prompt, the trunk of a fork), plain paged decode copies those pages once per request and runs one small
attention per request over them. Here each group's shared pages are gathered once, all the group's queries
attend to them in one GEMM, and each request then attends only to its own remaining pages; the two partial
results are merged exactly through their log-sum-exps (the split-KV merge of flash-decoding).

The plan is derived from the page table alone, once per forward (:func:`plan_decode`), and is the same for
every layer. Sliding-window layers are not planned (their window would cut the shared part).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from radixrt.kernels import cpu_kernels
from radixrt.kernels.torch_ref import decode_attention, decode_metadata, gather_pages

MAX_GROUPS = 8  # past this, per-group overhead outweighs the copies saved


@dataclass
class SharedGroup:
    rows: torch.Tensor  # [n] batch rows of the requests in the group
    pages: torch.Tensor  # [S] the pages they share, in order (all full)


@dataclass
class DecodePlan:
    """Where each request's keys are: ``groups`` (shared, read once) and its own ``pages`` after them."""

    groups: list[SharedGroup]
    pages: torch.Tensor  # [B, P'] int64: each request's pages after its group's shared ones
    allowed: torch.Tensor  # [B, 1, 1, P' * page_size] bool: which of those slots hold its keys
    own_lens: torch.Tensor  # [B] int32: how many keys each request has in ``pages``
    own_table: torch.Tensor  # ``pages`` as int32, for the C++ kernel
    _biases: dict = field(default_factory=dict, repr=False)

    def bias(self, dtype: torch.dtype) -> torch.Tensor:
        """``allowed`` as an additive mask (0 / -inf) of ``dtype``, made once per forward."""
        if dtype not in self._biases:
            zeros = torch.zeros(self.allowed.shape, dtype=dtype, device=self.allowed.device)
            self._biases[dtype] = zeros.masked_fill_(~self.allowed, float("-inf"))
        return self._biases[dtype]


def plan_decode(page_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int, min_shared_pages: int = 1) -> DecodePlan:
    """Groups requests by their first page, then finds how many leading pages each group has in common.

    Only full pages before a request's last page are shared, so its current token always lies in its own
    part. Groups are kept by pages saved (shared pages x (members - 1)), at most :data:`MAX_GROUPS`.
    """
    table = page_table.long()
    lens = seq_lens.long()
    num_pages = (lens + page_size - 1) // page_size
    _, inverse, counts = torch.unique(table[:, 0], return_inverse=True, return_counts=True)
    candidates: list[tuple[int, torch.Tensor, int]] = []
    for g in torch.nonzero(counts >= 2).flatten().tolist():
        rows = torch.nonzero(inverse == g).flatten()
        limit = int(num_pages[rows].min()) - 1
        if limit < min_shared_pages:
            continue
        block = table[rows, :limit]
        same = (block == block[:1]).all(dim=0)
        shared = int(torch.cumprod(same.int(), 0).sum())
        if shared >= min_shared_pages:
            candidates.append((shared * (len(rows) - 1), rows, shared))
    candidates.sort(key=lambda c: -c[0])
    shift = torch.zeros_like(lens)
    groups = []
    for _, rows, shared in candidates[:MAX_GROUPS]:
        shift[rows] = shared
        groups.append(SharedGroup(rows=rows, pages=table[rows[0], :shared].clone()))
    own_pages = num_pages - shift
    columns = shift[:, None] + torch.arange(int(own_pages.max()))[None, :]
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

    Each request's own pages are read in place by the C++ kernel where it is built (cpu_kernels), else
    gathered and read by SDPA. Without shared groups that is all there is to do.
    """
    batch, heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    if cpu_kernels.usable_for(q, k_cache):
        out, lse = cpu_kernels.paged_decode(q, k_cache, v_cache, plan.own_table, plan.own_lens, sm_scale)
        if not plan.groups:
            return out
        out, lse = out.view(batch, kv_heads, group, head_dim), lse.view(batch, kv_heads, group)
    elif not plan.groups:
        return decode_attention(q, k_cache, v_cache, plan.pages, None, sm_scale, meta=(plan.pages, plan.allowed))
    else:
        own_len = plan.pages.shape[1] * page_size
        keys = gather_pages(k_cache, plan.pages).view(batch, own_len, kv_heads, head_dim).transpose(1, 2).to(q.dtype)
        values = gather_pages(v_cache, plan.pages).view(batch, own_len, kv_heads, head_dim).transpose(1, 2).to(q.dtype)
        out, lse = _attend(q.view(batch, kv_heads, group, head_dim), keys, values, sm_scale, plan.bias(q.dtype))
    q4 = q.view(batch, kv_heads, group, head_dim)
    out = out.float()
    for shared in plan.groups:
        n, length = len(shared.rows), len(shared.pages) * page_size
        k_s = gather_pages(k_cache, shared.pages).view(length, kv_heads, head_dim).transpose(0, 1).to(q.dtype)
        v_s = gather_pages(v_cache, shared.pages).view(length, kv_heads, head_dim).transpose(0, 1).to(q.dtype)
        q_s = q4[shared.rows].transpose(0, 1).reshape(kv_heads, n * group, head_dim)
        o_s, lse_s = _attend(q_s[None], k_s[None], v_s[None], sm_scale)  # [1, KH, n*G, D], [1, KH, n*G]
        o_s = o_s.float().view(kv_heads, n, group, head_dim).transpose(0, 1)
        lse_s = lse_s.view(kv_heads, n, group).transpose(0, 1)
        lse_own = lse[shared.rows]
        top = torch.maximum(lse_own, lse_s)
        w_own, w_s = torch.exp(lse_own - top)[..., None], torch.exp(lse_s - top)[..., None]
        out[shared.rows] = (out[shared.rows] * w_own + o_s * w_s) / (w_own + w_s)
    return out.to(q.dtype).reshape(batch, heads, head_dim)
