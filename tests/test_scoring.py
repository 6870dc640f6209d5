"""Scoring through the Engine, equal to transformers: SGLang's ``token_ids_logprob`` (the logprobs of chosen ids at
every returned position), ``Engine.score`` (label tokens' probabilities after a query and each item) and
``Engine.rerank`` (a yes/no reranker template on a generating model; a one-label classifier as a cross-encoder,
against sentence-transformers' ``CrossEncoder``); their refusals. The HTTP routes: tests/test_score_server.py."""

from __future__ import annotations

import math
import shutil

import pytest
import torch

import radixrt
from radixrt.rerank import RerankCall, is_reranker_template, ranked, score_pairs

pytestmark = pytest.mark.model

# A yes/no reranker template in the form SGLang's and vLLM's Qwen3-Reranker templates take.
RERANK_TEMPLATE = (
    '<|im_start|>system\nJudge whether the Document answers the Query. Note that the answer can only be "yes" or '
    '"no".<|im_end|>\n<|im_start|>user\n<Instruct>: {{ instruct | default("Find passages that answer the query.") }}'
    '\n<Query>: {{ messages[0]["content"] }}\n<Document>: {{ messages[1]["content"] }}<|im_end|>\n'
    "<|im_start|>assistant{{ '\\n' }}"  # Jinja drops a template's last newline
)


def rendered(query: str, document: str, instruct: str = "Find passages that answer the query.") -> str:
    """The template's prompt, written out by hand."""
    return ('<|im_start|>system\nJudge whether the Document answers the Query. Note that the answer can only be '
            f'"yes" or "no".<|im_end|>\n<|im_start|>user\n<Instruct>: {instruct}\n<Query>: {query}\n'
            f'<Document>: {document}<|im_end|>\n<|im_start|>assistant\n')


QUERY = "What do pandas eat?"
DOCUMENTS = ["Pandas eat bamboo shoots and leaves.", "The stock market closed higher today.",
             "Giant pandas live in the mountains of China."]


@pytest.fixture(scope="module")
def engine(default_model_path):
    with radixrt.Engine(dtype="float32", log_interval=0, debug_checks=True, kv_memory_gb=0.3) as eng:
        yield eng


def _last_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0, -1].float(), -1)


# ----- token_ids_logprob ------------------------------------------------------------------------------------


def test_token_ids_logprob_at_every_position_equals_transformers(engine, hf_model):
    prompts = [engine.tokenizer.encode("The capital of France is"), engine.tokenizer.encode("Once upon a time, there")]
    labels = [5, 17, 300, 1000]
    outs = engine.generate(input_ids=prompts, return_logprob=True, logprob_start_len=1, token_ids_logprob=labels,
                           sampling_params={"max_new_tokens": 3, "temperature": 0, "ignore_eos": True})
    for ids, out in zip(prompts, outs):  # a batch: each row's own logprobs
        meta = out["meta_info"]
        with torch.no_grad():
            ref = torch.log_softmax(hf_model(torch.tensor([ids + out["output_ids"]])).logits[0].float(), -1)
        assert len(meta["output_token_ids_logprobs"]) == 3
        for i, row in enumerate(meta["output_token_ids_logprobs"]):  # output token i was predicted at len(ids)+i-1
            assert [t for _, t, _ in row] == labels
            assert all(abs(lp - ref[len(ids) + i - 1, t].item()) < 1e-3 for lp, t, _ in row)
        assert len(meta["input_token_ids_logprobs"]) == len(ids) - 1  # prompt positions from logprob_start_len on
        for j, row in enumerate(meta["input_token_ids_logprobs"]):  # prompt token j + 1 was predicted at j
            assert all(abs(lp - ref[j, t].item()) < 1e-3 for lp, t, _ in row)


def test_a_prompt_only_request_reports_the_ids_after_its_prompt(engine, hf_model):
    ids = engine.tokenizer.encode("One, two, three,")
    out = engine.generate(input_ids=[ids, ids[:-1]], sampling_params={"max_new_tokens": 0}, return_logprob=True,
                          token_ids_logprob=[[9, 700], None], logprob_start_len=1)  # every prompt row's logits too
    assert out[0]["output_ids"] == [] and out[0]["meta_info"]["finish_reason"]["type"] == "length"
    (row,) = out[0]["meta_info"]["output_token_ids_logprobs"]
    want = _last_logprobs(hf_model, ids)
    assert [t for _, t, _ in row] == [9, 700] and all(abs(lp - want[t].item()) < 1e-3 for lp, t, _ in row)
    assert "output_token_ids_logprobs" not in out[1]["meta_info"]  # the second prompt asked for none


@pytest.mark.parametrize("labels,return_logprob,message", [
    ([1, 2], False, "needs return_logprob"),
    ([[1, 2], [3]], True, "2 lists for 1 prompts"),
    ([], True, "non-empty list"),
    ([1, 1], True, "twice"),
    ([10**7], True, "outside the vocabulary"),
    (["a"], True, "non-empty list of token ids"),
])
def test_bad_token_ids_logprob_is_refused(engine, labels, return_logprob, message):
    with pytest.raises(ValueError, match=message):
        engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 1}, return_logprob=return_logprob,
                        token_ids_logprob=labels)
    assert engine.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 1})["output_ids"]  # still serving


# ----- Engine.score -----------------------------------------------------------------------------------------


def _hf_scores(hf_model, tokenizer, prompts: list[str | list[int]], labels: list[int], softmax: bool):
    scores = []
    for prompt in prompts:
        ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        logprobs = _last_logprobs(hf_model, ids)[labels]
        scores.append((torch.softmax(logprobs, -1) if softmax else logprobs.exp()).tolist())
    return scores


@pytest.mark.parametrize("apply_softmax", [True, False])
def test_score_equals_transformers_for_text_and_item_first(engine, hf_model, apply_softmax):
    tok = engine.tokenizer
    labels = [tok.encode(" to", add_special_tokens=False)[0], tok.encode(" the", add_special_tokens=False)[0]]
    got = engine.score("I pledge allegiance", ["", " to"], labels, apply_softmax=apply_softmax)
    want = _hf_scores(hf_model, tok, ["I pledge allegiance", "I pledge allegiance to"], labels, apply_softmax)
    assert _all_close(got, want)
    got = engine.score(" is a city", ["Tokyo", "Japan"], labels, apply_softmax=apply_softmax, item_first=True)
    assert _all_close(got, _hf_scores(hf_model, tok, ["Tokyo is a city", "Japan is a city"], labels, apply_softmax))
    if apply_softmax:
        assert all(abs(sum(s) - 1.0) < 1e-9 for s in got)


def test_score_of_token_ids_shares_the_query_through_the_cache(engine, hf_model):
    query = engine.tokenizer.encode("A long question about the weather in many places, asked once. " * 3)
    items = [[300, 301], [302], [303, 304, 305]]
    labels = [11, 12, 11, 700]  # a label listed twice gets its score twice
    engine.flush_cache()
    got = engine.score(query, items, labels)
    want = _hf_scores(hf_model, engine.tokenizer, [query + item for item in items], labels, False)
    assert _all_close(got, want) and all(s[0] == s[2] for s in got)
    cached = engine.generate(input_ids=query + [306], sampling_params={"max_new_tokens": 0})
    assert cached["meta_info"]["cached_tokens"] >= len(query) - 16  # the query's whole pages


@pytest.mark.parametrize("query,items,labels,message", [
    ("q", [[1, 2]], [5], "both text"),
    ([1, 2], ["a"], [5], "both text"),
    ("q", [], [5], "non-empty list"),
    ("q", ["a"], [], "label_token_ids"),
    ("q", ["a"], [10**7], "outside the vocabulary"),
    ("", ["a"], [5], "query must not be empty"),
])
def test_bad_score_calls_are_refused(engine, query, items, labels, message):
    with pytest.raises(ValueError, match=message):
        engine.score(query, items, labels)


def test_a_detached_engine_scores_as_a_threaded_one(engine, template_file):
    """The scheduler in its own process: the chosen ids travel over its sockets (radixrt.server.detached)."""
    labels = [11, 12, 700]
    want = engine.score("The weather today is", [" sunny", " cold and wet"], labels, apply_softmax=True)
    with radixrt.Engine(dtype="float32", log_interval=0, kv_memory_gb=0.3, engine_scheduler="process",
                        chat_template=str(template_file)) as detached:
        assert _all_close(detached.score("The weather today is", [" sunny", " cold and wet"], labels,
                                         apply_softmax=True), want, rel=1e-5)
        ranked_docs = detached.rerank(QUERY, DOCUMENTS)
        assert sorted(r["index"] for r in ranked_docs) == [0, 1, 2] and all(0 < r["score"] < 1 for r in ranked_docs)


def _all_close(got: list[list[float]], want: list[list[float]], rel: float = 1e-3) -> bool:
    return len(got) == len(want) and all(
        len(g) == len(w) and all(math.isclose(a, b, rel_tol=rel, abs_tol=1e-7) for a, b in zip(g, w))
        for g, w in zip(got, want))


# ----- rerank: a generating model with a yes/no reranker template ------------------------------------------------


@pytest.fixture(scope="module")
def template_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "reranker.jinja"
    path.write_text(RERANK_TEMPLATE)
    return path


def test_the_reranker_template_is_recognised():
    assert is_reranker_template(RERANK_TEMPLATE)
    assert not is_reranker_template("{% for m in messages %}{{ m.content }}{% endfor %}") and \
        not is_reranker_template(None)


def test_a_decoder_reranker_scores_yes_against_no_as_transformers(template_file, hf_model):
    with radixrt.Engine(dtype="float32", log_interval=0, debug_checks=True, kv_memory_gb=0.3,
                        chat_template=str(template_file)) as eng:
        tok = eng.tokenizer
        yes, no = tok.encode("yes", add_special_tokens=False)[0], tok.encode("no", add_special_tokens=False)[0]
        for instruct in (None, "Judge relevance."):
            got = eng.rerank(QUERY, DOCUMENTS, instruct=instruct)
            want = []
            for doc in DOCUMENTS:
                prompt = rendered(QUERY, doc) if instruct is None else rendered(QUERY, doc, instruct)
                logprobs = _last_logprobs(hf_model, tok.encode(prompt, add_special_tokens=False))
                want.append(math.exp(logprobs[yes]) / (math.exp(logprobs[yes]) + math.exp(logprobs[no])))
            assert sorted(r["index"] for r in got) == [0, 1, 2]
            assert [r["score"] for r in got] == sorted((r["score"] for r in got), reverse=True)
            for r in got:
                assert math.isclose(r["score"], want[r["index"]], rel_tol=1e-3)
                assert r["document"] == DOCUMENTS[r["index"]]
                assert r["meta_info"]["prompt_tokens"] == len(tok.encode(rendered(QUERY, DOCUMENTS[r["index"]]) if
                                                                         instruct is None else rendered(
                    QUERY, DOCUMENTS[r["index"]], instruct), add_special_tokens=False))
        top = eng.rerank(QUERY, DOCUMENTS, top_n=1, return_documents=False)
        assert len(top) == 1 and top[0]["index"] == got[0]["index"] and top[0]["document"] is None
        with pytest.raises(ValueError, match="documents must be"):
            eng.rerank(QUERY, [])
        with pytest.raises(ValueError, match="top_n"):
            eng.rerank(QUERY, DOCUMENTS, top_n=-1)


def test_a_model_without_a_reranker_template_does_not_rerank(engine):
    with pytest.raises(ValueError, match="does not rerank"):
        engine.rerank(QUERY, DOCUMENTS)


def test_score_pairs_reads_one_against_many_or_pair_by_pair():
    assert score_pairs("q", ["a", "b"]) == [("q", "a"), ("q", "b")] == score_pairs(["q"], ["a", "b"])
    assert score_pairs(["q", "r"], ["a", "b"]) == [("q", "a"), ("r", "b")] and score_pairs("q", "a") == [("q", "a")]
    for bad in ((["q", "r"], ["a", "b", "c"]), ("q", []), ("", "a"), ("q", ["a", 3])):
        with pytest.raises(ValueError):
            score_pairs(*bad)


def test_ranked_orders_best_first_ties_in_document_order():
    call = RerankCall("q", ["a", "b", "c", "d"], top_n=3)
    assert [r["index"] for r in ranked(call, [0.2, 0.9, 0.2, 0.5])] == [1, 3, 0]


# ----- rerank: a one-label classifier as a cross-encoder ---------------------------------------------------------


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory, default_model_path):
    from tiny_models import save_classifier_model

    path = tmp_path_factory.mktemp("cross-encoder")
    model = save_classifier_model("qwen3", path, ["relevance"], vocab_size=49152)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (default_model_path / name).is_file():
            shutil.copy(default_model_path / name, path / name)
    return path, model


def test_a_cross_encoder_ranks_as_sentence_transformers(cross_encoder):
    from sentence_transformers import CrossEncoder

    path, _ = cross_encoder
    reference = CrossEncoder(str(path), device="cpu")
    want = [float(reference.predict([(QUERY, doc)], batch_size=1)[0]) for doc in DOCUMENTS]
    with radixrt.Engine(model_path=str(path), dtype="float32", kv_memory_gb=0.05, log_interval=0,
                        debug_checks=True) as eng:
        got = eng.rerank(QUERY, DOCUMENTS)
    assert sorted(r["index"] for r in got) == [0, 1, 2]
    for r in got:
        assert math.isclose(r["score"], want[r["index"]], rel_tol=1e-4), (r, want)


def test_a_cross_encoder_renders_pairs_through_a_reranker_template(cross_encoder, template_file):
    path, model = cross_encoder
    with radixrt.Engine(model_path=str(path), dtype="float32", kv_memory_gb=0.05, log_interval=0,
                        debug_checks=True, chat_template=str(template_file)) as eng:
        got = {r["index"]: r["score"] for r in eng.rerank(QUERY, DOCUMENTS)}
        for i, doc in enumerate(DOCUMENTS):
            with torch.no_grad():
                logit = model(torch.tensor([eng.tokenizer.encode(rendered(QUERY, doc),
                                                                 add_special_tokens=False)])).logits[0, 0]
            assert math.isclose(got[i], torch.sigmoid(logit).item(), rel_tol=1e-4)
