"""Per-request logits processing before sampling: penalties, logit bias, banned tokens, logprobs of the raw model.

Every tensor made here is made on the logits' device; token ids given as a tensor on another device are
moved there.
"""

from __future__ import annotations

import numpy as np
import torch

from radixrt.device_copy import stage
from radixrt.sampling.params import SamplingParams


def penalised(p: SamplingParams) -> bool:
    """Whether ``apply_penalties`` changes this request's row."""
    return p.repetition_penalty != 1.0 or bool(p.frequency_penalty) or bool(p.presence_penalty)


def apply_penalties(
    logits: torch.Tensor, params: list[SamplingParams], prompts: list[list[int]], outputs: list[list[int]]
) -> torch.Tensor:
    """Repetition (HF: over prompt and output), frequency and presence (OpenAI: over the output) penalties, in
    place, for all penalised rows at once (their token ids reach the device in one copy)."""
    rows = [i for i, p in enumerate(params) if penalised(p)]
    if not rows:
        return logits
    vocab = logits.shape[-1]
    chosen = [params[i] for i in rows]
    repeat = [i for i in rows if params[i].repetition_penalty != 1.0]
    seen = [prompts[i] + outputs[i] if params[i].repetition_penalty != 1.0 else [] for i in rows]
    counted = [outputs[i] if params[i].frequency_penalty or params[i].presence_penalty else [] for i in rows]
    t = stage({
        "rows": np.array(rows, np.int64),
        "repetition": np.array([[p.repetition_penalty] for p in chosen], np.float32),
        "frequency": np.array([[p.frequency_penalty] for p in chosen], np.float32),
        "presence": np.array([[p.presence_penalty] for p in chosen], np.float32),
        "seen": _padded(seen, vocab), "counted": _padded(counted, vocab),
    }, logits.device)
    sub = logits[t["rows"]]
    if repeat:
        mask = torch.zeros(len(rows), vocab + 1, dtype=torch.bool, device=logits.device)
        mask.scatter_(1, t["seen"], True)
        scaled = torch.where(sub > 0, sub / t["repetition"], sub * t["repetition"])
        sub = torch.where(mask[:, :vocab], scaled, sub)
    if any(counted):
        counts = torch.zeros(len(rows), vocab + 1, dtype=sub.dtype, device=logits.device)
        counts.scatter_add_(1, t["counted"], torch.ones_like(t["counted"], dtype=sub.dtype))
        counts = counts[:, :vocab]
        sub = sub - (t["frequency"] * counts + t["presence"] * (counts > 0).to(sub.dtype))
    logits[t["rows"]] = sub
    return logits


def _padded(ids: list[list[int]], pad: int) -> np.ndarray:
    """``ids`` as one ``[rows, longest]`` matrix, padded with ``pad`` (a column past the vocabulary)."""
    out = np.full((len(ids), max(1, max(map(len, ids)))), pad, np.int64)
    for row, values in zip(out, ids):
        row[: len(values)] = values
    return out


def apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Add each request's ``logit_bias`` (token id -> bias, checked by SamplingParams) to its row, in place, all
    rows in one copy (OpenAI's: added to the logits before sampling; -100 all but bans a token, +100 all but
    forces it)."""
    entries = [(row, int(token), bias) for row, p in enumerate(params) if p.logit_bias
               for token, bias in p.logit_bias.items()]
    if not entries:
        return logits
    t = stage({"rows": np.array([e[0] for e in entries], np.int64),
               "tokens": np.array([e[1] for e in entries], np.int64),
               "bias": np.array([e[2] for e in entries], np.float32)}, logits.device)
    logits.index_put_((t["rows"], t["tokens"]), t["bias"].to(logits.dtype), accumulate=True)
    return logits


def ban_tokens(logits: torch.Tensor, banned: list[list[int]]) -> torch.Tensor:
    """Set the listed token ids of each row to -inf (eos and stop ids before min_new_tokens), all in one copy."""
    pairs = [(row, token) for row, ids in enumerate(banned) for token in ids]
    if pairs:
        t = stage({"pairs": np.array(pairs, np.int64)}, logits.device)["pairs"]
        logits[t[:, 0], t[:, 1]] = float("-inf")
    return logits


def ids_logprobs(logprobs: torch.Tensor, ids: list[int]) -> list[list[tuple[float, int]]]:
    """Each row's log-probabilities of ``ids`` (SGLang's ``token_ids_logprob``), as (logprob, id) in their order."""
    values = logprobs[:, torch.tensor(ids, device=logprobs.device)].tolist()
    return [list(zip(row, ids)) for row in values]


def token_logprobs(
    logprobs: torch.Tensor, tokens: torch.Tensor, top_k: int
) -> tuple[list[float], list[list[tuple[float, int]]] | None]:
    """Log-probabilities of ``tokens`` (one per row) and, if ``top_k``, each row's top-k entries."""
    chosen = logprobs.gather(1, tokens.to(logprobs.device).view(-1, 1)).view(-1).tolist()
    if top_k <= 0:
        return chosen, None
    values, ids = logprobs.topk(top_k, dim=-1)
    return chosen, [list(zip(v, i)) for v, i in zip(values.tolist(), ids.tolist())]
