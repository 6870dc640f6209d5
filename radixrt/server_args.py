"""Every runtime option, shared by `radixrt serve`, `radixrt.Engine(**kwargs)` and the benchmarks."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any

from radixrt.model.weights import DEFAULT_MODEL


@dataclass
class ServerArgs:
    model: str = field(default=DEFAULT_MODEL, metadata={"help": "bundled model name, local HF folder, or hub id"})
    dtype: str = field(default="auto", metadata={"help": "auto (bf16 where the CPU has AMX/AVX512-BF16), bfloat16, float32, float16"})
    device: str = field(default="cpu", metadata={"help": "cpu or cuda"})
    page_size: int = field(default=16, metadata={"help": "tokens per KV page"})
    kv_memory_gb: float = field(default=1.0, metadata={"help": "memory budget of the KV pool in GB"})
    max_total_pages: int | None = field(default=None, metadata={"help": "fix the pool size in pages (overrides --kv-memory-gb)"})
    context_length: int | None = field(default=None, metadata={"help": "maximum prompt + output tokens (default: the model's)"})
    attention_backend: str = field(default="auto", metadata={"help": "auto, torch or triton"})
    schedule_policy: str = field(default="lpm", metadata={"help": "lpm, dfs-weight or fcfs"})
    chunked_prefill_size: int = field(default=2048, metadata={"help": "prefill tokens per step (chunked prefill)"})
    enable_mixed_chunk: bool = field(default=False, metadata={"help": "decode in the same steps as prefill chunks (default: prefill first)"})
    max_running_requests: int = field(default=64, metadata={"help": "requests decoded together at most"})
    max_queued_requests: int = field(default=1024, metadata={"help": "waiting requests beyond which new ones get 503"})
    disable_radix_cache: bool = field(default=False, metadata={"help": "compute every prompt from scratch"})
    disable_partial_page_reuse: bool = field(default=False, metadata={"help": "share whole pages only"})
    disable_jump_forward: bool = field(default=False, metadata={"help": "decode constrained text token by token"})
    random_seed: int = field(default=0, metadata={"help": "seeds the sampling of requests that give no seed: the same requests in the same order sample the same tokens"})
    debug_checks: bool = field(default=False, metadata={"help": "check cache and page invariants after every step"})
    log_interval: float = field(default=10.0, metadata={"help": "seconds between stats log lines (0: off)"})
    host: str = field(default="127.0.0.1", metadata={"help": "HTTP host"})
    port: int = field(default=30000, metadata={"help": "HTTP port"})
    served_model_name: str | None = field(default=None, metadata={"help": "model name reported by /v1/models"})

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        for f in fields(cls):
            flag = "--" + f.name.replace("_", "-")
            help_text = f.metadata.get("help", "")
            if f.type in ("bool", bool):
                parser.add_argument(flag, action="store_true", help=help_text)
                continue
            kind = {"int": int, "float": float, "int | None": int, "str | None": str}.get(str(f.type), str)
            parser.add_argument(flag, type=kind, default=f.default, help=f"{help_text} (default: {f.default})")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "ServerArgs":
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "ServerArgs":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown runtime option(s): {', '.join(unknown)}")
        return cls(**kwargs)

    def replace(self, **changes: Any) -> "ServerArgs":
        return dataclasses.replace(self, **changes)
