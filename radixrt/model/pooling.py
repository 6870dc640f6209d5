"""How an embedding model turns a prompt's final hidden states into one vector, as its checkpoint says.

An embedding checkpoint made with sentence-transformers lists its modules in ``modules.json``: the transformer,
then a ``Pooling`` module (its ``config.json`` names the pooling: the last token's state, the mean over every
token, or the first token's) and usually a ``Normalize`` module (unit L2 length). ``read_pooling`` reads them;
a checkpoint without ``modules.json`` gets SGLang's pooling of a causal model: the last token, normalized.
Modules radixrt does not compute (a ``Dense`` projection, max pooling, several poolings concatenated, a pooling
that leaves the prompt's instruction out) are refused by name rather than served as a different vector.

A Matryoshka model (its config sets ``is_matryoshka`` or lists ``matryoshka_dimensions``, as SGLang and vLLM
read it) may be asked for fewer dimensions: the vector is cut to its first ``dimensions`` values, then
normalized where the model normalizes (``matryoshka``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

POOLING_METHODS = ("last", "mean", "cls")
# sentence-transformers' Pooling config key of each method radixrt computes
_MODE_KEYS = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
_OTHER_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
_TRANSFORMER, _POOLING, _NORMALIZE = "Transformer", "Pooling", "Normalize"


@dataclass(frozen=True)
class Pooling:
    """``method``: "last" (the last prompt token's state), "mean" (the mean over every prompt token) or "cls" (the
    first token's); ``normalize``: scaled to unit L2 length."""

    method: str = "last"
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.method not in POOLING_METHODS:
            raise ValueError(f"pooling method {self.method!r} is not one of {POOLING_METHODS}")

    @property
    def every_token(self) -> bool:
        """The pooling reads every prompt token's state, so no prefix of the prompt may come from the cache."""
        return self.method != "last"


def read_pooling(model_dir: Path) -> Pooling:
    """The pooling a sentence-transformers checkpoint declares; SGLang's (last token, normalized) without one."""
    modules_file = Path(model_dir) / "modules.json"
    if not modules_file.is_file():
        return Pooling()
    modules = json.loads(modules_file.read_text())
    kinds = [str(m.get("type", "")).rpartition(".")[2] for m in modules]
    others = [k for k in kinds if k not in (_TRANSFORMER, _POOLING, _NORMALIZE)]
    if others:
        raise ValueError(f"{modules_file}: sentence-transformers modules {others} are not served (radixrt computes "
                         "a transformer, a Pooling and a Normalize module)")
    if kinds.count(_POOLING) != 1:
        raise ValueError(f"{modules_file}: an embedding checkpoint needs exactly one Pooling module")
    pooling_dir = Path(model_dir) / modules[kinds.index(_POOLING)].get("path", "")
    config = json.loads((pooling_dir / "config.json").read_text())
    return Pooling(_pooling_method(config, pooling_dir), normalize=_NORMALIZE in kinds)


def _pooling_method(config: dict, where: Path) -> str:
    chosen = [method for key, method in _MODE_KEYS.items() if config.get(key)]
    others = [key for key in _OTHER_MODES if config.get(key)]
    if others or len(chosen) != 1:
        raise ValueError(f"{where}: radixrt serves exactly one pooling of last token, mean or cls; this one asks "
                         f"for {[k for k in (*_MODE_KEYS, *_OTHER_MODES) if config.get(k)]}")
    if not config.get("include_prompt", True):
        raise ValueError(f"{where}: pooling that leaves the prompt's instruction out (include_prompt false) is "
                         "not served")
    return chosen[0]


def matryoshka(config) -> tuple[int, ...] | None:
    """The output sizes a Matryoshka model allows: its ``matryoshka_dimensions``, an empty tuple (any size up to
    the hidden size) where it only sets ``is_matryoshka``, or None where it is not one."""
    dims = getattr(config, "matryoshka_dimensions", None)
    if dims:
        return tuple(int(d) for d in dims)
    return () if getattr(config, "is_matryoshka", False) else None
