"""Mixture-of-experts MLP blocks: Mixtral, Qwen2-MoE (with its gated shared expert), Qwen3-MoE and Granite-MoE.

Routing follows transformers step for step, so its rounding is the same: router logits in the model's dtype,
softmax in fp32, the top ``k`` experts of each token, their weights renormalised to sum to one where the family
does (Mixtral always, the Qwen families by ``norm_topk_prob``), then cast to the model's dtype where the family
does (the Qwen families; Mixtral scales in fp32 and rounds after). Granite-MoE takes the top ``k`` router logits
first and softmaxes those alone (fp32), then casts.

A forward sorts the batch's (token, expert) pairs by expert, gathers their rows once, and runs each expert the
batch hits once over its slice, through the expert's own gate/up and down products (packed for the CPU like
every projection; on the bf16 panel kernel or the fp8 one every expert's product in one call; the activation runs
once over all slices). The scaled outputs are added into each token's
row in ascending expert order, the order transformers adds them in. Experts no token chose cost nothing; a
decode step of one token runs ``k`` of them.

Tensor parallel: every expert's intermediate width is split over the ranks as the dense MLP's is, the router is
replicated, and the block's partial sums (routed and shared experts together) are all-reduced once.

The per-expert row counts are read on the host, a sync inside the forward: on CUDA these models run eagerly,
without decode graphs (``syncs_in_forward``).
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from radixrt.kernels import cpu_kernels

from radixrt.model.forward_batch import ForwardBatch
from radixrt.model.layers import silu_and_mul
from radixrt.model.module import InferenceModule
from radixrt.model.parallel import ColumnParallelLinear, PackableLinear, RowParallelLinear, TPGroup

MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "granitemoe")
EVERY_LAYER_SPARSE = ("mixtral", "granitemoe")  # the others keep dense MLPs in some layers


def is_moe(config) -> bool:
    return getattr(config, "model_type", None) in MOE_MODEL_TYPES


def num_experts_of(config) -> int:
    if config.model_type in EVERY_LAYER_SPARSE:
        return config.num_local_experts
    return config.num_experts


def expert_width_of(config) -> int:
    """The intermediate width of one routed expert."""
    return config.intermediate_size if config.model_type in EVERY_LAYER_SPARSE else config.moe_intermediate_size


def shared_expert_width_of(config) -> int:
    """The intermediate width of the shared expert beside the routed ones (Qwen2-MoE); 0: none."""
    return int(getattr(config, "shared_expert_intermediate_size", 0) or 0) if config.model_type == "qwen2_moe" else 0


def is_sparse_layer(config, layer: int) -> bool:
    """Whether ``layer``'s MLP is a mixture of experts (the Qwen families keep dense MLPs in ``mlp_only_layers``
    and between every ``decoder_sparse_step``-th layer)."""
    if not is_moe(config):
        return False
    if config.model_type in EVERY_LAYER_SPARSE:
        return True
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return num_experts_of(config) > 0 and layer not in (config.mlp_only_layers or ()) and (layer + 1) % step == 0


def moe_widths(config) -> list[tuple[str, int]]:
    """Each intermediate width a tensor-parallel split must divide, with its name (for the error message)."""
    if not is_moe(config):
        return []
    widths = [("an expert's intermediate size", expert_width_of(config))]
    if shared_expert_width_of(config):
        widths.append(("the shared expert's intermediate size", shared_expert_width_of(config)))
    return widths


class Expert(InferenceModule):
    """One gated MLP whose output is left as this rank's partial sum (the block all-reduces once)."""

    def __init__(self, hidden: int, width: int, tp: TPGroup) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden, [width, width], bias=False, tp=tp)
        self.down_proj = RowParallelLinear(width, hidden, bias=False, tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.product(silu_and_mul(self.gate_up_proj(x)))


class SparseMoeBlock(InferenceModule):
    def __init__(self, config, layer: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.num_experts = num_experts_of(config)
        self.top_k = config.num_experts_per_tok
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.top_k} must be between 1 and the {self.num_experts} experts")
        mixtral = config.model_type == "mixtral"
        self.renormalize = mixtral or bool(getattr(config, "norm_topk_prob", False))
        self.weights_in_model_dtype = not mixtral
        self.softmax_of_top_k = config.model_type == "granitemoe"
        hidden = config.hidden_size
        # every rank holds the whole router (replicas = ranks)
        self.gate = ColumnParallelLinear(hidden, [self.num_experts], bias=False, tp=tp, replicas=[tp.size])
        self.experts = nn.ModuleList(Expert(hidden, expert_width_of(config), tp) for _ in range(self.num_experts))
        shared = shared_expert_width_of(config)
        self.shared_expert = Expert(hidden, shared, tp) if shared else None
        self.shared_expert_gate = (
            ColumnParallelLinear(hidden, [1], bias=False, tp=tp, replicas=[tp.size]) if shared else None
        )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights ``[T, k]``, expert ids ``[T, k]``) of each token's chosen experts."""
        if self.softmax_of_top_k:
            logits, ids = torch.topk(self.gate(x).float(), self.top_k, dim=-1)
            return torch.softmax(logits, dim=-1).to(x.dtype), ids
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.weights_in_model_dtype:
            weights = weights.to(x.dtype)
        return weights, ids

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        weights, ids = self.route(x)
        flat_ids = ids.flatten()
        order = flat_ids.argsort(stable=True)  # the (token, slot) pairs grouped by expert, ascending
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        tokens = order // self.top_k
        rows = x.index_select(0, tokens)  # each pair's token, expert by expert
        hit = [expert for expert, count in zip(self.experts, counts) if count]
        bounds = list(itertools.accumulate((count for count in counts if count), initial=0))
        h = silu_and_mul(_per_expert([e.gate_up_proj for e in hit], rows, bounds))
        y = _per_expert([e.down_proj for e in hit], h, bounds) * weights.flatten().index_select(0, order)[:, None]
        # one add per pair in index order: each token's experts land in ascending order, as transformers adds them
        out = torch.zeros_like(x).index_add_(0, tokens, y.to(x.dtype))
        if self.shared_expert is not None:
            out = out + vectorized_sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.tp.all_reduce(out)


def vectorized_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """``torch.sigmoid(x)`` with every value on torch's vectorized path: torch computes a tensor's last values past its
    whole vector pairs with its scalar exp, whose last bit differs from the vectorized one's for a few values in a
    hundred (fp32), so a row's gate would depend on where the row falls in its batch (deterministic inference).
    Padded to a multiple of 64 values, no value is left over."""
    values = x.reshape(-1)
    padded = values.new_zeros(-(-values.numel() // 64) * 64)
    padded[: values.numel()] = values
    return torch.sigmoid(padded)[: values.numel()].view(x.shape)


def _per_expert(linears: list[PackableLinear], x: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """Rows ``bounds[e]:bounds[e + 1]`` of ``x`` through ``linears[e]`` (without bias or all-reduce), stacked: on the
    bf16 panel kernel or the fp8 one all of them in one call, else one product each."""
    packed = [linear.packed for linear in linears]
    if all(p is not None and p.kernel == "bf16" for p in packed):
        return cpu_kernels.linear_bf16_grouped(x, [p.data for p in packed], bounds, packed[0].out_features)
    if all(p is not None and p.kernel == "fp8" for p in packed):  # one checkpoint: one blocking, one shard
        first = packed[0]
        return cpu_kernels.linear_fp8_grouped(x, [p.data for p in packed], [p.scales for p in packed], bounds,
                                              first.block_k, first.k_offset, first.out_features)
    parts = [linear.product(x[a:b]) for linear, a, b in zip(linears, bounds, bounds[1:])]
    return torch.cat(parts) if len(parts) > 1 else parts[0]
