"""Which model class serves which architecture (a config's ``architectures``)."""

from __future__ import annotations

from radixrt.model.gemma import Gemma3ForCausalLM
from radixrt.model.llama import ARCHITECTURES as LLAMA_ARCHITECTURES
from radixrt.model.llama import LlamaForCausalLM

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    **{name: LlamaForCausalLM for name in LLAMA_ARCHITECTURES},
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
}
SUPPORTED_ARCHITECTURES = tuple(MODEL_CLASSES)


def model_class(config) -> type[LlamaForCausalLM]:
    """The class of the first of the config's architectures radixrt serves; a ``ValueError`` where none is."""
    architectures = getattr(config, "architectures", None) or []
    for name in architectures:
        if name in MODEL_CLASSES:
            return MODEL_CLASSES[name]
    raise ValueError(f"architecture {architectures} is not supported; supported: {SUPPORTED_ARCHITECTURES}")
