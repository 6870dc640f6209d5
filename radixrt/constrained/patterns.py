r"""Turning a request's constraint (regex, JSON schema, choices, any JSON object) into one regex.

- regex: checked with Python's parser for a clear message (position included), then for what the
  DFA engine cannot do (look-around, back-references, word boundaries, anchors inside the pattern).
  A leading ``^`` and trailing ``$`` are dropped: the whole output must match anyway.
- JSON schema: outlines-core's ``build_regex_from_schema``. It ignores numeric bounds, so integer
  and number sub-schemas with ``minimum``/``maximum``/``exclusive*`` are swapped for placeholder
  constants before the call and the placeholders replaced by range regexes after it. Number bounds are
  honoured conservatively (a subset of the valid numbers, no exponent). ``format: date`` gets an
  ASCII-digit pattern (outlines' ``\d`` would admit any Unicode digit).
- choices: an alternation of the escaped strings.
- ebnf: a grammar of rules inlined into one regex (radixrt.constrained.ebnf; recursion is refused).
- structural_tag: free text whose triggers open JSON structures (radixrt.constrained.structural_tag).
- whitespace between JSON tokens: ``GrammarCompiler(json_whitespace=...)``; the default "" (compact
  JSON) lets jump-forward force whole runs such as ``{"name":"``, which ``[ ]?`` would break up.
- json_object: any JSON object, nested at most two levels deep (a bounded regex keeps the DFA small).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

_RE_META = set("\\.+*?()|[]{}^$#&-~")


def escape(text: str) -> str:
    """Escape ``text`` for the grammar engine (Rust regex syntax; a subset of what Python accepts)."""
    return "".join("\\" + c if c in _RE_META else c for c in text)


def choices_regex(choices: Any) -> str:
    if isinstance(choices, str):  # a JSON list, as the engine's messages carry it
        try:
            choices = json.loads(choices)
        except json.JSONDecodeError:
            raise ValueError("choices must be a list of strings (or a JSON list of them)") from None
    if not isinstance(choices, (list, tuple)) or not choices:
        raise ValueError("choices must be a non-empty list of strings")
    if any(not isinstance(c, str) or c == "" for c in choices):
        raise ValueError("choices must be non-empty strings")
    return "(" + "|".join(escape(c) for c in choices) + ")"


# ---------------------------------------------------------------- regex checks

def _sre_parser():
    try:
        import re._parser as parser  # Python >= 3.11
    except ImportError:  # pragma: no cover
        import sre_parse as parser  # type: ignore[no-redef]
    return parser


def _strip_outer_anchors(pattern: str) -> str:
    if pattern.startswith("^"):
        pattern = pattern[1:]
    if pattern.endswith("$"):
        backslashes = len(pattern) - 1 - len(pattern[:-1].rstrip("\\"))
        if backslashes % 2 == 0:
            pattern = pattern[:-1]
    return pattern


_UNSUPPORTED = {
    "ASSERT": "look-ahead/look-behind assertions",
    "ASSERT_NOT": "negative look-ahead/look-behind assertions",
    "GROUPREF": "back-references",
    "GROUPREF_EXISTS": "conditional groups",
    "ATOMIC_GROUP": "atomic groups",
    "POSSESSIVE_REPEAT": "possessive quantifiers",
}


def _walk(tree, found: list[str]) -> None:
    for op, arg in tree:
        name = str(op)
        if name in _UNSUPPORTED:
            found.append(_UNSUPPORTED[name])
        elif name == "AT":
            at = str(arg)
            if at in ("AT_BOUNDARY", "AT_NON_BOUNDARY", "AT_UNI_BOUNDARY", "AT_UNI_NON_BOUNDARY", "AT_LOC_BOUNDARY", "AT_LOC_NON_BOUNDARY"):
                found.append("word boundaries (\\b, \\B)")
            else:
                found.append("anchors (^, $, \\A, \\Z) other than a leading ^ and a trailing $")
        # Recurse into sub-patterns whatever the opcode's argument shape.
        stack = [arg]
        while stack:
            item = stack.pop()
            if isinstance(item, (list, tuple)):
                stack.extend(item)
            elif hasattr(item, "data") and isinstance(getattr(item, "data"), list):
                _walk(item.data, found)


def check_regex(pattern: Any) -> str:
    """The regex the grammar engine should compile, or ``ValueError`` naming the problem."""
    if not isinstance(pattern, str):
        raise ValueError(f"regex must be a string, got {type(pattern).__name__}")
    if pattern == "":
        raise ValueError("invalid regex: the pattern is empty")
    body = _strip_outer_anchors(pattern)
    try:
        tree = _sre_parser().parse(body)
    except re.error as exc:
        # Rust-only syntax (\p{L}, \x{...}, [[:digit:]]) fails here but may still compile: the engine
        # gets the last word (see GrammarCompiler.validate).
        raise _PythonSyntaxError(f"invalid regex: {exc.msg} at position {exc.pos} in {pattern!r}") from None
    found: list[str] = []
    _walk(tree.data if hasattr(tree, "data") else tree, found)
    if found:
        raise ValueError(f"invalid regex {pattern!r}: {sorted(set(found))[0]} are not supported by the grammar engine")
    return body


class _PythonSyntaxError(ValueError):
    """Python's parser rejected the pattern; the grammar engine may still accept it."""


# ---------------------------------------------------------------- integer / number ranges

def _same_length(lo: str, hi: str) -> list[str]:
    """Regexes for every digit string of len(lo) between lo and hi (inclusive, lo <= hi)."""
    if lo == hi:
        return [lo]
    if len(lo) == 1:
        return [f"[{lo}-{hi}]"]
    if lo[0] == hi[0]:
        return [lo[0] + r for r in _same_length(lo[1:], hi[1:])]
    rest = len(lo) - 1
    parts = [lo[0] + r for r in _same_length(lo[1:], "9" * rest)]
    low, high = int(lo[0]) + 1, int(hi[0]) - 1
    if low <= high:
        digit = str(low) if low == high else f"[{low}-{high}]"
        parts.append(digit + "[0-9]" * rest)
    parts += [hi[0] + r for r in _same_length("0" * rest, hi[1:])]
    return parts


def nonneg_range_regex(lo: int, hi: int | None) -> str:
    """Regex for the decimal integers in [lo, hi] (hi None: unbounded), 0 <= lo, no leading zeros."""
    if hi is not None and hi < lo:
        raise ValueError(f"empty integer range [{lo}, {hi}]")
    parts: list[str] = []
    top = hi if hi is not None else 10 ** len(str(lo)) - 1
    for length in range(len(str(lo)), len(str(top)) + 1):
        start = max(lo, 10 ** (length - 1) if length > 1 else 0)
        end = min(top, 10**length - 1)
        if start <= end:
            parts += _same_length(str(start), str(end))
    if hi is None:
        parts.append(f"[1-9][0-9]{{{len(str(lo))},}}")
    return "(" + "|".join(parts) + ")"


def integer_range_regex(lo: int | None, hi: int | None) -> str:
    """Regex for the integers in [lo, hi] (None: unbounded on that side)."""
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"empty integer range: minimum {lo} > maximum {hi}")
    alternatives = []
    if hi is None or hi >= 0:
        alternatives.append(nonneg_range_regex(max(lo, 0) if lo is not None else 0, hi))
    if lo is None or lo < 0:
        top = -lo if lo is not None else None
        bottom = max(1, -hi) if hi is not None else 1
        alternatives.append("-" + nonneg_range_regex(bottom, top))
    return "(" + "|".join(alternatives) + ")"


def _magnitude_parts(low: float, high: float | None, low_ex: bool, high_ex: bool) -> list[str]:
    """Regexes for (a subset of) the non-negative decimals x with low <= x <= high (bounds >= 0)."""
    parts: list[str] = []
    first = int(low) + 1 if (low_ex and float(low).is_integer()) else math.ceil(low)
    # Integer parts I whose whole [I, I + 1) lies inside the bounds take any fraction.
    last_full = None if high is None else math.floor(high) - 1
    if last_full is None or first <= last_full:
        parts.append(nonneg_range_regex(first, last_full) + r"(\.[0-9]+)?")
    if high is not None:
        # The top integer itself (fraction zeros only), unless excluded.
        top = int(high) - 1 if (high_ex and float(high).is_integer()) else math.floor(high)
        if top >= first and (last_full is None or top > last_full):
            parts.append(nonneg_range_regex(top, top) + r"(\.0+)?")
    return parts


def number_range_regex(lo: float | None, hi: float | None, lo_exclusive: bool = False, hi_exclusive: bool = False) -> str:
    """Regex for a subset of the JSON numbers within the bounds, with no exponent: exact at integer
    values, conservative between them (an integer part whose unit interval fits takes any fraction)."""
    alternatives: list[str] = []
    if hi is None or hi >= 0:
        low, low_ex = (lo, lo_exclusive) if lo is not None and lo >= 0 else (0, False)
        alternatives += _magnitude_parts(low, hi, low_ex, hi_exclusive)
    if lo is None or lo < 0:
        # -y with max(0, -hi) <= y <= -lo
        low, low_ex = (-hi, hi_exclusive) if hi is not None and hi <= 0 else (0, False)
        alternatives += ["-" + part for part in _magnitude_parts(low, None if lo is None else -lo, low_ex, lo_exclusive)]
    if not alternatives:
        raise ValueError(f"number bounds [{lo}, {hi}] are too narrow for the grammar engine (no integer part fits)")
    return "(" + "|".join(alternatives) + ")"


# ---------------------------------------------------------------- JSON schema

_PLACEHOLDER = "radixrtbound{}x9q"
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SUBSCHEMA_ONE = ("items", "additionalProperties", "not", "contains")


def _bounds(schema: dict) -> tuple[Any, Any, bool, bool]:
    lo, hi = schema.get("minimum"), schema.get("maximum")
    lo_ex = hi_ex = False
    ex_lo, ex_hi = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
    if isinstance(ex_lo, bool):  # draft 4
        lo_ex = ex_lo
    elif isinstance(ex_lo, (int, float)):
        if lo is None or ex_lo >= lo:
            lo, lo_ex = ex_lo, True
    if isinstance(ex_hi, bool):
        hi_ex = ex_hi
    elif isinstance(ex_hi, (int, float)):
        if hi is None or ex_hi <= hi:
            hi, hi_ex = ex_hi, True
    return lo, hi, lo_ex, hi_ex


def _bounded_number_regex(schema: dict) -> str | None:
    kind = schema.get("type")
    if kind not in ("integer", "number"):
        return None
    lo, hi, lo_ex, hi_ex = _bounds(schema)
    if lo is None and hi is None:
        return None
    for name, value in (("minimum", lo), ("maximum", hi)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ValueError(f"invalid JSON schema: {name} must be a number")
    if kind == "integer":
        low = None if lo is None else (math.floor(lo) + 1 if lo_ex and float(lo).is_integer() else math.ceil(lo))
        high = None if hi is None else (math.ceil(hi) - 1 if hi_ex and float(hi).is_integer() else math.floor(hi))
        if low is not None and high is not None and low > high:
            raise ValueError(f"invalid JSON schema: no integer satisfies the bounds [{lo}, {hi}]")
        return integer_range_regex(low, high)
    return number_range_regex(lo, hi, lo_ex, hi_ex)


_ASCII_DATE = "^[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])$"


def python_literal(value: Any) -> str:
    """``value`` (a JSON value) as Python source: True, False and None for JSON's words, strings and numbers as
    JSON writes them (valid Python, the same value), lists and dicts element by element."""
    if value is True or value is False or value is None:
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(python_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        items = (json.dumps(str(k), ensure_ascii=False) + ": " + python_literal(v) for k, v in value.items())
        return "{" + ", ".join(items) + "}"
    return json.dumps(value, ensure_ascii=False, allow_nan=False)


def _python_literal_regex(schema: dict) -> str | None:
    """Where JSON's and Python's spellings differ (booleans, null; a const or enum holding them), the regex of the
    value as Python writes it; None elsewhere."""
    if "const" in schema:
        return escape(python_literal(schema["const"]))
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return "(" + "|".join(escape(python_literal(v)) for v in schema["enum"]) + ")"
    kind = schema.get("type")
    if kind == "boolean":
        return "(True|False)"
    if kind == "null":
        return "None"
    return None


def _rewrite(schema: Any, replacements: dict[str, str], python: bool = False) -> Any:
    if not isinstance(schema, dict):
        return schema
    if python and isinstance(schema.get("type"), list):
        rest = {k: v for k, v in schema.items() if k != "type"}
        schema = {"anyOf": [rest | {"type": kind} for kind in schema["type"]]}
    literal = _python_literal_regex(schema) if python else None
    if literal is not None:
        key = _PLACEHOLDER.format(len(replacements))
        replacements[key] = literal
        return {"const": key}
    if schema.get("type") == "string" and schema.get("format") == "date" and "pattern" not in schema:
        # outlines-core spells the year \d{4}, which the engine reads as any Unicode digit.
        schema = {k: v for k, v in schema.items() if k != "format"} | {"pattern": _ASCII_DATE}
    regex = _bounded_number_regex(schema)
    if regex is not None:
        key = _PLACEHOLDER.format(len(replacements))
        replacements[key] = regex
        return {"const": key}
    out = dict(schema)
    for name in _SUBSCHEMA_LISTS:
        if isinstance(out.get(name), list):
            out[name] = [_rewrite(s, replacements, python) for s in out[name]]
    for name in _SUBSCHEMA_MAPS:
        if isinstance(out.get(name), dict):
            out[name] = {k: _rewrite(s, replacements, python) for k, s in out[name].items()}
    for name in _SUBSCHEMA_ONE:
        if isinstance(out.get(name), dict):
            out[name] = _rewrite(out[name], replacements, python)
    return out


def parse_json_schema(spec: Any) -> Any:
    """The schema as a Python object, or ``ValueError`` naming the problem."""
    if isinstance(spec, (dict, bool)):
        schema = spec
    elif isinstance(spec, str):
        try:
            schema = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise ValueError(f"invalid JSON schema: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    else:
        raise ValueError(f"json_schema must be a JSON string or an object, got {type(spec).__name__}")
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"invalid JSON schema: must be an object or a boolean, got {type(schema).__name__}")
    try:
        import jsonschema
    except ImportError:  # pragma: no cover - jsonschema is a test extra; outlines-core still checks
        return schema
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        raise ValueError(f"invalid JSON schema at {where}: {exc.message}") from None
    return schema


def json_schema_regex(spec: Any, whitespace_pattern: str | None = None, python_literals: bool = False) -> str:
    """Regex for the JSON documents ``spec`` describes, or ``ValueError`` naming the problem. With
    ``python_literals`` the values are written as Python literals instead (True, False and None for JSON's words,
    wherever the schema names a boolean, null, const or enum; what it leaves open, an untyped value, stays JSON)."""
    from outlines_core import json_schema as outlines_json_schema

    build_regex_from_schema = outlines_json_schema.build_regex_from_schema

    schema = parse_json_schema(spec)
    if schema is True or schema == {} or schema == {"type": "object"}:
        # Any JSON (object): outlines' own regex for it takes tens of seconds to index.
        return json_object_regex(whitespace_pattern, python_literals)
    if schema is False:
        raise ValueError("invalid JSON schema: false matches no document")
    replacements: dict[str, str] = {}
    rewritten = _rewrite(schema, replacements, python_literals)
    try:
        regex = build_regex_from_schema(json.dumps(rewritten), whitespace_pattern)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"unsupported JSON schema: {exc}") from None
    for key, value in replacements.items():
        quoted = f'"{key}"'
        if quoted not in regex:
            raise ValueError("unsupported JSON schema: numeric bounds could not be applied here")
        regex = regex.replace(quoted, value)
    return regex


_STRING = r'"([^"\\\x00-\x1F\x7F-\x9F]|\\["\\/bfnrt])*"'
_NUMBER = r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?"
_DEFAULT_WS = r"[ ]?"  # outlines-core's default between JSON tokens


def json_object_regex(whitespace_pattern: str | None = None, python_literals: bool = False) -> str:
    """Any JSON object, values nested up to two levels (deeper nesting makes the DFA explode); with
    ``python_literals`` True, False and None in place of JSON's words."""
    _WS = _DEFAULT_WS if whitespace_pattern is None else whitespace_pattern
    scalar = f"({_STRING}|{_NUMBER}|{'True|False|None' if python_literals else 'true|false|null'})"

    def obj(value: str) -> str:
        member = f"{_STRING}{_WS}:{_WS}{value}"
        return rf"\{{{_WS}({member}({_WS},{_WS}{member})*)?{_WS}\}}"

    def arr(value: str) -> str:
        return rf"\[{_WS}({value}({_WS},{_WS}{value})*)?{_WS}\]"

    level1 = f"({scalar}|{obj(scalar)}|{arr(scalar)})"
    return obj(level1)


def any_value_regex(whitespace_pattern: str | None = None, python_literals: bool = False) -> str:
    """Any JSON value: a scalar, or an object or array nested as :func:`json_object_regex` nests them."""
    _WS = _DEFAULT_WS if whitespace_pattern is None else whitespace_pattern
    scalar = f"({_STRING}|{_NUMBER}|{'True|False|None' if python_literals else 'true|false|null'})"
    array = rf"\[{_WS}({scalar}({_WS},{_WS}{scalar})*)?{_WS}\]"
    return f"({scalar}|{array}|{json_object_regex(whitespace_pattern, python_literals)})"


# ---------------------------------------------------------------- one entry point (torch-free)

KINDS = ("regex", "json_schema", "json_object", "choices", "ebnf", "structural_tag")


def engine_accepts_regex(regex: str) -> bool:
    """Whether outlines-core compiles ``regex`` (over a 256-byte vocabulary: fast, no tokenizer)."""
    from outlines_core import Index, Vocabulary

    tiny = Vocabulary(0, {bytes([b]): [b + 1] for b in range(256)})
    try:
        Index(regex, tiny)
        return True
    except BaseException:  # pyo3 errors are not all Exceptions
        return False


def normalise_constraint(kind: str, spec: Any, json_whitespace: str = "") -> tuple[str, str]:
    """(cache key text, regex) of a constraint, or ``ValueError`` naming the problem."""
    if kind == "regex":
        try:
            return spec, check_regex(spec)
        except _PythonSyntaxError as python_error:
            # Python rejects Rust-only syntax (\p{L}, \x{..}, [[:alpha:]]); let the engine decide.
            if not engine_accepts_regex(spec):
                raise ValueError(str(python_error)) from None
            return spec, spec
    if kind == "json_schema":
        schema = parse_json_schema(spec)
        key = json.dumps(schema, separators=(",", ":"))  # keeps property order: it shapes the regex
        return key, json_schema_regex(schema, json_whitespace)
    if kind == "json_object":
        return "", json_object_regex(json_whitespace)
    if kind == "choices":
        regex = choices_regex(spec)
        return regex, regex
    if kind == "ebnf":
        from radixrt.constrained.ebnf import ebnf_regex

        return spec, ebnf_regex(spec)
    if kind == "structural_tag":
        from radixrt.constrained.structural_tag import parse_structural_tag, structural_tag_regex

        tag = parse_structural_tag(spec)
        return json.dumps(tag, separators=(",", ":")), structural_tag_regex(tag, json_whitespace)
    raise ValueError(f"unknown constraint kind {kind!r} (expected one of {', '.join(KINDS)})")


def validate_grammar(kind: str, spec: Any = None, json_whitespace: str = "") -> str:
    """The regex a constraint compiles to, or ``ValueError`` naming the problem. Fast, torch-free
    (for the HTTP process); builds no token index."""
    return normalise_constraint(kind, spec, json_whitespace)[1]
