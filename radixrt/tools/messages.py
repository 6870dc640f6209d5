"""OpenAI chat messages with tool calls and tool results, prepared for a chat template.

``messages_for_template(messages, tools, fmt, native)`` returns new message dicts (the input is not changed):

- ``native=True`` (the template renders tools): ``content: None`` becomes "", an assistant's ``tool_calls``
  are kept with their ``arguments`` parsed to objects (what Hugging Face templates expect); the rest is left
  to the template.
- ``native=False`` (fallback): the format's tools section goes into the system message (appended to the first
  one, or a new one first), an assistant's ``tool_calls`` are written into its content in the format's
  layout, and each ``tool`` message becomes a ``user`` message with the result written by the format
  (consecutive results share one user message, so user and assistant turns still alternate).

Checked either way (``RequestError``): a ``tool`` message needs a string ``tool_call_id``; ``tool_calls`` must be
a list of ``{"id"?, "type": "function", "function": {"name": str, "arguments": JSON text or object}}``.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from radixrt.protocol.errors import RequestError

if TYPE_CHECKING:
    from radixrt.tools.format_base import ToolCallFormat
    from radixrt.tools.spec import Tool


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, list):  # OpenAI text parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else str(content)


def _checked_calls(i: int, calls: Any) -> list[tuple[str | None, str, Any]]:
    """(id, name, arguments object) of each of an assistant message's tool calls."""
    if not isinstance(calls, list):
        raise RequestError(f"messages[{i}].tool_calls must be a list")
    out = []
    for j, call in enumerate(calls):
        where = f"messages[{i}].tool_calls[{j}]"
        if not isinstance(call, dict):
            raise RequestError(f"{where} must be an object")
        if call.get("type", "function") != "function":
            raise RequestError(f"{where}.type must be \"function\"")
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise RequestError(f"{where}.id must be a string")
        function = call.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise RequestError(f"{where}.function must be an object with a string name")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                raise RequestError(f"{where}.function.arguments is not valid JSON") from None
        elif not isinstance(arguments, dict):
            raise RequestError(f"{where}.function.arguments must be a JSON string or an object")
        out.append((call_id, function["name"], arguments))
    return out


def messages_for_template(messages: list[dict], tools: "list[Tool]", fmt: "ToolCallFormat",
                          native: bool) -> list[dict]:
    """See the module docstring."""
    names_by_id: dict[str, str] = {}
    out: list[dict] = []
    previous_result = False
    for i, message in enumerate(messages):
        role = message.get("role")
        if role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str):
                raise RequestError(f"messages[{i}]: a tool message needs a string tool_call_id")
            name = message.get("name") if isinstance(message.get("name"), str) else names_by_id.get(call_id)
            if native:
                out.append({**message, "content": _text(message.get("content"))})
                continue
            result = fmt.render_tool_result(_text(message.get("content")), name)
            if previous_result:
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result})
            previous_result = True
            continue
        previous_result = False
        new = {**message, "content": _text(message.get("content"))}
        if role == "assistant" and message.get("tool_calls") is not None:
            calls = _checked_calls(i, message["tool_calls"])
            for call_id, name, _ in calls:
                if call_id is not None:
                    names_by_id[call_id] = name
            if native:
                new["tool_calls"] = [
                    {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
                    for call_id, name, arguments in calls]
            else:
                del new["tool_calls"]
                written = fmt.render_calls([(name, json.dumps(args, ensure_ascii=False)) for _, name, args in calls])
                if calls:
                    new["content"] = (new["content"] + "\n" if new["content"] else "") + written
        out.append(new)
    if not native and tools:
        section = fmt.render_system_prompt(tools)
        if out and out[0].get("role") == "system":
            first = out[0]["content"]
            out[0] = {**out[0], "content": (first + "\n\n" + section) if first else section}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out
