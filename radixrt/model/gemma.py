"""Gemma 3's text decoder (``Gemma3ForCausalLM``): the Llama family's attention and gated MLP with Gemma's
differences, each rounded where transformers rounds:

- its RMSNorm scales by ``1 + weight`` in fp32 and rounds once, after (Llama's rounds the normalised x first);
- four norms a layer: after the attention and after the MLP too, each before its residual add;
- q/k norms per head; scores scaled by ``query_pre_attn_scalar ** -0.5``;
- sliding-window and full-attention layers (``layer_types``), each kind with its own rotary parameters;
- the embedding scaled by sqrt(hidden), that factor rounded to the model's dtype; a GELU (tanh) gate;
- ``final_logit_softcapping``, where set, applied to the fp32 logits.

Refused with the reason: soft-capped attention scores (Gemma 2's ``attn_logit_softcapping``; the attention
kernels do not cap) and bidirectional attention (EmbeddingGemma).
"""

from __future__ import annotations

import torch
from torch import nn

from radixrt.model.attention import AttentionBackend
from radixrt.model.forward_batch import ForwardBatch
from radixrt.model.layers import RotaryEmbedding, RoundOnceRMSNorm
from radixrt.model.llama import MLP, Attention, LlamaForCausalLM, head_dim_of
from radixrt.model.module import InferenceModule
from radixrt.model.parallel import SINGLE, TPGroup


def GemmaRMSNorm(size: int, eps: float) -> RoundOnceRMSNorm:
    return RoundOnceRMSNorm(size, eps, weight_offset=1.0)


class GemmaAttention(Attention):
    def __init__(self, config, layer: int, rotary: RotaryEmbedding, tp: TPGroup) -> None:
        super().__init__(config, layer, rotary, tp)
        self.qk_norm = "head"
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.sm_scale = config.query_pre_attn_scalar**-0.5


class GemmaDecoderLayer(InferenceModule):
    def __init__(self, config, layer: int, rotary: RotaryEmbedding, tp: TPGroup) -> None:
        super().__init__()
        self.self_attn = GemmaAttention(config, layer, rotary, tp)
        self.mlp = MLP(config, layer, tp)
        eps = config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, batch: ForwardBatch,
                attn: AttentionBackend) -> torch.Tensor:
        h = self.self_attn(positions, self.input_layernorm(x), batch, attn)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x), batch)
        return x + self.post_feedforward_layernorm(h)


def check_gemma(config) -> None:
    """A ``ValueError`` for the Gemma variants radixrt does not compute."""
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise ValueError("soft-capped attention scores (attn_logit_softcapping, Gemma 2) are not supported")
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("bidirectional attention (use_bidirectional_attention) is not supported")


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Loads and packs as ``LlamaForCausalLM`` does (the same checkpoint names); its own layers and forward."""

    def __init__(self, config, max_positions: int, tp: TPGroup = SINGLE) -> None:
        InferenceModule.__init__(self)
        check_gemma(config)
        self.embeddings_and_head(config, tp)
        kinds = sorted(set(config.layer_types))
        rotaries = {kind: RotaryEmbedding(config, head_dim_of(config), max_positions, kind) for kind in kinds}
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, i, rotaries[kind], tp)
                                    for i, kind in enumerate(config.layer_types))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.final_softcap = getattr(config, "final_logit_softcapping", None)
        # sqrt(hidden) rounded to each dtype the model may run in, as transformers rounds it (made here: a tensor
        # made inside a forward would be a host-to-device copy, which a captured graph cannot hold)
        scale = torch.tensor(config.hidden_size**0.5, device="cpu")
        self.embed_scales = {dtype: scale.to(dtype).item() for dtype in (torch.float32, torch.bfloat16, torch.float16)}

    def final_hidden(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)
        x = x * self.embed_scales[x.dtype]
        for layer in self.layers:
            x = layer(batch.positions, x, batch, attn)
        return self.norm(x[batch.logits_indices])

    def scale_logits(self, logits: torch.Tensor) -> torch.Tensor:
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits
