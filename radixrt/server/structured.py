"""Hook for structured output in the HTTP layer (the grammar compiler itself lives in radixrt.constrained).

- ``response_format_to_params``: OpenAI's ``response_format`` -> radixrt sampling-param fields.
- ``validate_grammar``: a fast check of a constraint before the request is queued, so bad grammars get 400
  without a round trip. It uses ``radixrt.constrained.validate_grammar(kind, spec)`` when that module
  provides one (it must not import torch: this runs in the HTTP process). Without it the scheduler still
  rejects a bad grammar when it compiles it; the server turns that abort into a 400 as well (streaming
  requests wait for their first output before answering, so the error still arrives as a 4xx).
"""

from __future__ import annotations

import json
from typing import Any

from radixrt.scheduler.validation import RequestError


def response_format_to_params(response_format: Any) -> dict[str, Any]:
    if response_format is None:
        return {}
    if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
        raise RequestError("response_format must be an object with a 'type'")
    kind = response_format["type"]
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_schema": json.dumps({"type": "object"})}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise RequestError("response_format.json_schema must be an object with a 'schema'")
        schema = spec.get("schema", spec.get("schema_", {"type": "object"}))
        return {"json_schema": schema if isinstance(schema, str) else json.dumps(schema)}
    if kind == "regex":  # extension (not OpenAI): {"type": "regex", "regex": "..."}
        regex = response_format.get("regex")
        if not isinstance(regex, str):
            raise RequestError("response_format.regex must be a string")
        return {"regex": regex}
    raise RequestError(f"unsupported response_format type {kind!r} (text, json_object, json_schema, regex)")


def validate_grammar(kind: str, spec: str) -> None:
    """Raise RequestError for a constraint that cannot compile, when a torch-free validator is available."""
    try:
        import radixrt.constrained as constrained

        check = getattr(constrained, "validate_grammar", None)
    except Exception:  # the constrained package is optional here: the scheduler checks again when compiling
        check = None
    if check is None:
        if kind == "json_schema":
            try:
                json.loads(spec)
            except ValueError as exc:
                raise RequestError(f"invalid grammar: json_schema is not valid JSON: {exc}") from None
        return
    try:
        check(kind, spec)
    except ValueError as exc:
        raise RequestError(f"invalid grammar: {exc}") from None
