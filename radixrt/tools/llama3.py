"""The llama3 family (Llama 3.1/3.2 JSON tool calling): the whole reply is the calls,

    {"name": "get_weather", "parameters": {"city": "Paris"}}

optionally after ``<|python_tag|>``, several separated by ``; `` (the canonical layout). Calls are recognised
only at the start of the reply (after JSON whitespace, which is content) and right after a previous call and
its ``;``; an object that is not a call, or any other text, makes the rest of the reply content. The
arguments member may be ``parameters`` or ``arguments``. Constraint for "auto": text that does not start
(after whitespace) with ``{`` or the python tag, or the calls.
"""

from __future__ import annotations

import json

from radixrt.tools import regex as rx
from radixrt.tools.format_base import ToolCallFormat, result_text, tools_json_lines
from radixrt.tools.parser import ToolCallStreamParser
from radixrt.tools.scan import WHITESPACE

PYTHON_TAG = "<|python_tag|>"


class Llama3Parser(ToolCallStreamParser):
    args_keys = ("parameters", "arguments")

    def __init__(self) -> None:
        super().__init__()
        self.state = "start"
        self._tag = 0  # characters of the python tag matched

    def _step(self, ch: str) -> None:
        state = self.state
        if state == "content":
            self._emit_content(ch)
        elif state == "start":
            if ch in WHITESPACE:
                self._emit_content(ch)
            elif ch == "{":
                self._begin_object(ch, anchor=1)
            elif ch == PYTHON_TAG[0]:
                self._hold(ch, anchor=1)
                self._tag, self.state = 1, "tag"
            else:
                self.state = "content"
                self._emit_content(ch)
        elif state == "tag":
            if ch != PYTHON_TAG[self._tag]:
                self._rollback("content", ch)
                return
            self._hold(ch)
            self._tag += 1
            if self._tag == len(PYTHON_TAG):
                self.state = "after_tag"
        elif state in ("after_tag", "next"):  # whitespace, then a call object
            if ch in WHITESPACE:
                self._hold(ch)
            elif ch == "{":
                self._begin_object(ch)
            else:
                self._rollback("content", ch)
        elif state == "object":
            result = self._object_step(ch, "content")
            if result is not None:
                self.state = "separator"
                self._anchor = 1
                if result == "broken":
                    self._reread(ch)
        else:  # "separator": whitespace, ";", whitespace, then the next call
            if ch in WHITESPACE:
                self._hold(ch)
            elif ch == ";":
                self._hold(ch)
                self.state = "next"
            else:
                self._rollback("content", ch)

    def _end(self) -> None:
        if self.state == "object":
            self._end_object("content")
        elif self._held:
            self._rollback("content")


class Llama3(ToolCallFormat):
    name = "llama3"
    separator = "; "

    def parser(self) -> Llama3Parser:
        return Llama3Parser()

    def call_prefix(self, name: str) -> str:
        return '{"name": ' + json.dumps(name) + ', "parameters": '

    def free_text_regex(self) -> str:
        return rx.not_starting_with(["{", PYTHON_TAG])

    def render_system_prompt(self, tools) -> str:
        return (
            "You have access to the functions below, each described by one JSON object:\n"
            f"{tools_json_lines(tools)}\n\n"
            "If a function helps with the request, answer with nothing but the call: a JSON object "
            '{"name": function name, "parameters": object of arguments following its schema}, for example\n'
            '{"name": "function_name", "parameters": {"argument": "value"}}\n'
            "Separate several calls with \"; \". Otherwise, answer in plain text."
        )

    def render_tool_result(self, content: str, name: str | None) -> str:
        return result_text(content, name)
