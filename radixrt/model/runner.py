"""Loads a model folder into our modules and runs one forward per batch over the page pool."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from radixrt.kernels import cpu_kernels
from radixrt.memory.page_pool import KVLayout, PagePool
from radixrt.model.cpu_malloc import keep_freed_memory
from radixrt.model.attention import AttentionBackend, create_attention_backend
from radixrt.model.forward_batch import ForwardBatch
from radixrt.model.llama import SUPPORTED_ARCHITECTURES, LlamaForCausalLM, head_dim_of

# What `--dtype auto` resolves to, whatever the CPU: float32 or bfloat16 (unset: bf16 where the CPU runs it fast).
AUTO_DTYPE_ENV = "RADIXRT_AUTO_DTYPE"
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(dtype: str | torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        forced = os.environ.get(AUTO_DTYPE_ENV)
        if forced:  # test matrices run the whole suite with auto resolving to each dtype
            if forced not in DTYPES:
                raise ValueError(f"{AUTO_DTYPE_ENV}={forced!r}; choose one of {', '.join(DTYPES)}")
            return DTYPES[forced]
        if torch.device(device).type == "cuda":  # bf16: native on Ampere and newer
            return torch.bfloat16
        return torch.bfloat16 if _cpu_has_fast_bf16() else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _cpu_has_fast_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def load_config(model_path: Path):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    architectures = getattr(config, "architectures", None) or []
    if not any(a in SUPPORTED_ARCHITECTURES for a in architectures):
        raise ValueError(f"architecture {architectures} is not supported; supported: {SUPPORTED_ARCHITECTURES}")
    return config


def iterate_safetensors(model_path: Path):
    from safetensors import safe_open

    files = sorted(model_path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {model_path}")
    for file in files:
        with safe_open(file, framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


class ModelRunner:
    def __init__(
        self,
        model_path: Path,
        dtype: str | torch.dtype = "float32",
        page_size: int = 16,
        num_pages: int | None = None,
        kv_memory_gb: float | None = None,
        attention_backend: str = "auto",
        context_length: int | None = None,
        device: str = "cpu",
    ) -> None:
        started = time.perf_counter()
        self.model_path = Path(model_path)
        self.config = load_config(self.model_path)
        self.device = torch.device(device)
        self.dtype = parse_dtype(dtype, self.device)
        if self.device.type == "cpu":
            keep_freed_memory()
            cpu_kernels.load()  # compiled on the first run ever (about 50 s), then loaded from the cache
        self.context_length = int(context_length or self.config.max_position_embeddings)
        # Parameters are created with torch.empty, so building the modules costs no initialisation.
        with torch.device(self.device):
            self.model = LlamaForCausalLM(self.config, max_positions=self.context_length)
        self.model.load_weights(iterate_safetensors(self.model_path))
        self.model.to(self.dtype)
        self.model.eval()
        self.packed_linears = self.model.pack_linear_weights() if self.device.type == "cpu" else 0
        layout = KVLayout(
            num_layers=self.config.num_hidden_layers,
            kv_heads=self.config.num_key_value_heads,
            head_dim=head_dim_of(self.config),
            page_size=page_size,
            dtype=self.dtype,
        )
        if num_pages is not None:
            self.pool = PagePool(layout, num_pages, self.device)
        else:
            self.pool = PagePool.from_memory_budget(layout, kv_memory_gb, self.device)
        self.attention: AttentionBackend = create_attention_backend(self.pool, attention_backend)
        self.load_seconds = time.perf_counter() - started

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model(batch, self.attention)
