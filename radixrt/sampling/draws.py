"""Counter-based random draws: a sampled row's uniform is a hash of its request's seed and the index of the token
being drawn, computed for every row at once on the logits' device.

A request's k-th output token always meets the draw ``uniform(seed, k)``, whatever batch it runs in, whether the
step was launched ahead (overlap), computed again after a retraction, or verified with draft tokens (row i of a
verify step draws for output index ``k + i``; rows past the first rejection are simply not used, so nothing is
rewound). No generator object and no per-row launch: one pass of integer ops over ``[B]`` tensors, which a CUDA
graph could hold too.

The hash is SplitMix64 (Steele, Lea and Flood, 2014): the seed is mixed once, stepped ``k + 1`` times by the golden
gamma, and mixed again; the top 53 bits make a double in ``[0, 1)``. Torch has no unsigned 64-bit arithmetic, so the
state is an int64 whose products wrap modulo 2**64 (as they do on CPUs and GPUs) and whose right shifts are made
logical by masking. ``reference_uniform`` is the same in Python's integers, for tests and the GPU check.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def _signed(value: int) -> int:
    """``value`` modulo 2**64 as an int64."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def seed_word(seed: int) -> int:
    """A request's seed (any Python int) mixed once, as the int64 that ``uniforms`` steps from (on the host, once
    per request and batch)."""
    return _signed(_mix_int(seed & _MASK64))


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = x ^ _shr(x, 30)
    x = x * _signed(_MIX1)
    x = x ^ _shr(x, 27)
    x = x * _signed(_MIX2)
    return x ^ _shr(x, 31)


def uniforms(seed_words: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """``[B]`` float64 draws in ``[0, 1)``: row i's for its seed (int64, ``seed_word``) and its counter (the index
    of the output token being drawn)."""
    state = seed_words + (counters + 1) * _signed(_GAMMA)
    return _shr(_mix(state), 11).to(torch.float64) * 2.0**-53


def _mix_int(x: int) -> int:
    x ^= x >> 30
    x = (x * _MIX1) & _MASK64
    x ^= x >> 27
    x = (x * _MIX2) & _MASK64
    return x ^ (x >> 31)


def reference_uniform(seed: int, counter: int) -> float:
    """``uniforms`` for one row, in Python's integers."""
    state = (_mix_int(seed & _MASK64) + (counter + 1) * _GAMMA) & _MASK64
    return (_mix_int(state) >> 11) * 2.0**-53
