"""An embedding request's answer: its prompt's final hidden states, pooled as the model says (``Pooling``).

``last`` (SGLang's pooling of a causal model, and that of most decoder embedding models): the final norm's output at
the prompt's last token. ``mean`` and ``cls`` read every prompt token's state (the mean over all of them, the first
one's), so such a request takes no prefix from the cache (``Admission``) and keeps every row of each chunk it
computes; a chunk that starts at the prompt's first token starts the pooling again (a retracted request is computed
again from its start). The vector is cut to ``dimensions`` (a Matryoshka model), then scaled to unit L2 length where
the model normalizes, in float32; it goes out with the request's finish (``ReqDelta.embedding``).
"""

from __future__ import annotations

import torch

from radixrt.model.pooling import Pooling


class EmbeddingPool:
    """One embedding request's pooling, fed the final hidden states of each chunk it computes."""

    def __init__(self, pooling: Pooling, dimensions: int | None = None) -> None:
        self.pooling = pooling
        self.dimensions = dimensions
        self._sum: torch.Tensor | None = None
        self._count = 0
        self._first: torch.Tensor | None = None

    @property
    def every_token(self) -> bool:
        return self.pooling.every_token

    def add(self, start: int, hidden: torch.Tensor) -> None:
        """The final hidden states ``[n, hidden]`` of prompt tokens ``start .. start + n`` (every-token poolings)."""
        if start == 0:
            self._sum, self._count, self._first = None, 0, hidden[0].float()
        if self._first is None:
            raise RuntimeError("an every-token pooling was fed a chunk before the prompt's first token")
        if self.pooling.method == "mean":
            rows = hidden.float().sum(dim=0)
            self._sum = rows if self._sum is None else self._sum + rows
            self._count += hidden.shape[0]

    def vector(self, last_hidden: torch.Tensor) -> list[float]:
        """The answer, given the final hidden state of the prompt's last token."""
        method = self.pooling.method
        if method == "last":
            vector = last_hidden.float()
        elif method == "mean":
            vector = self._sum / self._count
        else:
            vector = self._first
        if self.dimensions is not None:
            vector = vector[: self.dimensions]
        if self.pooling.normalize:
            vector = torch.nn.functional.normalize(vector, dim=-1)
        return vector.tolist()
