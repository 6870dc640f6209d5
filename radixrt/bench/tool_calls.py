"""How often tool calls come back valid: a fixed set of prompts and tools through the official ``openai`` client.

    radixrt bench tools [--num-prompts 50] [--tool-choice required] [--max-tokens 160] [--tool-call-parser P]

Starts ``radixrt serve`` twice on the default model (greedy, float32): with tool calls generated under each
tool's JSON schema (the default), then with ``--disable-tool-call-constraints``; ``--tool-call-parser`` picks
the format the model is asked to write (the server's flag; default: from the chat template, hermes here). Every prompt is asked twice
per server, as one answer and as a stream (whose deltas are put back together the way a client does). A
call is valid when its name is one of the tools and its arguments parse as JSON and validate against that
tool's schema; an answer is valid when it has at least one call and every call is valid.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "city name"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"]}}},
    {"type": "function", "function": {
        "name": "calculator", "description": "Evaluate an arithmetic expression such as 2 * (3 + 4).",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}},
    {"type": "function", "function": {
        "name": "search_documents", "description": "Search the local document set.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string"},
            "top_k": {"type": "integer", "minimum": 1, "maximum": 10}},
            "required": ["query", "top_k"]}}},
    {"type": "function", "function": {
        "name": "convert_currency", "description": "Convert an amount of money between currencies.",
        "parameters": {"type": "object", "properties": {
            "amount": {"type": "number", "minimum": 0},
            "from_currency": {"type": "string", "enum": ["USD", "EUR", "GBP", "JPY"]},
            "to_currency": {"type": "string", "enum": ["USD", "EUR", "GBP", "JPY"]}},
            "required": ["amount", "from_currency", "to_currency"]}}},
    {"type": "function", "function": {
        "name": "create_reminder", "description": "Create a reminder.",
        "parameters": {"type": "object", "properties": {
            "text": {"type": "string"},
            "minutes_from_now": {"type": "integer", "minimum": 1, "maximum": 10080},
            "urgent": {"type": "boolean"}},
            "required": ["text", "minutes_from_now", "urgent"]}}},
]

PROMPTS: list[str] = [
    "What's the weather like in Paris right now?",
    "Is it raining in Tokyo? Give me the temperature in fahrenheit.",
    "How warm is it in Buenos Aires today?",
    "Tell me the current weather in Oslo in celsius.",
    "Should I bring an umbrella in London this afternoon?",
    "What is the temperature in New York?",
    "Weather report for Cairo, please.",
    "How cold is it in Reykjavik?",
    "Check the weather in Sydney for me.",
    "Is it sunny in Madrid?",
    "What is 17 times 23?",
    "Compute (45 + 55) / 4.",
    "How much is 2 to the power of 10?",
    "Calculate 1234 minus 567.",
    "What's 15% of 240?",
    "Add 3.5 and 7.25.",
    "What is the square of 19?",
    "Divide 1000 by 8.",
    "Multiply 6 by 7 and then add 1.",
    "What is 99 + 1?",
    "Find documents about the radix tree prefix cache.",
    "Search my notes for the quarterly budget.",
    "Look up the top 3 documents on paged attention.",
    "Which documents mention the vacation policy?",
    "Search for anything about Python packaging.",
    "Find the 5 most relevant pages about continuous batching.",
    "Search the docs for the onboarding checklist.",
    "Are there documents about the Paris office?",
    "Search for the meeting notes from Monday.",
    "Find one document about the KV cache eviction policy.",
    "Convert 100 US dollars to euros.",
    "How many yen is 50 pounds?",
    "Change 250 EUR into USD.",
    "What is 1000 JPY in GBP?",
    "Convert 19.99 dollars to pounds.",
    "I have 75 euros; how much is that in yen?",
    "Exchange 500 GBP to EUR.",
    "How many dollars do I get for 3000 yen?",
    "Convert 1 euro to dollars.",
    "What is 12.5 pounds in euros?",
    "Remind me to call my mother in 30 minutes.",
    "Set an urgent reminder to submit the report in 2 hours.",
    "Remind me tomorrow to water the plants.",
    "Create a reminder to stretch in 45 minutes, not urgent.",
    "In 10 minutes remind me to check the oven, it's urgent!",
    "Remind me to buy milk in an hour.",
    "Set a reminder for the dentist appointment in 3 days.",
    "Remind me to reply to Sam's email in 20 minutes.",
    "Please remind me to take my medicine in 8 hours; urgent.",
    "Remind me to back up the laptop in a week.",
]


def _schemas() -> dict[str, dict]:
    return {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def call_problem(name: str | None, arguments: str | None, schemas: dict[str, dict] | None = None) -> str | None:
    """Why one call is invalid (None: valid)."""
    import jsonschema

    schemas = schemas if schemas is not None else _schemas()
    if name not in schemas:
        return f"unknown tool {name!r}"
    try:
        args = json.loads(arguments or "")
    except ValueError:
        return "arguments are not JSON"
    try:
        jsonschema.validate(args, schemas[name])
    except jsonschema.ValidationError as exc:
        return f"arguments break the schema: {exc.message}"
    return None


def answer_problem(calls: list[tuple[str | None, str | None]], schemas: dict[str, dict] | None = None) -> str | None:
    """Why one answer's calls are invalid (None: at least one call, all valid)."""
    if not calls:
        return "no tool call"
    for name, arguments in calls:
        problem = call_problem(name, arguments, schemas)
        if problem is not None:
            return problem
    return None


def ask(client, model: str, prompt: str, stream: bool, tool_choice: Any, max_tokens: int
        ) -> list[tuple[str | None, str | None]]:
    """One chat call; its tool calls as (name, arguments), a stream's deltas put together by index."""
    messages = [{"role": "user", "content": prompt}]
    common = dict(model=model, messages=messages, tools=TOOLS, tool_choice=tool_choice, max_tokens=max_tokens,
                  temperature=0)
    if not stream:
        msg = client.chat.completions.create(**common).choices[0].message
        return [(c.function.name, c.function.arguments) for c in msg.tool_calls or []]
    calls: dict[int, list] = {}
    for chunk in client.chat.completions.create(**common, stream=True):
        for choice in chunk.choices:
            for d in choice.delta.tool_calls or []:
                entry = calls.setdefault(d.index, [None, ""])
                if d.function is not None and d.function.name:
                    entry[0] = d.function.name
                if d.function is not None and d.function.arguments:
                    entry[1] += d.function.arguments
    return [(calls[i][0], calls[i][1]) for i in sorted(calls)]


def run_set(url: str, prompts: list[str], tool_choice: Any, max_tokens: int, concurrency: int = 8
            ) -> dict[str, Any]:
    """Every prompt as one answer and as a stream; counts of valid answers and the problems met."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    jobs = [(p, stream) for p in prompts for stream in (False, True)]
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        answers = list(pool.map(lambda job: ask(client, model, job[0], job[1], tool_choice, max_tokens), jobs))
    out: dict[str, Any] = {"seconds": round(time.perf_counter() - start, 1)}
    for stream in (False, True):
        problems = [answer_problem(calls) for (_, s), calls in zip(jobs, answers) if s == stream]
        key = "stream" if stream else "whole"
        out[key] = {"answers": len(problems), "valid": problems.count(None),
                    "problems": sorted({p for p in problems if p is not None})[:8]}
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=len(PROMPTS))
    p.add_argument("--tool-choice", default="required", help="required, auto, or a tool's name")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tool-call-parser", default="auto", help="the servers' --tool-call-parser")
    p.add_argument("--json", default=None, help="write the results to this file")


def run(args: argparse.Namespace) -> int:
    from radixrt.server.server_process import ServerProcess

    choice: Any = args.tool_choice
    if choice not in ("required", "auto", "none"):
        choice = {"type": "function", "function": {"name": choice}}
    prompts = PROMPTS[: args.num_prompts]
    results = {}
    for label, extra in (("constrained", []), ("unconstrained", ["--disable-tool-call-constraints"])):
        server = ServerProcess(["--dtype", args.dtype, "--log-interval", "0", "--tool-call-parser",
                                args.tool_call_parser, *extra]).start()
        try:
            results[label] = run_set(server.url, prompts, choice, args.max_tokens)
        finally:
            server.stop()
        r = results[label]
        print(f"{label:>13}: whole {r['whole']['valid']}/{r['whole']['answers']} valid, "
              f"stream {r['stream']['valid']}/{r['stream']['answers']} valid ({r['seconds']} s)"
              + (f"; problems: {r['whole']['problems'] + r['stream']['problems']}"
                 if r['whole']['problems'] or r['stream']['problems'] else ""), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tool_choice": args.tool_choice, "tool_call_parser": args.tool_call_parser,
                       "prompts": len(prompts), **results}, f, indent=1)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="radixrt bench tools", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
