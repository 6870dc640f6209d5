"""Tokenizer loading, chat templates and the set of ids that end generation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def load_tokenizer(model_path: Path | str, chat_template: str | None = None):
    """The tokenizer in ``model_path``; ``chat_template``: a Jinja template file that replaces its own."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if chat_template is not None:
        tokenizer.chat_template = read_chat_template(chat_template)
    return tokenizer


def read_chat_template(path: str) -> str:
    """The Jinja text of a chat template file (``--chat-template``); ValueError naming what is wrong."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"--chat-template {path!r} is not a file (radixrt takes a Jinja template file)")
    text = file.read_text()
    if file.suffix == ".json":  # a tokenizer_config.json-like file holding the template
        text = json.loads(text).get("chat_template") or ""
    if not text.strip():
        raise ValueError(f"--chat-template {path!r} holds no template")
    return text


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


def apply_chat_template(tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                        tools: list[dict[str, Any]] | None = None,
                        template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """``tools``: OpenAI tool definitions for a template that renders them (transformers' ``tools=``);
    ``template_kwargs``: more variables for the template (a request's ``chat_template_kwargs``)."""
    if not tokenizer.chat_template:
        raise ValueError("this model's tokenizer has no chat template")
    extra = {**(template_kwargs or {}), **({"tools": tools} if tools else {})}
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **extra)
    return tokenizer.encode(text, add_special_tokens=False)


def chat_template_info(tokenizer) -> dict[str, Any] | None:
    """The chat template as role markers, for clients that build prompts as text (the DSL).

    Renders conversations with sentinel contents and splits the text around them. Returns
    ``{"default_system_prompt", "role_prefix_and_suffix": {role: [prefix, suffix]}, "stop_str"}``.
    """
    if not tokenizer.chat_template:
        return None
    try:
        return _role_markers(tokenizer)
    except Exception:  # a template that cannot render these turns (a reranker's, one refusing a system turn)
        return None


def _role_markers(tokenizer) -> dict[str, Any] | None:
    marks = {"system": "RADIXRT_SYSTEM_7f3", "user": "RADIXRT_USER_7f3", "assistant": "RADIXRT_ASSISTANT_7f3"}

    def render(messages: list[dict[str, str]]) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)

    conversation = [{"role": role, "content": mark} for role, mark in marks.items()]
    roles: dict[str, list[str]] = {}
    previous = ""
    for i, (role, mark) in enumerate(marks.items()):
        text = render(conversation[: i + 1])
        if not text.startswith(previous):
            return None  # the template rewrites earlier turns; role markers cannot describe it
        added = text[len(previous):]
        prefix, _, suffix = added.partition(mark)
        roles[role] = [prefix, suffix]
        previous = text
    default_system = None
    user_only = render([{"role": "user", "content": marks["user"]}])
    system_prefix, system_suffix = roles["system"]
    if user_only.startswith(system_prefix) and system_prefix:
        start = len(system_prefix)
        end = user_only.find(system_suffix, start)
        if end > start:
            default_system = user_only[start:end]
    stop = roles["assistant"][1].strip()
    return {"default_system_prompt": default_system, "role_prefix_and_suffix": roles,
            "stop_str": [stop] if stop else []}
