"""Incremental detokenization: the Rust fast path gives the very text of ``tokenizer.decode``."""

import random
import subprocess
import sys

import pytest

from radixrt.detokenize import Detokenizer, RustDecoder, TextStream, batch_decode, decoder_json, fast_decode
from radixrt.protocol.messages import BatchTokenOut, FinishReason, ReqDelta

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


def test_a_batch_is_decoded_at_once_into_each_requests_own_text(tokenizer):
    """The detokenizer decodes every stream of a batch in one call per skip_special_tokens value and gives each
    request the text its own stream renders alone."""
    rng = random.Random(1)
    rids = [f"r{i}" for i in range(6)]
    ids = {rid: [rng.randrange(tokenizer.vocab_size) for _ in range(12)] for rid in rids}
    detokenizer, calls = Detokenizer(tokenizer), []
    many = detokenizer.decode_many
    detokenizer.decode_many = lambda lists, skip: calls.append(skip) or many(lists, skip)
    texts = dict.fromkeys(rids, "")
    for step in range(0, 12, 3):
        deltas = [ReqDelta(rid=rid, new_ids=ids[rid][step:step + 3], skip_special_tokens=i % 2 == 0,
                           finish_reason=None if step < 9 else FinishReason.length())
                  for i, rid in enumerate(rids)]
        for out in detokenizer.process(BatchTokenOut(deltas)).outputs:
            texts[out.rid] += out.text
    assert sorted(calls) == [False] * 4 + [True] * 4  # two calls a step, whatever the batch size
    for i, rid in enumerate(rids):
        alone = TextStream(tokenizer, skip_special_tokens=i % 2 == 0)
        alone.add(ids[rid])
        alone.finish()
        assert texts[rid] == alone.take(True)
    assert detokenizer.streams == {}


def test_a_request_that_cannot_be_decoded_fails_alone_in_its_batch(tokenizer):
    detokenizer = Detokenizer(tokenizer)
    real = detokenizer.decode

    def decode(ids, skip):
        if 13 in ids:
            raise ValueError("injected: cannot decode")
        return real(ids, skip)

    detokenizer.decode = decode
    detokenizer.decode_many = lambda lists, skip: [decode(ids, skip) for ids in lists]
    out = detokenizer.process(BatchTokenOut([ReqDelta(rid="good", new_ids=[504, 3458]),
                                             ReqDelta(rid="bad", new_ids=[13, 14])])).outputs
    assert out[0].rid == "good" and out[0].text == real([504, 3458], True) and out[0].delta.finish_reason is None
    assert out[1].rid == "bad" and out[1].text == "" and out[1].delta.finish_reason.status_code == 500
    assert "cannot decode" in out[1].delta.finish_reason.message and set(detokenizer.streams) == {"good"}


def test_batch_decode_matches_decode(tokenizer):
    lists = [[1, 504, 3458], [2, 28], []]
    for skip in (True, False):
        expected = [tokenizer.decode(ids, skip_special_tokens=skip) for ids in lists]
        assert batch_decode(tokenizer)(lists, skip) == expected


def test_a_requests_two_deltas_in_one_batch_are_taken_in_order(tokenizer):
    ids = [504, 3458, 28, 1, 2088, 314]
    together, apart = Detokenizer(tokenizer), Detokenizer(tokenizer)
    out = together.process(BatchTokenOut([ReqDelta(rid="a", new_ids=ids[:3]), ReqDelta(rid="b", new_ids=ids[:2]),
                                          ReqDelta(rid="a", new_ids=ids[3:], finish_reason=FinishReason.length())]))
    texts = [o.text for o in out.outputs]
    first = apart.process(BatchTokenOut([ReqDelta(rid="a", new_ids=ids[:3])])).outputs[0].text
    last = apart.process(BatchTokenOut([ReqDelta(rid="a", new_ids=ids[3:], finish_reason=FinishReason.length())]))
    assert [o.rid for o in out.outputs] == ["a", "b", "a"]
    assert texts[0] == first and texts[2] == last.outputs[0].text
    assert texts[0] + texts[2] == tokenizer.decode(ids, skip_special_tokens=True)
    assert set(together.streams) == {"b"}


def test_the_rust_tokenizer_alone_decodes_every_text_the_tokenizer_does(tokenizer):
    """What the server's detokenizer process decodes with (RustDecoder over ``decoder_json``, no transformers):
    random ids over the whole vocabulary, added special tokens and cut UTF-8 sequences included, streamed or not."""
    rust = RustDecoder(decoder_json(tokenizer))
    rng = random.Random(2)
    special = sorted(tokenizer.all_special_ids)
    for _ in range(300):
        ids = [rng.choice(special) if rng.random() < 0.1 else rng.randrange(len(tokenizer))
               for _ in range(rng.randint(0, 16))]
        for skip in (True, False):
            assert rust.decode(ids, skip_special_tokens=skip) == tokenizer.decode(ids, skip_special_tokens=skip)
    ids = [rng.randrange(len(tokenizer)) for _ in range(64)]
    streams = [TextStream(decoding, skip_special_tokens=False) for decoding in (rust, tokenizer)]
    for stream in streams:
        for token in ids:
            stream.add([token])
        stream.finish()
    assert streams[0].take(True) == streams[1].take(True)


def test_no_rust_tokenizer_alone_where_decoding_cleans_up_spaces(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", True)
    assert decoder_json(tokenizer) is None


def test_the_detokenizer_process_decodes_without_transformers_or_torch(tokenizer, tmp_path):
    """Its start-up is the Rust tokenizer's (a tenth of a second), not transformers' and torch's (seconds)."""
    source = tmp_path / "decoder.json"
    source.write_text(decoder_json(tokenizer))
    ids = [1, 504, 3458, 2, 28]
    script = ("import sys; from radixrt.server.detokenizer_process import load_decoder; "
              f"print(load_decoder({str(source)!r}).decode({ids}, skip_special_tokens=True)); "
              "print(sorted({'torch', 'transformers'} & set(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [tokenizer.decode(ids, skip_special_tokens=True), "[]"]
