"""Seeded random checkpoints of the families the default model does not represent, with the default model's
tokenizer, for benchmarks on machines that cannot download one. Both engines of ``radixrt bench vllm --model OUT``
read them. At the default model's width (hidden 576, 9 query and 3 K/V heads of 64):

- ``qwen3-moe``: Qwen3-MoE, each token through ``active`` of ``experts`` experts whose widths add up to the
  default model's MLP (4 x 384 = 1536);
- ``gemma3``: Gemma 3's text decoder with the default model's MLP width, five sliding-window layers (512 tokens)
  to one of full attention, as Gemma 3 lays them out;
- ``phi4-mini``: Phi-4-mini's layout (Phi-3's fused projections) with the default model's MLP width: 3/4 of each
  head rotated, LongRoPE past an original context of 4,096 tokens;
- ``granite-moe``: Granite-MoE (Granite's scalings), ``active`` of ``experts`` experts a token, as ``qwen3-moe``.

    python -m radixrt.bench.random_model OUT [--family qwen3-moe|gemma3|phi4-mini|granite-moe] [--layers 16]
        [--experts 32] [--active 4] [--expert-width 384]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt")


FAMILIES = ("qwen3-moe", "gemma3", "phi4-mini", "granite-moe")


def write_random_model(out: str | Path, family: str = "qwen3-moe", layers: int = 16, experts: int = 32,
                       active: int = 4, expert_width: int = 384, seed: int = 0, std: float = 0.02) -> Path:
    from transformers import AutoModelForCausalLM

    from radixrt.model.weights import resolve_model_path
    from radixrt.server_args import DEFAULT_MODEL

    tokenizer_dir = resolve_model_path(DEFAULT_MODEL)
    config = _config(family, layers, experts, active, expert_width)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, std)
    out = Path(out)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    return out


def _config(family: str, layers: int, experts: int, active: int, expert_width: int):
    from transformers import Gemma3TextConfig, GraniteMoeConfig, Phi3Config, Qwen3MoeConfig

    common = dict(vocab_size=49152, hidden_size=576, num_hidden_layers=layers, num_attention_heads=9,
                  num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, tie_word_embeddings=True,
                  bos_token_id=1, eos_token_id=2)
    if family == "qwen3-moe":
        return Qwen3MoeConfig(**common, num_experts=experts, num_experts_per_tok=active,
                              moe_intermediate_size=expert_width, intermediate_size=expert_width * active,
                              norm_topk_prob=True, rms_norm_eps=1e-5,
                              rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
    if family == "gemma3":
        kinds = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}
        return Gemma3TextConfig(**common, intermediate_size=1536, sliding_window=512, query_pre_attn_scalar=64,
                                layer_types=kinds, rope_parameters=rope, rms_norm_eps=1e-6)
    if family == "phi4-mini":
        rotated = 48  # of 64: Phi-4-mini's partial_rotary_factor 0.75
        factors = torch.linspace(1.0, 1.5, rotated // 2).tolist(), torch.linspace(1.0, 48.0, rotated // 2).tolist()
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                "short_factor": factors[0], "long_factor": factors[1]}
        return Phi3Config(**common, intermediate_size=1536, original_max_position_embeddings=4096,
                          rope_parameters=rope, rms_norm_eps=1e-5, pad_token_id=None)
    if family == "granite-moe":
        return GraniteMoeConfig(**{k: v for k, v in common.items() if k != "head_dim"}, num_local_experts=experts,
                                num_experts_per_tok=active, intermediate_size=expert_width, rms_norm_eps=1e-5,
                                embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.015625,
                                logits_scaling=6.0)
    raise ValueError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES)}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--family", choices=FAMILIES, default="qwen3-moe")
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--active", type=int, default=4, help="experts a token")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--expert-width", type=int, default=384)
    args = p.parse_args(argv)
    path = write_random_model(args.out, args.family, args.layers, args.experts, args.active, args.expert_width)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
