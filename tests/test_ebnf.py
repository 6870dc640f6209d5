"""EBNF grammars (SGLang's ``ebnf``) inlined into one regex: every construct of the notation against strings it
must and must not match, the refusals (recursion, undefined or missing rules, syntax errors with their place),
the regex compiled on the default model's vocabulary, and generation under a grammar through the Engine, /generate
and the OpenAI routes (a bad grammar is that request's 400; the server keeps serving)."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixrt.constrained.ebnf import ebnf_regex
from radixrt.constrained.patterns import engine_accepts_regex

CASES = [
    ('root ::= "yes" | "no"', ["yes", "no"], ["", "yesno", "Yes"]),
    ('root ::= "a" b "c"\nb ::= "B"+', ["aBc", "aBBBc"], ["ac", "abc"]),
    ('root ::= [a-c_]* [^a-z\\n]', ["ab_X", "9", "cc "], ["abc", "a\n", ""]),
    ('root ::= ("ab" | "c")? "!"', ["!", "ab!", "c!"], ["abc!", "a!"]),
    ('root ::= [0-9]{2} "-" [0-9]{1,3} "." [0-9]{2,}', ["12-1.00", "00-123.4567"], ["1-1.00", "12-1234.00", "12-1.0"]),
    ('root ::= "q\\"\\\\\\n\\t\\x41\\u00e9"', ['q"\\\n\tAé'], ["q"]),
    ('root ::= . . "x"', ["abx", "\n\tx", "é😀x"], ["ax", "abcx"]),
    ('root ::= "a.b*" [\\]\\-^]', ["a.b*]", "a.b*-", "a.b*^"], ["a.bb]", "a.b*x"]),
    ('# a comment\nroot ::= item ("," item)*  # trailing\nitem ::= "x" | "y"\n', ["x", "x,y,x"], ["", "x,", ",x"]),
    ('root ::=\n  "multi"\n  "line"\nother ::= "unused"', ["multiline"], ["multi"]),
    ('root ::= ws "[" ws ( value ( ws "," ws value )* )? ws "]"\nvalue ::= [0-9]+ | "\\"" [a-z]* "\\""\n'
     'ws ::= [ ]?', ['[1, "ab",2]', "[]", ' [ 7 ]'], ["[1,]", "[a]"]),
]


@pytest.mark.parametrize("grammar,good,bad", CASES)
def test_each_construct_matches_what_it_should(grammar, good, bad):
    regex = ebnf_regex(grammar)
    pattern = re.compile(regex)
    for text in good:
        assert pattern.fullmatch(text), (grammar, text)
    for text in bad:
        assert not pattern.fullmatch(text), (grammar, text)
    assert engine_accepts_regex(regex)


@pytest.mark.parametrize("grammar,needle", [
    ('root ::= "(" root ")" | "x"', "recursive (root -> root)"),
    ('root ::= a\na ::= "[" b "]"\nb ::= a | "x"', "recursive (a -> b -> a)"),
    ('root ::= thing', "'thing' is used but not defined"),
    ('start ::= "x"', "no 'root' rule"),
    ('root ::= "x"\nroot ::= "y"', "defined twice"),
    ('root ::= "x" |', "an empty alternative"),
    ('root ::= ("x"', "a group is not closed"),
    ('root ::= "x" )', "unexpected ')'"),
    ('root ::= "x"\n  @', "line 2, column 3"),
    ('root ::= [z-a]', "reversed"),
    ('root ::= "\\q"', "unknown escape"),
    ('root ::= "a"{3,1}', "max < min"),
    ('"x" ::= root', "rules of the form"),
    ("", "empty"),
])
def test_bad_grammars_are_refused_with_the_reason(grammar, needle):
    with pytest.raises(ValueError) as info:
        ebnf_regex(grammar)
    assert needle in str(info.value)


def test_sampling_params_take_one_constraint():
    from radixrt.sampling.params import SamplingParams

    assert SamplingParams.from_dict({"ebnf": 'root ::= "a"'}).validate().ebnf == 'root ::= "a"'
    with pytest.raises(ValueError, match="only one of regex, json_schema, choices, ebnf and structural_tag"):
        SamplingParams.from_dict({"ebnf": 'root ::= "a"', "regex": "a"}).validate()


GRAMMAR = 'root ::= "The answer is " answer "."\nanswer ::= "yes" | "no" | [0-9]{1,3}'


@pytest.mark.model
def test_the_engine_generates_under_a_grammar(default_model_path):
    import radixrt

    engine = radixrt.Engine(model_path=default_model_path, dtype="float32", kv_memory_gb=0.1)
    try:
        out = engine.generate("Is the sky blue? Answer:", {"max_new_tokens": 24, "temperature": 0, "ebnf": GRAMMAR})
        assert re.fullmatch(ebnf_regex(GRAMMAR), out["text"]), out["text"]
        with pytest.raises(ValueError, match="recursive"):
            engine.generate("x", {"max_new_tokens": 4, "ebnf": 'root ::= "(" root ")"'})
        sampled = engine.generate("Pick:", {"max_new_tokens": 24, "temperature": 1.0, "seed": 3, "ebnf": GRAMMAR})
        assert re.fullmatch(ebnf_regex(GRAMMAR), sampled["text"]), sampled["text"]
    finally:
        engine.shutdown()


GRAMMAR_PIECES = ["root", " ::= ", "::=", "a", "b", " ", "\n", '"x"', '"', "\\", "[", "]", "^", "-", "(", ")", "|",
                  "*", "+", "?", "{2}", "{1,}", "{", "}", ",", ".", "#", "0-9", "\\x4", "\\u00e9"]


@settings(max_examples=400, deadline=None)
@given(st.booleans(), st.lists(st.sampled_from(GRAMMAR_PIECES) | st.text(max_size=3), max_size=20))
def test_any_text_is_a_grammar_or_a_value_error(rooted, pieces):
    """Whatever a client sends as a grammar, the answer is a regex the engine compiles or a ValueError (a 400)."""
    text = ("root ::= " if rooted else "") + "".join(pieces)
    try:
        regex = ebnf_regex(text)
    except ValueError:
        return
    assert engine_accepts_regex(regex), (text, regex)
