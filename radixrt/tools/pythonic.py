r"""The pythonic family (Llama 3.2 / 3.3 / 4): the reply is a Python list of calls with keyword arguments,

    [get_weather(city="Paris", days=[1, 2]), add(a=1, b=True)]

(canonical layout: ", " between calls, ``=`` without spaces, values as Python literals). Calls are recognised
only when the reply starts (after whitespace, which is content) with ``[`` and a call; any other reply is
content, and so is the text after the list's ``]``. Values are Python literals (strings in either quote,
numbers, True / False / None, lists, tuples, dicts with string keys; JSON's true / false / null and its escaped
slash ``\/`` are read too) and
reach the client as the JSON object of the call's keyword arguments. A call streams its id and name at its
``(``, then its arguments one keyword argument at a time as each value ends (not character by character: a
Python literal is only converted once it is whole), then the closing ``}``. A malformed argument (a positional
one, a value that is not a literal) ends the call with the arguments read so far, and the text from the
character that broke it on is content; a reply cut off inside a call closes it with its whole arguments.
Constraint for "auto": text that does not start (after whitespace) with ``[``, or the calls; each tool's
parameters must be an object of named properties (the keyword arguments, in the schema's order).
Not handled: Llama 4's ``<|python_start|>`` / ``<|python_end|>`` wrapping. Torch-free.
"""

from __future__ import annotations

import ast
import json
import math
import warnings
from typing import Any

from radixrt.constrained.patterns import any_value_regex, json_schema_regex, python_literal
from radixrt.protocol.errors import RequestError
from radixrt.tools import regex as rx
from radixrt.tools.format_base import ToolCallFormat, result_text, tools_json_lines
from radixrt.tools.parser import ToolCallStreamParser
from radixrt.tools.scan import WHITESPACE

NAME_START = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_")
KEY_CHARS = NAME_START | set("0123456789")
NAME_CHARS = KEY_CHARS | set("-.")  # tool names may hold "-" (OpenAI's rule), which Python's names may not
_JSON_WORDS = {"true": True, "false": False, "null": None}
_OPEN, _CLOSE = "([{", ")]}"


def literal_value(text: str) -> Any:
    """The JSON value of one Python literal (JSON's true, false and null read as well); ValueError otherwise."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # an invalid escape such as "\d" reads as Python reads it
            node = ast.parse(text.strip(), mode="eval").body
        return _value(node)
    except (SyntaxError, RecursionError, MemoryError) as exc:
        raise ValueError(f"not a Python literal: {exc}") from None


def _value(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (bool, int, float, str))):
        if isinstance(node.value, float) and not math.isfinite(node.value):
            raise ValueError("not a JSON number")
        return node.value
    if isinstance(node, ast.Name) and node.id in _JSON_WORDS:
        return _JSON_WORDS[node.id]
    if (isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd))
            and isinstance(node.operand, ast.Constant) and type(node.operand.value) in (int, float)):
        value = _value(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_value(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        out = {}
        for key, value in zip(node.keys, node.values):
            name = None if key is None else _value(key)
            if not isinstance(name, str):
                raise ValueError("a dict's keys must be strings")
            out[name] = _value(value)
        return out
    raise ValueError(f"not a literal: {type(node).__name__}")


class PythonicParser(ToolCallStreamParser):
    def __init__(self) -> None:
        super().__init__()
        self.state = "start"
        self._name: list[str] = []
        self._key: list[str] = []
        self._value: list[str] = []
        self._depth = 0
        self._quote = ""  # the open string's quote character, "" outside strings
        self._escape = False
        self._written = 0  # keyword arguments of the open call sent
        self._in_list = 0  # calls read in this list

    def _step(self, ch: str) -> None:
        state = self.state
        if state == "content":
            self._emit_content(ch)
        elif state == "start":
            if ch in WHITESPACE:
                self._emit_content(ch)
            elif ch == "[":
                self._hold(ch, anchor=1)
                self.state = "list"
            else:
                self.state = "content"
                self._emit_content(ch)
        elif state == "list":  # whitespace, then a call's name
            if ch in WHITESPACE:
                self._hold(ch)
            elif ch in NAME_START:
                self._hold(ch)
                self._name, self.state = [ch], "name"
            else:
                self._rollback("content", ch)
        elif state == "name":
            if ch in NAME_CHARS:
                self._hold(ch)
                self._name.append(ch)
            elif ch == "(":
                self._drop_held()
                self._start_call("".join(self._name))
                self._written, self.state = 0, "kwargs"
            else:
                self._rollback("content", ch)
        elif state == "kwargs":  # after "(" or ",": a keyword, or ")"
            if ch in WHITESPACE:
                return
            if ch in NAME_START:
                self._key, self.state = [ch], "key"
            elif ch == ")":
                self._end_call()
            else:
                self._broken(ch)
        elif state in ("key", "eq"):
            if ch == "=":
                self._value, self._depth, self._quote, self._escape = [], 0, "", False
                self.state = "value"
            elif ch in WHITESPACE:
                self.state = "eq"
            elif ch in KEY_CHARS and state == "key":
                self._key.append(ch)
            else:
                self._broken(ch)
        elif state == "value":
            self._value_step(ch)
        else:  # "after": a call closed; whitespace, then "," and the next call, or the list's "]"
            if ch in WHITESPACE:
                self._hold(ch)
            elif ch == ",":
                self._hold(ch)
                self.state = "list"
            elif ch == "]":
                self._drop_held()
                self.state = "content"
            else:
                self._rollback("content", ch)

    def _value_step(self, ch: str) -> None:
        if self._quote:
            if self._escape:
                self._escape = False
                if ch == "/":  # JSON's escaped slash (Python would keep the backslash): the constraint admits it
                    self._value[-1] = "/"
                    return
            elif ch == "\\":
                self._escape = True
            elif ch == self._quote:
                self._quote = ""
        elif ch in "\"'":
            self._quote = ch
        elif ch in _OPEN:
            self._depth += 1
        elif ch in _CLOSE:
            if self._depth == 0:
                if ch == ")":
                    self._argument_done(ch)
                else:
                    self._broken(ch)
                return
            self._depth -= 1
        elif ch == "," and self._depth == 0:
            self._argument_done(ch)
            return
        self._value.append(ch)

    def _argument_done(self, ch: str) -> None:
        try:
            value = json.dumps(literal_value("".join(self._value)), ensure_ascii=False, allow_nan=False)
        except ValueError:
            self._broken(ch)
            return
        key = json.dumps("".join(self._key))
        self._emit_args(("{" if self._written == 0 else ", ") + key + ": " + value)
        self._written += 1
        if ch == ")":
            self._end_call()
        else:
            self.state = "kwargs"

    def _end_call(self) -> None:
        self._emit_args("}" if self._written else "{}")
        self._close_call()
        self._in_list += 1
        self._anchor, self.state = 1, "after"

    def _broken(self, ch: str) -> None:
        """The open call cannot go on: it ends with what was read; ``ch`` and the rest are content."""
        self._emit_args("}" if self._written else "{}")
        self._close_call()
        self.state = "content"
        self._reread(ch)

    def _end(self) -> None:
        state = self.state
        if state in ("kwargs", "key", "eq", "value"):  # cut off inside a call: it keeps its whole arguments
            self._emit_args("}" if self._written else "{}")
            self._close_call()
            self.state = "content"
        elif state in ("list", "name", "after") and self._in_list:
            self._drop_held()  # the reply ended after a whole call: the rest is the list's syntax
            self.state = "content"
        elif self._held:
            self._rollback("content")


class Pythonic(ToolCallFormat):
    name = "pythonic"
    separator = ", "

    def parser(self) -> PythonicParser:
        return PythonicParser()

    def calls_open(self) -> str:
        return "["

    def calls_close(self) -> str:
        return "]"

    def call_regex(self, tool, json_whitespace: str) -> str:
        return rx.escape(tool.name + "(") + keyword_arguments_regex(tool, json_whitespace) + rx.escape(")")

    def free_text_regex(self) -> str:
        return rx.not_starting_with(["["])

    def render_calls(self, calls: list[tuple[str, str]]) -> str:
        return "[" + ", ".join(f"{name}({_keyword_arguments(arguments)})" for name, arguments in calls) + "]"

    def render_system_prompt(self, tools) -> str:
        return (
            "You have access to the functions below, each described by one JSON object:\n"
            f"{tools_json_lines(tools)}\n\n"
            "If a function helps with the request, answer with nothing but the calls, as a Python list of calls "
            "with keyword arguments, for example\n"
            '[function_name(argument="value", other=2), other_function()]\n'
            "Otherwise, answer in plain text."
        )

    def render_tool_result(self, content: str, name: str | None) -> str:
        return result_text(content, name)


def _keyword_arguments(arguments: Any) -> str:
    """A call's JSON arguments as keyword arguments; arguments that are not a JSON object pass as one."""
    try:
        value = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        value = arguments
    if not isinstance(value, dict):
        return "" if value in ("", None) else "arguments=" + python_literal(value)
    return ", ".join(f"{k}={python_literal(v)}" for k, v in value.items())


_ROOT_KEYS = {"type", "properties", "required", "description", "title", "$defs", "definitions", "$schema",
              "additionalProperties"}


def keyword_arguments_regex(tool, json_whitespace: str = "") -> str:
    """The keyword arguments of ``tool``'s calls: its properties in the schema's order, each at most once, the
    required ones always, ", " between them, each value a Python literal under its schema. ``RequestError`` for
    parameters that are not an object of properties named like Python's keyword arguments."""
    schema = tool.parameters
    where = f"tool {tool.name!r}"
    extra = sorted(set(schema) - _ROOT_KEYS) if isinstance(schema, dict) else ["(not an object)"]
    if extra or schema.get("type", "object") != "object":
        raise RequestError(f"{where}: the pythonic tool-call format takes parameters that are an object of named "
                           f"properties (unsupported here: {', '.join(extra) or 'type'})")
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    required = set(schema.get("required", []))
    items: list[tuple[str, bool]] = []
    for key, sub in schema.get("properties", {}).items():
        if not key.isidentifier():
            raise RequestError(f"{where}: the argument name {key!r} is not a Python keyword argument's name "
                               "(pythonic tool-call format)")
        items.append((rx.escape(key) + "=" + _value_regex(sub, defs, json_whitespace, where), key in required))
    if not items:
        return ""
    sep = rx.escape(", ")
    alternatives = []
    for first, (item, _) in enumerate(items):  # the first argument written is `first`, those before it absent
        rest = "".join(f"({sep}{it})" + ("" if req else "?") for it, req in items[first + 1:])
        alternatives.append(item + rest)
        if items[first][1]:
            break
    else:
        alternatives.append("")  # no argument is required
    return "(" + "|".join(alternatives) + ")"


def _value_regex(sub: Any, defs: dict, json_whitespace: str, where: str) -> str:
    if sub is True or sub == {}:
        return any_value_regex(json_whitespace, python_literals=True)
    if not isinstance(sub, dict):
        raise RequestError(f"{where}: a property's schema must be an object")
    try:
        return "(" + json_schema_regex(sub | defs, json_whitespace, python_literals=True) + ")"
    except ValueError as exc:
        raise RequestError(f"{where}: {exc}") from None
