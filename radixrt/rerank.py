"""Reranking: how the served model scores documents against a query, and the ranked answer. Torch-free.

A ``Reranker`` is one of two kinds (``reranker_of`` picks it from the served model and its chat template):

- ``cross-encoder``: a classifier with one label (``*ForSequenceClassification``, e.g. a Qwen3-Reranker converted to
  one). Each (query, document) pair is one embedding request (the score head at its last token);
  its score is that label's sigmoid, as sentence-transformers' ``CrossEncoder``, vLLM and SGLang give it. The pair
  is the tokenizer's encoding of two texts, or, where the chat template is a reranker's, the template's rendering.
- ``decoder``: a generating model served with a yes/no reranker template (Qwen3-Reranker's: the answer "can only be
  "yes" or "no""). Each pair is rendered by the template and scored p(yes) / (p(yes) + p(no)) at the position after
  it: a prompt-only request whose ``token_ids_logprob`` are the two words' ids (radixrt.scoring's mechanism).

A template is rendered with the messages ``[{"role": "query", ...}, {"role": "document", ...}]`` and the call's
``instruct`` (as ``instruct`` and ``instruction``), which SGLang's and vLLM's reranker templates both read. Pairs of
one query share its rendering up to the document, a prefix the radix cache keeps. ``ranked`` is SGLang's /v1/rerank
answer: every document with its score and index, best first, ``top_n`` of them. ``score_pairs`` reads vLLM's /score
pairs (one text against many, or two lists pair by pair).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from radixrt.protocol.errors import RequestError
from radixrt.protocol.request import GenerateInput
from radixrt.scoring import PROMPT_ONLY, next_token_logprobs, sigmoid, softmax

MAX_RERANK_DOCUMENTS = 1024


@dataclass(frozen=True)
class RerankCall:
    """A rerank call's arguments, unchecked."""

    query: Any
    documents: Any
    instruct: Any = None
    top_n: Any = None
    return_documents: Any = True


def score_pairs(text_1: Any, text_2: Any) -> list[tuple[str, str]]:
    """vLLM's /score pairs: one text against one or many (``text_1`` a string or a list of one), or two lists of
    the same length, pair by pair; RequestError otherwise."""
    first = [text_1] if isinstance(text_1, str) else text_1
    second = [text_2] if isinstance(text_2, str) else text_2
    for name, texts in (("text_1", first), ("text_2", second)):
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t for t in texts):
            raise RequestError(f"{name} must be a non-empty string or a non-empty list of them")
    if len(second) > MAX_RERANK_DOCUMENTS:
        raise RequestError(f"at most {MAX_RERANK_DOCUMENTS} pairs are scored in one call")
    if len(first) == 1:
        return [(first[0], t) for t in second]
    if len(first) != len(second):
        raise RequestError(f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, or as many "
                           "as text_2")
    return list(zip(first, second))


def is_reranker_template(template: Any) -> bool:
    """A yes/no reranker's chat template (SGLang's test: the answer "can only be" "yes" or "no")."""
    if not isinstance(template, str):
        return False
    text = template.lower()
    return "can only be" in text and '"yes"' in text and '"no"' in text


def _single_token(tokenizer: Any, word: str) -> int:
    ids = tokenizer.encode(word, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"a yes/no reranker needs {word!r} to be one token; this tokenizer makes it {ids}")
    return ids[0]


@dataclass(frozen=True)
class Reranker:
    kind: Literal["cross-encoder", "decoder"]
    template: str | None  # the reranker template pairs are rendered with (None: the tokenizer's pair encoding)
    yes_no: tuple[int, int] | None = None  # a decoder reranker's label ids

    def check(self, call: RerankCall) -> None:
        if not isinstance(call.query, str) or not call.query:
            raise RequestError("query must be a non-empty string")
        docs = call.documents
        if not isinstance(docs, list) or not docs or not all(isinstance(d, str) and d for d in docs):
            raise RequestError("documents must be a non-empty list of non-empty strings")
        if len(docs) > MAX_RERANK_DOCUMENTS:
            raise RequestError(f"at most {MAX_RERANK_DOCUMENTS} documents are ranked in one call")
        if call.instruct is not None and not isinstance(call.instruct, str):
            raise RequestError("instruct must be a string")
        if call.top_n is not None and (type(call.top_n) is not int or call.top_n < 0):
            raise RequestError("top_n must be a non-negative integer (0 or null: every document)")
        if not isinstance(call.return_documents, bool):
            raise RequestError("return_documents must be a boolean")

    def pair_ids(self, tokenizer: Any, pairs: list[tuple[str, str]], instruct: str | None) -> list[list[int]]:
        """Each (query, document) pair as token ids. Blocking (it tokenizes)."""
        if self.template is None:
            return [tokenizer(query, doc)["input_ids"] for query, doc in pairs]
        extra = {} if instruct is None else {"instruct": instruct, "instruction": instruct}
        prompts = []
        for query, doc in pairs:
            messages = [{"role": "query", "content": query}, {"role": "document", "content": doc}]
            text = tokenizer.apply_chat_template(messages, chat_template=self.template, tokenize=False,
                                                 add_generation_prompt=False, **extra)
            prompts.append(tokenizer.encode(text, add_special_tokens=False))
        return prompts

    def request(self, tokenizer: Any, call: RerankCall, lora_path: str | None = None) -> GenerateInput:
        """The call's requests: one per document, in order. Blocking (it tokenizes)."""
        self.check(call)
        return self.pairs_request(tokenizer, [(call.query, doc) for doc in call.documents], call.instruct, lora_path)

    def pairs_request(self, tokenizer: Any, pairs: list[tuple[str, str]], instruct: str | None = None,
                      lora_path: str | None = None) -> GenerateInput:
        """One request per (query, document) pair, in order. Blocking (it tokenizes)."""
        ids = self.pair_ids(tokenizer, pairs, instruct)
        if self.kind == "cross-encoder":
            return GenerateInput(input_ids=ids, embed=True, lora_path=lora_path)
        return GenerateInput(input_ids=ids, sampling_params=PROMPT_ONLY, return_logprob=True,
                             token_ids_logprob=list(self.yes_no), lora_path=lora_path)

    def score(self, result: dict[str, Any]) -> float:
        """One document's relevance in [0, 1] from its answer."""
        if self.kind == "cross-encoder":
            return sigmoid(result["embedding"][0])
        logprobs = next_token_logprobs(result)
        return softmax([logprobs[token] for token in self.yes_no])[0]  # p(yes) / (p(yes) + p(no))


def reranker_of(model_info: dict[str, Any], tokenizer: Any) -> Reranker:
    """How the served model reranks; RequestError (400) when it cannot."""
    template = getattr(tokenizer, "chat_template", None)
    template = template if is_reranker_template(template) else None
    labels = model_info.get("classifier_labels")
    if labels is not None:
        if len(labels) != 1:
            raise RequestError(f"reranking needs a classifier with one label (a relevance score); this one has "
                               f"{len(labels)}")
        return Reranker("cross-encoder", template)
    if model_info.get("is_generation", True) and template is not None:
        return Reranker("decoder", template, (_single_token(tokenizer, "yes"), _single_token(tokenizer, "no")))
    raise RequestError("this model does not rerank: serve a cross-encoder (a *ForSequenceClassification checkpoint "
                       "with one label) or a yes/no reranker with its reranker template (--chat-template, e.g. "
                       "Qwen3-Reranker's)")


def served_reranker(model_info: dict[str, Any], tokenizer: Any) -> Reranker | None:
    """How the served model reranks, or None when it does not (its rerank routes do not exist)."""
    try:
        return reranker_of(model_info, tokenizer)
    except (RequestError, ValueError):
        return None


def ranked(call: RerankCall, scores: list[float], meta: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """SGLang's /v1/rerank answer: ``{"score", "document", "index", "meta_info"}`` per document, best first (ties in
    document order), the first ``top_n`` (0 or None: all); ``document`` None unless ``return_documents``."""
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    if call.top_n:
        order = order[: call.top_n]
    return [{"score": scores[i], "document": call.documents[i] if call.return_documents else None, "index": i,
             "meta_info": meta[i] if meta is not None else None} for i in order]
