"""Role markers for system/user/assistant.

The runtime derives the markers from the model's own tokenizer chat template and reports them in
`get_model_info()["chat_template"]`; `ChatTemplate.from_model_info` builds the template from that.
The named templates below are the fallback when a backend reports none (and what the OpenAI
backend uses to lay out text, since a chat server applies its own template to the messages).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple


@dataclass
class ChatTemplate:
    name: str
    default_system_prompt: Optional[str]
    role_prefix_and_suffix: Dict[str, Tuple[str, str]]
    stop_str: Sequence[str] = ()
    image_token: str = "<image>"
    # "plain", or "llama2" (the system block sits inside the first [INST]).
    style: str = "plain"

    def get_prefix_and_suffix(self, role: str, hist_messages: List[Dict[str, Any]]) -> Tuple[str, str]:
        prefix, suffix = self.role_prefix_and_suffix.get(role, ("", ""))
        if self.style == "llama2":
            if role == "system" and not hist_messages:
                user_prefix, _ = self.role_prefix_and_suffix.get("user", ("", ""))
                return user_prefix + prefix, suffix
            if role == "user" and len(hist_messages) == 1 and hist_messages[0]["role"] == "system":
                return "", suffix
        return prefix, suffix

    def get_prompt(self, messages: List[Dict[str, Any]]) -> str:
        """Render OpenAI-style messages as text with this template's markers."""
        out = ""
        for i, message in enumerate(messages):
            content = message["content"]
            if message["role"] == "system" and content is None:
                content = self.default_system_prompt
                if content is None:
                    continue
            prefix, suffix = self.get_prefix_and_suffix(message["role"], messages[:i])
            out += f"{prefix}{content}{suffix}"
        return out

    @classmethod
    def from_model_info(cls, info: Mapping[str, Any]) -> "ChatTemplate":
        """The template a runtime reports (`get_model_info()`); a named fallback matched on the
        model path when it reports none."""
        spec = info.get("chat_template") if isinstance(info, Mapping) else None
        if isinstance(spec, Mapping) and spec.get("role_prefix_and_suffix"):
            roles = {
                role: (str(pair[0] or ""), str(pair[1] or ""))
                for role, pair in spec["role_prefix_and_suffix"].items()
            }
            return cls(
                name=str(spec.get("name") or info.get("model_path") or "model"),
                default_system_prompt=spec.get("default_system_prompt"),
                role_prefix_and_suffix=roles,
                stop_str=tuple(spec.get("stop_str") or ()),
                image_token=spec.get("image_token") or "<image>",
                style=spec.get("style") or "plain",
            )
        if isinstance(spec, str) and spec in _REGISTRY:
            return _REGISTRY[spec]
        return get_chat_template_by_model_path(str(info.get("model_path") or ""))


_REGISTRY: Dict[str, ChatTemplate] = {}


def register_chat_template(template: ChatTemplate) -> None:
    _REGISTRY[template.name] = template


def get_chat_template(name: str) -> ChatTemplate:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown chat template {name!r}; known: {sorted(_REGISTRY)}") from None


def get_chat_template_by_model_path(model_path: str) -> ChatTemplate:
    path = model_path.lower()
    if "llama-3" in path and "instruct" in path:
        return _REGISTRY["llama-3-instruct"]
    if "llama-2" in path and "chat" in path:
        return _REGISTRY["llama-2-chat"]
    if "qwen" in path and ("instruct" in path or "chat" in path):
        return _REGISTRY["qwen"]
    if "gemma" in path and "it" in path.split("-"):
        return _REGISTRY["gemma-it"]
    if any(k in path for k in ("smollm", "hermes", "chatml")) and ("instruct" in path or "chat" in path):
        return _REGISTRY["chatml"]
    return _REGISTRY["default"]


def _chatml(name: str, default_system: Optional[str] = None) -> ChatTemplate:
    return ChatTemplate(
        name=name,
        default_system_prompt=default_system,
        role_prefix_and_suffix={
            "system": ("<|im_start|>system\n", "<|im_end|>\n"),
            "user": ("<|im_start|>user\n", "<|im_end|>\n"),
            "assistant": ("<|im_start|>assistant\n", "<|im_end|>\n"),
        },
        stop_str=("<|im_end|>",),
    )


for _t in (
    ChatTemplate(
        name="default",
        default_system_prompt=None,
        role_prefix_and_suffix={
            "system": ("SYSTEM:", "\n"),
            "user": ("USER:", "\n"),
            "assistant": ("ASSISTANT:", "\n"),
        },
    ),
    _chatml("chatml"),
    _chatml("qwen", "You are a helpful assistant."),
    ChatTemplate(
        name="llama-3-instruct",
        default_system_prompt=None,
        role_prefix_and_suffix={
            r: (f"<|start_header_id|>{r}<|end_header_id|>\n\n", "<|eot_id|>")
            for r in ("system", "user", "assistant")
        },
        stop_str=("<|eot_id|>",),
    ),
    ChatTemplate(
        name="llama-2-chat",
        default_system_prompt=None,
        role_prefix_and_suffix={
            "system": ("<<SYS>>\n", "\n<</SYS>>\n\n"),
            "user": ("[INST] ", " [/INST]"),
            "assistant": ("", " </s><s>"),
        },
        style="llama2",
    ),
    ChatTemplate(
        name="gemma-it",
        default_system_prompt=None,
        role_prefix_and_suffix={
            "system": ("", ""),
            "user": ("<start_of_turn>user\n", "<end_of_turn>\n"),
            "assistant": ("<start_of_turn>model\n", "<end_of_turn>\n"),
        },
    ),
):
    register_chat_template(_t)
