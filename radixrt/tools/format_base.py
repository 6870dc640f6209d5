"""What every tool-call format family provides (``ToolCallFormat``), and the parts they share.

A family (hermes, llama3, mistral) is stateless: it makes parsers, builds the constraint regex of a request
(radixrt.tools.regex does the pieces), and writes tools, calls and results as text for chat templates
without tool support. The regex makes the output exactly the calls in the family's canonical layout, so
every string it accepts parses (``parse_tool_calls``) into calls whose arguments follow their tool's schema.
Torch-free.
"""

from __future__ import annotations

import json

from radixrt.tools import regex as rx
from radixrt.tools.parser import ToolCallStreamParser
from radixrt.tools.spec import Tool, ToolChoice


class ToolCallFormat:
    """One family of tool-call syntax. Subclasses set ``name`` and the layout hooks below."""

    name: str = ""
    separator: str = "\n"  # between two calls in the canonical layout

    # -- parsing

    def parser(self) -> ToolCallStreamParser:  # pragma: no cover - abstract
        raise NotImplementedError

    # -- constraint

    def call_regex(self, tool: Tool, json_whitespace: str) -> str:
        """One call of ``tool`` in the canonical layout."""
        return rx.escape(self.call_prefix(tool.name)) + rx.arguments_regex(tool, json_whitespace) + rx.escape(
            self.call_suffix())

    def calls_regex(self, tools: list[Tool], parallel: bool, json_whitespace: str) -> str:
        """One call of any of ``tools``, then (``parallel``) more after the separator; wrapped as the family
        wraps a reply of calls."""
        one = rx.alternation([self.call_regex(t, json_whitespace) for t in tools])
        body = f"{one}({rx.escape(self.separator)}{one})*" if parallel else one
        return rx.escape(self.calls_open()) + body + rx.escape(self.calls_close())

    def free_text_regex(self) -> str:  # pragma: no cover - abstract
        """Text the parser keeps as content whole (never starts a call)."""
        raise NotImplementedError

    def auto_regex(self, calls: str) -> str:
        """``tool_choice`` "auto": free text, or the calls."""
        return f"({self.free_text_regex()}|{calls})"

    def constraint_regex(self, tools: list[Tool], choice: ToolChoice, parallel: bool,
                         json_whitespace: str = "") -> str | None:
        """The regex the whole output must match for ``choice``; None for "none" (or no tools)."""
        if choice.mode == "none" or not tools:
            return None
        if choice.mode == "named":
            named = [t for t in tools if t.name == choice.name]
            if not named:
                raise ValueError(f"tool_choice names {choice.name!r}, which is not among the tools")
            return self.calls_regex(named, False, json_whitespace)
        calls = self.calls_regex(tools, parallel, json_whitespace)
        if choice.mode == "required":
            return calls
        if choice.mode == "auto":
            return self.auto_regex(calls)
        raise ValueError(f"unknown tool_choice mode {choice.mode!r}")

    # -- canonical layout (the regex and the fallback rendering share it)

    def call_prefix(self, name: str) -> str:
        return '{"name": ' + json.dumps(name) + ', "arguments": '

    def call_suffix(self) -> str:
        return "}"

    def calls_open(self) -> str:
        return ""

    def calls_close(self) -> str:
        return ""

    # -- fallback rendering for templates without tool support

    def render_call(self, name: str, arguments: str) -> str:
        """One earlier call of an assistant message, as the model would have written it."""
        return self.render_calls([(name, arguments)])

    def render_calls(self, calls: list[tuple[str, str]]) -> str:
        """Several calls of one assistant message, in the canonical layout."""
        body = self.separator.join(self.call_prefix(n) + _arguments_text(a) + self.call_suffix() for n, a in calls)
        return self.calls_open() + body + self.calls_close()

    def render_system_prompt(self, tools: list[Tool]) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    def render_tool_result(self, content: str, name: str | None) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"ToolCallFormat({self.name})"


def _arguments_text(arguments: str) -> str:
    """The arguments as written into a conversation: the client's JSON text (compact "{}" when empty)."""
    text = arguments.strip() if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return text or "{}"


def result_text(content: str, name: str | None) -> str:
    """A tool's result as a user turn: "Result of the function NAME:" and the content (llama3, pythonic)."""
    who = f"the function {name}" if name else "the function call"
    return f"Result of {who}:\n{content}"


def tools_json_lines(tools: list[Tool]) -> str:
    """Each tool as one line of JSON (name, description unless empty, parameters), for the system prompts."""
    lines = []
    for tool in tools:
        entry = {"name": tool.name, "description": tool.description, "parameters": tool.parameters}
        if not tool.description:
            del entry["description"]
        lines.append(json.dumps(entry, ensure_ascii=False))
    return "\n".join(lines)
