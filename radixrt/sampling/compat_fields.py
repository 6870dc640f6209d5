"""SGLang's extra request fields that radixrt does not serve itself: which are harmless and which are refused.

SGLang clients (its router, its OpenAI server's clients, its Python SDK) send fields radixrt has no use for.
Every such field is declared on the request struct (so misspelt names are still refused) and given a rule:

- ``Ignored(why)``: the field does not change the result (a model name, a metrics switch, a routing hint).
  Any value is accepted; the first non-null value of each field name is logged once per process.
- ``Unsupported(what, off)``: the field asks for something radixrt cannot do (a LoRA adapter, image data,
  hidden states, ...). A value in ``off`` (null, false, empty, SGLang's default) asks for nothing and passes
  silently; any other value is refused with a ``ValueError`` naming the field.

``check_fields(obj, rules)`` applies the rules to a decoded struct. ``compat_type(rule)`` is the field's type
on a msgspec struct, carrying its JSON schema (``field_schema``), so the OpenAPI document says which values
are served. Imports nothing of the runtime.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

logger = logging.getLogger("radixrt.compat")

OFF: tuple[Any, ...] = (None, False, "", [], {})


@dataclass(frozen=True)
class Ignored:
    why: str


@dataclass(frozen=True)
class Unsupported:
    what: str
    off: tuple[Any, ...] = OFF


Rule = Ignored | Unsupported

_logged: set[str] = set()
_lock = threading.Lock()


def is_off(value: Any, off: tuple[Any, ...]) -> bool:
    # Same type and equal: `0 == False` in Python, but 0 is not an "off" value unless a rule lists it.
    return any(type(value) is type(o) and value == o for o in off)


def log_ignored(name: str, why: str) -> bool:
    """Log an ignored field the first time its name is seen in this process; True when it logged."""
    with _lock:
        if name in _logged:
            return False
        _logged.add(name)
    logger.info("accepted SGLang field %r and ignored it: %s (logged once)", name, why)
    return True


def check_fields(obj: Any, rules: dict[str, Rule], where: str = "") -> None:
    """Refuse an unsupported field with a non-default value (``ValueError`` naming it); log ignored ones once."""
    for name, rule in rules.items():
        value = getattr(obj, name)
        if isinstance(rule, Unsupported):
            if not is_off(value, rule.off):
                raise ValueError(f"{where}{name} is not supported by radixrt ({rule.what}); "
                                 f"leave it out or send null")
        elif value is not None:
            log_ignored(where + name, rule.why)


def field_schema(rule: Rule) -> dict[str, Any]:
    """The JSON schema of a compatibility field: any value when ignored, only the "off" values when refused."""
    if isinstance(rule, Ignored):
        return {"description": f"accepted for SGLang compatibility and ignored: {rule.why}"}
    return {"enum": list(rule.off), "description": f"not supported by radixrt ({rule.what}); "
                                                 f"only these values, which ask for nothing, are accepted"}


def compat_type(rule: Rule) -> Any:
    """The struct field type of a compatibility field: any JSON value, documented by ``field_schema``."""
    return Annotated[Any, msgspec.Meta(extra_json_schema=field_schema(rule))]


def struct_fields(rules: dict[str, Rule]) -> list[tuple[str, Any, None]]:
    """The ``msgspec.defstruct`` fields of a rule table: each one ``compat_type(rule)``, default null."""
    return [(name, compat_type(rule), None) for name, rule in rules.items()]
