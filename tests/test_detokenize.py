"""Incremental detokenization: the Rust fast path gives the very text of ``tokenizer.decode``."""

import random

import pytest

from radixrt.detokenize import TextStream, fast_decode

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def tokenizer(default_model_path):
    from radixrt.tokenizer import load_tokenizer

    return load_tokenizer(default_model_path)


def test_fast_decode_is_the_rust_tokenizers_where_no_cleanup_applies(tokenizer):
    assert not tokenizer.clean_up_tokenization_spaces
    ids = [1, 504, 3458, 2, 28]
    for skip in (True, False):
        assert fast_decode(tokenizer)(ids, skip) == tokenizer.decode(ids, skip_special_tokens=skip)


def test_fast_decode_falls_back_where_cleanup_applies(tokenizer, monkeypatch):
    calls = []
    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", True)
    monkeypatch.setattr(tokenizer, "decode", lambda ids, skip_special_tokens: calls.append(ids) or "x")
    assert fast_decode(tokenizer)([5, 6], True) == "x" and calls == [[5, 6]]


def test_streams_render_the_same_text_either_way(tokenizer):
    rng = random.Random(0)
    slow = lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)  # noqa: E731
    for _ in range(100):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 24))]
        for skip in (True, False):
            fast, reference = TextStream(tokenizer, skip_special_tokens=skip), TextStream(
                tokenizer, skip_special_tokens=skip, decode=slow)
            for token in ids:
                fast.add([token])
                reference.add([token])
            fast.finish()
            reference.finish()
            assert fast.take(True) == reference.take(True)
