"""Which model class serves which architecture (a config's ``architectures``): the decoders, embedding checkpoints
(a decoder saved without its LM head, served for embeddings only), classifiers and reward models (the decoder with a
``score`` head, served for their scores only), and the multimodal checkpoints served as their
text model alone (Gemma 3's 4B-27B): their text config, their language model's tensors under the text model's names,
the vision tower and projector left unread."""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from radixrt.model.gemma import Gemma3ForCausalLM
from radixrt.model.llama import ARCHITECTURES as LLAMA_ARCHITECTURES
from radixrt.model.llama import LlamaForCausalLM
from radixrt.model.olmo import Olmo2ForCausalLM

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    **{name: LlamaForCausalLM for name in LLAMA_ARCHITECTURES},
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
}
# an embedding checkpoint's architecture (the decoder saved without its LM head, its tensors without the
# "model." prefix: e5-mistral, gte-Qwen2, Qwen3-Embedding's layout) -> the decoder's, served for embeddings only
EMBEDDING_MODELS = {"LlamaModel": "LlamaForCausalLM", "MistralModel": "MistralForCausalLM",
                    "Qwen2Model": "Qwen2ForCausalLM", "Qwen3Model": "Qwen3ForCausalLM"}
# a classifier or reward model (the decoder, then a linear ``score`` head read at the last token) -> the decoder's
CLASSIFIER_MODELS = {"LlamaForSequenceClassification": "LlamaForCausalLM",
                     "MistralForSequenceClassification": "MistralForCausalLM",
                     "Qwen2ForSequenceClassification": "Qwen2ForCausalLM",
                     "Qwen3ForSequenceClassification": "Qwen3ForCausalLM"}
# a multimodal architecture -> the text model it holds, served alone (prompts of text only)
TEXT_MODELS = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}
SUPPORTED_ARCHITECTURES = tuple(MODEL_CLASSES) + tuple(EMBEDDING_MODELS) + tuple(CLASSIFIER_MODELS) + tuple(TEXT_MODELS)
# where a multimodal checkpoint keeps its language model, as transformers has saved it over the years
_LANGUAGE_MODEL = (("language_model.model.", "model."), ("model.language_model.", "model."),
                   ("language_model.lm_head.", "lm_head."))
_OTHER_TOWERS = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def served_config(config):
    """The config of the model radixrt runs: a multimodal checkpoint's text config (its architecture the text
    model's), else ``config`` itself."""
    for name in getattr(config, "architectures", None) or []:
        if name in TEXT_MODELS:
            text = config.text_config
            text.architectures = [TEXT_MODELS[name]]
            return text
    return config


def text_model_tensors(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's tensors under the text model's names: a multimodal checkpoint's language model renamed, its
    vision tower and projector dropped. A text checkpoint's tensors pass unchanged."""
    for name, tensor in weights:
        if name.startswith(_OTHER_TOWERS):
            continue
        for prefix, replacement in _LANGUAGE_MODEL:
            if name.startswith(prefix):
                name = replacement + name[len(prefix):]
                break
        yield name, tensor


def is_embedding_checkpoint(config) -> bool:
    """The config names an embedding model's or a classifier's architecture (``EMBEDDING_MODELS``,
    ``CLASSIFIER_MODELS``): it has no LM head to generate."""
    return is_classifier_checkpoint(config) or any(name in EMBEDDING_MODELS
                                                   for name in getattr(config, "architectures", None) or [])


def is_classifier_checkpoint(config) -> bool:
    """The config names a classifier's architecture (``CLASSIFIER_MODELS``): a ``score`` head over the decoder."""
    return any(name in CLASSIFIER_MODELS for name in getattr(config, "architectures", None) or [])


def model_class(config) -> type[LlamaForCausalLM]:
    """The class of the first of the config's architectures radixrt serves; a ``ValueError`` where none is."""
    architectures = getattr(config, "architectures", None) or []
    for name in architectures:
        name = EMBEDDING_MODELS.get(name, CLASSIFIER_MODELS.get(name, name))
        if name in MODEL_CLASSES:
            return MODEL_CLASSES[name]
    raise ValueError(f"architecture {architectures} is not supported; supported: {SUPPORTED_ARCHITECTURES}")
