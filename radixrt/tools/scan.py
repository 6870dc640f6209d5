"""Character-by-character reading of one tool call's JSON object, for the streaming parsers.

``CallObjectScanner`` is handed the characters that follow a call's opening ``{`` one at a time and says what
each one meant (``step`` returns an event):

- ``("name", str)``: the ``"name"`` member's string just closed (decoded; never empty);
- ``("args", str)``: characters of the arguments member's value, in order, as the model wrote them
  (``args_keys``: the member names that hold the arguments; the first such member counts, later ones are skipped);
- ``("done", None)``: the object's closing ``}``;
- ``("error", None)``: the text cannot be a call object (the character is not consumed: the caller decides);
- ``None``: consumed, nothing to report yet.

Members other than the name and the arguments are skipped. Values are tracked only as far as needed to find
where they end (string state and bracket depth): nothing is validated or repaired. Torch-free, no imports
beyond the standard library.
"""

from __future__ import annotations

import json

WHITESPACE = " \t\n\r"  # JSON's whitespace; the parsers and the constraint regexes use the same set

# states
_KEY_OR_END, _KEY_START, _KEY, _COLON, _VALUE, _NAME, _RAW, _AFTER, _DONE = range(9)
_SCALAR_END = ",}]" + WHITESPACE


class CallObjectScanner:
    """Reads one JSON object after its ``{``; see the module docstring for the events."""

    def __init__(self, args_keys: tuple[str, ...]):
        self.args_keys = args_keys
        self.state = _KEY_OR_END
        self.name: str | None = None
        self.saw_args = False
        self._text: list[str] = []  # the key or name string being read (raw, without quotes)
        self._escape = False
        self._key = ""
        self._streaming = False  # the value being read is the arguments
        self._depth = 0
        self._in_string = False
        self._scalar = False

    @property
    def finished(self) -> bool:
        return self.state == _DONE

    def step(self, ch: str) -> tuple[str, str | None] | None:
        state = self.state
        if state == _RAW:
            return self._raw(ch)
        if state in (_KEY, _NAME):
            return self._string(ch)
        if state == _DONE:
            return ("error", None)
        if ch in WHITESPACE:
            return None
        if state in (_KEY_OR_END, _KEY_START):
            if ch == '"':
                self.state, self._text, self._escape = _KEY, [], False
                return None
            if ch == "}" and state == _KEY_OR_END:
                self.state = _DONE
                return ("done", None)
            return ("error", None)
        if state == _COLON:
            if ch == ":":
                self.state = _VALUE
                return None
            return ("error", None)
        if state == _VALUE:
            return self._value_start(ch)
        # _AFTER
        if ch == ",":
            self.state = _KEY_START
            return None
        if ch == "}":
            self.state = _DONE
            return ("done", None)
        return ("error", None)

    # -- strings (keys and the name)

    def _string(self, ch: str):
        if self._escape:
            self._escape = False
            self._text.append(ch)
            return None
        if ch == "\\":
            self._escape = True
            self._text.append(ch)
            return None
        if ch != '"':
            self._text.append(ch)
            return None
        try:
            value = json.loads('"' + "".join(self._text) + '"')
        except ValueError:
            return ("error", None)
        if self.state == _KEY:
            self._key = value
            self.state = _COLON
            return None
        if not value:
            return ("error", None)
        self.state = _AFTER
        if self.name is not None:  # a second name member: ignored
            return None
        self.name = value
        return ("name", value)

    # -- values

    def _value_start(self, ch: str):
        key = self._key
        if key == "name" and self.name is None:
            if ch != '"':
                return ("error", None)
            self.state, self._text, self._escape = _NAME, [], False
            return None
        self._streaming = key in self.args_keys and not self.saw_args
        if self._streaming:
            self.saw_args = True
        self.state = _RAW
        self._depth, self._in_string, self._escape = 0, False, False
        self._scalar = ch not in '{["'
        if ch in "}],:":
            return ("error", None)
        return self._raw(ch)

    def _raw(self, ch: str):
        """One character of a value being skipped or streamed."""
        if self._scalar:
            if ch in _SCALAR_END:
                self.state = _AFTER
                return self.step(ch)
            return self._emit(ch)
        if self._in_string:
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self._in_string = False
                if self._depth == 0:
                    self.state = _AFTER
        elif ch == '"':
            self._in_string = True
        elif ch in "{[":
            self._depth += 1
        elif ch in "}]":
            self._depth -= 1
            if self._depth == 0:
                self.state = _AFTER
        return self._emit(ch)

    def _emit(self, ch: str):
        return ("args", ch) if self._streaming else None
