"""Random LoRA adapters in PEFT's format (``save_pretrained``), for a model folder, and PEFT's reference model."""

from __future__ import annotations

from pathlib import Path

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def load_base(model_folder: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def save_adapter(model_folder: Path, out: Path, *, r: int = 8, alpha: float = 16, targets=ALL_TARGETS, seed: int = 0,
                 std: float = 0.05, use_rslora: bool = False, layers: list[int] | None = None,
                 rank_pattern: dict | None = None) -> Path:
    """A LoRA adapter of the model with seeded random A and B (PEFT starts B at zero, which would change nothing)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0,
                        init_lora_weights=False, use_rslora=use_rslora, layers_to_transform=layers,
                        rank_pattern=rank_pattern or {})
    model = get_peft_model(load_base(model_folder), config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    model.save_pretrained(out)
    return out


def peft_model(model_folder: Path, adapter: Path | None):
    """The transformers model with ``adapter`` applied by PEFT (None: the base model), fp32, eval."""
    from peft import PeftModel

    base = load_base(model_folder)
    if adapter is None:
        return base
    return PeftModel.from_pretrained(base, adapter).eval()
