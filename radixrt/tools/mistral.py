"""The mistral family (Mistral 7B v0.3, Mixtral, Mistral Nemo/Small): the calls follow a marker as one JSON array,

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": ...}]

(canonical layout: ", " between calls). A single object after the marker is read as one call too. Text
before the marker and after the array is content; a partial marker at the end is held back. ``[TOOL_CALLS]``
is a special token in Mistral's tokenizers: the server keeps it in the text (skip_special_tokens off).
Constraint for "auto": text without the marker, or the calls.
"""

from __future__ import annotations

from radixrt.tools import regex as rx
from radixrt.tools.format_base import ToolCallFormat, tools_json_lines
from radixrt.tools.markers import MarkerMatcher
from radixrt.tools.parser import ToolCallStreamParser
from radixrt.tools.scan import WHITESPACE

MARKER = "[TOOL_CALLS]"


class MistralParser(ToolCallStreamParser):
    def __init__(self) -> None:
        super().__init__()
        self._marker = MarkerMatcher(MARKER)
        self._in_array = False
        self._items = 0  # calls read in the current array

    def _step(self, ch: str) -> None:
        state = self.state
        if state == "text":
            released, found = self._marker.step(ch)
            self._emit_content(released)
            if found:
                self._hold(MARKER, anchor=len(MARKER))
                self.state = "open"
        elif state == "open":  # after the marker: whitespace, then "[" or one object
            if ch in WHITESPACE:
                self._hold(ch)
            elif ch == "[":
                self._hold(ch)
                self._in_array, self._items, self.state = True, 0, "item"
            elif ch == "{":
                self._in_array = False
                self._begin_object(ch)
            else:
                self._rollback("text", ch)
        elif state == "item":  # inside the array: whitespace, then an object (or "]" when empty)
            if ch in WHITESPACE:
                self._hold(ch)
            elif ch == "{":
                self._begin_object(ch)
            elif ch == "]":  # an empty array, or a trailing comma
                self._drop_held()
                self.state = "text"
            else:
                self._rollback("text", ch)
        elif state == "object":
            result = self._object_step(ch, "text")
            if result is None:
                return
            self._anchor = 1
            self._items += 1
            if not self._in_array:
                self.state = "text"
            else:
                self.state = "after_item"
            if result == "broken":
                self._reread(ch)
        else:  # "after_item": whitespace, then "," and the next object, or "]"
            if ch in WHITESPACE:
                self._hold(ch)
            elif ch == ",":
                self._hold(ch)
                self.state = "item"
            elif ch == "]":
                self._drop_held()
                self._in_array, self.state = False, "text"
            else:
                self._in_array = False
                self._rollback("text", ch)

    def _end(self) -> None:
        state = self.state
        if state == "text":
            self._emit_content(self._marker.reset())
        elif state == "object":
            self._end_object("text")
        elif state == "after_item" or (state == "item" and self._items):
            self._drop_held()  # the reply ended after a whole call: the rest of the array is syntax
            self.state = "text"
        else:
            self._rollback("text")


class Mistral(ToolCallFormat):
    name = "mistral"
    separator = ", "

    def parser(self) -> MistralParser:
        return MistralParser()

    def calls_open(self) -> str:
        return MARKER + "["

    def calls_close(self) -> str:
        return "]"

    def free_text_regex(self) -> str:
        return rx.text_without(MARKER)

    def render_system_prompt(self, tools) -> str:
        return (
            "Functions you can call (one JSON object each):\n"
            f"{tools_json_lines(tools)}\n\n"
            f"To call functions, reply with {MARKER} followed by a JSON array of calls, each "
            '{"name": function name, "arguments": object of arguments following its schema}, for example\n'
            f'{MARKER}[{{"name": "function_name", "arguments": {{"argument": "value"}}}}]'
        )

    def render_tool_result(self, content: str, name: str | None) -> str:
        label = f" of {name}" if name else ""
        return f"[TOOL_RESULTS] Result{label}: {content} [/TOOL_RESULTS]"
