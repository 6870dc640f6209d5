"""OLMo 2's decoder (``Olmo2ForCausalLM``): the Llama family's attention and MLP with OLMo 2's differences, rounded
where transformers rounds:

- its RMSNorm multiplies by the weight in fp32 and rounds once (Llama's rounds the normalised x first);
- norms after the attention and after the MLP, each before its residual add, and none before them;
- q and k normalised over the whole projection (every head together) before they are split into heads.

Tensor parallelism is refused: a rank holds some heads, and the q/k norms need all of them.
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


def OlmoRMSNorm(size: int, eps: float) -> RoundOnceRMSNorm:
    return RoundOnceRMSNorm(size, eps, weight_offset=0.0)


class Olmo2Attention(Attention):
    def __init__(self, config, layer: int, rotary: RotaryEmbedding, tp: TPGroup) -> None:
        super().__init__(config, layer, rotary, tp)
        self.qk_norm = "projection"
        self.q_norm = OlmoRMSNorm(self.num_heads * self.head_dim, config.rms_norm_eps)
        self.k_norm = OlmoRMSNorm(self.num_kv_heads * self.head_dim, config.rms_norm_eps)


class Olmo2DecoderLayer(InferenceModule):
    def __init__(self, config, layer: int, rotary: RotaryEmbedding, tp: TPGroup) -> None:
        super().__init__()
        self.self_attn = Olmo2Attention(config, layer, rotary, tp)
        self.mlp = MLP(config, layer, tp)
        self.post_attention_layernorm = OlmoRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = OlmoRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, batch: ForwardBatch,
                attn: AttentionBackend) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(positions, x, batch, attn))
        return x + self.post_feedforward_layernorm(self.mlp(x, batch))


class Olmo2ForCausalLM(LlamaForCausalLM):
    """Loads and packs as ``LlamaForCausalLM`` does (the same checkpoint names); its own layers and forward."""

    def __init__(self, config, max_positions: int, tp: TPGroup = SINGLE) -> None:
        InferenceModule.__init__(self)
        if tp.size > 1:
            raise ValueError("OLMo 2 does not run with tensor parallelism (--tp-size > 1): its q/k norms span "
                             "every head, and each rank holds some")
        self.embeddings_and_head(config, tp)
        rotary = RotaryEmbedding(config, head_dim_of(config), max_positions)
        self.layers = nn.ModuleList(Olmo2DecoderLayer(config, i, rotary, tp) for i in range(config.num_hidden_layers))
        self.norm = OlmoRMSNorm(config.hidden_size, config.rms_norm_eps)

    def final_hidden(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)
        for layer in self.layers:
            x = layer(batch.positions, x, batch, attn)
        return self.norm(x[batch.logits_indices])
