"""OpenAI's ``response_format`` -> radixrt sampling-param fields (regex / json_schema / structural_tag).

The constraint itself is checked with the rest of the request (radixrt.scheduler.validation, torch-free);
the grammar compiler lives in radixrt.constrained.
"""

from __future__ import annotations

import json
from typing import Any

from radixrt.protocol.errors import RequestError


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
    if kind == "structural_tag":  # SGLang's and vLLM's: {"type", "structures", "triggers"}
        return {"structural_tag": json.dumps(response_format)}
    if kind == "regex":  # extension (not OpenAI): {"type": "regex", "regex": "..."}
        regex = response_format.get("regex")
        if not isinstance(regex, str):
            raise RequestError("response_format.regex must be a string")
        return {"regex": regex}
    raise RequestError(f"unsupported response_format type {kind!r} (text, json_object, json_schema, "
                       "structural_tag, regex)")
