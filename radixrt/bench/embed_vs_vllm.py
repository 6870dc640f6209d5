"""`radixrt bench embed`: embedding throughput, radixrt next to vLLM's pooling runner, the same token ids, alternating.

    radixrt bench embed --vllm-python /tmp/radixrt-peers/venv-vllm/bin/python [--model M] [--rounds 2]

Both engines serve the model for embeddings only (radixrt: ``is_embedding``; vLLM: ``runner="pooling"``), pool as
the checkpoint says (without sentence-transformers files: the last token, normalized, for both) and keep their
prefix caches on. Every engine run is a fresh subprocess (`embed_run.py`; vLLM's by file path under its own
python, as `radixrt bench vllm` runs it). The workloads (ids from vs_vllm's seeded words, the model's tokenizer):
  queries: 256 search queries of 16 tokens behind one instruction (Qwen3-Embedding's retrieval prompt), as a
           retrieval service embeds them;
  documents: 64 distinct passages of 400 tokens, as an indexing job does;
  rerank: 8 queries of 16 tokens, each against the same 32 passages of 200 tokens, as (query, passage) pairs through
          a cross-encoder (the model's decoder with a seeded one-label score head, `save_cross_encoder`; radixrt
          serves it as a classifier, vLLM's pooling runner classifies with it), as a reranking service scores a
          retriever's candidates.
Each row: prompt tokens a second of each engine (best of the rounds), radixrt / vLLM, and how the two engines agree:
the smallest cosine between their vectors of the first prompts (the same model, so near 1 up to the dtype's
rounding), or the largest difference between their first pairs' relevances.
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import tempfile
from pathlib import Path

from radixrt.bench.embed_run import RERANK_WORKLOADS
from radixrt.bench.vs_vllm import ids_exact, machine_line, resolve_dtype, run_engine, tokenizer_encoder, vllm_env

EMBED_RUN = Path(__file__).with_name("embed_run.py")
INSTRUCTION = ("Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:")
QUERIES, QUERY_LEN = 256, 16
DOCUMENTS, DOCUMENT_LEN = 64, 400
RERANK_QUERIES, RERANK_PASSAGES, PASSAGE_LEN = 8, 32, 200


def build_workloads(encode) -> dict[str, list[list[int]]]:
    instruction = encode(INSTRUCTION)
    queries = [instruction + ids_exact(encode, random.Random(9000 + i), QUERY_LEN, "")
               for i in range(QUERIES)]
    documents = [ids_exact(encode, random.Random(19000 + i), DOCUMENT_LEN, f"Passage {i}:") for i in range(DOCUMENTS)]
    passages = [ids_exact(encode, random.Random(29000 + i), PASSAGE_LEN, f"Passage {i}:")
                for i in range(RERANK_PASSAGES)]
    rerank = [ids_exact(encode, random.Random(39000 + q), QUERY_LEN, "Query:") + passage
              for q in range(RERANK_QUERIES) for passage in passages]  # this tokenizer's pair: the two texts' ids
    return {"queries": queries, "documents": documents, "rerank": rerank}


def save_cross_encoder(model: str, folder: Path) -> str:
    """A one-label ``LlamaForSequenceClassification`` in ``folder``: ``model``'s decoder and a seeded random score
    head (no reranker of this size and family exists offline; the work per pair is a real cross-encoder's)."""
    import shutil

    import torch
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    classifier = AutoModelForSequenceClassification.from_pretrained(model, num_labels=1, dtype=torch.bfloat16)
    classifier.config.pad_token_id = classifier.config.eos_token_id
    classifier.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (Path(model) / name).is_file():
            shutil.copy(Path(model) / name, folder / name)
    return str(folder)


def min_cosine(a: list[list[float]], b: list[list[float]]) -> float:
    def cos(x: list[float], y: list[float]) -> float:
        return sum(p * q for p, q in zip(x, y)) / math.sqrt(sum(p * p for p in x) * sum(q * q for q in y))

    return min(cos(x, y) for x, y in zip(a, b))


def agreement(name: str, a: list[list[float]], b: list[list[float]]) -> str:
    """The smallest cosine between two engines' vectors, or for a reranking workload the largest difference of
    their relevances."""
    if name in RERANK_WORKLOADS:
        return f"max |diff| {max(abs(x[0] - y[0]) for x, y in zip(a, b)):.5f}"
    return f"min cosine {min_cosine(a, b):.5f}"


def add_embed_parser(sub) -> None:
    from radixrt.server_args import DEFAULT_MODEL

    p = sub.add_parser("embed", help="embedding throughput next to vLLM's pooling runner, engines alternating")
    p.add_argument("--vllm-python", required=True, help="the python of a venv with vLLM installed")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="auto", help="auto: what radixrt picks on this CPU, for both engines")
    p.add_argument("--workloads", default="queries,documents,rerank")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--timeout", type=float, default=1200.0)
    p.set_defaults(run=run_embed_bench)


def run_embed_bench(args) -> int:
    from radixrt.model.weights import resolve_model_path

    model = str(resolve_model_path(args.model))
    dtype = resolve_dtype(args.dtype)
    machine = machine_line()
    print(machine, flush=True)
    names = [n for n in args.workloads.split(",") if n]
    best: dict[tuple[str, str], dict] = {}
    with tempfile.TemporaryDirectory(prefix="radixrt-embed-") as tmp:
        path = str(Path(tmp) / "workload.json")
        with open(path, "w") as f:
            json.dump(build_workloads(tokenizer_encoder(model)), f)
        cross_encoder = save_cross_encoder(model, Path(tmp) / "cross-encoder") if any(
            n in RERANK_WORKLOADS for n in names) else None
        slots = [("radixrt", [sys.executable, "-m", "radixrt.bench.embed_run", "radixrt"], dict(os.environ)),
                 ("vllm", [args.vllm_python, str(EMBED_RUN), "vllm"], vllm_env())]
        for round_index in range(1, args.rounds + 1):
            for name in names:
                for slot, cmd, env in slots:
                    print(f"[round {round_index}] {slot} {name} {dtype}", file=sys.stderr, flush=True)
                    # vLLM 0.32's CPU build may abort shutting down ("terminate called without an active
                    # exception") after printing its result, which stands
                    served = cross_encoder if name in RERANK_WORKLOADS else model
                    result = run_engine([*cmd, served, path, name, dtype], env, args.timeout, result_despite_exit=True)
                    if result is None:
                        print(f"{slot} failed on {name}", file=sys.stderr)
                        return 1
                    print("RESULT_JSON", json.dumps({k: v for k, v in result.items() if k != "vectors"}), flush=True)
                    if (slot, name) not in best or result["prompts_s"] > best[slot, name]["prompts_s"]:
                        best[slot, name] = result
    print(machine)
    print(f"{'workload':10} {'dtype':9} {'radixrt tok/s':>13} {'vLLM tok/s':>10} {'ratio':>6} "
          f"{'radixrt cached':>14}  agreement")
    for name in names:  # prompt tokens a second (the same prompts for both: the ratio of prompts a second too)
        ours, peer = best["radixrt", name], best["vllm", name]
        print(f"{name:10} {dtype:9} {ours['prompt_tok_s']:13.1f} {peer['prompt_tok_s']:10.1f} "
              f"{ours['prompt_tok_s'] / peer['prompt_tok_s']:6.2f} {ours['cached_prompt_tokens']!s:>14} "
              f"  {agreement(name, ours['vectors'], peer['vectors'])}")
    return 0
