"""Numbers in request bodies, as JSON Schema counts them and as the runtime can carry them.

- ``integral_floats_as_ints``: JSON Schema's ``integer`` includes numbers like ``2.0``, so the server takes them
  where it takes integers (within 64 bits; a larger one stays a float).
- ``big_int_path``: the runtime's messages carry 64-bit integers, so a typed integer field of a decoded body
  beyond that range is refused (its JSON path, or None). Free-form values (``Any``: an ignored SGLang field, a
  chat message's extra keys, a tool's JSON schema) are passed on or dropped untouched, so any integer is fine
  there.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import inspect as mi

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def integral_floats_as_ints(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer() and INT64_MIN <= value <= INT64_MAX:
        return int(value)
    if isinstance(value, list):
        return [integral_floats_as_ints(v) for v in value]
    if isinstance(value, dict):
        return {k: integral_floats_as_ints(v) for k, v in value.items()}
    return value


def big_int_path(value: Any, kind: Any, path: str = "$") -> str | None:
    """The path of the first integer beyond 64 bits where ``kind`` (a type or msgspec type info) types one."""
    info = kind if isinstance(kind, mi.Type) else mi.type_info(kind)
    while isinstance(info, mi.Metadata):  # Annotated[...]: the type under the annotation
        info = info.type
    if isinstance(info, mi.UnionType):
        info = next((t for t in info.types if _holds(t, value)), mi.AnyType())
    if isinstance(info, mi.AnyType) or value is None or isinstance(value, bool):
        return None
    if isinstance(value, int):
        return None if INT64_MIN <= value <= INT64_MAX else path
    if isinstance(value, msgspec.Struct):
        for field in mi.type_info(type(value)).fields:
            bad = big_int_path(getattr(value, field.name), field.type, f"{path}.{field.name}")
            if bad is not None:
                return bad
    elif isinstance(value, (list, tuple)):
        item = getattr(info, "item_type", mi.AnyType())
        return next((p for i, v in enumerate(value) if (p := big_int_path(v, item, f"{path}[{i}]"))), None)
    elif isinstance(value, dict):
        item = getattr(info, "value_type", mi.AnyType())
        return next((p for k, v in value.items() if (p := big_int_path(v, item, f"{path}.{k}"))), None)
    return None


def _holds(info: mi.Type, value: Any) -> bool:
    """Whether the union member ``info`` is the one ``value`` was decoded as."""
    kinds = {mi.IntType: int, mi.ListType: (list, tuple), mi.DictType: dict, mi.StrType: str,
             mi.FloatType: float, mi.BoolType: bool}
    while isinstance(info, mi.Metadata):
        info = info.type
    if isinstance(info, mi.StructType):
        return isinstance(value, info.cls)
    return isinstance(value, kinds.get(type(info), ()))
