"""Structural tags (SGLang's and vLLM's ``structural_tag``, xgrammar's first form) turned into one regex:

    {"type": "structural_tag",
     "structures": [{"begin": "<function=get_weather>", "schema": {...}, "end": "</function>"}],
     "triggers": ["<function="]}

The output is free text in which a trigger may only appear as the start of one of the structures that begin with
it: the structure's ``begin``, JSON under its ``schema``, its ``end``; free text resumes after it, as often as
the model likes. Every ``begin`` must start with one of the triggers (as xgrammar requires). A spec is an object
or its JSON text; anything else, an empty list, a structure without its fields, a schema that does not compile,
or xgrammar's later form (``{"type": "structural_tag", "format": {...}}``) is a ``ValueError`` naming the
problem. Torch-free.
"""

from __future__ import annotations

import json
from typing import Any

from radixrt.constrained.patterns import escape, json_schema_regex
from radixrt.constrained.text_regex import alternation, text_without_any


def parse_structural_tag(spec: Any) -> dict:
    """The spec as an object with ``structures`` and ``triggers`` checked; ValueError otherwise."""
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise ValueError(f"structural_tag is not valid JSON ({exc.msg})") from None
    if not isinstance(spec, dict):
        raise ValueError("structural_tag must be an object with 'structures' and 'triggers'")
    if "format" in spec:
        raise ValueError("structural_tag: the 'format' form is not supported; give 'structures' and 'triggers'")
    structures, triggers = spec.get("structures"), spec.get("triggers")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise ValueError("structural_tag.triggers must be a non-empty list of non-empty strings")
    if not isinstance(structures, list) or not structures:
        raise ValueError("structural_tag.structures must be a non-empty list")
    for i, s in enumerate(structures):
        if not (isinstance(s, dict) and isinstance(s.get("begin"), str) and isinstance(s.get("end"), str)
                and isinstance(s.get("schema"), (dict, bool))):
            raise ValueError(f"structural_tag.structures[{i}] must have a string 'begin' and 'end' and a 'schema'")
        if not any(s["begin"].startswith(t) for t in triggers):
            raise ValueError(f"structural_tag.structures[{i}].begin {s['begin']!r} starts with none of the triggers")
    return {"structures": structures, "triggers": triggers}


def structural_tag_regex(spec: Any, json_whitespace: str | None = None) -> str:
    """Regex of the outputs ``spec`` allows (see the module docstring)."""
    tag = parse_structural_tag(spec)
    triggers = tuple(dict.fromkeys(tag["triggers"]))
    by_trigger: dict[str, list[str]] = {}
    for i, s in enumerate(tag["structures"]):
        try:
            body = json_schema_regex(s["schema"], json_whitespace)
        except ValueError as exc:
            raise ValueError(f"structural_tag.structures[{i}].schema: {exc}") from None
        # of the triggers it starts with, the shortest: the one the text completes first there
        trigger = min((t for t in triggers if s["begin"].startswith(t)), key=len)
        by_trigger.setdefault(trigger, []).append(escape(s["begin"]) + "(" + body + ")" + escape(s["end"]))
    parts = [text_without_any(triggers, before=t) + alternation(structures) for t, structures in by_trigger.items()]
    return "(" + alternation(parts) + ")*" + text_without_any(triggers)
