"""LoRA adapters as the scheduler sees them: a request's adapter by name, and loads and unloads between steps.

The adapters themselves live in the model runner (``ModelRunner.adapters``, radixrt.model.lora; None unless
``--enable-lora`` or ``--lora-paths``). A request names one by ``lora_path``; it runs under the adapter's uid,
which is also its namespace in the radix cache. An adapter is unloaded only while no request, waiting or
running, uses it (else 409); its cached prefixes stay in the tree, unreachable, until evicted.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from radixrt.protocol.errors import Conflict, NotFound, RequestError

if TYPE_CHECKING:
    from radixrt.model.lora import Adapters
    from radixrt.scheduler.request import Req

logger = logging.getLogger("radixrt.scheduler")


def _adapters(runner) -> Adapters:
    adapters = getattr(runner, "adapters", None)
    if adapters is None:
        raise RequestError("this runtime serves no LoRA adapters (start it with --enable-lora or --lora-paths)")
    return adapters


def adapter_uid(runner, name: str | None) -> int:
    """The uid of the loaded adapter ``name`` (0 for None: the base model); NotFound (404, as an unknown session)
    for one not loaded."""
    if name is None:
        return 0
    try:
        return _adapters(runner).uid_of(name)
    except ValueError as exc:
        raise NotFound(f"lora_path: {exc}") from None


def loaded(runner) -> dict[str, str]:
    """Every loaded adapter's name -> path."""
    adapters = getattr(runner, "adapters", None)
    return {} if adapters is None else {a.name: a.path for a in adapters.by_name.values()}


def load(runner, name: str, path: str, max_loaded: int | None, folder: str | None = None) -> dict[str, str]:
    """Load an adapter between steps, from ``folder`` where the caller fetched ``path`` already (a hub download
    happens off the scheduler's thread: in the HTTP process, or in the Engine's caller)."""
    adapters = _adapters(runner)
    if name in adapters.by_name:
        raise Conflict(f"a LoRA adapter named {name!r} is already loaded")
    if max_loaded is not None and len(adapters.by_name) >= max_loaded:
        raise Conflict(f"{len(adapters.by_name)} LoRA adapters are loaded, --max-loaded-loras {max_loaded}: "
                       "unload one first")
    try:
        adapter = adapters.load(name, path, folder)
    except ValueError as exc:  # AdapterError: the adapter's own fault
        raise RequestError(str(exc)) from None
    logger.info("LoRA adapter %r loaded from %s: rank %d on %s", name, path, adapter.rank, ", ".join(adapter.targets))
    return loaded(runner)


def unload(runner, name: str, requests: list[Req]) -> dict[str, str]:
    adapters = _adapters(runner)
    adapter = adapters.by_name.get(name)
    if adapter is None:
        raise NotFound(f"no LoRA adapter named {name!r} is loaded")
    users = sum(r.lora_uid == adapter.uid for r in requests)
    if users:
        raise Conflict(f"LoRA adapter {name!r} is in use by {users} request(s); unload it once they finish")
    adapters.unload(name)
    logger.info("LoRA adapter %r unloaded", name)
    return loaded(runner)
