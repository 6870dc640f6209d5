"""Turns a batch of logits into next tokens, vectorised over requests with different parameters.

Device contract: every tensor ``sample`` uses lives on the logits' device. Build the batch there
(``SamplingBatch.build(..., device=logits.device)``: its parameters reach the device in one non-blocking copy,
none when every row is greedy); a batch built elsewhere is moved first.

Randomness: a sampled row's draw is a hash of its seed and its counter, the index of the output token it draws
(radixrt.sampling.draws), for every row at once: a request's k-th token meets the same draw in any batch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from radixrt.device_copy import stage
from radixrt.kernels import cpu_kernels
from radixrt.sampling import draws
from radixrt.sampling.params import SamplingParams


@dataclass
class SamplingBatch:
    """Per-row sampling parameters as tensors, built once per forward (none at all when every row is greedy)."""

    temperatures: torch.Tensor | None  # [B, 1]
    top_ks: torch.Tensor | None  # [B] (vocab size where off)
    top_ps: torch.Tensor | None  # [B]
    min_ps: torch.Tensor | None  # [B]
    greedy: torch.Tensor | None  # [B] bool
    filtered: torch.Tensor | None  # [B] bool: the row asks for top-k, top-p or min-p
    seed_words: torch.Tensor | None  # [B] int64: each row's seed, mixed (draws.seed_word)
    counters: torch.Tensor | None  # [B] int64: the index of the output token each row draws
    all_greedy: bool
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        vocab_size: int,
        seeds: list[int | None] | None = None,
        counters: list[int] | None = None,
        device: str | torch.device = "cpu",
    ) -> "SamplingBatch":
        """``seeds``: each row's seed (a sampled row without one draws it from torch's global generator);
        ``counters``: the index of the output token each row draws (0 where not given)."""
        greedy = [p.greedy for p in params]
        top_ks = [vocab_size if p.top_k < 1 else min(p.top_k, vocab_size) for p in params]
        flags = dict(all_greedy=all(greedy), need_top_k=any(k < vocab_size for k in top_ks),
                     need_top_p=any(p.top_p < 1.0 for p in params), need_min_p=any(p.min_p > 0.0 for p in params))
        if flags["all_greedy"]:  # argmax needs no parameter: nothing to copy to the device
            return cls(temperatures=None, top_ks=None, top_ps=None, min_ps=None, greedy=None, filtered=None,
                       seed_words=None, counters=None, **flags)
        seeds = seeds if seeds is not None else [None] * len(params)
        words = [0 if g else draws.seed_word(s if s is not None else int(torch.randint(0, 2**62, ())))
                 for g, s in zip(greedy, seeds)]
        tensors = stage({
            "temperatures": np.array([[1.0 if g else p.temperature] for p, g in zip(params, greedy)], np.float32),
            "top_ks": np.array(top_ks, np.int64),
            "top_ps": np.array([p.top_p for p in params], np.float32),
            "min_ps": np.array([p.min_p for p in params], np.float32),
            "greedy": np.array(greedy, np.bool_),
            "filtered": np.array([k < vocab_size or p.top_p < 1.0 or p.min_p > 0.0 for k, p in zip(top_ks, params)],
                                 np.bool_),
            "seed_words": np.array(words, np.int64),
            "counters": np.array(counters if counters is not None else [0] * len(params), np.int64),
        }, device)
        return cls(**tensors, **flags)

    @property
    def device(self) -> torch.device | None:
        return None if self.greedy is None else self.greedy.device

    def to(self, device: str | torch.device) -> "SamplingBatch":
        """This batch with its tensors on ``device`` (itself when they are there already)."""
        device = torch.device(device)
        if self.greedy is None or _same_device(self.device, device):
            return self
        tensors = ("temperatures", "top_ks", "top_ps", "min_ps", "greedy", "filtered", "seed_words", "counters")
        return dataclasses.replace(self, **{name: getattr(self, name).to(device) for name in tensors})

    def advanced(self) -> "SamplingBatch":
        """The same rows drawing their next output token (every counter one further), on the device."""
        if self.all_greedy:
            return self
        return dataclasses.replace(self, counters=self.counters + 1)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Next token per row of ``logits`` ``[B, V]`` (already penalised and masked), on the logits' device.

    Inverse-CDF sampling: a row's token is where its uniform draw (radixrt.sampling.draws: a hash of its seed and
    counter), scaled to the row's total, falls in the cumulative sum (fp64) of its probabilities; a token of
    probability 0 spans nothing and is never drawn. One number a row: the exponential race it replaced drew ``V``
    numbers a row, which on a CPU took about 1 ms a row (30 ms a step at batch 32). On a CPU with the C++ kernels,
    the rows that ask for temperature alone are sampled by one kernel (``cpu_kernels.sample_tokens``: the same rule
    over the softmax's numerators, two passes over a row and a third over one vector of it, nothing row-sized
    written; 0.18 ms for 8 rows of 49,152 logits on two cores, where the torch ops took 0.85); the rows that ask
    for top-k, top-p or min-p by the torch ops. A row's way depends on its own parameters alone, so its token never
    depends on what the other rows of its batch ask for."""
    if batch.all_greedy:
        return greedy_tokens(logits)
    batch = batch.to(logits.device)
    uniforms = draws.uniforms(batch.seed_words, batch.counters)[:, None]
    if _kernel_samples(logits):
        sampled = cpu_kernels.sample_tokens(logits.float(), batch.temperatures.view(-1), uniforms.view(-1))
        if batch.need_top_k or batch.need_top_p or batch.need_min_p:  # torch samples the rows that sort first
            rows = batch.filtered.nonzero().view(-1)
            sampled[rows] = _inverse_cdf(logits[rows], _rows_of(batch, rows), uniforms[rows])
        return torch.where(batch.greedy, greedy_tokens(logits), sampled) if bool(batch.greedy.any()) else sampled
    return torch.where(batch.greedy, greedy_tokens(logits), _inverse_cdf(logits, batch, uniforms))


def _inverse_cdf(logits: torch.Tensor, batch: SamplingBatch, uniforms: torch.Tensor) -> torch.Tensor:
    """Each row's token where its uniform falls in the cumulative sum (fp64) of its (filtered) probabilities."""
    probs = torch.softmax(logits.float() / batch.temperatures, dim=-1)
    if batch.need_top_k or batch.need_top_p or batch.need_min_p:
        probs = _filter(probs, batch)
    cdf = probs.double().cumsum_(dim=-1)
    total = cdf[:, -1:]
    # below the total even where u * total rounds up to it, so the token found always has probability > 0
    point = torch.minimum(uniforms * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, point, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)  # NaN rows


def _kernel_samples(logits: torch.Tensor) -> bool:
    """Whether the C++ kernel samples the rows that ask for temperature alone: CPU logits with contiguous rows."""
    return (logits.device.type == "cpu" and logits.dim() == 2 and logits.shape[1] > 0 and logits.stride(1) == 1
            and cpu_kernels.load() is not None)


def _rows_of(batch: SamplingBatch, rows: torch.Tensor) -> SamplingBatch:
    """The batch's parameters at ``rows`` (the filter flags as the whole batch's: a row without a filter is left
    whole by it)."""
    return dataclasses.replace(batch, temperatures=batch.temperatures[rows], top_ks=batch.top_ks[rows],
                               top_ps=batch.top_ps[rows], min_ps=batch.min_ps[rows], greedy=batch.greedy[rows],
                               filtered=batch.filtered[rows], seed_words=batch.seed_words[rows],
                               counters=batch.counters[rows])


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)``: the first of the maximal values, NaN where a row has one. On a CPU with the C++
    kernels, one vectorised pass a row (``cpu_kernels.greedy_tokens``: a verify step's 40 rows of 49,152 logits in
    0.17 ms on two cores); elsewhere read off ``max``, which on a CPU takes a third of argmax's time (0.55 ms
    against 1.5)."""
    if (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2 and logits.shape[1] > 0
            and logits.stride(1) == 1 and cpu_kernels.load() is not None):
        return cpu_kernels.greedy_tokens(logits)
    return logits.max(dim=-1).indices


def _same_device(a: torch.device, b: torch.device) -> bool:
    """Whether ``a`` and ``b`` name one device (``cuda`` is the current CUDA device, as for tensors)."""
    return a.type == b.type and _index(a) == _index(b)


def _index(device: torch.device) -> int:
    if device.index is not None:
        return device.index
    return torch.cuda.current_device() if device.type == "cuda" else 0


def _filter(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(probs.shape[-1], device=probs.device).expand_as(sorted_probs)
    drop = ranks >= batch.top_ks[:, None]
    if batch.need_top_p:
        # Keep the smallest head whose mass reaches top_p (the token that crosses it stays). A row without top_p
        # drops nothing: in fp32 the mass before a tail token can round past 1.0, and a row's tokens must not
        # depend on whether another row of its batch asked for top_p.
        before = sorted_probs.cumsum(dim=-1) - sorted_probs
        top_ps = batch.top_ps[:, None]
        drop |= (before > top_ps) & (top_ps < 1.0)
    if batch.need_min_p:
        drop |= sorted_probs < sorted_probs[:, :1] * batch.min_ps[:, None]
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
