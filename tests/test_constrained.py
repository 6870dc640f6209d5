"""Constrained decoding on the default model's real tokenizer (no forward passes): vocabulary, grammar
compilation and validation, masks, matcher, jump-forward, random walks that must always match."""

from __future__ import annotations

import json
import random
import re
import threading
import time

import jsonschema
import numpy as np
import pytest
import torch

from radixrt.constrained import (
    GrammarCompiler,
    GrammarMatcher,
    allocate_bitmask,
    apply_bitmask,
    apply_bitmask_reference,
    fill_bitmasks,
    jump_forward,
    unpack_bitmask,
)
from radixrt.constrained import patterns
from radixrt.constrained.vocabulary import build_tokenizer_info

REGEXES = {
    "int": r"-?(0|[1-9][0-9]*)",
    "float": r"-?[0-9]{1,6}\.[0-9]{1,4}",
    "scientific": r"[+-]?[0-9]{1,4}(\.[0-9]{1,4})?([eE][+-]?[0-9]{1,2})?",
    "date": r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
    "time": r"([01][0-9]|2[0-3]):[0-5][0-9](:[0-5][0-9])?",
    "email": r"[a-z0-9._%+-]{1,16}@[a-z0-9-]{1,12}\.(com|org|net|io)",
    "ipv4": r"((25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])",
    "phone_us": r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}",
    "phone_intl": r"\+[1-9][0-9]{0,2} [0-9]{2,4} [0-9]{3} [0-9]{3,4}",
    "hex_color": r"#[0-9a-fA-F]{6}",
    "uuid": r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
    "anchored_words": r"^[A-Z][a-z]{1,8}( [A-Z][a-z]{1,8}){0,2}$",
}

_INT = {"type": "integer"}
_STR = {"type": "string", "maxLength": 12}
SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {"name": _STR, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": _INT, "name": _STR, "admin": {"type": "boolean"}},
                "required": ["id", "name"],
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
    },
    "int_array": {
        "type": "object",
        "properties": {"values": {"type": "array", "items": {"type": "integer", "minimum": -10, "maximum": 10}, "minItems": 1, "maxItems": 4}},
        "required": ["values"],
    },
    "enums": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"type": "string", "enum": ["S", "M", "L", "XL"]}, "count": {"enum": [1, 2, 3]}},
        "required": ["color", "size", "count"],
    },
    "number_bounds": {
        "type": "object",
        "properties": {
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "celsius": {"type": "number", "minimum": -40, "maximum": 50},
            "percent": {"type": "integer", "minimum": 0, "maximum": 100},
        },
        "required": ["score", "celsius", "percent"],
    },
    "exclusive_bounds": {
        "type": "object",
        "properties": {
            "level": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
            "ratio": {"type": "number", "exclusiveMinimum": 0, "maximum": 5},
            "offset": {"type": "integer", "minimum": -1000},
        },
        "required": ["level", "ratio", "offset"],
    },
    "optional_fields": {
        "type": "object",
        "properties": {"title": _STR, "subtitle": _STR, "pages": {"type": "integer", "minimum": 1, "maximum": 2000}},
        "required": ["title"],
    },
    "string_patterns": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            "short": {"type": "string", "minLength": 2, "maxLength": 5},
        },
        "required": ["code", "zip", "short"],
    },
    "array_of_objects": {
        "type": "object",
        "properties": {
            "order": {"type": "string", "pattern": "^ORD[0-9]{4}$"},
            "lines": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}, "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
                    "required": ["sku", "qty"],
                },
                "maxItems": 3,
            },
        },
        "required": ["order", "lines"],
    },
    "nullable_anyof": {
        "type": "object",
        "properties": {"value": {"anyOf": [{"type": "integer"}, {"type": "null"}]}, "note": {"type": "string", "maxLength": 10}},
        "required": ["value", "note"],
    },
    "refs": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer", "minimum": -100, "maximum": 100}, "y": {"type": "integer", "minimum": -100, "maximum": 100}},
                "required": ["x", "y"],
            }
        },
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
    },
    "formats_and_const": {
        "type": "object",
        "properties": {"kind": {"const": "event"}, "day": {"type": "string", "format": "date"}, "ok": {"type": "boolean"}},
        "required": ["kind", "day", "ok"],
    },
}

DATE_CHECK = jsonschema.FormatChecker(["date"])


@pytest.fixture(scope="module")
def eos_ids(default_model_path, tokenizer):
    from radixrt.tokenizer import eos_token_ids

    return eos_token_ids(default_model_path, tokenizer)


@pytest.fixture(scope="module")
def compiler(tokenizer, eos_ids):
    compiler = GrammarCompiler(tokenizer, eos_ids, cache_size=64, max_workers=2)
    # Start every compile at once: the pool works through them while the first tests run.
    for spec in REGEXES.values():
        compiler.compile_async("regex", spec)
    for schema in SCHEMAS.values():
        compiler.compile_async("json_schema", schema)
    yield compiler
    compiler.shutdown()


# ------------------------------------------------------------------ random walks

_CLOSER_BYTES = np.zeros(256, dtype=bool)
_CLOSER_BYTES[[ord(c) for c in '"]}']] = True
_PUNCT_BYTES = np.zeros(256, dtype=bool)
_PUNCT_BYTES[[c for c in range(33, 127) if not chr(c).isalnum()]] = True
_POOLS: dict = {}


def _pools(grammar, state):
    """(eos allowed here, allowed ids, ids starting with a closer, ids starting with punctuation)."""
    key = (id(grammar), state)
    if key not in _POOLS:
        info = grammar.info
        allowed = unpack_bitmask(grammar.allowed_row(state)[None], grammar.mask_vocab_size)[0].numpy().nonzero()[0]
        eos = np.isin(allowed, info.eos_token_ids)
        tokens = allowed[~eos]
        starts = info.first_byte[tokens].astype(np.int64)
        _POOLS[key] = (bool(eos.any()), tokens, tokens[_CLOSER_BYTES[starts]], tokens[_PUNCT_BYTES[starts]])
    return _POOLS[key]


def walk(matcher: GrammarMatcher, tokenizer, seed: int, jump: bool = False, max_steps: int = 300) -> tuple[str, list[int], int]:
    """Sample only allowed tokens (biased towards closing punctuation and eos so walks end) until
    finished. Returns (text, output ids, number of sampling steps)."""
    info = matcher.grammar.info
    rng = random.Random(seed)
    out: list[int] = []
    steps = 0
    while not matcher.is_finished():
        if jump:
            jf = jump_forward(matcher, out, tokenizer)
            if jf is not None:
                del out[len(out) - jf.num_tokens_to_drop :]
                out += jf.tokens_to_append
                continue
        assert steps < max_steps, f"walk did not finish: {info.decode_bytes(out)!r}"
        steps += 1
        eos_ok, allowed, closers, punct = _pools(matcher.grammar, matcher.state)
        assert eos_ok == matcher.can_terminate()
        if eos_ok and rng.random() < 0.5:
            assert matcher.accept_token(info.eos_token_ids[0])
            break
        assert allowed.size > 0
        draw = rng.random()
        pool = closers if closers.size and draw < 0.4 else punct if punct.size and draw < 0.7 else allowed
        token = int(pool[rng.randrange(pool.size)])
        assert matcher.accept_token(token), token
        out.append(token)
    return info.decode_bytes(out).decode("utf-8"), out, steps


@pytest.mark.parametrize("name", sorted(REGEXES))
def test_regex_random_walks_fully_match(compiler, tokenizer, name):
    pattern = REGEXES[name]
    grammar = compiler.compile("regex", pattern, timeout=120)
    for seed in range(4):
        jump = seed % 2 == 1
        text, ids, _ = walk(GrammarMatcher(grammar), tokenizer, seed, jump=jump)
        assert re.fullmatch(pattern, text), (name, text)
        assert tokenizer.decode(ids) == text


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_random_walks_validate(compiler, tokenizer, name):
    schema = SCHEMAS[name]
    grammar = compiler.compile("json_schema", schema, timeout=180)
    for seed in range(4):
        jump = seed % 2 == 1
        text, _, _ = walk(GrammarMatcher(grammar), tokenizer, seed, jump=jump)
        document = json.loads(text)
        jsonschema.validate(document, schema, format_checker=DATE_CHECK)


def test_choices_and_json_object(compiler, tokenizer):
    choices = ["yes", "no", "maybe so", "a+b (c)"]
    grammar = compiler.compile("choices", choices)
    seen = set()
    for seed in range(12):
        text, _, _ = walk(GrammarMatcher(grammar), tokenizer, seed, jump=seed % 2 == 0)
        assert text in choices
        seen.add(text)
    assert len(seen) >= 2
    grammar = compiler.compile("json_object", None, timeout=180)
    for seed in range(4):
        text, _, _ = walk(GrammarMatcher(grammar), tokenizer, seed, jump=seed % 2 == 0)
        assert isinstance(json.loads(text), dict)


def test_jump_forward_saves_steps_and_keeps_matches(compiler, tokenizer):
    grammar = compiler.compile("json_schema", SCHEMAS["array_of_objects"], timeout=180)
    steps_on = steps_off = 0
    for seed in range(4):
        text_on, _, on = walk(GrammarMatcher(grammar), tokenizer, seed, jump=True)
        text_off, _, off = walk(GrammarMatcher(grammar), tokenizer, seed + 100, jump=False)
        for text in (text_on, text_off):
            jsonschema.validate(json.loads(text), SCHEMAS["array_of_objects"])
        steps_on += on
        steps_off += off
    assert steps_on < steps_off


# ------------------------------------------------------------------ jump-forward details

def test_jump_forward_forced_json_prefix_and_retokenisation(compiler, tokenizer):
    grammar = compiler.compile("json_schema", SCHEMAS["person"], timeout=120)
    matcher = GrammarMatcher(grammar)
    assert matcher.jump_forward_text() == '{"name":"'
    jf = jump_forward(matcher, [], tokenizer)
    assert jf.num_tokens_to_drop == 0 and tokenizer.decode(jf.tokens_to_append) == '{"name":"'
    out = list(jf.tokens_to_append)
    for piece in ("Bob", '"'):
        ids = tokenizer.encode(piece, add_special_tokens=False)
        assert matcher.accept_tokens(ids)
        out += ids
    assert matcher.jump_forward_text() == ',"age":'
    jf = jump_forward(matcher, out, tokenizer)
    # The closing quote is re-tokenised together with the forced text (`","` is one token).
    assert jf.num_tokens_to_drop >= 1
    out = out[: len(out) - jf.num_tokens_to_drop] + jf.tokens_to_append
    assert tokenizer.decode(out) == '{"name":"Bob","age":'
    assert out == tokenizer.encode('{"name":"Bob","age":', add_special_tokens=False)
    # The matcher was re-synced: it accepts exactly what follows the forced text.
    assert not matcher.is_allowed(tokenizer.convert_tokens_to_ids('"'))
    for digit in "42":
        assert matcher.accept_token(tokenizer.convert_tokens_to_ids(digit))
    assert not matcher.can_terminate() and matcher.jump_forward_text() == "}"  # 42x > 120
    jf = jump_forward(matcher, out + tokenizer.encode("42", add_special_tokens=False), tokenizer)
    assert jf.tokens_to_append and matcher.is_finished()


def test_jump_forward_respects_budget_and_none_when_free(compiler, tokenizer):
    grammar = compiler.compile("json_schema", SCHEMAS["person"], timeout=120)
    matcher = GrammarMatcher(grammar)
    jf = jump_forward(matcher, [], tokenizer, max_tokens_to_append=1)
    assert len(jf.tokens_to_append) == 1 and matcher.num_accepted == 1
    matcher = GrammarMatcher(compiler.compile("regex", REGEXES["int"], timeout=120))
    assert matcher.jump_forward_text() is None and jump_forward(matcher, [], tokenizer) is None


def test_forced_text_stops_at_character_boundaries(compiler, tokenizer):
    grammar = compiler.compile("choices", ["héllo wörld", "héllo wärld"])
    matcher = GrammarMatcher(grammar)
    assert matcher.jump_forward_text() == "héllo w"  # then ö/ä share their first UTF-8 byte
    jf = jump_forward(matcher, [], tokenizer)
    assert tokenizer.decode(jf.tokens_to_append) == "héllo w"
    text, _, _ = walk(matcher, tokenizer, 0, jump=True)
    assert "héllo w" + text in ("héllo wörld", "héllo wärld")


# ------------------------------------------------------------------ matcher semantics

def test_matcher_eos_only_in_accepting_states_and_rollback(compiler, tokenizer, eos_ids):
    eos = min(eos_ids)
    matcher = GrammarMatcher(compiler.compile("regex", REGEXES["int"], timeout=120))
    assert not matcher.is_allowed(eos) and not matcher.accept_token(eos)
    assert not matcher.accept_token(tokenizer.convert_tokens_to_ids("a"))
    assert matcher.accept_token(tokenizer.convert_tokens_to_ids("1"))
    assert matcher.can_terminate() and matcher.is_allowed(eos) and not matcher.is_finished()
    fork = matcher.copy()
    assert matcher.accept_token(eos) and matcher.is_finished() and matcher.terminated
    assert not matcher.accept_token(tokenizer.convert_tokens_to_ids("2"))
    matcher.rollback(2)
    assert matcher.num_accepted == 0 and not matcher.terminated and not matcher.can_terminate()
    assert fork.num_accepted == 1 and fork.accept_token(tokenizer.convert_tokens_to_ids("2"))
    assert not fork.accept_tokens(tokenizer.encode("3x", add_special_tokens=False)) and fork.num_accepted == 2


def test_finished_when_only_eos_may_follow(compiler, tokenizer):
    matcher = GrammarMatcher(compiler.compile("choices", ["yes", "no"]))
    assert matcher.accept_tokens(tokenizer.encode("no", add_special_tokens=False))
    assert matcher.can_terminate() and matcher.is_finished() and not matcher.terminated


# ------------------------------------------------------------------ vocabulary

def test_vocabulary_round_trip(compiler, tokenizer, eos_ids):
    info = compiler.info
    rng = random.Random(0)
    alphabet = "abcXYZ 019{}[]\":,.\n\t-_éüß漢字😀🙂\\/<>|"
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 60))) for _ in range(200)]
    texts += ['{"name": "Ünïcödé 😀"}', "  leading spaces", "def f(x):\n    return x\n"]
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert info.decode_bytes(ids) == text.encode("utf-8"), text
    for special in set(tokenizer.all_special_ids) | set(eos_ids):
        assert info.token_bytes[special] is None
    # printable ASCII and the bytes of most UTF-8 characters have a single-byte token (jump-forward
    # steps through them; where one is missing, forced text simply stops there)
    needed = [0x09, 0x0A, 0x0D] + list(range(0x20, 0x7F)) + list(range(0x80, 0xC0)) + list(range(0xC2, 0xF1))
    assert all(b in info.byte_tokens for b in needed)
    assert info.byte_level and info.vocabulary is info.vocabulary


@pytest.mark.parametrize("kind,spec,texts", [
    ("regex", "a(,b)*", ["a", "a,b", "a,b,b"]),  # a match that goes on through a non-matching prefix
    ("regex", r"[0-9]+(\.[0-9]+)?", ["3", "3.14"]),
    ("choices", ["a", "ab", "abc"], ["a", "ab", "abc"]),  # alternatives that are prefixes of each other
    ("regex", "(x?|xy)", ["", "x", "xy"]),
    ("json_schema", json.dumps({"type": "integer", "minimum": 0, "maximum": 120}), ["0", "7", "10", "99", "120"]),
])
def test_every_string_of_the_language_can_be_written_byte_by_byte(compiler, kind, spec, texts):
    """outlines-core's index loses strings whose proper prefix is already a match (its DFA reports matches a
    byte late, and prefers the first alternative): the grammar's end-of-match pseudo-token keeps them all."""
    grammar = compiler.compile(kind, spec)
    for text in texts:
        matcher = GrammarMatcher(grammar)
        for byte in text.encode():
            assert matcher.accept_token(grammar.info.byte_tokens[byte]), (text, byte)
        assert matcher.can_terminate(), text
        assert not grammar.is_accepting(grammar.initial_state) or "" in texts


def test_closing_token_finishes_a_match_within_the_budget(compiler):
    schema = {"type": "object", "properties": {"text": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["text", "n"]}
    grammar = compiler.compile("json_schema", json.dumps(schema))
    matcher = GrammarMatcher(grammar)
    out = b'{"text":"once upon a time'
    for byte in out:
        assert matcher.accept_token(grammar.info.byte_tokens[byte])
    length, first = grammar.closing(matcher.state)
    assert length == len('","n":0}') and first == grammar.info.byte_tokens[ord('"')]
    assert matcher.closing_token(length + 1) is None  # room left: the model writes what it wants
    budget = length
    while not matcher.can_terminate():
        token = matcher.closing_token(budget)
        assert token is not None and matcher.accept_token(token)
        out += grammar.info.token_bytes[token]
        budget -= 1
    assert budget == 0
    jsonschema.validate(json.loads(out), schema)
    assert grammar.closing(grammar.initial_state)[0] == len('{"text":"","n":0}')


def test_a_matching_output_stops_when_going_on_could_not_match_again(compiler):
    grammar = compiler.compile("regex", "(ab)+")  # after "ab": more must be a whole "ab"
    matcher = GrammarMatcher(grammar)
    assert matcher.accept_tokens([grammar.info.byte_tokens[b] for b in b"ab"])
    assert grammar.reopen(matcher.state) == 2
    assert matcher.closing_token(2) is None  # room for one more "ab"
    assert matcher.closing_token(1) == grammar.info.eos_token_ids[0]
    far = compiler.compile("regex", "x(y{80})*")  # going on needs 80 bytes: beyond the horizon
    matcher = GrammarMatcher(far)
    assert matcher.accept_token(far.info.byte_tokens[ord("x")])
    assert far.reopen(matcher.state) == -1 and matcher.closing_token(64) == far.info.eos_token_ids[0]
    assert matcher.closing_token(65) is None


def test_plain_added_tokens_are_grammar_tokens(default_model_path, eos_ids):
    """A non-special added token (Qwen's ``<tool_call>``) is in the grammar vocabulary, spelled by its text, so a
    grammar asking for that text allows the single token the model writes; special ones stay out."""
    from radixrt.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model_path)  # a fresh copy: the shared one must not change
    tok.add_tokens(["<tool_call>"], special_tokens=False)
    tok.add_tokens(["<secret>"], special_tokens=True)
    plain, special = tok.convert_tokens_to_ids(["<tool_call>", "<secret>"])
    info = build_tokenizer_info(tok, eos_ids)
    assert info.token_bytes[plain] == b"<tool_call>" and info.token_bytes[special] is None
    grammar = GrammarCompiler(tok, eos_ids, cache_size=1, max_workers=1).compile("regex", "<tool_call>x")
    matcher = GrammarMatcher(grammar)
    assert matcher.accept_token(plain)
    assert matcher.accept_tokens(tok.encode("x", add_special_tokens=False)) and matcher.is_finished()


def test_sentencepiece_style_tokens():
    class FakeTokenizer:
        all_special_ids = [0, 2]

        def get_vocab(self):
            return {"<unk>": 0, "▁hello": 1, "</s>": 2, "<0x0A>": 3, "world": 4, "▁": 5, "é": 6}

        def get_added_vocab(self):
            return {}

        def __len__(self):
            return 7

    info = build_tokenizer_info(FakeTokenizer(), [2])
    assert not info.byte_level
    assert info.token_bytes == [None, b" hello", None, b"\n", b"world", b" ", "é".encode()]
    assert info.byte_tokens == {0x0A: 3, 0x20: 5}


# ------------------------------------------------------------------ validation

@pytest.mark.parametrize(
    "kind, spec, problem",
    [
        ("regex", "(abc", "missing ), unterminated subpattern"),
        ("regex", "[a-", "unterminated character set"),
        ("regex", "a{3,1}", "min repeat greater than max repeat"),
        ("regex", "(?=a)b", "look-ahead"),
        ("regex", r"(a)\1", "back-references"),
        ("regex", r"\bword", "word boundaries"),
        ("regex", "a^b", "anchors"),
        ("regex", "", "empty"),
        ("regex", 12, "must be a string"),
        ("json_schema", "{not json", "not valid JSON"),
        ("json_schema", '{"type": "foo"}', "invalid JSON schema at type"),
        ("json_schema", {"type": "object", "properties": {"a": {"type": "integer", "minimum": "x"}}}, "minimum"),
        ("json_schema", {"type": "integer", "minimum": 10, "maximum": 5}, "no integer satisfies"),
        ("json_schema", {"type": "number", "minimum": 0.2, "maximum": 0.8}, "too narrow"),
        ("json_schema", "[1, 2]", "must be an object"),
        ("choices", [], "non-empty list"),
        ("choices", ["a", 3], "non-empty strings"),
        ("grammar", "x", "unknown constraint kind"),
    ],
)
def test_invalid_specs_raise_clear_value_errors(compiler, kind, spec, problem):
    with pytest.raises(ValueError, match=re.escape(problem)):
        compiler.validate(kind, spec)
    future = compiler.compile_async(kind, spec)
    with pytest.raises(ValueError, match=re.escape(problem)):
        future.result(timeout=5)


def test_validate_is_fast_and_accepts_engine_syntax(compiler):
    start = time.perf_counter()
    for schema in SCHEMAS.values():
        regex = compiler.validate("json_schema", json.dumps(schema))
        assert isinstance(regex, str) and regex
    for pattern in REGEXES.values():
        compiler.validate("regex", pattern)
    assert time.perf_counter() - start < 2.0
    assert compiler.validate("regex", "^abc$") == "abc"
    assert compiler.validate("regex", r"\p{Lu}[a-z]+") == r"\p{Lu}[a-z]+"  # Rust syntax Python lacks


def test_numeric_range_regexes_exact():
    rng = random.Random(1)
    for lo, hi in [(0, 0), (0, 9), (5, 123), (-50, 50), (-1000, -7), (17, None), (None, -3), (0, 100000)]:
        pattern = patterns.integer_range_regex(lo, hi)
        for value in list(range(-1200, 1200)) + [rng.randint(-10**7, 10**7) for _ in range(500)]:
            inside = (lo is None or value >= lo) and (hi is None or value <= hi)
            assert bool(re.fullmatch(pattern, str(value))) == inside, (lo, hi, value)
    for lo, hi, lo_ex, hi_ex in [(0, 1, False, False), (-40, 50, False, False), (2.5, 7.25, False, False), (0, 5, True, False)]:
        pattern = patterns.number_range_regex(lo, hi, lo_ex, hi_ex)
        matched = 0
        for _ in range(3000):
            text = rng.choice(["", "-"]) + str(rng.randint(0, 60)) + rng.choice(["", f".{rng.randint(0, 999)}", ".0"])
            if re.fullmatch(pattern, text):
                matched += 1
                value = float(text)
                assert (value > lo if lo_ex else value >= lo) and (value < hi if hi_ex else value <= hi), (text, pattern)
        assert matched > 0


# ------------------------------------------------------------------ cache and async compile

def test_lru_cache_returns_same_grammar_and_evicts(tokenizer, eos_ids):
    compiler = GrammarCompiler(tokenizer, eos_ids, cache_size=2)
    try:
        a = compiler.compile("choices", ["alpha", "beta"])
        assert compiler.compile("choices", ["alpha", "beta"]) is a
        b = compiler.compile("regex", "[0-9]{2}")
        assert compiler.compile("choices", ["alpha", "beta"]) is a  # a is now the most recent
        compiler.compile("regex", "[a-c]{3}")  # evicts b, the least recently used
        assert len(compiler) == 2 and compiler.cached("choices", ["alpha", "beta"]) and not compiler.cached("regex", "[0-9]{2}")
        assert compiler.compile("regex", "[0-9]{2}") is not b
        # schemas are keyed by content, not by their text's spacing
        s1 = compiler.compile("json_schema", '{"type": "object", "properties": {"x": {"type": "integer"}}}')
        assert compiler.compile("json_schema", {"type": "object", "properties": {"x": {"type": "integer"}}}) is s1
    finally:
        compiler.shutdown()


def test_compile_async_never_blocks(tokenizer, eos_ids):
    release = threading.Event()

    class SlowCompiler(GrammarCompiler):
        def _build(self, kind, key_text, regex):
            if "slow" in regex:
                release.wait(30)
            return super()._build(kind, key_text, regex)

    compiler = SlowCompiler(tokenizer, eos_ids, max_workers=2)
    try:
        start = time.perf_counter()
        slow = compiler.compile_async("regex", "slow[0-9]")
        assert time.perf_counter() - start < 0.5  # returns at once
        fast = compiler.compile_async("regex", "fast[0-9]")
        grammar = fast.result(timeout=60)
        assert not slow.done() and grammar.kind == "regex"
        same = compiler.compile_async("regex", "slow[0-9]")
        assert same is slow  # requests for an in-flight grammar share its future
        release.set()
        assert slow.result(timeout=60).regex == "slow[0-9]"
    finally:
        release.set()
        compiler.shutdown()


def test_compile_failure_is_not_cached(compiler):
    future = compiler.compile_async("regex", "(?=x)")
    with pytest.raises(ValueError):
        future.result(timeout=5)
    assert not compiler.cached("regex", "(?=x)")


# ------------------------------------------------------------------ masks

def test_apply_bitmask_matches_reference():
    gen = torch.Generator().manual_seed(0)
    batch, vocab = 4, 100
    logits = torch.randn(batch, vocab + 5, generator=gen)  # logits wider than the mask: the tail is disallowed
    bitmask = torch.randint(-(2**31), 2**31 - 1, (batch, (vocab + 31) // 32), generator=gen, dtype=torch.int32)
    expected = apply_bitmask_reference(logits, bitmask)
    assert torch.equal(apply_bitmask(logits.clone(), bitmask), expected)
    rows = [1, 3]
    got = apply_bitmask(logits.clone(), bitmask, rows)
    assert torch.equal(got[rows], expected[rows]) and torch.equal(got[[0, 2]], logits[[0, 2]])
    half = apply_bitmask(logits.clone().to(torch.bfloat16), bitmask)
    assert torch.equal(half, expected.to(torch.bfloat16))
    assert torch.equal(unpack_bitmask(bitmask, vocab), expected[:, :vocab] != float("-inf"))


def test_fill_bitmasks_from_matchers(compiler, tokenizer, eos_ids):
    grammar = compiler.compile("regex", REGEXES["int"], timeout=120)
    vocab = compiler.vocab_size
    matcher = GrammarMatcher(grammar)
    bitmask = allocate_bitmask(3, vocab)
    bitmask[1] = 0
    rows = fill_bitmasks(bitmask, [None, matcher, None])
    assert rows == [1] and (bitmask[0] == -1).all() and (bitmask[2] == -1).all()
    allowed = unpack_bitmask(bitmask, vocab)[1]
    digits = [tokenizer.convert_tokens_to_ids(d) for d in "0123456789"]
    assert allowed[digits].all() and not allowed[list(eos_ids)].any()
    assert not allowed[tokenizer.convert_tokens_to_ids("a")]
    logits = torch.zeros(3, vocab)
    apply_bitmask(logits, bitmask, rows)
    assert (logits[0] == 0).all() and (logits[1] == 0).sum() == allowed.sum()
    row = torch.empty(bitmask.shape[1], dtype=torch.int32)
    matcher.fill_bitmask(row)
    assert torch.equal(row, bitmask[1])


# ------------------------------------------------------------------ the scheduler-facing facade

def test_grammar_backend_facade(tokenizer, eos_ids):
    from radixrt.constrained import GrammarBackend, validate_grammar

    assert validate_grammar("choices", '["yes", "no"]') == "(yes|no)"  # the engine sends choices as JSON
    assert validate_grammar("json_schema", '{"type": "object"}') == validate_grammar("json_object")
    backend = GrammarBackend(tokenizer, eos_ids, vocab_size=49152 + 64, jump_forward=True)
    try:
        grammar = backend.compile_async("choices", '["yes", "no"]').result(timeout=60)
        assert backend.compile_async("choices", ["yes", "no"]).result() is grammar
        matcher = grammar.matcher()
        logits = torch.zeros(3, backend.vocab_size)
        backend.apply_masks(logits, [None, matcher, None])
        assert (logits[0] == 0).all() and (logits[2] == 0).all()
        allowed = (logits[1] == 0).nonzero().flatten().tolist()
        assert allowed and all(tokenizer.decode([t]) in ("y", "ye", "yes", "n", "no") for t in allowed)
        assert (logits[1, 49152:] == float("-inf")).all()  # padded vocabulary rows are never allowed
        assert matcher.accept_token(tokenizer.encode("y", add_special_tokens=False)[0])
        jf = backend.jump_forward(matcher, tokenizer.encode("y", add_special_tokens=False))
        assert jf is not None and matcher.is_finished()
        backend.jump_forward_enabled = False
        assert backend.jump_forward(grammar.matcher(), []) is None
    finally:
        backend.shutdown()


def test_apply_token_masks_matches_bitmask_path(compiler, tokenizer):
    """The scheduler's CPU path (per-state sparse ids / dense rows) equals fill_bitmasks + apply_bitmask, for
    every mask kind, mixed with unconstrained rows, all rows constrained, and bf16 logits."""
    from radixrt.constrained import apply_token_masks
    from radixrt.constrained.masks import MASK_ALLOWED, MASK_DENSE, MASK_DISALLOWED

    grammar = compiler.compile("json_schema", {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}}, "required": ["name", "n"]}, timeout=120)
    vocab = compiler.vocab_size
    rng = random.Random(1)
    matchers = []
    while len(matchers) < 24:
        matcher = GrammarMatcher(grammar)
        for _ in range(rng.randrange(0, 14)):
            allowed = unpack_bitmask(matcher.allowed_row()[None], vocab)[0].nonzero().flatten().tolist()
            allowed = [t for t in allowed if t not in grammar.info.eos_token_ids]
            if not allowed or matcher.is_finished():
                break
            matcher.accept_token(rng.choice(allowed))
        matchers.append(matcher)
    kinds = {grammar.token_mask(m.state)[0] for m in matchers}
    assert {MASK_ALLOWED, MASK_DISALLOWED} <= kinds, kinds
    # a dense state: any row with many allowed and many disallowed ids (forced here through a tiny limit)
    from radixrt.constrained import masks

    kind, bias = masks.token_mask_of_row(grammar.allowed_row(matchers[0].state), vocab)
    old = masks.SPARSE_MASK_LIMIT
    masks.SPARSE_MASK_LIMIT = 0
    try:
        kind, bias = masks.token_mask_of_row(grammar.allowed_row(matchers[0].state), vocab)
        assert kind == MASK_DENSE and torch.equal(bias == 0, unpack_bitmask(grammar.allowed_row(matchers[0].state)[None], vocab)[0])
        grammar._token_masks[matchers[0].state] = (kind, bias)
        for rows in (matchers, [m if i % 3 else None for i, m in enumerate(matchers)], [None] * 4):
            for dtype in (torch.float32, torch.bfloat16):
                logits = torch.randn(len(rows), vocab).to(dtype)
                bitmask = allocate_bitmask(len(rows), vocab)
                want = apply_bitmask(logits.clone(), bitmask, fill_bitmasks(bitmask, rows))
                assert torch.equal(apply_token_masks(logits.clone(), rows), want)
    finally:
        masks.SPARSE_MASK_LIMIT = old
        grammar._token_masks.clear()
