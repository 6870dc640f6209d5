"""Per-request logits processing before sampling: penalties, banned tokens, logprobs of the raw model.

Every tensor made here is made on the logits' device; token ids given as a tensor on another device are
moved there.
"""

from __future__ import annotations

import torch

from radixrt.sampling.params import SamplingParams


def apply_penalties(
    logits: torch.Tensor, params: list[SamplingParams], prompts: list[list[int]], outputs: list[list[int]]
) -> torch.Tensor:
    """Repetition (HF: over prompt and output), frequency and presence (OpenAI: over the output) penalties."""
    rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty]
    if not rows:
        return logits
    vocab = logits.shape[-1]
    for i in rows:
        p = params[i]
        row = logits[i]
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(prompts[i]) | set(outputs[i])), dtype=torch.long, device=logits.device)
            if seen.numel():
                values = row[seen]
                row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and outputs[i]:
            ids = torch.tensor(outputs[i], dtype=torch.long, device=logits.device)
            counts = torch.bincount(ids, minlength=vocab).to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    return logits


def ban_tokens(logits: torch.Tensor, banned: list[list[int]]) -> torch.Tensor:
    """Set the listed token ids of each row to -inf (eos and stop ids before min_new_tokens)."""
    for row, ids in enumerate(banned):
        if ids:
            logits[row, ids] = float("-inf")
    return logits


def token_logprobs(
    logprobs: torch.Tensor, tokens: torch.Tensor, top_k: int
) -> tuple[list[float], list[list[tuple[float, int]]] | None]:
    """Log-probabilities of ``tokens`` (one per row) and, if ``top_k``, each row's top-k entries."""
    chosen = logprobs.gather(1, tokens.to(logprobs.device).view(-1, 1)).view(-1).tolist()
    if top_k <= 0:
        return chosen, None
    values, ids = logprobs.topk(top_k, dim=-1)
    return chosen, [list(zip(v, i)) for v, i in zip(values.tolist(), ids.tolist())]
