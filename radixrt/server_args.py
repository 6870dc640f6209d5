"""Every runtime option, shared by `radixrt serve`, `radixrt.Engine(**kwargs)` and the benchmarks.

Each option is a field of ``ServerArgs``; its metadata drives the command line (``add_cli_args``) and the
keyword arguments (``from_kwargs``):

- ``help``: the flag's help; the default is appended unless it is None or False (a help that explains its
  default itself says "default" and gets nothing appended);
- ``aliases``: more flag names (SGLang's: ``--model-path``, ``--tp``, ``--dp``, ...); each is a keyword of
  ``Engine(...)`` too (``model_path=``);
- ``choices``: the values a fixed-choice option takes, so a typo fails when the flag is parsed;
- ``no_effect``: an SGLang flag that cannot change radixrt's results, accepted so launch scripts run unchanged
  (the text says why it has no effect);
- ``refused``: an SGLang flag asking for something radixrt does not serve: ``(what, values that ask for nothing)``;
  any other value is a ``ValueError`` naming it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field, fields
from typing import Any

from radixrt import env


# the bundled model (radixrt.model.weights.BUNDLED_MODELS) a runtime serves unless told otherwise
DEFAULT_MODEL = "smollm2-135m"

_CLI_TYPES = {"int": int, "float": float, "str": str, "int | None": int, "float | None": float,
              "str | None": str, "list[str] | None": str}

# The values of the fixed-choice options. The modules that act on them (model/runner.py's DTYPES,
# model/attention.py, scheduler/policy.py, server/openai_tools.py, reasoning/) take the same sets;
# tests/test_server_args.py keeps them equal.
DTYPES = ("auto", "bfloat16", "float32", "float16", "half", "float", "bf16", "fp32", "fp16")
DEVICES = ("cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "torch", "torch_native", "triton")
SCHEDULE_POLICIES = ("lpm", "dfs-weight", "fcfs")
TOOL_CALL_PARSERS = ("auto", "hermes", "qwen", "qwen25", "qwen3", "llama3", "llama3_json", "llama", "mistral",
                     "pythonic", "llama4", "llama4_pythonic")
REASONING_PARSERS = ("deepseek-r1", "qwen3", "qwen3-thinking")
ENGINE_SCHEDULERS = ("auto", "thread", "process")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


@dataclass
class ServerArgs:
    model: str = field(default=DEFAULT_MODEL, metadata={"help": "bundled model name, local HF folder, GGUF file, or hub id", "aliases": ("--model-path",)})
    dtype: str = field(default="auto", metadata={"help": "auto: bf16 on CUDA and where the CPU has AMX/AVX512-BF16, else fp32 (half is float16, float is float32)", "choices": DTYPES})
    device: str = field(default="cpu", metadata={"help": "where the model runs (SGLang picks CUDA when present; radixrt runs on the CPU unless told)", "choices": DEVICES})
    page_size: int = field(default=16, metadata={"help": "tokens per KV page"})
    kv_memory_gb: float | None = field(default=None, metadata={"help": "memory budget of the KV pool in GB (default: --mem-fraction-static if given, else 40%% of the memory available at start-up on a CPU, taken only as the cache fills, and 85%% of the free memory on a GPU)"})
    max_total_pages: int | None = field(default=None, metadata={"help": "fix the pool size in pages (overrides --kv-memory-gb and --max-total-tokens)"})
    context_length: int | None = field(default=None, metadata={"help": "maximum prompt + output tokens (default: the model's)"})
    attention_backend: str = field(default="auto", metadata={"help": "auto: triton on CUDA, torch on a CPU (torch_native is SGLang's name for torch)", "choices": ATTENTION_BACKENDS})
    schedule_policy: str = field(default="lpm", metadata={"help": "order of the waiting queue within a priority", "choices": SCHEDULE_POLICIES})
    schedule_low_priority_values_first: bool = field(default=False, metadata={"help": "a request's smaller priority value is the more urgent (default: the larger, as SGLang)"})
    priority_scheduling_preemption_threshold: int = field(default=10, metadata={"help": "a waiting request more urgent than running ones by more than this many priority levels retracts them when it finds no room (SGLang's default: 10)"})
    disable_priority_preemption: bool = field(default=False, metadata={"help": "priorities order the waiting queue only; a running request is never retracted for a more urgent one"})
    chunked_prefill_size: int = field(default=2048, metadata={"help": "prefill tokens per step (chunked prefill; -1: no chunking, a whole prompt in one step)"})
    enable_mixed_chunk: bool = field(default=False, metadata={"help": "decode in the same steps as prefill chunks (default: prefill first)"})
    max_running_requests: int = field(default=64, metadata={"help": "requests decoded together at most"})
    max_queued_requests: int = field(default=1024, metadata={"help": "waiting requests beyond which new ones get 503"})
    disable_radix_cache: bool = field(default=False, metadata={"help": "compute every prompt from scratch"})
    disable_partial_page_reuse: bool = field(default=False, metadata={"help": "share whole pages only"})
    disable_jump_forward: bool = field(default=False, metadata={"help": "decode constrained text token by token"})
    disable_overlap_schedule: bool = field(default=False, metadata={"help": "read each decode step's tokens back before launching the next (the overlap scheduler launches step N+1 first; on CUDA)"})
    engine_scheduler: str = field(default="auto", metadata={"help": "where an Engine runs its scheduler: thread (beside the caller, its scheduler and runner inspectable), process (a process of its own and the detokenizer in another, as radixrt serve runs them, so the scheduler shares no GIL with the caller); auto: process on CUDA, thread on a CPU. radixrt serve always uses processes", "choices": ENGINE_SCHEDULERS})
    enable_overlap_schedule: bool = field(default=False, metadata={"help": "use the overlap scheduler on a CPU too (it gains nothing there; for tests)"})
    disable_cuda_graph: bool = field(default=False, metadata={"help": "run decode steps eagerly on CUDA instead of replaying graphs captured at start-up"})
    cuda_graph_max_bs: int | None = field(default=None, metadata={"help": "largest decode batch replayed from a CUDA graph (default: --max-running-requests, at most 256)"})
    random_seed: int = field(default=0, metadata={"help": "seeds the sampling of requests that give no seed: the same requests in the same order sample the same tokens"})
    enable_deterministic_inference: bool = field(default=False, metadata={"help": "every request gets the same logits, to the last bit, whatever shares its batch, whether its prompt was cached, chunked or whole: each prompt token attends as a decode row would, on radixrt's own kernels (the CPU only, one process; a sampled request reproduces with a seed). Prefill runs slower (docs/BENCHMARKS.md)"})
    debug_checks: bool = field(default=False, metadata={"help": "check cache and page invariants after every step"})
    log_interval: float = field(default=10.0, metadata={"help": "seconds between stats log lines (0: off)"})
    # ----- sessions (/open_session, session_params; docs/FEATURES.md) -----
    session_max_pages: int | None = field(default=None, metadata={"help": "KV pages one session may pin in the prefix cache (its context's first pages; 0: none; default: no cap of its own)"})
    sessions_max_pages: int | None = field(default=None, metadata={"help": "KV pages all sessions may pin together; beyond it the least recently used sessions lose their pins (default: no cap; pins always yield to requests that need the room)"})
    session_timeout: float | None = field(default=None, metadata={"help": "close a session idle this many seconds (default: never)"})
    max_open_sessions: int = field(default=1024, metadata={"help": "open sessions at most (more are refused)"})
    # ----- speculative decoding (docs/FEATURES.md) -----
    speculative_algorithm: str | None = field(default=None, metadata={"help": "NGRAM: each decoding request drafts tokens from text the runtime has seen (the radix cache's continuation of its exact context, else n-gram matches in its own context and in recent requests) and the model verifies the draft in the same forward; the tokens are the same as without it (default: off)", "choices": ("NGRAM",)})
    speculative_num_draft_tokens: int = field(default=8, metadata={"help": "most draft tokens a request verifies in one step (the length adapts to how often its drafts are accepted)"})
    speculative_ngram_min_match_window_size: int = field(default=1, metadata={"help": "fewest latest tokens an n-gram draft's match must share"})
    speculative_ngram_max_match_window_size: int = field(default=12, metadata={"help": "most latest tokens compared when choosing among n-gram matches"})
    speculative_ngram_capacity: int = field(default=262144, metadata={"help": "tokens of recent requests' prompts and outputs kept for n-gram drafts"})
    disable_speculative_cache_drafts: bool = field(default=False, metadata={"help": "draft from n-gram matches only, never from continuations in the radix cache"})
    speculative_ngram_min_bfs_breadth: int = field(default=1, metadata={"no_effect": "radixrt drafts one chain of tokens, not a tree"})
    speculative_ngram_max_bfs_breadth: int = field(default=10, metadata={"no_effect": "radixrt drafts one chain of tokens, not a tree"})
    speculative_ngram_match_type: str = field(default="BFS", metadata={"no_effect": "radixrt drafts one chain of tokens, not a tree (BFS or PROB)", "choices": ("BFS", "PROB")})
    speculative_ngram_branch_length: int = field(default=18, metadata={"no_effect": "radixrt matches whole recent texts, not a trie of bounded depth"})
    # ----- tensor parallelism (docs/SCALING.md) -----
    tp_size: int = field(default=1, metadata={"help": "tensor-parallel ranks: each holds 1/N of the heads and MLP (gloo on a CPU, NCCL on CUDA)", "aliases": ("--tp", "--tensor-parallel-size")})
    nnodes: int = field(default=1, metadata={"help": "nodes the tensor-parallel ranks span (tp_size / nnodes ranks on each)"})
    node_rank: int = field(default=0, metadata={"help": "this node's index; nodes other than 0 run model ranks only (no HTTP)"})
    dist_init_addr: str | None = field(default=None, metadata={"help": "HOST:PORT where the ranks meet (node 0's address; default: a free local port)", "aliases": ("--nccl-init-addr",)})
    dp_size: int = field(default=1, metadata={"help": "data-parallel replicas: N > 1 starts N servers behind sglang-router's cache_aware policy (docs/SCALING.md)", "aliases": ("--dp", "--data-parallel-size")})
    host: str = field(default="127.0.0.1", metadata={"help": "HTTP host"})
    port: int = field(default=30000, metadata={"help": "HTTP port"})
    served_model_name: str | None = field(default=None, metadata={"help": "model name reported by /v1/models"})
    weight_version: str = field(default="default", metadata={"help": "the served weights' version, in each response's meta_info and /get_weight_version; updates of weights may change it (unset: 'default', as SGLang names it)"})
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
    tool_call_parser: str = field(default="auto", metadata={"help": "tool-call format: auto (from the chat template), hermes (also qwen, qwen25, qwen3), llama3 (also llama3_json, llama), mistral, pythonic (also llama4, llama4_pythonic)", "choices": TOOL_CALL_PARSERS})
    disable_tool_call_constraints: bool = field(default=False, metadata={"help": "let the model write tool calls freely instead of under each tool's JSON schema"})
    log_requests: bool = field(default=False, metadata={"help": "log each request's prompt and output text (off: sizes and timings only)"})
    # ----- reasoning models (docs/FEATURES.md) -----
    reasoning_parser: str | None = field(default=None, metadata={"help": "split a reasoning model's <think> block into reasoning_content: deepseek-r1 (reasoning from the first token), qwen3 (from a <think>, or from the first token when the prompt ends in one), qwen3-thinking (from the first token)", "choices": REASONING_PARSERS})
    # ----- SGLang's launch flags that radixrt serves by other means -----
    tokenizer_path: str | None = field(default=None, metadata={"help": "load the tokenizer from this folder (default: the model's)"})
    mem_fraction_static: float | None = field(default=None, metadata={"help": "fraction of the device's memory for weights plus KV pool (SGLang's meaning: the pool gets what is left of it after the weights; on a CPU, of the memory available at start-up); --kv-memory-gb wins"})
    max_total_tokens: int | None = field(default=None, metadata={"help": "fix the pool size in tokens (rounded up to whole pages)"})
    chat_template: str | None = field(default=None, metadata={"help": "a Jinja chat template file to use instead of the tokenizer's"})
    log_level: str = field(default="info", metadata={"help": "logging level of every process", "choices": LOG_LEVELS})
    log_level_http: str | None = field(default=None, metadata={"help": "logging level of the HTTP server, with an access log line per request at info or debug (default: warning, no access log)", "choices": LOG_LEVELS})
    is_embedding: bool = field(default=False, metadata={"help": "serve the model for embeddings only: no LM head is loaded, generation requests are refused, /v1/embeddings, /encode and Engine.encode pool as the checkpoint's sentence-transformers files say (default: the last token, normalized); an embedding checkpoint (architecture LlamaModel, MistralModel, Qwen2Model or Qwen3Model) is served so without the flag"})
    json_model_override_args: str = field(default="{}", metadata={"help": "a JSON object of model config fields to override before the model is built (vLLM's --hf-overrides), e.g. '{\"is_matryoshka\": true}' to allow an embedding's dimensions"})
    enable_weights_cpu_backup: bool = field(default=False, metadata={"help": "weights released by /release_memory_occupation move to host memory and come back as they were (on a CPU they are there already and stay); without it they are read from their checkpoint again"})
    # ----- SGLang's launch flags that cannot change radixrt's results: accepted, no effect -----
    trust_remote_code: bool = field(default=False, metadata={"no_effect": "radixrt runs its own model code, never a checkpoint's"})
    enable_metrics: bool = field(default=False, metadata={"no_effect": "/metrics always answers"})
    enable_cache_report: bool = field(default=False, metadata={"no_effect": "usage always reports cached tokens"})
    enable_priority_scheduling: bool = field(default=False, metadata={"no_effect": "the scheduler always honours request priorities"})
    skip_server_warmup: bool = field(default=False, metadata={"no_effect": "radixrt warms up while it loads, before it listens"})
    enable_torch_compile: bool = field(default=False, metadata={"no_effect": "a speed option; radixrt's kernels are compiled ahead"})
    disable_custom_all_reduce: bool = field(default=False, metadata={"no_effect": "radixrt reduces through torch.distributed"})
    enable_p2p_check: bool = field(default=False, metadata={"no_effect": "a CUDA peer-access check"})
    enable_memory_saver: bool = field(default=False, metadata={"no_effect": "memory can always be given back (/release_memory_occupation); radixrt needs no allocator of its own for it"})
    show_time_cost: bool = field(default=False, metadata={"no_effect": "a profiling print"})
    watchdog_timeout: float | None = field(default=None, metadata={"no_effect": "a batch that fails is failed, not waited on"})
    stream_interval: int | None = field(default=None, metadata={"no_effect": "streams send what each scheduler step produced"})
    max_prefill_tokens: int | None = field(default=None, metadata={"no_effect": "a prefill step's tokens are bounded by --chunked-prefill-size"})
    schedule_conservativeness: float | None = field(default=None, metadata={"no_effect": "admission reserves pages by its own decaying ratio"})
    decode_log_interval: int | None = field(default=None, metadata={"no_effect": "stats are logged every --log-interval seconds"})
    base_gpu_id: int | None = field(default=None, metadata={"no_effect": "radixrt uses the first visible GPU (set CUDA_VISIBLE_DEVICES)"})
    download_dir: str | None = field(default=None, metadata={"no_effect": "hub downloads go to the Hugging Face cache"})
    file_storage_path: str | None = field(default=None, metadata={"no_effect": "radixrt has no files API"})
    load_format: str = field(default="auto", metadata={"no_effect": "the format is read from the path (a folder of safetensors, or a .gguf file)", "choices": ("auto", "safetensors", "gguf")})
    quantization: str | None = field(default=None, metadata={"help": "fp8: quantize the model's projections to fp8 (e4m3, 128x128 blocks, weight-only) as they load; a checkpoint quantized to fp8 needs no flag (radixrt.model.fp8). Other methods are refused; a GGUF file is dequantized at load", "choices": ("fp8",)})
    # ----- LoRA adapters (radixrt.model.lora) -----
    enable_lora: bool = field(default=False, metadata={"help": "serve LoRA adapters, loaded at start-up (--lora-paths) or later (/load_lora_adapter); implied by --lora-paths"})
    lora_paths: list[str] | None = field(default=None, metadata={"help": "LoRA adapters to load at start-up, each PATH (named by its path), NAME=PATH, or JSON {\"lora_name\": ..., \"lora_path\": ...}; a path is a PEFT adapter folder or a hub id"})
    max_loras_per_batch: int = field(default=8, metadata={"help": "different adapters a batch may hold at most (the base model not counted); requests for more wait"})
    max_loaded_loras: int | None = field(default=None, metadata={"help": "adapters loaded at once at most (a load beyond it is refused; default: no limit)"})
    max_lora_rank: int | None = field(default=None, metadata={"help": "refuse adapters of a larger rank (default: any rank)"})
    lora_target_modules: list[str] | None = field(default=None, metadata={"no_effect": "an adapter may target any projection of the decoder; each adapter's own are read from it"})
    lora_backend: str | None = field(default=None, metadata={"no_effect": "radixrt picks the low-rank products itself (the packed CPU kernels in decode steps, torch's elsewhere)"})
    lora_eviction_policy: str | None = field(default=None, metadata={"no_effect": "every loaded adapter stays in memory: none is evicted"})
    max_lora_chunk_size: int | None = field(default=None, metadata={"no_effect": "a setting of SGLang's chunked SGMV kernels, which radixrt does not use"})
    enable_lora_overlap_loading: bool = field(default=False, metadata={"no_effect": "an adapter is loaded once, into the memory the forwards read"})
    # ----- SGLang's launch flags asking for what radixrt does not serve: refused unless they ask for nothing -----
    kv_cache_dtype: str = field(default="auto", metadata={"refused": ("a KV cache dtype other than the model's", ("auto",))})
    tokenizer_mode: str = field(default="auto", metadata={"refused": ("the slow tokenizer", ("auto",))})
    skip_tokenizer_init: bool = field(default=False, metadata={"refused": ("serving without a tokenizer", (False,))})
    revision: str | None = field(default=None, metadata={"refused": ("a hub revision other than the default", (None, "main"))})

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
        if self.enable_deterministic_inference:
            self._check_deterministic()
        if self.lora_paths is not None or self.enable_lora:
            self._check_lora()
        self.model_overrides()  # a ValueError for anything but a JSON object
        for f in fields(self):
            value = getattr(self, f.name)
            choices = f.metadata.get("choices")
            if choices is not None and value is not None and value not in choices:
                raise ValueError(f"{f.name} must be one of {', '.join(choices)}; got {value!r}")
            refused = f.metadata.get("refused")
            if refused is not None and value not in refused[1]:
                raise ValueError(f"{f.name}={value!r}: radixrt does not serve {refused[0]}")

    def _check_lora(self) -> None:
        if isinstance(self.lora_paths, str):
            self.lora_paths = [self.lora_paths]
        self.enable_lora = True
        adapters = self.lora_adapters()
        names = [name for name, _ in adapters]
        if len(set(names)) != len(names):
            raise ValueError(f"lora_paths names an adapter twice: {', '.join(sorted(n for n in names if names.count(n) > 1))}")
        if self.max_loaded_loras is not None and len(adapters) > self.max_loaded_loras:
            raise ValueError(f"{len(adapters)} lora_paths for max_loaded_loras {self.max_loaded_loras}")
        if self.tp_size > 1:
            raise ValueError("LoRA adapters do not run with tensor parallelism (tp_size > 1) yet")
        if self.enable_deterministic_inference:
            raise ValueError("enable_deterministic_inference does not run with LoRA adapters: their low-rank "
                             "products are torch's, whose sums may change with the rows beside them")
        if self.max_loras_per_batch < 1:
            raise ValueError("max_loras_per_batch must be >= 1")

    def lora_adapters(self) -> list[tuple[str, str]]:
        """``--lora-paths`` as (name, path) pairs: ``PATH`` (named by itself), ``NAME=PATH`` or SGLang's JSON form."""
        out = []
        for entry in self.lora_paths or ():
            if not isinstance(entry, str) or not entry.strip():
                raise ValueError(f"lora_paths entry {entry!r} is not an adapter path")
            entry = entry.strip()
            if entry.startswith("{"):
                try:
                    spec = json.loads(entry)
                    out.append((str(spec["lora_name"]), str(spec["lora_path"])))
                except (ValueError, KeyError, TypeError):
                    raise ValueError(f"lora_paths entry {entry!r}: the JSON form is "
                                     '{"lora_name": ..., "lora_path": ...}') from None
            elif "=" in entry:
                name, _, path = entry.partition("=")
                if not name or not path:
                    raise ValueError(f"lora_paths entry {entry!r}: NAME=PATH needs both")
                out.append((name, path))
            else:
                out.append((entry, entry))
        return out

    def model_overrides(self) -> dict[str, Any]:
        """``--json-model-override-args`` as a dict of config fields (empty for "" or "{}")."""
        text = (self.json_model_override_args or "").strip() or "{}"
        try:
            overrides = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"json_model_override_args is not JSON: {exc}") from None
        if not isinstance(overrides, dict):
            raise ValueError("json_model_override_args must be a JSON object of config fields")
        return overrides

    def _check_deterministic(self) -> None:
        """What deterministic inference cannot run with, refused before anything starts (the model runner checks
        the kernels it needs as it loads)."""
        if self.device != "cpu":
            raise ValueError(f"enable_deterministic_inference runs on the CPU only, not on {self.device!r}: on a GPU "
                             "radixrt's matrix products (cuBLAS) and split attention change with the batch")
        if self.tp_size > 1:
            raise ValueError("enable_deterministic_inference does not run with tensor parallelism (tp_size > 1): "
                             "the all-reduce's sums are not fixed per row")
        if self.attention_backend == "triton":
            raise ValueError("enable_deterministic_inference runs on the torch attention backend, not triton")
        if self.dtype in ("float16", "half", "fp16"):
            raise ValueError("enable_deterministic_inference runs in float32 or bfloat16, not float16")

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
            flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
            help_text = _help(f)
            if f.type in ("bool", bool):
                parser.add_argument(*flags, dest=f.name, action="store_true", help=help_text)
                continue
            kind = _CLI_TYPES.get(str(f.type))
            if kind is None:
                raise TypeError(f"ServerArgs.{f.name}: no command-line parser for type {f.type}")
            many = {"nargs": "+"} if str(f.type).startswith("list[") else {}
            parser.add_argument(*flags, dest=f.name, type=kind, default=f.default, help=help_text,
                                choices=f.metadata.get("choices"), **many)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "ServerArgs":
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    @classmethod
    def keyword_names(cls) -> dict[str, str]:
        """Every keyword ``from_kwargs`` takes -> its option: the options' names and their aliases."""
        names = {f.name: f.name for f in fields(cls)}
        for f in fields(cls):
            names.update({alias[2:].replace("-", "_"): f.name for alias in f.metadata.get("aliases", ())})
        return names

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "ServerArgs":
        """The options from keyword arguments (SGLang's names too: ``model_path``, ``tp``, ...); TypeError for an
        unknown one or an option given twice under two names, ValueError for a value the option refuses."""
        names = cls.keyword_names()
        unknown = sorted(set(kwargs) - set(names))
        if unknown:
            raise TypeError(f"unknown runtime option(s): {', '.join(unknown)}")
        options: dict[str, Any] = {}
        for key, value in kwargs.items():
            name = names[key]
            if name in options:
                raise TypeError(f"runtime option {name} given twice (as {key} and another name)")
            options[name] = value
        return cls(**options)

    def replace(self, **changes: Any) -> "ServerArgs":
        return dataclasses.replace(self, **changes)


def _help(f: dataclasses.Field) -> str:
    """A flag's help: its text, what SGLang's flags radixrt accepts do here, and its default (once)."""
    no_effect, refused = f.metadata.get("no_effect"), f.metadata.get("refused")
    if no_effect is not None:
        return f"SGLang's flag, accepted with no effect: {no_effect}"
    if refused is not None:
        return f"SGLang's flag, refused unless {' or '.join(map(str, refused[1]))}: radixrt does not serve {refused[0]}"
    text = f.metadata.get("help", "")
    if f.default in (None, False) or "default" in text:
        return text
    return f"{text} (default: {f.default})"
