"""Reasoning models' output: the reasoning block (``<think>...</think>``) apart from the answer. Torch-free."""

REASONING_FORMATS = ("deepseek-r1", "qwen3", "qwen3-thinking")
