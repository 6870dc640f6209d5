"""The speculative-decoding benchmark's workloads, for any engine: what its programs send and how they go on.

    /path/to/peer-venv/bin/python /path/to/spec_workloads.py vllm MODEL_DIR ARGS_JSON   (one RESULT_JSON line)

Like ``peer_run``, this file runs by path under another engine's python: it imports nothing of radixrt, and an
engine is two callables, ``generate(prompts, params) -> [(output_ids, text)]`` (params: max_new_tokens,
temperature, seeds) and ``chat(messages) -> prompt text`` (the model's chat template).

Each workload runs ``batch`` programs side by side, round by round (a round's prompts go in one call):

- ``extraction``: copy the fields of an invoice into JSON (one round; greedy);
- ``extraction-series``: the same program over three invoices in turn, each a conversation of its own (three
  rounds; greedy): how an extraction pipeline runs over a set of documents, where a later invoice's JSON can be
  drafted from what the earlier ones' made (its keys, its layout), text no prompt holds;
- ``agent``: a tool-using loop: each round returns a tool result (a JSON listing, then records) and asks for a
  report of it, over the conversation so far (three rounds; greedy);
- ``refine``: self-refinement: write a description from facts, then rewrite it twice, keeping the facts
  (three rounds; greedy);
- ``random``: a continuation of random words, sampled at temperature 1 with a seed per program: text no earlier
  text predicts (one round).
"""

from __future__ import annotations

import json
import random
import sys
import time
from typing import Callable

WORKLOADS = ("extraction", "extraction-series", "agent", "refine", "random")
Generate = Callable[[list[str], dict], list[tuple[list[int], str]]]
Chat = Callable[[list[dict]], str]

SELLERS = ("Northwind Traders", "Blue Fin Cafe", "Harbour Supplies", "Kestrel Paper Co", "Alder & Sons")
STREETS = ("Harbour Road", "Mill Lane", "Station Street", "Quay Parade", "Orchard Way")
TOWNS = ("Portsmouth", "Leeds", "Bristol", "Norwich", "Carlisle")
ITEMS = ("coffee beans", "paper cups", "oat milk", "napkins", "tea leaves", "sugar sachets")
WORDS = ("river stone lamp quiet ember violet orbit marble cedar lantern velvet harbor thistle copper meadow "
         "signal pepper winter saddle hollow candle bramble falcon meadow tundra ribbon canyon").split()


def invoice(rng: random.Random) -> str:
    seller, buyer = rng.sample(SELLERS, 2)
    lines = [f"{rng.randint(2, 40)} x {item} at {rng.randint(1, 30)}.{rng.randint(0, 99):02d}"
             for item in rng.sample(ITEMS, 3)]
    return (f"Invoice {rng.randint(1000, 9999)} was issued by {seller}, {rng.randint(1, 99)} {rng.choice(STREETS)}, "
            f"{rng.choice(TOWNS)}, to {buyer} on {rng.randint(1, 28)} March 2024. It lists "
            f"{'; '.join(lines)}. Payment is due within {rng.choice((14, 30, 60))} days to account "
            f"GB{rng.randint(10, 99)} NWBK {rng.randint(1000, 9999)} {rng.randint(1000, 9999)} {rng.randint(10, 99)}.")


def tool_results(rng: random.Random) -> list[str]:
    files = [{"path": f"src/{name}.py", "lines": rng.randint(40, 900), "owner": rng.choice(("ana", "bo", "cy"))}
             for name in rng.sample(("parser", "scheduler", "cache", "server", "client", "metrics", "tokens"), 5)]
    records = [{"path": f["path"], "last_commit": f"{rng.randint(1, 28)} Nov 2024", "tests": rng.randint(0, 40)}
               for f in files]
    failing = [{"test": f"tests/test_{rng.choice(('cache', 'server', 'tokens'))}.py::test_{i}",
                "error": rng.choice(("TimeoutError", "AssertionError", "KeyError"))} for i in range(4)]
    return [json.dumps({"files": files}), json.dumps({"history": records}), json.dumps({"failures": failing})]


def run_workload(name: str, generate: Generate, chat: Chat, batch: int, max_new_tokens: int, seed: int = 0
                 ) -> list[list[int]]:
    """Every output of the workload's rounds, program by program and round by round."""
    rng = random.Random(f"{name}-{seed}")
    greedy = {"max_new_tokens": max_new_tokens, "temperature": 0.0}
    outputs: list[list[int]] = []
    if name in ("extraction", "extraction-series"):
        for _ in range(3 if name == "extraction-series" else 1):
            prompts = [chat([{"role": "user", "content": "Extract the seller, buyer, date, items and account of this "
                                                         f"invoice as JSON.\n\n{invoice(rng)}"}]) for _ in range(batch)]
            outputs += [ids for ids, _ in generate(prompts, greedy)]
        return outputs
    if name == "random":
        prompts = [chat([{"role": "user", "content": "Continue this list of words: "
                                                     + " ".join(rng.choice(WORDS) for _ in range(40))}])
                   for _ in range(batch)]
        sampled = {"max_new_tokens": max_new_tokens, "temperature": 1.0, "seeds": list(range(batch))}
        return [ids for ids, _ in generate(prompts, sampled)]
    if name == "agent":
        results = [tool_results(rng) for _ in range(batch)]
        asks = ("List every file with its owner and line count.", "Report each file's last commit and tests.",
                "List each failing test with its error.")
        conversations = [[{"role": "user", "content": "Find out which files of the repository need attention."},
                          {"role": "assistant", "content": '{"tool": "list_files"}'}] for _ in range(batch)]
        turns = [[f"Tool result: {results[b][r]}\n\n{asks[r]}" for b in range(batch)] for r in range(3)]
    elif name == "refine":
        facts = [invoice(rng) for _ in range(batch)]
        conversations = [[] for _ in range(batch)]
        first = [f"Write a short email asking for payment of this invoice:\n\n{f}" for f in facts]
        again = "Rewrite the email to be more polite. Keep every name, number and date exactly as it is."
        turns = [first, [again] * batch, [again] * batch]
    else:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
    for round_messages in turns:
        for conversation, content in zip(conversations, round_messages):
            conversation.append({"role": "user", "content": content})
        replies = generate([chat(c) for c in conversations], greedy)
        for conversation, (ids, text) in zip(conversations, replies):
            conversation.append({"role": "assistant", "content": text})
            outputs.append(ids)
    return outputs


def vllm_engine(model: str, dtype: str, speculative: dict | None, max_num_seqs: int):
    import os

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    from vllm import LLM

    return LLM(model=model, dtype=dtype, max_model_len=4096, max_num_seqs=max_num_seqs, seed=0,
               speculative_config=speculative)


def vllm_calls(llm) -> tuple[Generate, Chat]:
    from vllm import SamplingParams

    tokenizer = llm.get_tokenizer()

    def generate(prompts: list[str], params: dict) -> list[tuple[list[int], str]]:
        seeds = params.get("seeds") or [None] * len(prompts)
        sampling = [SamplingParams(max_tokens=params["max_new_tokens"], temperature=params["temperature"], seed=s)
                    for s in seeds]
        outs = llm.generate(prompts, sampling, use_tqdm=False)
        return [(list(o.outputs[0].token_ids), o.outputs[0].text) for o in outs]

    def chat(messages: list[dict]) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    return generate, chat


def vllm_methods(num_draft_tokens: int) -> dict[str, dict | None]:
    """vLLM's engines: no speculation, n-gram prompt lookup, and suffix decoding (Arctic Inference's suffix trees
    over the prompt and every earlier output, with its own adaptive draft length; its defaults) where the
    ``arctic_inference`` package is installed."""
    methods: dict[str, dict | None] = {
        "off": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": num_draft_tokens, "prompt_lookup_max": 4,
                  "prompt_lookup_min": 1}}
    try:
        import arctic_inference  # noqa: F401
    except ImportError:
        return methods
    methods["suffix"] = {"method": "suffix"}
    return methods


def vllm_main(model: str, args: dict) -> None:
    """Each workload and batch size through each of vLLM's methods, alternating (one engine each). With
    ``requests_per_slot`` above 1, each run sends that many programs per slot of the batch and each batch size gets
    engines of its own that run at most ``batch`` requests at once (``max_num_seqs``)."""
    per_slot = args.get("requests_per_slot", 1)
    methods = vllm_methods(args["num_draft_tokens"])
    rows = []
    for slots in ([[b] for b in args["batch_sizes"]] if per_slot > 1 else [args["batch_sizes"]]):
        engines = {name: vllm_engine(model, args["dtype"], config, max(slots) if per_slot > 1 else 16)
                   for name, config in methods.items()}
        calls = {name: vllm_calls(llm) for name, llm in engines.items()}
        for name in args["workloads"]:
            for batch in slots:
                for method in calls:  # warm-up (at full length where radixrt's history is warm too)
                    run_workload(name, *calls[method], batch, args["max_new_tokens"] if args.get("warm") else 4,
                                 seed=-1)
                for repeat in range(args["repeats"]):
                    for method in calls:
                        started = time.perf_counter()
                        outs = run_workload(name, *calls[method], batch * per_slot, args["max_new_tokens"],
                                            seed=repeat)
                        seconds = time.perf_counter() - started
                        rows.append(dict(workload=name, batch=batch, method=method, repeat=repeat, seconds=seconds,
                                         tokens=sum(len(o) for o in outs)))
        for llm in engines.values():  # before the next batch size's engines take their memory
            llm.llm_engine.engine_core.shutdown()
        del engines, calls
    print("RESULT_JSON " + json.dumps(rows), flush=True)

if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "vllm":
        sys.exit(__doc__)
    vllm_main(sys.argv[2], json.loads(sys.argv[3]))
