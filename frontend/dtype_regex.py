"""The regular expressions behind typed generation: gen_int, gen_string, gen(dtype=...).

Backends turn a gen()'s `dtype` into one of these patterns; they are the same strings as SGLang's.
"""

from __future__ import annotations

REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""
