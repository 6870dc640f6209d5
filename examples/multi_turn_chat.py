"""Multi-turn chat: a conversation kept in one program state, each assistant turn a `gen`.

Every turn re-sends the whole conversation; the radix cache already holds all but the newest turn.
Two conversations run at once with `run_batch`.

    python examples/multi_turn_chat.py [--url http://127.0.0.1:30000]
"""

from __future__ import annotations

import argparse

import radixrt as sgl

CONVERSATIONS = [
    ["What is the capital of France?", "What is a famous tower there?", "How tall is it?"],
    ["Name a primary color.", "Name another one.", "What do they make when mixed?"],
]


@sgl.function
def chat(s, turns):
    s += sgl.system("You are a helpful assistant. Answer in one short sentence.")
    for i, turn in enumerate(turns):
        s += sgl.user(turn)
        s += sgl.assistant(sgl.gen(f"answer_{i}", max_tokens=12, stop="\n"))


def main(backend=None, conversations=CONVERSATIONS):
    backend = backend or sgl.get_default_backend()
    states = chat.run_batch([{"turns": turns} for turns in conversations], backend=backend, temperature=0)
    for turns, state in zip(conversations, states):
        if state.error() is not None:
            raise state.error()
        for message in state.messages():
            print(f"{message['role']:>9}: {message['content']}")
        cached = [state.get_meta_info(f"answer_{i}")["cached_tokens"] for i in range(len(turns))]
        print(f"(prompt tokens found in the cache, turn by turn: {cached})\n")
    return states


def backend_from_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running `radixrt serve` (default: the in-process engine)")
    args = parser.parse_args(argv)
    return sgl.RuntimeEndpoint(args.url) if args.url else sgl.Engine()


if __name__ == "__main__":
    sgl.set_default_backend(backend_from_args())
    main()
