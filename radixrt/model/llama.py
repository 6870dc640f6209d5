"""The Llama-style decoder family: Llama 2/3, SmolLM, SmolLM3 (layers without rotary), Mistral, Qwen2 (qkv bias), Qwen3
(q/k norm), Granite (scaled embedding, residual branches, scores and logits), Phi-3 and Phi-4 (q/k/v and gate/up stored
fused; partial rotary and LongRoPE: ``model/layers.py``), and the mixture-of-experts kin Mixtral, Qwen2-MoE, Qwen3-MoE
and Granite-MoE (the same attention; the MLP in ``model/moe.py``).

Tensor parallel (``tp``): each rank holds ``heads / tp_size`` query heads and their K/V heads; where ranks
outnumber the K/V heads each K/V head is replicated on ``tp_size / kv_heads`` consecutive ranks.
``check_tensor_parallel`` says which sizes a config allows.
"""

from __future__ import annotations

import re
from typing import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from radixrt.model.attention import AttentionBackend
from radixrt.model.forward_batch import ForwardBatch
from radixrt.model.layers import RMSNorm, RotaryEmbedding, gelu_tanh_and_mul, silu_and_mul
from radixrt.model.module import InferenceModule
from radixrt.model.moe import SparseMoeBlock, is_sparse_layer, moe_widths
from radixrt.model.cpu_linear import PackedWeight, pack_weight, packed_linear
from radixrt.model.fp8 import Fp8Scheme, fp8_scheme, fp8_tensors
from radixrt.model.parallel import (
    SINGLE,
    ColumnParallelLinear,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
    PackableLinear,
)

ARCHITECTURES = (  # those this module's LlamaForCausalLM serves (all of them: model/families.py)
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "GraniteForCausalLM",
    "Phi3ForCausalLM",
    "SmolLM3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "GraniteMoeForCausalLM",
)


ACTIVATIONS = {"silu": silu_and_mul, "gelu_pytorch_tanh": gelu_tanh_and_mul}


def activation_of(config) -> str:
    """The MLP's gate activation (Gemma names it ``hidden_activation``); a ``ValueError`` for one not built."""
    name = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None) or "silu"
    if name not in ACTIVATIONS:
        raise ValueError(f"the MLP activation {name!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
    return name


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def sliding_window_of(config, layer: int) -> int:
    window = getattr(config, "sliding_window", None) or 0
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer] == "sliding_attention" else 0
    return window


def uses_rope(config, layer: int) -> bool:
    """Whether ``layer`` rotates q and k: all do but SmolLM3's NoPE layers (``no_rope_layers[layer]`` 0)."""
    flags = getattr(config, "no_rope_layers", None)
    return flags is None or bool(flags[layer])


def kv_replicas(config, tp_size: int) -> int:
    """How many consecutive ranks hold the same K/V head."""
    return max(1, tp_size // config.num_key_value_heads)


def check_tensor_parallel(config, tp_size: int) -> None:
    """ValueError unless the model's heads and MLP split over ``tp_size`` ranks."""
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    problems = []
    if heads % tp_size:
        problems.append(f"{heads} attention heads do not divide by tp_size {tp_size}")
    if (kv_heads % tp_size) if tp_size <= kv_heads else (tp_size % kv_heads):
        problems.append(f"{kv_heads} K/V heads neither divide by tp_size {tp_size} nor divide it")
    dense = any(not is_sparse_layer(config, layer) for layer in range(config.num_hidden_layers))
    widths = ([("the MLP's intermediate size", config.intermediate_size)] if dense else []) + moe_widths(config)
    for what, width in widths:
        if width % tp_size:
            problems.append(f"{what} {width} does not divide by tp_size {tp_size}")
    if problems:
        raise ValueError(f"this model cannot run with tp_size {tp_size}: " + "; ".join(problems))


class Attention(InferenceModule):
    def __init__(self, config, layer: int, rotary: RotaryEmbedding, tp: TPGroup) -> None:
        super().__init__()
        self.layer = layer
        self.head_dim = head_dim_of(config)
        self.num_heads = config.num_attention_heads // tp.size
        replicas = kv_replicas(config, tp.size)
        self.num_kv_heads = config.num_key_value_heads * replicas // tp.size
        bias = getattr(config, "qkv_bias", None)  # Qwen2-MoE names it
        if bias is None:
            bias = getattr(config, "attention_bias", False) or config.model_type == "qwen2"
        d = self.head_dim
        self.qkv_proj = ColumnParallelLinear(
            config.hidden_size,
            [config.num_attention_heads * d, config.num_key_value_heads * d, config.num_key_value_heads * d],
            bias=bias,
            tp=tp,
            replicas=[1, replicas, replicas],
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * d, config.hidden_size, bias=getattr(config, "attention_bias", False), tp=tp
        )
        # q/k norms: over each head (Qwen3; Gemma's subclass), over the whole projection (OLMo 2's subclass), or none
        self.qk_norm: str | None = "head" if config.model_type in ("qwen3", "qwen3_moe") else None
        if self.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)
        self.rotary = rotary if uses_rope(config, layer) else None  # None: a NoPE layer (SmolLM3's every fourth)
        self.sm_scale = getattr(config, "attention_multiplier", None) or d**-0.5  # Granite sets it
        self.sliding_window = sliding_window_of(config, layer)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, batch: ForwardBatch, attn: AttentionBackend
    ) -> torch.Tensor:
        tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        if batch.lora is not None:
            batch.lora.add(self.layer, "qkv", x, qkv)
        q, k, v = qkv.split(
            [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.num_kv_heads * self.head_dim], -1
        )
        if self.qk_norm == "projection":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is None:
            attn.store_layer(self.layer, k, v, batch)
        else:
            q = attn.rope_and_store(self.layer, self.rotary, positions, q, k, v, batch)
        out = attn.attend_layer(self.layer, q, batch, self.sm_scale, self.sliding_window)
        out = out.reshape(tokens, self.num_heads * self.head_dim)
        y = self.o_proj(out)
        if batch.lora is not None:
            batch.lora.add(self.layer, "o", out, y)
        return y


class MLP(InferenceModule):
    def __init__(self, config, layer: int, tp: TPGroup) -> None:
        super().__init__()
        self.layer = layer
        self.gate_up_proj = ColumnParallelLinear(
            config.hidden_size, [config.intermediate_size] * 2, bias=getattr(config, "mlp_bias", False), tp=tp
        )
        self.down_proj = RowParallelLinear(
            config.intermediate_size, config.hidden_size, bias=getattr(config, "mlp_bias", False), tp=tp
        )
        self.act_and_mul = ACTIVATIONS[activation_of(config)]

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        lora = batch.lora
        if lora is None:
            return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))
        gate_up = self.gate_up_proj(x)
        lora.add(self.layer, "gate_up", x, gate_up)
        h = self.act_and_mul(gate_up)
        y = self.down_proj(h)
        lora.add(self.layer, "down", h, y)
        return y


class DecoderLayer(InferenceModule):
    def __init__(self, config, layer: int, rotary: RotaryEmbedding, tp: TPGroup) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer, rotary, tp)
        self.mlp = SparseMoeBlock(config, layer, tp) if is_sparse_layer(config, layer) else MLP(config, layer, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.residual_multiplier = getattr(config, "residual_multiplier", None)  # Granite: each branch scaled

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch,
        attn: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it): the caller's next norm adds the two, so
        each residual add is fused into the norm that follows it."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(positions, h, batch, attn)
        if self.residual_multiplier is not None:
            h = h * self.residual_multiplier
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        h = self.mlp(h, batch)
        if self.residual_multiplier is not None:
            h = h * self.residual_multiplier
        return h, residual


class LlamaForCausalLM(InferenceModule):
    # checkpoint projection name -> (our module attribute, index of its shard in the merged weight)
    _MERGED = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config, max_positions: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.embeddings_and_head(config, tp)
        rotary = RotaryEmbedding(config, head_dim_of(config), max_positions)
        self.layers = nn.ModuleList(DecoderLayer(config, i, rotary, tp) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.embedding_multiplier = getattr(config, "embedding_multiplier", None)  # Granite's scaling

    def embeddings_and_head(self, config, tp: TPGroup) -> None:
        """What every family's model holds beside its layers and final norm: the config, the token embedding and the
        LM head (the embedding itself where tied; packed for the CPU by ``pack_linear_weights``)."""
        self.config = config
        self.tp = tp
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = None if self.tie_word_embeddings else VocabParallelEmbedding(config.vocab_size,
                                                                                   config.hidden_size, tp)
        self.has_head = True  # False for an embedding model (``drop_head``): the forward ends at the final norm
        self.score: nn.Linear | None = None  # a classifier's head (``add_classifier``), read at the logits rows
        self.logits_scaling = getattr(config, "logits_scaling", None)  # Granite's
        self.packed_head: PackedWeight | None = None
        # the checkpoint's fp8 scheme (model/fp8.py); the runner sets --quantization fp8's before loading
        self.fp8_scheme: Fp8Scheme | None = fp8_scheme(config)

    def drop_head(self) -> None:
        """Serve the model for embeddings only: no LM head is built or loaded (a checkpoint's is skipped) and the
        forward returns the final norm's output at the logits rows instead of logits. Call before loading."""
        self.lm_head = None
        self.has_head = False

    def add_classifier(self, num_labels: int) -> None:
        """Serve the model as a classifier or reward model (transformers' ``*ForSequenceClassification``): no LM
        head, and a ``score`` projection to ``num_labels`` after the final norm, whose output the forward returns
        (and an embedding request pools, unnormalized). Call before loading."""
        self.drop_head()
        self.score = nn.Linear(self.config.hidden_size, num_labels, bias=False)

    def _head_weight(self) -> torch.Tensor:
        return (self.embed_tokens if self.lm_head is None else self.lm_head).weight

    def pack_linear_weights(self, row_invariant: bool = False) -> int:
        """Prepack every projection and the LM head for the CPU (cpu_linear); returns how many were packed.
        ``row_invariant`` (deterministic inference): on radixrt's own kernels, or a ``ValueError``.

        The LM head gets its own packed copy: the embedding table it may share stays for token lookups.
        """
        block_k = self.fp8_scheme.block_k if self.fp8_scheme is not None else 0
        packed = sum(m.pack(row_invariant, block_k) for m in self.modules() if isinstance(m, PackableLinear))
        if self.has_head:
            self.packed_head = pack_weight(self._head_weight(), row_invariant)
        return packed + (self.packed_head is not None)

    def dequantize_fp8_weights(self) -> None:
        """Every fp8 weight not packed for the CPU's fp8 kernel as a plain weight in the model's dtype (CUDA; other
        CPUs and dtypes dequantize as they pack)."""
        if self.fp8_scheme is None:
            return
        for m in self.modules():
            if isinstance(m, PackableLinear):
                m.dequantize_fp8(self.fp8_scheme.block_k)

    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        """Logits (fp32) at ``batch.logits_indices``; with ``batch.return_hidden`` the final norm's output at those
        rows goes to ``batch.hidden_states`` too. A model without its head (``drop_head``) returns that output."""
        return self.head_logits(self.final_hidden(batch, attn), batch)

    def final_hidden(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        """The final norm's output at ``batch.logits_indices``: each family's decoder."""
        x, residual = self.embed_tokens(batch.input_ids), None
        if self.embedding_multiplier is not None:
            x = x * self.embedding_multiplier
        for layer in self.layers:
            x, residual = layer(batch.positions, x, residual, batch, attn)
        rows = batch.logits_indices
        x, _ = self.norm.add_forward(x[rows], residual[rows])
        return x

    def head_logits(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The fp32 logits of ``x``, the final norm's output at the logits rows (with ``batch.return_hidden``, ``x``
        goes to ``batch.hidden_states`` too); ``x`` itself where the model has no head, a classifier's scores."""
        if self.score is not None:
            x = F.linear(x, self.score.weight)  # in the model's dtype, as transformers' score head
        if batch.return_hidden:
            batch.hidden_states = x
        if not self.has_head:
            return x
        if self.packed_head is not None:
            logits = packed_linear(x, self.packed_head, fp32_out=True)
        else:
            logits = F.linear(x, self._head_weight())
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return self.scale_logits(head.gather_logits(logits).float().contiguous())  # fp32 already if the head wrote it

    def scale_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The family's last touch to its logits (Granite divides them by ``logits_scaling``)."""
        return logits if self.logits_scaling is None else logits / self.logits_scaling

    def _place(self, name: str) -> tuple[str, str, int] | None:
        """Where a checkpoint tensor (its name as the loader's renaming left it) is held: the module's path, the
        parameter's name and the index of its shard in a merged weight; None for one the model does without."""
        name = name.removeprefix("model.")
        if "rotary_emb" in name or (name == "lm_head.weight" and self.lm_head is None):
            return None
        module_path, _, param = name.rpartition(".")
        owner, _, proj = module_path.rpartition(".")
        if proj in self._MERGED:
            target, index = self._MERGED[proj]
            return f"{owner}.{target}", param, index
        return module_path, param, 0

    def read_weight(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The served values of checkpoint tensor ``name`` (of ``shape`` in the checkpoint), in the checkpoint's
        layout and the model's dtype: what the forward multiplies by, read back from a packed weight through its own
        kernel (an identity matrix through it). A ``ValueError`` for a tensor the model does not hold as one."""
        if self.tp.size > 1:
            raise ValueError("weights cannot be read back under tensor parallelism (--tp-size > 1)")
        if len(shape) > 2 or name.endswith("weight_scale"):
            raise ValueError(f"{name!r} is not held as one tensor here (experts stacked in one tensor, fp8 scales: "
                             "read the experts' or the weight's own)")
        if name == "lm_head.weight" and self.lm_head is None:
            name = "model.embed_tokens.weight"  # tied: the embedding is the head
        modules = dict(self.named_modules())
        parts = []
        for part_name, part in _unfused(_expert_tensors([(name, torch.empty(shape, device="meta"))]), self.config):
            place = self._place(part_name)
            module = None if place is None else modules.get(place[0])
            if module is None:
                raise ValueError(f"{name!r} has no place in {type(self).__name__}")
            parts.append(_held(module, place[1], place[2], part.shape[0], self.embed_tokens.weight.dtype))
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def update_weights_in_place(self, weights: Iterable[tuple[str, torch.Tensor]], row_invariant: bool) -> None:
        """Load some of a checkpoint's tensors into this loaded model (fp8 aside): each into its parameter, which
        keeps its address; a packed layer a tensor lands in is read back through its kernel (exact), loaded and
        packed again (``row_invariant`` as at start), and the LM head's packed copy is made again when what it
        copies changed."""
        renamed = list(_unfused(_expert_tensors(weights), self.config))  # load_weights passes these through
        modules = dict(self.named_modules())
        shards: dict[str, set[int]] = {}  # module path -> the shards of its weight the tensors fill
        for place in map(self._place, (name for name, _ in renamed)):
            if place is not None:
                shards.setdefault(place[0], set()).update([place[2]] if place[1] == "weight" else [])
        unpacked = [path for path in shards if getattr(modules.get(path), "packed", None) is not None]
        dtype = self.embed_tokens.weight.dtype
        for path in unpacked:
            module = modules[path]
            # a weight the tensors fill whole is not read back (that product costs in^2 x out a layer)
            if len(shards[path]) == len(getattr(module, "local_sizes", [0])):
                weight = torch.empty(module.packed.out_features, _inputs(module), dtype=dtype)
            else:
                weight = _unpacked(module, dtype)
            module.weight, module.packed = nn.Parameter(weight, requires_grad=False), None
        self.load_weights(renamed, partial=True)
        for path in unpacked:
            modules[path].pack(row_invariant)
        if self.packed_head is not None and shards.keys() & {"embed_tokens", "lm_head"}:
            self.packed_head = pack_weight(self._head_weight(), row_invariant)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], partial: bool = False) -> None:
        """Load a checkpoint's tensors into their places; ``partial``: some of them, into a loaded model (each
        copied into its parameter, which keeps its address), else every weight must be filled."""
        modules = dict(self.named_modules())
        seen: set[str] = set()
        for name, tensor in _unfused(_expert_tensors(fp8_tensors(weights, self.fp8_scheme)), self.config):
            place = self._place(name)
            if place is None:
                continue
            module_path, param, index = place
            module = modules.get(module_path)
            if module is None:
                raise KeyError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            if hasattr(module, "load_shard"):
                module.load_shard(param, tensor, index)
            else:
                getattr(module, param).data.copy_(tensor)
            if param != "weight_scale":  # an fp8 weight's scales, which model/fp8.py pairs with its bits
                seen.add(f"{module_path}.{param}.{index}")
        if partial:
            return
        expected = sum(
            len(getattr(m, "local_sizes", [0])) if n.endswith(("qkv_proj", "gate_up_proj")) else 1
            for n, m in self.named_modules()
            for _ in m.parameters(recurse=False)
        )
        if self.lm_head is not None and "lm_head.weight.0" not in seen:
            raise ValueError("the checkpoint has no LM head (lm_head.weight) and its embeddings are not tied: an "
                             "embedding model? Serve it with --is-embedding (Engine(is_embedding=True))")
        if len(seen) != expected:
            raise ValueError(f"the checkpoint filled {len(seen)} of {expected} weights")


def _unpacked(module: PackableLinear, dtype: torch.dtype) -> torch.Tensor:
    """A packed layer's weight ``[out, in]`` read back through its own kernel: an identity matrix times it (each
    output one product by 1, so exact), in the model's ``dtype``."""
    return packed_linear(torch.eye(_inputs(module), dtype=dtype), module.packed).t().contiguous()


def _inputs(module: PackableLinear) -> int:
    return module.in_features if isinstance(module, ColumnParallelLinear) else module.local_in


def _held(module: nn.Module, param: str, index: int, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """Parameter ``param`` of ``module`` as the forward uses it (shard ``index`` of a merged weight, ``rows`` long;
    ``dtype``: the model's)."""
    if param == "weight" and getattr(module, "packed", None) is not None:
        held = _unpacked(module, dtype)
    else:
        held = getattr(module, param).detach()
    if isinstance(module, VocabParallelEmbedding):
        held = held[: module.vocab_size]
    offset = sum(getattr(module, "local_sizes", [0])[:index])
    return held[offset : offset + rows]


_MIXTRAL_EXPERT = re.compile(r"\.experts\.(\d+)\.w([123])\.")
_MIXTRAL_NAMES = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}
_STACKED_EXPERTS = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")
# Granite-MoE's names (after block_sparse_moe -> mlp): its stacked experts and its router
_GRANITE_MOE_NAMES = {".mlp.input_linear.weight": ".mlp.experts.gate_up_proj",
                      ".mlp.output_linear.weight": ".mlp.experts.down_proj",
                      ".mlp.router.layer.weight": ".mlp.gate.weight", ".mlp.router.weight": ".mlp.gate.weight"}


def _expert_tensors(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's tensors with every expert named as the Qwen MoE checkpoints name it
    (``mlp.experts.E.gate_proj.weight``): Mixtral's ``block_sparse_moe.experts.E.w1/w2/w3`` renamed, and experts
    stored as one 3-D tensor per projection (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, ``mlp.experts.down_proj``
    ``[E, H, I]``, as transformers lays them out in memory; Granite-MoE's ``input_linear`` and ``output_linear``)
    split per expert, and Granite-MoE's router named as the others' (``mlp.gate``). Other tensors pass unchanged."""
    for name, tensor in weights:
        if ".block_sparse_moe." in name:
            name = name.replace(".block_sparse_moe.", ".mlp.")
            name = _MIXTRAL_EXPERT.sub(lambda m: f".experts.{m[1]}.{_MIXTRAL_NAMES[m[2]]}.", name)
            for suffix, renamed in _GRANITE_MOE_NAMES.items():
                if name.endswith(suffix):
                    name = name[: -len(suffix)] + renamed
                    break
        stacked = _STACKED_EXPERTS.search(name)
        if stacked is None or tensor.dim() != 3:
            yield name, tensor
            continue
        prefix = name[: stacked.start()]
        for expert, weight in enumerate(tensor):
            if stacked[1] == "down_proj":
                yield f"{prefix}.experts.{expert}.down_proj.weight", weight
            else:
                gate, up = weight.chunk(2, dim=0)
                yield f"{prefix}.experts.{expert}.gate_proj.weight", gate
                yield f"{prefix}.experts.{expert}.up_proj.weight", up


def _unfused(weights: Iterable[tuple[str, torch.Tensor]], config) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's tensors with Phi-3's fused projections split into the ones the other families store:
    ``self_attn.qkv_proj.weight`` into q, k and v, ``mlp.gate_up_proj.weight`` into gate and up (an fp8 weight's
    per-row ``weight_scale`` with it)."""
    d = head_dim_of(config)
    qkv = [config.num_attention_heads * d, config.num_key_value_heads * d, config.num_key_value_heads * d]
    for name, tensor in weights:
        if name.endswith((".self_attn.qkv_proj.weight", ".self_attn.qkv_proj.weight_scale")):
            for proj, part in zip(("q_proj", "k_proj", "v_proj"), tensor.split(qkv)):
                yield name.replace(".qkv_proj.", f".{proj}."), part
        elif name.endswith((".mlp.gate_up_proj.weight", ".mlp.gate_up_proj.weight_scale")):
            gate, up = tensor.chunk(2, dim=0)
            yield name.replace(".gate_up_proj.", ".gate_proj."), gate
            yield name.replace(".gate_up_proj.", ".up_proj."), up
        else:
            yield name, tensor
