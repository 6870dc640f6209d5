"""The protocol layer, at the bottom of the runtime: what crosses between a client and the scheduler.

- ``messages``: every message between processes or threads (msgspec structs), control calls included;
- ``request``: ``GenerateInput`` (a generation call's arguments in one object) and the one request path
  (``prepare``, ``expand``);
- ``validation``: the one check of a request against the model's limits;
- ``limits``: ``ModelLimits``, ``ClientLimits``;
- ``errors``: ``RequestError`` (400), ``RequestFailed`` (500), ``Overloaded`` and ``RuntimeDown`` (503).

Torch-free: the HTTP process and the frontend's clients import it. It imports only the sampling parameters and
the constraint patterns.
"""
