"""What bounds a request: the model's limits (reported by the scheduler) and a server's limits on one client."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixrt.protocol.errors import RequestError
from radixrt.sampling.params import SamplingParams


@dataclass(frozen=True)
class ModelLimits:
    """The model's and the KV pool's bounds; the scheduler reports them to the HTTP process at start-up."""

    vocab_size: int
    context_length: int
    page_size: int
    num_pages: int
    generates: bool = True  # False: an embedding model (no LM head), which answers embedding requests only
    embedding_size: int = 0  # an embedding's length (the hidden size)
    matryoshka: tuple[int, ...] | None = None  # the dimensions an embedding may be cut to (): any; None: none

    @classmethod
    def of_ready(cls, ready: Any) -> "ModelLimits":
        """The limits a scheduler process announced in its ``SchedulerReady``."""
        return cls(vocab_size=ready.vocab_size, context_length=ready.context_length, page_size=ready.page_size,
                   num_pages=ready.num_pages, generates=ready.generates, embedding_size=ready.embedding_size,
                   matryoshka=None if ready.matryoshka is None else tuple(ready.matryoshka))


@dataclass(frozen=True)
class ClientLimits:
    """A server's bounds on what one client may ask: prompt characters (checked before the text is tokenized),
    ``n``, stop strings. The in-process Engine sets none."""

    max_prompt_chars: int | None = None
    max_n: int | None = None
    max_stop_strings: int | None = None
    max_stop_string_chars: int | None = None

    @classmethod
    def of_server(cls, args: Any, context_length: int) -> "ClientLimits":
        """The limits of ``radixrt serve`` (ServerArgs); prompt characters default to 32 per context token."""
        return cls(max_prompt_chars=args.max_prompt_chars or 32 * context_length, max_n=args.max_n,
                   max_stop_strings=args.max_stop_strings, max_stop_string_chars=args.max_stop_string_chars)

    def check_text(self, text: str, what: str = "the prompt") -> None:
        self.check_chars(len(text), what)

    def check_chars(self, chars: int, what: str = "the prompt") -> None:
        if self.max_prompt_chars is not None and chars > self.max_prompt_chars:
            raise RequestError(f"{what} has {chars} characters; this server takes at most "
                               f"{self.max_prompt_chars}")

    def check_params(self, params: SamplingParams) -> None:
        if self.max_n is not None and params.n > self.max_n:
            raise RequestError(f"n must be <= {self.max_n} on this server")
        stops = params.stop or []
        if self.max_stop_strings is not None and len(stops) > self.max_stop_strings:
            raise RequestError(f"at most {self.max_stop_strings} stop strings are allowed")
        if self.max_stop_string_chars is not None and any(len(s) > self.max_stop_string_chars for s in stops):
            raise RequestError(f"stop strings must be at most {self.max_stop_string_chars} characters")


NO_LIMITS = ClientLimits()
