"""An embedding request's answer: its prompt's last hidden state, pooled and normalized.

The pooling is SGLang's for a causal language model served for embeddings: the final norm's output at the
prompt's last token, scaled to unit L2 length, as float32. The vector goes out with the request's finish
(``ReqDelta.embedding``).
"""

from __future__ import annotations

import torch


def pooled_embedding(last_hidden: torch.Tensor) -> list[float]:
    """The unit-length float32 vector of one request's last hidden state (``[hidden]``)."""
    vector = last_hidden.float()
    return torch.nn.functional.normalize(vector, dim=-1).tolist()
