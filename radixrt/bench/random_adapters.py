"""Random LoRA adapters of a model in PEFT's layout (``adapter_config.json``, ``adapter_model.safetensors``), for
benchmarks: every projection of every layer at one rank, seeded. Torch and safetensors only (no PEFT)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch

from radixrt.model.lora import projection_sizes

PROJECTIONS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def write_random_adapter(model_dir: str | Path, out: str | Path, rank: int = 16, seed: int = 0,
                         std: float = 0.02) -> Path:
    from safetensors.torch import save_file

    config = json.loads((Path(model_dir) / "config.json").read_text())
    sizes = projection_sizes(SimpleNamespace(**config))
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for block, names in PROJECTIONS.items():
            for name in names:
                fan_in, fan_out = sizes[name]
                prefix = f"base_model.model.model.layers.{layer}.{block}.{name}"
                tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) * std
                tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * std
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors")
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0, "bias": "none",
        "target_modules": [n for names in PROJECTIONS.values() for n in names], "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir), "use_rslora": False, "use_dora": False,
        "fan_in_fan_out": False, "modules_to_save": None}))
    return out


def write_random_adapters(model_dir: str | Path, out_dir: str | Path, count: int, rank: int = 16) -> list[Path]:
    return [write_random_adapter(model_dir, Path(out_dir) / f"lora{k}", rank, seed=k) for k in range(count)]
