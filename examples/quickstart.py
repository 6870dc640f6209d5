"""The main job of `make demo`: greedy answers to a few chat prompts on the default model."""

from radixrt.cli import main

if __name__ == "__main__":
    main([
        "generate",
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "Give me three tips for learning to code.",
        "--max-new-tokens", "48",
    ])
