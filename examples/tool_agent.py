"""A tool-calling agent on the official `openai` client against `radixrt serve`.

The model gets two real local tools, a calculator and a search over a small document set, and the loop
runs each call it makes and sends the result back as a `tool` message, until the model answers in text
(or the step budget runs out; then it is asked to answer without tools). The first turn uses
tool_choice="required", so the agent starts by looking something up; radixrt generates every call's
arguments under the tool's JSON schema, so each one parses, even from a small model.

The loop runs in a session (SGLang's /open_session and ``session_params``, passed through the client's
``extra_body``): the server keeps the conversation's KV pages pinned between turns, so each turn's resent
history is read from the cache even when other requests fill the server's memory while a tool runs.

    python examples/tool_agent.py [--url http://127.0.0.1:30000] [--question "..."]

Without --url it starts a server on the default model (sgl.Runtime) and stops it at the end.
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import re
from typing import Any

DOCUMENTS = {
    "radix-cache": "radixrt keeps token prefixes in a radix tree; requests that share a prefix reuse its KV pages.",
    "paged-attention": "KV memory is split into fixed-size pages allocated on demand and shared across requests.",
    "tool-calling": "Tool calls are generated under each tool's JSON schema, so their arguments always parse.",
    "eiffel-tower": "The Eiffel Tower in Paris is 330 metres tall and was completed in 1889.",
    "mount-everest": "Mount Everest is 8849 metres high, the highest mountain above sea level.",
}

TOOLS = [
    {"type": "function", "function": {
        "name": "calculator", "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}},
    {"type": "function", "function": {
        "name": "search", "description": "Search the local documents; returns the best matching ones.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}},
]

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculator(expression: str) -> str:
    """Arithmetic only (no eval): numbers, + - * /, unary minus, parentheses."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ValueError("not arithmetic")

    try:
        return str(ev(ast.parse(expression.strip(), mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError) as exc:
        return f"error: {exc}"


def search(query: str, top_k: int = 2) -> str:
    """Documents ranked by how many of the query's words they contain."""
    words = set(re.findall(r"[a-z0-9]+", query.lower()))
    scored = sorted(DOCUMENTS.items(), key=lambda kv: -len(words & set(re.findall(r"[a-z0-9]+", kv[1].lower()))))
    return json.dumps([{"id": k, "text": v} for k, v in scored[:top_k]])


LOCAL_TOOLS = {"calculator": calculator, "search": search}


def run_tool(name: str, arguments: str) -> str:
    try:
        args = json.loads(arguments)
        return str(LOCAL_TOOLS[name](**args))
    except (KeyError, TypeError, ValueError) as exc:
        return f"error: cannot run {name}({arguments}): {exc}"


def agent(client: Any, model: str, question: str, max_steps: int = 3, max_tokens: int = 160,
          session_id: str | None = None) -> dict[str, Any]:
    """The loop; returns the answer, the calls made (name, arguments, result) and the conversation."""
    extra = {"session_params": {"id": session_id}} if session_id else None
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a helpful assistant. Use the tools to find facts and compute."},
        {"role": "user", "content": question},
    ]
    calls: list[dict[str, str]] = []
    for step in range(max_steps):
        reply = client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, tool_choice="required" if step == 0 else "auto",
            temperature=0, max_tokens=max_tokens, extra_body=extra).choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            return {"answer": reply.content or "", "calls": calls, "messages": messages}
        for call in reply.tool_calls:
            result = run_tool(call.function.name, call.function.arguments)
            calls.append({"name": call.function.name, "arguments": call.function.arguments, "result": result})
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    final = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=max_tokens,
        extra_body=extra).choices[0].message
    messages.append(final.model_dump(exclude_none=True))
    return {"answer": final.content or "", "calls": calls, "messages": messages}


def main(url: str | None = None, question: str = "How tall is the Eiffel Tower in feet? One metre is 3.28 feet."
         ) -> dict[str, Any]:
    import httpx
    import openai

    runtime = None
    if url is None:
        import radixrt as sgl

        runtime = sgl.Runtime()
        url = runtime.url
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        model = client.models.list().data[0].id
        session_id = httpx.post(url + "/open_session", json={}).json()
        try:
            result = agent(client, model, question, session_id=session_id)
        finally:
            httpx.post(url + "/close_session", json={"session_id": session_id})
    finally:
        if runtime is not None:
            runtime.shutdown()
    for call in result["calls"]:
        print(f"called {call['name']}({call['arguments']}) -> {call['result'][:100]}")
    print("answer:", result["answer"])
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", default=None, help="a running radixrt serve (default: start one)")
    parser.add_argument("--question", default="How tall is the Eiffel Tower in feet? One metre is 3.28 feet.")
    cli = parser.parse_args()
    main(cli.url, cli.question)
