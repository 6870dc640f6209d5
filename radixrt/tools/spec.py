"""A chat request's ``tools`` and ``tool_choice`` (OpenAI's shapes), checked and normalised.

``parse_tools`` turns ``[{"type": "function", "function": {"name", "description"?, "parameters"?, "strict"?}}]``
into ``Tool`` values and refuses, with a ``RequestError`` (HTTP 400) naming the entry, anything radixrt could
not serve: a bad shape, a bad or repeated name, a parameters schema that admits anything but a JSON object (a
call's arguments are one, as OpenAI requires), or one that the constrained decoder cannot compile (checked here,
before anything runs).
``parse_tool_choice`` turns ``tool_choice`` into a ``ToolChoice``: "none", "auto", "required", or "named" (one
given function). Torch-free.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from radixrt.protocol.errors import RequestError

NAME_PATTERN = re.compile(r"[a-zA-Z0-9_-]{1,64}")
EMPTY_PARAMETERS: dict = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str = ""  # "" when absent
    parameters: dict = field(default_factory=lambda: dict(EMPTY_PARAMETERS))  # JSON schema of the arguments

    def to_openai(self) -> dict:
        """The OpenAI tool object (what transformers' ``apply_chat_template(tools=...)`` takes)."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # "none" | "auto" | "required" | "named"
    name: str | None = None  # the function, for "named"


def parse_tools(tools: list | None) -> list[Tool]:
    """The request's tools; ``RequestError`` naming the first bad entry."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise RequestError(f"tools must be a list of tool objects, got {type(tools).__name__}")
    out: list[Tool] = []
    seen: dict[str, int] = {}
    for i, entry in enumerate(tools):
        tool = _parse_tool(i, entry)
        if tool.name in seen:
            raise RequestError(f"tools[{i}]: the function name {tool.name!r} is already used by tools[{seen[tool.name]}]")
        seen[tool.name] = i
        out.append(tool)
    return out


def _parse_tool(i: int, entry: Any) -> Tool:
    where = f"tools[{i}]"
    if not isinstance(entry, dict):
        raise RequestError(f"{where} must be an object, got {type(entry).__name__}")
    if entry.get("type") != "function":
        raise RequestError(f"{where}.type must be \"function\", got {entry.get('type')!r}")
    function = entry.get("function")
    if not isinstance(function, dict):
        raise RequestError(f"{where}.function must be an object with the function's name")
    name = function.get("name")
    if not isinstance(name, str):
        raise RequestError(f"{where}.function.name is required and must be a string")
    if not NAME_PATTERN.fullmatch(name):
        raise RequestError(f"{where}.function.name {name!r} must be 1 to 64 letters, digits, '_' or '-'")
    description = function.get("description")
    if description is None:
        description = ""
    elif not isinstance(description, str):
        raise RequestError(f"{where}.function.description must be a string")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = dict(EMPTY_PARAMETERS)
    elif not isinstance(parameters, dict):
        raise RequestError(f"{where}.function.parameters must be a JSON schema object, got {type(parameters).__name__}")
    elif not admits_only_objects(parameters, parameters):
        raise RequestError(f"{where}.function.parameters must describe a JSON object (a call's arguments are one); "
                           "its root type, enum, const or a branch of its anyOf / oneOf / allOf admits other values")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise RequestError(f"{where}.function.strict must be a boolean")
    tool = Tool(name, description, parameters)
    from radixrt.constrained.patterns import engine_accepts_regex
    from radixrt.tools.regex import arguments_regex

    try:
        regex = arguments_regex(tool)
    except ValueError as exc:
        raise RequestError(f"{where}.function.parameters cannot be used for function {name!r}: {exc}") from None
    if not engine_accepts_regex(regex):
        raise RequestError(f"{where}.function.parameters cannot be used for function {name!r}: the grammar engine "
                           "cannot compile its regex (look-around or other unsupported regex syntax in a pattern?)")
    return tool


def admits_only_objects(schema: Any, root: dict, depth: int = 0) -> bool:
    """Whether every value ``schema`` admits is a JSON object, read as outlines-core compiles it: a combinator
    (anyOf, oneOf, allOf), enum or const decides before ``type``; no type and no combinator is an object. A
    local ``$ref`` is followed; one that does not resolve is left to the compile check."""
    if not isinstance(schema, dict) or depth > 32:
        return False
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        target: Any = root
        for part in ref[1:].split("/")[1:]:
            target = target.get(part.replace("~1", "/").replace("~0", "~")) if isinstance(target, dict) else None
        return target is None or admits_only_objects(target, root, depth + 1)
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            branches = schema[key]
            return isinstance(branches, list) and all(admits_only_objects(b, root, depth + 1) for b in branches)
    if "enum" in schema:
        return isinstance(schema["enum"], list) and all(isinstance(v, dict) for v in schema["enum"])
    if "const" in schema:
        return isinstance(schema["const"], dict)
    return schema.get("type", "object") == "object"


def parse_tool_choice(choice: str | dict | None, tools: list[Tool]) -> ToolChoice:
    """The request's ``tool_choice`` against its (parsed) tools; ``RequestError`` for a bad one.

    Absent: "auto" with tools, "none" without. "auto" without tools is "none" (nothing to call)."""
    if choice is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(choice, str):
        if choice == "none":
            return ToolChoice("none")
        if choice == "auto":
            return ToolChoice("auto" if tools else "none")
        if choice == "required":
            if not tools:
                raise RequestError("tool_choice \"required\" needs at least one tool in tools")
            return ToolChoice("required")
        raise RequestError(f"tool_choice must be \"none\", \"auto\", \"required\" or a function object, got {choice!r}")
    if isinstance(choice, dict):
        function = choice.get("function")
        if choice.get("type") != "function" or not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RequestError('tool_choice as an object must be {"type": "function", "function": {"name": ...}}')
        name = function["name"]
        if not tools:
            raise RequestError(f"tool_choice names the function {name!r} but the request has no tools")
        if name not in {t.name for t in tools}:
            known = ", ".join(t.name for t in tools)
            raise RequestError(f"tool_choice names the function {name!r}, which is not among the tools ({known})")
        return ToolChoice("named", name)
    raise RequestError(f"tool_choice must be a string or an object, got {type(choice).__name__}")
