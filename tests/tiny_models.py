"""Tiny randomly initialised checkpoints of every supported family, saved as HF folders."""

from __future__ import annotations

from pathlib import Path

import torch

FAMILIES = ("llama", "llama3-scaled", "mistral", "qwen2", "qwen3", "untied-gqa1", "mixtral", "qwen2-moe", "qwen3-moe",
            "gemma3", "olmo2", "granite", "phi3", "phi4-mini", "smollm3", "granite-moe")
MOE_FAMILIES = ("mixtral", "qwen2-moe", "qwen3-moe", "granite-moe")


def tiny_config(family: str):
    from transformers import (Gemma3TextConfig, GraniteConfig, GraniteMoeConfig, LlamaConfig, MistralConfig, MixtralConfig,
                              Olmo2Config, Phi3Config, Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig,
                              SmolLM3Config)

    common = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
    )
    if family == "llama":
        return LlamaConfig(**common, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if family == "llama3-scaled":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
        return LlamaConfig(**common, tie_word_embeddings=False, rope_parameters=rope)
    if family == "mistral":
        return MistralConfig(**common, sliding_window=5, tie_word_embeddings=False)
    if family == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=True)
    if family == "qwen3":
        return Qwen3Config(**{**common, "num_key_value_heads": 1}, head_dim=32, tie_word_embeddings=True)
    if family == "untied-gqa1":
        return LlamaConfig(**{**common, "num_key_value_heads": 4}, tie_word_embeddings=False)
    if family == "mixtral":  # every layer sparse: 4 experts of width 96, 2 a token, sliding window
        return MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2, sliding_window=7,
                             tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)
    if family == "qwen2-moe":  # a shared expert beside 6 routed ones; layer 1 dense; weights not renormalised
        return Qwen2MoeConfig(**common, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                              shared_expert_intermediate_size=48, mlp_only_layers=[1], norm_topk_prob=False,
                              tie_word_embeddings=False)
    if family == "qwen3-moe":  # 8 experts, 3 a token, renormalised; every second layer sparse
        return Qwen3MoeConfig(**common, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                              decoder_sparse_step=2, norm_topk_prob=True, head_dim=16, tie_word_embeddings=True)
    if family == "gemma3":  # sliding and full layers, each with its own rotary; head_dim 256 as Gemma 3 1B
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}
        return Gemma3TextConfig(**common, head_dim=256, sliding_window=5, query_pre_attn_scalar=24,
                                layer_types=["sliding_attention", "full_attention"], rope_parameters=rope)
    if family == "granite":  # every scaling away from 1
        return GraniteConfig(**common, embedding_multiplier=6.0, residual_multiplier=1.5, attention_multiplier=2.0,
                             logits_scaling=0.5, tie_word_embeddings=True)
    if family == "granite-moe":  # Granite's scalings; 5 experts, 2 a token, the top 2 logits softmaxed
        return GraniteMoeConfig(**{**common, "intermediate_size": 32}, num_local_experts=5, num_experts_per_tok=2,
                                embedding_multiplier=6.0, residual_multiplier=1.5, attention_multiplier=2.0,
                                logits_scaling=0.5, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None)
    if family == "phi3":  # q/k/v and gate/up stored fused; a sliding window, as Phi-3-mini has
        return Phi3Config(**common, sliding_window=6, tie_word_embeddings=False, pad_token_id=None, eos_token_id=None)
    if family == "phi4-mini":  # as Phi-4-mini: 3/4 of each head rotated, LongRoPE past an original context of 8
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5], "long_factor": [1.5, 3.0, 6.0, 12.0, 24.0, 48.0]}
        return Phi3Config(**common, tie_word_embeddings=True, pad_token_id=None, eos_token_id=None,
                          original_max_position_embeddings=8, rope_parameters=rope)
    if family == "smollm3":  # as SmolLM3: every n-th layer without rotary (NoPE), here the second of two
        return SmolLM3Config(**common, no_rope_layer_interval=2, rope_theta=50000.0, tie_word_embeddings=True,
                             pad_token_id=None, bos_token_id=None, eos_token_id=None)
    if family == "olmo2":
        return Olmo2Config(**common, tie_word_embeddings=False)
    raise ValueError(family)


def save_tiny_model(family: str, folder: Path, seed: int = 0, init_std: float = 0.25):
    """Save a random tiny model of ``family``, its weights drawn with ``init_std`` (wide enough that a wrong rotation,
    norm or last bit moves the logits past the tests' bounds; at 0.08 they were nearly flat); return the transformers
    model (fp32, eval). The configs name no eos token where transformers' ``generate`` would ban it under
    ``min_new_tokens`` while radixrt's runs, which ignore eos, would not."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(family)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():  # widen the init so differences show up in the logits
        for param in model.parameters():
            param.normal_(0.0, init_std)
    model.eval()
    model.save_pretrained(folder)
    return model


def save_fp8_checkpoint(source: Path, folder: Path, block: tuple[int, int], quantizer: str = "transformers") -> None:
    """``source``'s checkpoint with every projection of its layers quantized to fp8 (e4m3) in blocks of ``block``, as
    the hub's FP8 checkpoints store them (``weight`` float8 beside ``weight_scale_inv``, the config's
    ``quantization_config``). ``quantizer``: transformers' own FP8 quantizer (``block`` must divide every
    projection), or radixrt's (partial blocks where a dimension is not a multiple)."""
    import re
    from types import SimpleNamespace

    from safetensors.torch import load_file
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    from radixrt.model.fp8 import quantize

    config = FineGrainedFP8Config(weight_block_size=list(block))
    hf_quantizer = Fp8Quantize(SimpleNamespace(quantization_config=config))
    tensors = {}
    for file in sorted(source.glob("*.safetensors")):
        for name, tensor in load_file(file).items():
            if not re.search(r"layers\.\d+\..*(_proj|\.w[123])\.weight$", name) or tensor.dim() != 2:
                tensors[name] = tensor
            elif quantizer == "transformers":
                quantized = hf_quantizer._quantize_one(name, tensor)
                assert quantized[name].dtype == torch.float8_e4m3fn, f"{block} does not divide {name}"
                tensors.update(quantized)
            else:
                bits, scales = quantize(tensor, block)
                tensors[name] = bits.view(torch.float8_e4m3fn)
                tensors[name.replace(".weight", ".weight_scale_inv")] = scales
    write_checkpoint(source, folder, tensors, config.to_dict())


def save_compressed_tensors_checkpoint(source: Path, folder: Path, strategy: str) -> None:
    """``source``'s checkpoint as llm-compressor writes an FP8 one (``quant_method: compressed-tensors``): every
    projection of its layers in fp8 with a bf16 ``weight_scale`` per tensor, per output channel or per 32 x 32
    block (``strategy``), each scale its rows' largest magnitude / 448; the LM head and embeddings left alone."""
    import re

    from safetensors.torch import load_file

    from radixrt.model.fp8 import FP8_MAX, quantize

    tensors = {}
    for name, tensor in load_file(source / "model.safetensors").items():
        if not re.search(r"layers\.\d+\..*_proj\.weight$", name):
            tensors[name] = tensor
            continue
        if strategy == "block":
            bits, scale = quantize(tensor, (32, 32))
            scale = scale.to(torch.bfloat16)
        else:
            amax = tensor.abs().amax() if strategy == "tensor" else tensor.abs().amax(dim=1, keepdim=True)
            scale = (amax / FP8_MAX).to(torch.bfloat16)
            bits = (tensor / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
        tensors[name] = bits.view(torch.float8_e4m3fn)
        tensors[name.replace(".weight", ".weight_scale")] = scale.reshape(1) if strategy == "tensor" else scale
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": strategy,
               "block_structure": [32, 32] if strategy == "block" else None}
    activations = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "token"}
    write_checkpoint(source, folder, tensors, {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": activations}},
        "ignore": ["lm_head"]})


def dequantized(fp8_folder: Path, folder: Path, block: tuple[int, int] | None) -> None:
    """An fp8 checkpoint (``weight_scale_inv`` or compressed-tensors' ``weight_scale``: one a tensor, one a row, or
    one per ``block``) dequantized in plain torch (each fp8 value times its scale in fp32, partial blocks
    included) into an fp32 checkpoint without a quantization config: the reference radixrt's fp8 weights must
    equal."""
    from safetensors.torch import load_file

    tensors = load_file(fp8_folder / "model.safetensors")
    out = {}
    for name, tensor in tensors.items():
        if name.endswith(("weight_scale_inv", "weight_scale")):
            continue
        if tensor.dtype == torch.float8_e4m3fn:
            scales = tensors.get(name + "_scale_inv", tensors.get(name + "_scale")).float()
            rows, cols = tensor.shape
            if scales.numel() == 1 or scales.shape == (rows, 1):
                grid = scales.reshape(-1, 1)
            else:
                bn, bk = block
                grid = scales.repeat_interleave(bn, 0)[:rows].repeat_interleave(bk, 1)[:, :cols]
            out[name] = tensor.float() * grid
        else:
            out[name] = tensor
    write_checkpoint(fp8_folder, folder, out, None)


def write_checkpoint(source: Path, folder: Path, tensors: dict, quantization_config: dict | None) -> None:
    """``tensors`` as ``folder``'s checkpoint beside ``source``'s other files (tokenizer, generation config), its
    config ``source``'s with ``quantization_config`` set (None: removed)."""
    import json
    import shutil

    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    for extra in source.iterdir():
        if extra.suffix != ".safetensors" and extra.name != "config.json" and extra.is_file():
            shutil.copy(extra, folder / extra.name)
    config = json.loads((source / "config.json").read_text())
    config.pop("quantization_config", None)
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (folder / "config.json").write_text(json.dumps(config))


def save_embedding_model(family: str, folder: Path, pooling: str = "last", normalize: bool = True,
                         tokenizer_from: Path | None = None, causal: bool = False, **config_fields):
    """A tiny decoder saved as a sentence-transformers embedding checkpoint: by default as the hub's embedding
    models store it (transformers' base model: no LM head, tensors without the ``model.`` prefix, architecture
    ``Qwen3Model`` and kin); ``causal``: the whole ForCausalLM checkpoint (served with ``--is-embedding``). Beside it
    ``modules.json``, the Pooling module's config (``pooling``: last, mean or cls) and, with ``normalize``, a
    Normalize module; ``tokenizer_from``'s tokenizer files (sentence-transformers loads one); ``config_fields`` go
    into the config (``is_matryoshka``, ...). Returns transformers' base model (fp32, eval)."""
    import json
    import shutil

    model = save_tiny_model(family, folder / "causal" if not causal else folder)
    base = model.model
    for name, value in config_fields.items():
        setattr(base.config, name, value)
        setattr(model.config, name, value)
    if causal:
        model.save_pretrained(folder)
    else:
        base.save_pretrained(folder)
        shutil.rmtree(folder / "causal")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if tokenizer_from is not None and (tokenizer_from / name).is_file():
            shutil.copy(tokenizer_from / name, folder / name)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (folder / "2_Normalize").mkdir(exist_ok=True)
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    modes = {"pooling_mode_cls_token": pooling == "cls", "pooling_mode_mean_tokens": pooling == "mean",
             "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
             "pooling_mode_weightedmean_tokens": False, "pooling_mode_lasttoken": pooling == "last"}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": base.config.hidden_size, **modes, "include_prompt": True}))
    return base


def save_classifier_model(family: str, folder: Path, labels: list[str], seed: int = 0, **config_fields):
    """A tiny ``*ForSequenceClassification`` checkpoint of ``family`` (a reward model with one label), its labels
    named in the config (``config_fields`` too: a ``vocab_size``...); returns transformers' model (fp32, eval)."""
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(seed)
    config = tiny_config(family)
    for name, value in config_fields.items():
        setattr(config, name, value)
    config.num_labels = len(labels)
    config.id2label = dict(enumerate(labels))
    config.label2id = {label: i for i, label in enumerate(labels)}
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.25)
    model.eval()
    model.save_pretrained(folder)
    return model
