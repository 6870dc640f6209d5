"""Tokenizer loading, chat templates and the set of ids that end generation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def load_tokenizer(model_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def eos_token_ids(model_path: Path, tokenizer) -> set[int]:
    """Ids that end a generation: the generation config's eos ids plus the tokenizer's eos token."""
    ids: set[int] = set()
    generation_config = Path(model_path) / "generation_config.json"
    if generation_config.is_file():
        eos = json.loads(generation_config.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def apply_chat_template(tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
    if not tokenizer.chat_template:
        raise ValueError("this model's tokenizer has no chat template")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return tokenizer.encode(text, add_special_tokens=False)
