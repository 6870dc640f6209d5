"""The hermes family (Hermes 2/3, Qwen2.5, Qwen3): each call is a JSON object between tags,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

several calls one after another (separated by a newline in the canonical layout). A call may start anywhere
in the text; everything outside the tags (also the whitespace between two calls) is content. Parsing: text
until ``<tool_call>`` (a partial marker at the end is held back), JSON whitespace, the call object, JSON
whitespace, ``</tool_call>``. A call object that closes without its end tag still ends the call; text that
follows is content again. Constraint for "auto": text without ``<tool_call>``, optionally followed by calls.
"""

from __future__ import annotations

from radixrt.tools import regex as rx
from radixrt.tools.format_base import ToolCallFormat, tools_json_lines
from radixrt.tools.markers import MarkerMatcher
from radixrt.tools.parser import ToolCallStreamParser
from radixrt.tools.scan import WHITESPACE

START, END = "<tool_call>", "</tool_call>"


class HermesParser(ToolCallStreamParser):
    def __init__(self) -> None:
        super().__init__()
        self._start = MarkerMatcher(START)
        self._end_tag = MarkerMatcher(END)

    def _step(self, ch: str) -> None:
        state = self.state
        if state == "text":
            released, found = self._start.step(ch)
            self._emit_content(released)
            if found:
                self._hold(START, anchor=len(START))
                self.state = "open"
        elif state == "open":  # after <tool_call>: whitespace, then the object
            if ch in WHITESPACE:
                self._hold(ch)
            elif ch == "{":
                self._begin_object(ch)
            else:
                self._rollback("text", ch)
        elif state == "object":
            result = self._object_step(ch, "text")
            if result is not None:
                self.state = "close"
                if result == "broken":  # not consumed: it may already be the end tag
                    self._reread(ch)
        else:  # "close": whitespace, then </tool_call>
            matcher = self._end_tag
            if matcher.matched == 0 and ch in WHITESPACE:
                self._hold(ch)
                return
            before = matcher.matched
            _, found = matcher.step(ch)
            if found:
                self._drop_held()
                self.state = "text"
            elif matcher.matched == before + 1:
                self._hold(ch)
            else:  # no end tag: the call ended with its object; what follows is content
                matcher.reset()
                self.state = "text"
                self._reread(self._drop_held() + ch)

    def _end(self) -> None:
        state = self.state
        if state == "text":
            self._emit_content(self._start.reset())
        elif state == "open":
            self._rollback("text")
        elif state == "object":
            self._end_object("text")
        else:
            self._emit_content(self._drop_held())
            self._end_tag.reset()
            self.state = "text"


class Hermes(ToolCallFormat):
    name = "hermes"
    separator = "\n"

    def parser(self) -> HermesParser:
        return HermesParser()

    def call_prefix(self, name: str) -> str:
        return START + "\n" + super().call_prefix(name)

    def call_suffix(self) -> str:
        return "}\n" + END

    def auto_regex(self, calls: str) -> str:
        return f"{rx.text_without(START, before_marker=True)}({calls})?"

    def render_system_prompt(self, tools) -> str:
        return (
            "# Tools\n\n"
            "You may call one or more of the functions below to help with the user's request. Each function "
            "is described by one JSON object:\n"
            f"<tools>\n{tools_json_lines(tools)}\n</tools>\n\n"
            "To call a function, write its name and a JSON object of arguments that follows its parameters "
            "schema, between tags, like this:\n"
            f'{START}\n{{"name": "function_name", "arguments": {{"argument": "value"}}}}\n{END}\n'
            "Write one such block per call. The results come back in the next message."
        )

    def render_tool_result(self, content: str, name: str | None) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"
