"""Tool calling on /v1/chat/completions: a request's ``tools`` -> the prompt, the constraint and the parser.

``tool_format`` picks the server's call format once (``--tool-call-parser``; ``auto`` reads the chat template).
``plan_tools`` checks ``tools``/``tool_choice`` (a bad schema is a 400 before anything runs) and, unless the
server runs with ``--disable-tool-call-constraints``, builds the regex that keeps the output to calls whose
arguments follow each tool's JSON schema (``required`` and named: calls only; ``auto``: free text, or calls once
the model starts one). ``template_messages`` turns OpenAI messages (assistant ``tool_calls``, ``tool`` results)
into what the chat template takes: the template's own tool support where it has one, else the format's
fallback (tools described in the system prompt, calls and results written as text). The answer side parses
the output with ``ToolPlan.fmt`` (radixrt.server.openai_responses). Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixrt.protocol.errors import RequestError
from radixrt.tools.formats import ToolCallFormat, choose_format, messages_for_template, template_supports_tools
from radixrt.tools.spec import Tool, ToolChoice, parse_tool_choice, parse_tools

# SGLang's and vLLM's --tool-call-parser names for the formats radixrt parses.
PARSER_ALIASES = {"auto": None, "hermes": "hermes", "qwen": "hermes", "qwen25": "hermes", "qwen3": "hermes",
                  "llama3": "llama3", "llama3_json": "llama3", "llama": "llama3", "mistral": "mistral",
                  "pythonic": "pythonic", "llama4": "pythonic", "llama4_pythonic": "pythonic"}


def tool_format(parser: str, chat_template: Any) -> tuple[ToolCallFormat, bool]:
    """The server's tool-call format and whether its chat template renders tools itself; ValueError for a
    parser name radixrt does not know."""
    if parser not in PARSER_ALIASES:
        raise ValueError(f"unknown --tool-call-parser {parser!r}; choose one of {', '.join(PARSER_ALIASES)}")
    template = chat_template if isinstance(chat_template, str) else None
    return choose_format(PARSER_ALIASES[parser], template), template_supports_tools(template)


@dataclass(frozen=True)
class ToolPlan:
    tools: list[Tool]
    choice: ToolChoice
    fmt: ToolCallFormat
    native: bool  # the chat template renders the tools
    regex: str | None  # the constraint on the output; None: unconstrained

    def sampling_fields(self, skip_special_tokens: bool | None) -> dict[str, Any]:
        """What the plan adds to the request's sampling params: the constraint, and the format's markers kept in
        the text where they are special tokens (Mistral's [TOOL_CALLS]) unless the client says otherwise."""
        out: dict[str, Any] = {}
        if self.regex is not None:
            out["regex"] = self.regex
        if self.fmt.name == "mistral" and skip_special_tokens is None:
            out["skip_special_tokens"] = False
        return out

    def template_tools(self) -> list[dict] | None:
        """The ``tools`` argument of transformers' apply_chat_template (None for the fallback)."""
        return [t.to_openai() for t in self.tools] if self.native else None


def plan_tools(req: Any, fmt: ToolCallFormat, native: bool, constrained: bool, json_whitespace: str = ""
               ) -> ToolPlan | None:
    """The tool calling a chat request asks for; None when it asks for none (no tools, or tool_choice none)."""
    tools = parse_tools(req.tools)
    choice = parse_tool_choice(req.tool_choice, tools)
    if choice.mode == "none":
        return None
    parallel = req.parallel_tool_calls is not False
    regex = fmt.constraint_regex(tools, choice, parallel, json_whitespace) if constrained else None
    if regex is not None and _asks_for_format(req):
        raise RequestError("tool calls are generated under the tools' schemas; pass response_format, regex or "
                           "json_schema only with tool_choice \"none\"")
    return ToolPlan(tools, choice, fmt, native, regex)


def _asks_for_format(req: Any) -> bool:
    rf = req.response_format
    return (req.regex is not None or req.json_schema is not None or req.ebnf is not None
            or (isinstance(rf, dict) and rf.get("type") not in (None, "text")))


def uses_tools(messages: list[dict[str, Any]]) -> bool:
    return any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


def template_messages(messages: list[dict[str, Any]], plan: ToolPlan | None, fmt: ToolCallFormat, native: bool
                      ) -> list[dict[str, Any]]:
    """The messages for the chat template: unchanged when neither the request nor its history uses tools."""
    if plan is None and not uses_tools(messages):
        return messages
    return messages_for_template(messages, plan.tools if plan is not None else [], fmt, native)
