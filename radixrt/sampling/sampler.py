"""Turns a batch of logits into next tokens, vectorised over requests with different parameters."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixrt.sampling.params import SamplingParams


@dataclass
class SamplingBatch:
    """Per-row sampling parameters as tensors, built once per forward."""

    temperatures: torch.Tensor  # [B, 1]
    top_ks: torch.Tensor  # [B] (vocab size where off)
    top_ps: torch.Tensor  # [B]
    min_ps: torch.Tensor  # [B]
    greedy: torch.Tensor  # [B] bool
    generators: list[torch.Generator | None]
    all_greedy: bool
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool

    @classmethod
    def build(
        cls, params: list[SamplingParams], vocab_size: int, generators: list[torch.Generator | None] | None = None
    ) -> "SamplingBatch":
        greedy = [p.greedy for p in params]
        top_ks = [vocab_size if p.top_k < 1 else min(p.top_k, vocab_size) for p in params]
        return cls(
            temperatures=torch.tensor([[1.0 if g else p.temperature] for p, g in zip(params, greedy)]),
            top_ks=torch.tensor(top_ks),
            top_ps=torch.tensor([p.top_p for p in params]),
            min_ps=torch.tensor([p.min_p for p in params]),
            greedy=torch.tensor(greedy),
            generators=generators or [None] * len(params),
            all_greedy=all(greedy),
            need_top_k=any(k < vocab_size for k in top_ks),
            need_top_p=any(p.top_p < 1.0 for p in params),
            need_min_p=any(p.min_p > 0.0 for p in params),
        )


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Next token per row of ``logits`` ``[B, V]`` (already penalised and masked)."""
    if batch.all_greedy:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / batch.temperatures, dim=-1)
    if batch.need_top_k or batch.need_top_p or batch.need_min_p:
        probs = _filter(probs, batch)
    # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p; each seeded row uses its own generator.
    noise = torch.empty_like(probs).exponential_()
    for row, generator in enumerate(batch.generators):
        if generator is not None:
            noise[row].exponential_(generator=generator)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(batch.greedy, logits.argmax(dim=-1), sampled)


def _filter(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(probs.shape[-1]).expand_as(sorted_probs)
    drop = ranks >= batch.top_ks[:, None]
    if batch.need_top_p:
        # Keep the smallest head whose mass reaches top_p (the token that crosses it stays).
        before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop |= before > batch.top_ps[:, None]
    if batch.need_min_p:
        drop |= sorted_probs < sorted_probs[:, :1] * batch.min_ps[:, None]
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
