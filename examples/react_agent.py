"""A ReAct-style agent: the model thinks, picks a tool with `select`, writes the tool's argument
(a `gen` that stops at "]"), and the program runs the tool in Python and appends the observation,
until the model selects "finish" or the step budget runs out.

The program runs in a session (`backend.with_sessions()`): the server keeps the agent's context pinned in its
prefix cache between steps, so each step's prompt is served from the cache even when other traffic fills the
KV pool; the session closes when the program ends. `--no-sessions` runs without one (same output).

    python examples/react_agent.py [--url http://127.0.0.1:30000]
"""

from __future__ import annotations

import argparse
import ast
import operator

import radixrt as sgl

FACTS = {
    "france": "France is a country in Europe. Its capital is Paris. Population: 68 million.",
    "paris": "Paris is the capital of France. Population: 2.1 million.",
    "japan": "Japan is an island country in Asia. Its capital is Tokyo. Population: 125 million.",
    "tokyo": "Tokyo is the capital of Japan. Population: 14 million.",
}

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculate(expression: str) -> str:
    """Arithmetic on numbers with + - * / only (no eval)."""

    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ValueError("not arithmetic")

    try:
        return str(ev(ast.parse(expression.strip(), mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError):
        return f"cannot calculate {expression.strip()!r}"


def search(query: str) -> str:
    words = [w.strip(".,?!").lower() for w in query.split()]
    for w in words:
        if w in FACTS:
            return FACTS[w]
    return f"no result for {query.strip()!r}"


TOOLS = {"search": search, "calculate": calculate}
ACTIONS = ["search", "calculate", "finish"]

INSTRUCTIONS = """Solve the question with steps of Thought, Action and Observation. Action is one of:
search[topic] looks the topic up, calculate[expression] does arithmetic, finish[answer] gives the answer.

Question: What is the capital of Japan?
Thought 1: I need to look up Japan.
Action 1: search[Japan]
Observation 1: Japan is an island country in Asia. Its capital is Tokyo. Population: 125 million.
Thought 2: The capital of Japan is Tokyo.
Action 2: finish[Tokyo]

"""


@sgl.function
def react(s, question, max_steps=3):
    s += INSTRUCTIONS + "Question: " + question + "\n"
    for i in range(1, max_steps + 1):
        s += f"Thought {i}:" + sgl.gen(f"thought_{i}", max_tokens=16, stop=["\n", "Action"]) + "\n"
        s += f"Action {i}: " + sgl.select(f"action_{i}", choices=ACTIONS)
        s += "[" + sgl.gen(f"arg_{i}", max_tokens=10, stop=["]", "\n"]) + "]\n"
        action, arg = s[f"action_{i}"], s[f"arg_{i}"]  # reading waits for the model
        if action == "finish":
            s["answer"] = arg.strip()
            return i
        observation = TOOLS[action](arg)
        s[f"observation_{i}"] = observation
        s += f"Observation {i}: {observation}\n"
    return max_steps


def main(backend=None, question="What is the population of France?", use_sessions=True):
    backend = backend or sgl.get_default_backend()
    if use_sessions and hasattr(backend, "with_sessions"):  # the native backends (RuntimeEndpoint, EngineBackend)
        backend = backend.with_sessions()
    state = react.run(question=question, backend=backend, temperature=0)
    if state.error() is not None:
        raise state.error()
    print(state.text()[len(INSTRUCTIONS):])
    print(f"steps: {state.ret_value}; answer: {state['answer'] if 'answer' in state else '(no finish)'}")
    return state


def backend_from_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running `radixrt serve` (default: the in-process engine)")
    parser.add_argument("--no-sessions", action="store_true", help="run without a session")
    args = parser.parse_args(argv)
    return (sgl.RuntimeEndpoint(args.url) if args.url else sgl.Engine()), not args.no_sessions


if __name__ == "__main__":
    backend, use_sessions = backend_from_args()
    sgl.set_default_backend(backend)
    main(use_sessions=use_sessions)
