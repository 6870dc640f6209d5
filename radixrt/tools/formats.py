"""The tool-call format families and how a server picks one.

``FORMATS`` maps each family's name (hermes, llama3, mistral, pythonic) to its stateless ``ToolCallFormat``.
``choose_format`` takes ``--tool-call-parser`` (a family name or an SGLang/vLLM alias; None or "auto" reads
the chat template: ``<|python_start|>`` is pythonic, ``[TOOL_CALLS]`` is mistral, ``<|python_tag|>`` or an ``ipython`` header is llama3, anything
else hermes, which is also the fallback for templates without tool support). ``template_supports_tools``
says whether a Jinja chat template renders ``tools`` itself; ``messages_for_template`` (radixrt.tools.messages)
prepares OpenAI messages for it. Torch-free.
"""

from __future__ import annotations

import re

from radixrt.tools.format_base import ToolCallFormat
from radixrt.tools.hermes import Hermes
from radixrt.tools.llama3 import Llama3
from radixrt.tools.messages import messages_for_template
from radixrt.tools.mistral import Mistral
from radixrt.tools.pythonic import Pythonic

__all__ = ["FORMATS", "ToolCallFormat", "choose_format", "messages_for_template", "template_supports_tools"]

FORMATS: dict[str, ToolCallFormat] = {f.name: f for f in (Hermes(), Llama3(), Mistral(), Pythonic())}
ALIASES = {"qwen": "hermes", "qwen25": "hermes", "qwen3": "hermes", "llama3_json": "llama3", "llama": "llama3",
           "llama4": "pythonic", "llama4_pythonic": "pythonic"}

_TOOLS_WORD = re.compile(r"\btools\b")


def choose_format(parser_name: str | None, chat_template: str | None) -> ToolCallFormat:
    """The family for ``--tool-call-parser`` (None/"auto": from the chat template's source);
    ValueError for an unknown name."""
    if parser_name is not None and parser_name != "auto":
        key = ALIASES.get(parser_name, parser_name)
        if key not in FORMATS:
            raise ValueError(f"unknown tool-call parser {parser_name!r}; choose one of "
                             f"{', '.join(['auto', *FORMATS])}")
        return FORMATS[key]
    template = chat_template or ""
    if "<|python_start|>" in template:  # Llama 4
        return FORMATS["pythonic"]
    if "[TOOL_CALLS]" in template:
        return FORMATS["mistral"]
    if "<|python_tag|>" in template or "<|start_header_id|>ipython" in template:
        return FORMATS["llama3"]
    return FORMATS["hermes"]


def template_supports_tools(chat_template: str | None) -> bool:
    """Whether the Jinja chat template's source uses the ``tools`` variable."""
    return bool(chat_template) and _TOOLS_WORD.search(chat_template) is not None
