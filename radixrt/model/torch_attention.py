"""The torch attention backend: the CPU path, torch with the C++ CPU kernels and the cascade attention.

``rope_and_store`` is one C++ kernel where the kernels are built (:func:`cpu_kernels.rope_and_store`: q rotated
in place, k rotated straight into its cache slots, v copied beside it), else the model's rotary then
``store_kv``.
A decode batch runs the cascade decode (:mod:`radixrt.kernels.torch_cascade`: a prefix shared by a group of
requests is read once), or with a sliding window the C++ paged decode (:mod:`radixrt.kernels.cpu_kernels`)
when it is usable, else :mod:`radixrt.kernels.torch_ref`. An extend batch in bf16 runs the C++ paged extend
where it is vectorized and the CPU has no AMX (AVX-512 builds: pages read in place, 2-3x torch's attention over
gathered pages; with AMX torch's flash attention runs on the tiles, 3x this kernel), else the cascade extend, or
``torch_ref`` with a sliding window. A request of at most ``SHORT_EXTEND`` new tokens (a speculative verify step)
attends as a decode with a row per token (:class:`DecodeRows`), and so, where the decode kernel's products run on AMX
tiles (bf16), does one of up to ``TILED_ROWS_NEW`` new tokens over up to ``TILED_ROWS_KEYS`` keys (a chat turn, a
question about a cached document); in a mixed batch those requests do, and the rest run as an extend
(:class:`MixedSplit`). What the page table implies is the same for every layer, so plans are derived once per
forward and kept in ``batch.attn_cache``.

Deterministic inference (``all_rows``): every extend runs as decode rows, whatever its length, on the C++ decode
kernel. A token's attention then takes the same sums whether its prompt came whole, in chunks, after a cached
prefix or beside other requests, and the same as a decode step over the same keys would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixrt import env
from radixrt.kernels import cpu_kernels, torch_cascade, torch_ref
from radixrt.memory.page_pool import PagePool
from radixrt.model.attention import AttentionBackend
from radixrt.model.forward_batch import ForwardBatch
from radixrt.model.layers import RotaryEmbedding


class TorchAttention(AttentionBackend):
    backend = "torch"
    store_kv = staticmethod(torch_ref.store_kv)

    def __init__(self, pool: PagePool, all_rows: bool = False) -> None:
        super().__init__(pool)
        if all_rows and cpu_kernels.load() is None:
            raise ValueError("deterministic inference needs radixrt's C++ CPU kernels, which are not built here "
                             "(radixrt env shows why)")
        self.all_rows = all_rows

    def rope_and_store(self, layer: int, rotary: RotaryEmbedding, positions: torch.Tensor, q: torch.Tensor,
                       k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        k_cache, v_cache = self.pool.k_caches[layer], self.pool.v_caches[layer]
        if _fused_rope_usable(q, k, v, k_cache):
            cpu_kernels.rope_and_store(positions, q, k, v, *rotary.fp32_caches(), batch.out_slots, k_cache, v_cache)
            return q
        return super().rope_and_store(layer, rotary, positions, q, k, v, batch)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
               sm_scale: float, sliding_window: int) -> torch.Tensor:
        """Requests of a mixed batch with a few new tokens (a decode, a verify step) take the batched decode path
        (and its cascade), a row per token: attending one query per request through the extend loop costs a whole
        gather and call each, and the decode kernel gives a row the same bits whatever shares its batch."""
        if batch.is_decode:
            return _decode(q, k_cache, v_cache, batch.page_table, batch.seq_lens, batch.attn_cache,
                           ("decode", sliding_window), sm_scale, sliding_window)
        as_rows = batch.attn_cache.get("as_rows")
        if as_rows is None:
            tiled = q.dtype == k_cache.dtype == torch.bfloat16 and cpu_kernels.decode_tiles_usable()
            as_rows = batch.attn_cache["as_rows"] = row_requests(batch, tiled, self.all_rows)
        if bool(as_rows.all()):
            rows = batch.attn_cache.get("rows")
            if rows is None:
                rows = batch.attn_cache["rows"] = DecodeRows.of(batch)
            return _decode(q, k_cache, v_cache, rows.page_table, rows.seq_lens, batch.attn_cache,
                           ("rows", sliding_window), sm_scale, sliding_window)
        if not bool(as_rows.any()):
            return _extend(q, k_cache, v_cache, batch.page_table, batch.prefix_lens, batch.extend_lens,
                           batch.attn_cache, ("extend", sliding_window), sm_scale, sliding_window)
        split = batch.attn_cache.get("mixed")
        if split is None:
            split = batch.attn_cache["mixed"] = MixedSplit.of(batch, as_rows)
        out = torch.empty_like(q)
        out[split.row_tokens] = _decode(
            q[split.row_tokens], k_cache, v_cache, batch.page_table[split.row_reqs], split.row_seq_lens,
            batch.attn_cache, ("mixed-decode", sliding_window), sm_scale, sliding_window,
        )
        out[split.extend_tokens] = _extend(
            q[split.extend_tokens], k_cache, v_cache, batch.page_table[split.extend_reqs],
            batch.prefix_lens[split.extend_reqs], batch.extend_lens[split.extend_reqs], batch.attn_cache,
            ("mixed-extend", sliding_window), sm_scale, sliding_window,
        )
        return out


# New tokens per request up to which an extend batch runs as decode rows (a speculative verify step, a short
# prompt): at batch 8 over 500 keys, 2 rows a request took the extend kernel 0.82 ms a layer, 4x a decode's.
SHORT_EXTEND = 16
# Where the decode kernel multiplies on AMX tiles (bf16), a request's rows walk its pages together, 16 rows a tile:
# on a 2-vCPU Xeon a chunk's forward takes 0.91-1.02x the flash kernel's time up to 512 new tokens a request over up
# to about 1,500 keys, 1.04-1.37x past that, and workloads of short chunks over cached prefixes gain 2-7% of output
# (docs/BENCHMARKS.md). RADIXRT_TILED_ROWS_NEW=0 turns this off.
TILED_ROWS_NEW = int(env.get("RADIXRT_TILED_ROWS_NEW"))
TILED_ROWS_KEYS = 2048


def row_requests(batch: ForwardBatch, tiled: bool, always: bool = False) -> torch.Tensor:
    """Which requests of an extend batch attend as decode rows (host, bool): those of at most :data:`SHORT_EXTEND`
    new tokens; with ``tiled`` (the decode kernel on AMX tiles) also those of at most :data:`TILED_ROWS_NEW` new
    tokens and :data:`TILED_ROWS_KEYS` keys; with ``always`` (deterministic inference) every one."""
    new = batch.extend_lens.long().cpu()
    if always:
        return torch.ones_like(new, dtype=torch.bool)
    rows = new <= SHORT_EXTEND
    if tiled:
        rows |= (new <= TILED_ROWS_NEW) & (batch.prefix_lens.long().cpu() + new <= TILED_ROWS_KEYS)
    return rows


@dataclass
class DecodeRows:
    """An extend batch as one decode row per new token: token i of a request attends, as a decode would, to
    the request's pages up to and including itself (length ``prefix + i + 1``). The rows of a request share its
    pages, so the cascade reads them once for all of them."""

    page_table: torch.Tensor
    seq_lens: torch.Tensor

    @classmethod
    def of(cls, batch: ForwardBatch) -> "DecodeRows":
        reqs, seq_lens = token_rows(batch)
        device = batch.page_table.device
        return cls(page_table=batch.page_table[reqs.to(device)], seq_lens=seq_lens.int().to(device))


def token_rows(batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """For every new token of an extend batch (on the host, int64): its request, and its length as a decode row
    (token i of a request attends to ``prefix + i + 1`` keys)."""
    lens = batch.extend_lens.long().cpu()
    reqs = torch.repeat_interleave(torch.arange(len(lens)), lens)
    first = torch.cumsum(lens, 0) - lens
    position = torch.arange(int(lens.sum())) - first[reqs]
    return reqs, batch.prefix_lens.long().cpu()[reqs] + position + 1


def _fused_rope_usable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """CPU tensors of the caches' dtype, each head's elements contiguous, kernels built."""
    heads_contiguous = all(t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (q, k, v))
    same_dtype = q.dtype == k.dtype == v.dtype == k_cache.dtype
    return heads_contiguous and same_dtype and q.device.type == "cpu" and cpu_kernels.load() is not None


@dataclass
class MixedSplit:
    """A mixed batch's requests that attend as decode rows (:func:`row_requests`: decodes, verify steps, short
    chunks), a row per token (``row_*``: the row's request, its token and its length, as :class:`DecodeRows`), and
    the rest (``extend_*``: request and token rows). A verify step's rows thus meet the decode kernel whether or not
    a prefill chunk shares their batch, and get the bits a decode step would."""

    row_reqs: torch.Tensor
    row_tokens: torch.Tensor
    row_seq_lens: torch.Tensor
    extend_reqs: torch.Tensor
    extend_tokens: torch.Tensor

    @classmethod
    def of(cls, batch: ForwardBatch, short: torch.Tensor) -> "MixedSplit":
        """``short``: which requests attend as rows (host, bool)."""
        token_req, token_len = token_rows(batch)
        token_is_row = short[token_req]
        row_tokens = torch.nonzero(token_is_row).flatten()
        device = batch.extend_lens.device
        return cls(
            row_reqs=token_req[row_tokens].to(device),
            row_tokens=row_tokens.to(device),
            row_seq_lens=token_len[row_tokens].int().to(device),
            extend_reqs=torch.nonzero(~short).flatten().to(device),
            extend_tokens=torch.nonzero(~token_is_row).flatten().to(device),
        )


def _decode(q, k_cache, v_cache, page_table, seq_lens, cache: dict, key, sm_scale: float,
            sliding_window: int) -> torch.Tensor:
    # what the page table implies is the same for every layer: derive it once per forward
    plan = cache.get(key)
    page_size = k_cache.shape[1]
    if sliding_window == 0:
        if plan is None:
            plan = cache[key] = torch_cascade.plan_decode(page_table, seq_lens, page_size,
                                                          align_pages=torch_cascade.shared_alignment(q, k_cache))
        return torch_cascade.cascade_decode_attention(q, k_cache, v_cache, plan, sm_scale)
    if cpu_kernels.usable_for(q, k_cache):
        return cpu_kernels.paged_decode(q, k_cache, v_cache, page_table, seq_lens, sm_scale, sliding_window)[0]
    if plan is None:
        plan = cache[key] = torch_ref.decode_metadata(page_table, seq_lens, sliding_window, page_size)
    return torch_ref.decode_attention(q, k_cache, v_cache, page_table, seq_lens, sm_scale, sliding_window, meta=plan)


def _extend(q, k_cache, v_cache, page_table, prefix_lens, extend_lens, cache: dict, key, sm_scale: float,
            sliding_window: int) -> torch.Tensor:
    if cpu_kernels.paged_extend_usable(q, k_cache):
        return cpu_kernels.paged_extend(q, k_cache, v_cache, page_table, prefix_lens, extend_lens, sm_scale,
                                        sliding_window)
    if sliding_window > 0:
        return torch_ref.extend_attention(q, k_cache, v_cache, page_table, prefix_lens, extend_lens, sm_scale,
                                          sliding_window, cache)
    plan = cache.get(key)
    if plan is None:
        plan = cache[key] = torch_cascade.plan_extend(page_table, prefix_lens, extend_lens, k_cache.shape[1])
    return torch_cascade.cascade_extend_attention(q, k_cache, v_cache, page_table, prefix_lens, extend_lens, plan,
                                                  sm_scale, cache)
