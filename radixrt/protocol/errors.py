"""The errors of the request path, and what each means to a client: the same on the Engine and the server.

- ``RequestError`` (a ``ValueError``): the request cannot be served as asked; HTTP 400. Two of them say more:
  ``NotFound`` (it names something the runtime does not have: a session, a model; HTTP 404) and ``Conflict``
  (it clashes with the runtime's state: a session id already open; HTTP 409). ``status_of`` and ``error_for``
  translate between the error and the status a finish reason or a reply carries.
- ``RequestFailed``: the runtime failed while serving it (its batch's forward, its output); HTTP 500.
- ``Overloaded``: the waiting queue is full; HTTP 503, retry later.
- ``RuntimeDown``: the scheduler is gone (the model cannot run, the engine was shut down, a helper process
  died); HTTP 503. The Engine raises it as ``EngineDead``.
"""

from __future__ import annotations


class RequestError(ValueError):
    """A request the runtime cannot serve (a 4xx for the HTTP server)."""


class NotFound(RequestError):
    """A request that names something the runtime does not have (HTTP 404)."""


class Conflict(RequestError):
    """A request that clashes with the runtime's state, such as an id already in use (HTTP 409)."""


class RequestFailed(RuntimeError):
    """The runtime failed while serving this request; the others go on (HTTP 500)."""


class Overloaded(RuntimeError):
    """The waiting queue is full (HTTP 503)."""


class RuntimeDown(RuntimeError):
    """The scheduler cannot answer any more (HTTP 503)."""


def status_of(error: RequestError) -> int:
    """The HTTP status of a refused request."""
    return 404 if isinstance(error, NotFound) else 409 if isinstance(error, Conflict) else 400


def error_for(status: int, message: str) -> Exception:
    """The error a status stands for (a refused request below 500, a failure from 500 on)."""
    if status >= 500:
        return RequestFailed(message)
    return {404: NotFound, 409: Conflict}.get(status, RequestError)(message)
