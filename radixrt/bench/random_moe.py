"""A seeded random mixture-of-experts checkpoint with the default model's tokenizer, for benchmarks of the expert
path on machines that cannot download one: Qwen3-MoE's layout at the default model's width (hidden 576, 9
query and 3 K/V heads of 64), each token through ``active`` of ``experts`` experts whose widths add up to the
default model's MLP (4 x 384 = 1536). Both engines of ``radixrt bench vllm --model OUT`` read it.

    python -m radixrt.bench.random_moe OUT [--experts 32] [--active 4] [--layers 16] [--expert-width 384]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt")


def write_random_moe(out: str | Path, experts: int = 32, active: int = 4, layers: int = 16, expert_width: int = 384,
                     seed: int = 0, std: float = 0.02) -> Path:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from radixrt.model.weights import resolve_model_path
    from radixrt.server_args import DEFAULT_MODEL

    tokenizer_dir = resolve_model_path(DEFAULT_MODEL)
    config = Qwen3MoeConfig(
        vocab_size=49152, hidden_size=576, num_hidden_layers=layers, num_attention_heads=9, num_key_value_heads=3,
        head_dim=64, num_experts=experts, num_experts_per_tok=active, moe_intermediate_size=expert_width,
        intermediate_size=expert_width * active, norm_topk_prob=True, max_position_embeddings=8192,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    )
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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--active", type=int, default=4, help="experts a token")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--expert-width", type=int, default=384)
    args = p.parse_args(argv)
    path = write_random_moe(args.out, args.experts, args.active, args.layers, args.expert_width)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
