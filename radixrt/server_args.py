"""Every runtime option, shared by `radixrt serve`, `radixrt.Engine(**kwargs)` and the benchmarks."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any

from radixrt import env


# the bundled model (radixrt.model.weights.BUNDLED_MODELS) a runtime serves unless told otherwise
DEFAULT_MODEL = "smollm2-135m"

_CLI_TYPES = {"int": int, "float": float, "str": str, "int | None": int, "float | None": float,
              "str | None": str}


@dataclass
class ServerArgs:
    model: str = field(default=DEFAULT_MODEL, metadata={"help": "bundled model name, local HF folder, or hub id"})
    dtype: str = field(default="auto", metadata={"help": "auto (bf16 on CUDA and where the CPU has AMX/AVX512-BF16, else fp32), bfloat16, float32, float16"})
    device: str = field(default="cpu", metadata={"help": "cpu or cuda"})
    page_size: int = field(default=16, metadata={"help": "tokens per KV page"})
    kv_memory_gb: float | None = field(default=None, metadata={"help": "memory budget of the KV pool in GB (default: 40%% of the memory available at start-up on a CPU, taken only as the cache fills; 85%% of the free memory on a GPU)"})
    max_total_pages: int | None = field(default=None, metadata={"help": "fix the pool size in pages (overrides --kv-memory-gb)"})
    context_length: int | None = field(default=None, metadata={"help": "maximum prompt + output tokens (default: the model's)"})
    attention_backend: str = field(default="auto", metadata={"help": "auto, torch or triton"})
    schedule_policy: str = field(default="lpm", metadata={"help": "lpm, dfs-weight or fcfs"})
    schedule_low_priority_values_first: bool = field(default=False, metadata={"help": "a request's smaller priority value is the more urgent (default: the larger, as SGLang)"})
    priority_scheduling_preemption_threshold: int = field(default=10, metadata={"help": "a waiting request more urgent than running ones by more than this many priority levels retracts them when it finds no room (SGLang's default: 10)"})
    disable_priority_preemption: bool = field(default=False, metadata={"help": "priorities order the waiting queue only; a running request is never retracted for a more urgent one"})
    chunked_prefill_size: int = field(default=2048, metadata={"help": "prefill tokens per step (chunked prefill)"})
    enable_mixed_chunk: bool = field(default=False, metadata={"help": "decode in the same steps as prefill chunks (default: prefill first)"})
    max_running_requests: int = field(default=64, metadata={"help": "requests decoded together at most"})
    max_queued_requests: int = field(default=1024, metadata={"help": "waiting requests beyond which new ones get 503"})
    disable_radix_cache: bool = field(default=False, metadata={"help": "compute every prompt from scratch"})
    disable_partial_page_reuse: bool = field(default=False, metadata={"help": "share whole pages only"})
    disable_jump_forward: bool = field(default=False, metadata={"help": "decode constrained text token by token"})
    disable_overlap_schedule: bool = field(default=False, metadata={"help": "read each decode step's tokens back before launching the next (the overlap scheduler launches step N+1 first; on CUDA)"})
    enable_overlap_schedule: bool = field(default=False, metadata={"help": "use the overlap scheduler on a CPU too (it gains nothing there; for tests)"})
    disable_cuda_graph: bool = field(default=False, metadata={"help": "run decode steps eagerly on CUDA instead of replaying graphs captured at start-up"})
    cuda_graph_max_bs: int | None = field(default=None, metadata={"help": "largest decode batch replayed from a CUDA graph (default: --max-running-requests, at most 256)"})
    random_seed: int = field(default=0, metadata={"help": "seeds the sampling of requests that give no seed: the same requests in the same order sample the same tokens"})
    debug_checks: bool = field(default=False, metadata={"help": "check cache and page invariants after every step"})
    log_interval: float = field(default=10.0, metadata={"help": "seconds between stats log lines (0: off)"})
    # ----- sessions (/open_session, session_params; docs/FEATURES.md) -----
    session_max_pages: int | None = field(default=None, metadata={"help": "KV pages one session may pin in the prefix cache (its context's first pages; 0: none; default: no cap of its own)"})
    sessions_max_pages: int | None = field(default=None, metadata={"help": "KV pages all sessions may pin together; beyond it the least recently used sessions lose their pins (default: no cap; pins always yield to requests that need the room)"})
    session_timeout: float | None = field(default=None, metadata={"help": "close a session idle this many seconds (default: never)"})
    max_open_sessions: int = field(default=1024, metadata={"help": "open sessions at most (more are refused)"})
    # ----- speculative decoding (docs/FEATURES.md) -----
    speculative_algorithm: str | None = field(default=None, metadata={"help": "NGRAM: each decoding request drafts tokens from text the runtime has seen (the radix cache's continuation of its exact context, else n-gram matches in its own context and in recent requests) and the model verifies the draft in the same forward; the tokens are the same as without it (default: off)"})
    speculative_num_draft_tokens: int = field(default=8, metadata={"help": "most draft tokens a request verifies in one step (the length adapts to how often its drafts are accepted)"})
    speculative_ngram_min_match_window_size: int = field(default=1, metadata={"help": "fewest latest tokens an n-gram draft's match must share"})
    speculative_ngram_max_match_window_size: int = field(default=12, metadata={"help": "most latest tokens compared when choosing among n-gram matches"})
    speculative_ngram_capacity: int = field(default=262144, metadata={"help": "tokens of recent requests' prompts and outputs kept for n-gram drafts"})
    disable_speculative_cache_drafts: bool = field(default=False, metadata={"help": "draft from n-gram matches only, never from continuations in the radix cache"})
    speculative_ngram_min_bfs_breadth: int = field(default=1, metadata={"help": "SGLang's draft-tree breadth; radixrt drafts one chain, so this has no effect"})
    speculative_ngram_max_bfs_breadth: int = field(default=10, metadata={"help": "SGLang's draft-tree breadth; radixrt drafts one chain, so this has no effect"})
    speculative_ngram_match_type: str = field(default="BFS", metadata={"help": "SGLang's draft-tree shape (BFS or PROB); radixrt drafts one chain, so this has no effect"})
    speculative_ngram_branch_length: int = field(default=18, metadata={"help": "SGLang's n-gram trie depth; radixrt matches whole recent texts, so this has no effect"})
    # ----- tensor parallelism (docs/SCALING.md) -----
    tp_size: int = field(default=1, metadata={"help": "tensor-parallel ranks: each holds 1/N of the heads and MLP (gloo on a CPU, NCCL on CUDA)"})
    nnodes: int = field(default=1, metadata={"help": "nodes the tensor-parallel ranks span (tp_size / nnodes ranks on each)"})
    node_rank: int = field(default=0, metadata={"help": "this node's index; nodes other than 0 run model ranks only (no HTTP)"})
    dist_init_addr: str | None = field(default=None, metadata={"help": "HOST:PORT where the ranks meet (node 0's address; default: a free local port)"})
    dp_size: int = field(default=1, metadata={"help": "data-parallel replicas: N > 1 starts N servers behind sglang-router's cache_aware policy (docs/SCALING.md)"})
    host: str = field(default="127.0.0.1", metadata={"help": "HTTP host"})
    port: int = field(default=30000, metadata={"help": "HTTP port"})
    served_model_name: str | None = field(default=None, metadata={"help": "model name reported by /v1/models"})
    # ----- the server's security (docs/SECURITY.md) -----
    api_key: str | None = field(default=None, metadata={"help": "require 'Authorization: Bearer KEY' on every route but /health (or set RADIXRT_API_KEY)"})
    admin_api_key: str | None = field(default=None, metadata={"help": "a separate key for /flush_cache and /abort_request (or set RADIXRT_ADMIN_API_KEY)"})
    max_request_bytes: int = field(default=8 << 20, metadata={"help": "largest request body in bytes (413 beyond)"})
    request_body_timeout: float = field(default=30.0, metadata={"help": "seconds a request body may take to arrive (408 beyond)"})
    request_header_timeout: float = field(default=10.0, metadata={"help": "seconds a connection may take to send a request head before it is closed"})
    max_connections: int = field(default=1024, metadata={"help": "concurrent connections and requests at most (503 beyond)"})
    max_prompt_chars: int | None = field(default=None, metadata={"help": "longest prompt in characters, checked before tokenizing (default: 32 x the context length)"})
    max_n: int = field(default=16, metadata={"help": "most samples per prompt (n)"})
    max_stop_strings: int = field(default=16, metadata={"help": "most stop strings per request"})
    max_stop_string_chars: int = field(default=256, metadata={"help": "longest stop string in characters"})
    max_messages: int = field(default=1024, metadata={"help": "most messages in one chat request"})
    max_tools: int = field(default=128, metadata={"help": "most tools in one chat request"})
    # ----- tool calling (docs/FEATURES.md) -----
    tool_call_parser: str = field(default="auto", metadata={"help": "tool-call format: auto (from the chat template), hermes (also qwen25, qwen3), llama3, mistral"})
    disable_tool_call_constraints: bool = field(default=False, metadata={"help": "let the model write tool calls freely instead of under each tool's JSON schema"})
    log_requests: bool = field(default=False, metadata={"help": "log each request's prompt and output text (off: sizes and timings only)"})

    SECRETS = ("api_key", "admin_api_key")

    def __post_init__(self) -> None:
        if self.api_key is None:
            self.api_key = env.get("RADIXRT_API_KEY") or None
        if self.admin_api_key is None:
            self.admin_api_key = env.get("RADIXRT_ADMIN_API_KEY") or None
        if self.speculative_algorithm is not None:
            algorithm = self.speculative_algorithm.upper()
            if algorithm != "NGRAM":
                raise ValueError(f"speculative_algorithm {self.speculative_algorithm!r}: radixrt drafts without a "
                                 "draft model, from text it has seen: NGRAM")
            self.speculative_algorithm = "NGRAM"
        if self.speculative_ngram_match_type.upper() not in ("BFS", "PROB"):
            raise ValueError("speculative_ngram_match_type must be BFS or PROB")

    def public_dict(self) -> dict[str, Any]:
        """Every option, with the keys masked: what may be shown or logged."""
        out = dataclasses.asdict(self)
        for name in self.SECRETS:
            if out[name]:
                out[name] = "***"
        return out

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        for f in fields(cls):
            flag = "--" + f.name.replace("_", "-")
            help_text = f.metadata.get("help", "")
            if f.type in ("bool", bool):
                parser.add_argument(flag, action="store_true", help=help_text)
                continue
            kind = _CLI_TYPES.get(str(f.type))
            if kind is None:
                raise TypeError(f"ServerArgs.{f.name}: no command-line parser for type {f.type}")
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
