"""Loads a model folder into our modules and runs one forward per batch over the page pool.

Under tensor parallelism (``world``: a ``radixrt.distributed.world.TPWorld``) the runner holds this rank's
shard and a pool of this rank's K/V heads, with the page count every rank agrees on; rank 0's ``forward``
first broadcasts the batch to the followers, and a forward that fails there kills them (the ranks would be
out of step). The only other write to K/V, the radix cache's copy of a partly matched page, is recorded on
rank 0 (``MirroredPagePool``) and sent with the next batch; followers apply it before that forward, so
every pool goes through the same writes in the same order.

On CUDA (one rank, the Triton attention backend), decode batches replay CUDA graphs captured at start-up
(``model/cuda_graph.py``), unless ``disable_cuda_graph`` or the model is a mixture of experts (its forward reads
the experts' row counts on the host); any other batch runs eagerly. A ``graph_factory`` given by a caller (tests on a CPU)
takes the CUDA graphs' place.

``release_memory`` and ``resume_memory`` give the memory of the weights, the KV pool and the decode graphs back
between uses and take it again (SGLang's ``release_memory_occupation``, tags ``MEMORY_TAGS``): the weights are
dropped and built again from the checkpoint (``model_path``, with ``overlay``), so tensors copied in place since it
was read are not kept (``weights_diverged`` says whether there are any), or with a backup moved to host memory and
back (``model/offload.py``); the pool keeps its tensors
(``PagePool.release_memory``); the graphs, which replay the addresses of both, are captured again once all three are
back.

An embedding model (``is_embedding``, or an embedding checkpoint's architecture: ``model/families.py``) is built
without its LM head: its forward returns the final norm's output at the logits rows, and it captures no graphs (it
never decodes). ``pooling`` (``model/pooling.py``) says how its requests' vectors are made. A classifier or reward
model (``*ForSequenceClassification``) is such a model with a ``score`` head: its requests' vectors are the scores
at the prompt's last token.
"""

from __future__ import annotations

import gc
import logging
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from radixrt import env
from radixrt.kernels import cpu_kernels
from radixrt.memory.page_pool import KVLayout, PagePool, default_budget_bytes, fraction_budget_bytes
from radixrt.model.cpu_malloc import keep_freed_memory, release_freed_memory
from radixrt.model.attention import AttentionBackend, create_attention_backend
from radixrt.model.cuda_graph import CudaGraphFactory, GraphFactory, GraphRunner
from radixrt.model.forward_batch import ForwardBatch, SeqChunk
from radixrt.model.lora import Adapters
from radixrt.model.families import (
    is_classifier_checkpoint,
    is_embedding_checkpoint,
    model_class,
    served_config,
    text_model_tensors,
)
from radixrt.model.fp8 import fp8_scheme
from radixrt.model.layers import long_rope_from
from radixrt.model.llama import (
    check_tensor_parallel,
    head_dim_of,
    kv_replicas,
)
from radixrt.model.moe import is_moe
from radixrt.model.offload import offload, restore
from radixrt.model.parallel import SINGLE
from radixrt.model.pooling import Pooling, matryoshka, read_pooling
from radixrt.model.reload import check_same_model, check_tensor_names, checkpoint_shapes, copy_parameters

if TYPE_CHECKING:
    from radixrt.distributed.world import TPWorld
    from radixrt.server_args import ServerArgs

logger = logging.getLogger("radixrt.runner")
# the largest batch captured by default (--cuda-graph-max-bs); larger decode batches run eagerly
DEFAULT_CUDA_GRAPH_MAX_BS = 256
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")  # SGLang's names of what release_memory gives back

# What `--dtype auto` resolves to, whatever the CPU: float32 or bfloat16 (unset: bf16 where the CPU runs it fast).
AUTO_DTYPE_ENV = "RADIXRT_AUTO_DTYPE"
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def parse_dtype(dtype: str | torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        forced = env.get(AUTO_DTYPE_ENV)
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


def load_config(model_path: Path, overrides: dict | None = None):
    """The config of the model radixrt runs, with ``overrides`` (``--json-model-override-args``) applied."""
    from transformers import AutoConfig

    config = served_config(AutoConfig.from_pretrained(model_path))
    for name, value in (overrides or {}).items():
        setattr(config, name, value)
    model_class(config)  # a ValueError for an architecture radixrt does not serve
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


def check_deterministic(device: torch.device, world: TPWorld | None) -> None:
    """Deterministic inference (``--enable-deterministic-inference``) needs kernels that compute a row the same way
    whatever rows come with it: radixrt's own CPU kernels on one CPU process. Elsewhere a ``ValueError`` says why."""
    if device.type != "cpu":
        raise ValueError("--enable-deterministic-inference runs on the CPU only: on a GPU radixrt's matrix products "
                         "(cuBLAS) and split attention change with the batch")
    if world is not None:
        raise ValueError("--enable-deterministic-inference does not run with tensor parallelism (--tp-size > 1): "
                         "the all-reduce's sums are not fixed per row")


def graph_refusal(config) -> str | None:
    """Why this model's decode steps cannot be captured as CUDA graphs, or None where they can."""
    if is_moe(config):
        return "a mixture-of-experts forward reads its experts' row counts on the host (it runs eagerly)"
    return None


class MirroredPagePool(PagePool):
    """Rank 0's pool: records each page copy, for the followers to repeat before the next forward."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pending_copies: list[tuple[int, int, int]] = []

    def copy_page_prefix(self, src: int, dst: int, num_tokens: int) -> None:
        super().copy_page_prefix(src, dst, num_tokens)
        self.pending_copies.append((src, dst, num_tokens))


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
        world: TPWorld | None = None,
        disable_cuda_graph: bool = False,
        cuda_graph_max_bs: int | None = None,
        graph_factory: GraphFactory | None = None,
        mem_fraction_static: float | None = None,
        deterministic: bool = False,
        enable_lora: bool = False,
        lora_adapters: list[tuple[str, str]] | None = None,
        max_lora_rank: int | None = None,
        quantization: str | None = None,
        is_embedding: bool = False,
        model_overrides: dict | None = None,
    ) -> None:
        started = time.perf_counter()
        self.model_path = Path(model_path)
        self.config = load_config(self.model_path, model_overrides)
        # served for embeddings only: no LM head; its pooling from the checkpoint's sentence-transformers files. A
        # classifier's request pools its scores at the last token, unnormalized
        self.embedding_only = is_embedding or is_embedding_checkpoint(self.config)
        self.classifier = is_classifier_checkpoint(self.config)
        if self.classifier:
            self.pooling = Pooling("last", normalize=False)
        else:
            self.pooling = read_pooling(self.model_path) if self.embedding_only else Pooling()
        self.matryoshka = matryoshka(self.config)
        self.world = world
        tp = SINGLE if world is None else world.tp
        check_tensor_parallel(self.config, tp.size)
        self.device = torch.device(device if world is None else world.device)
        self.dtype = parse_dtype(dtype, self.device)
        if deterministic:
            check_deterministic(self.device, world)
        self.deterministic = deterministic
        if self.device.type == "cpu":
            keep_freed_memory()
            cpu_kernels.load()  # compiled on the first run ever (about 50 s), then loaded from the cache
        self.context_length = int(context_length or self.config.max_position_embeddings)
        self.tp, self.quantization, self.model_overrides = tp, quantization, model_overrides
        self.overlay: dict[str, torch.Tensor] = {}  # tensors updated since model_path's (update_tensors)
        self.weights_diverged = False  # tensors copied in place since model_path was read, not in overlay
        self.released: set[str] = set()  # of MEMORY_TAGS, by release_memory
        self._offloaded: list | None = None  # the weights' storages in host memory (release_memory's backup)
        self.model, self.packed_linears = self._build_model(self.model_path, self.device, self.device.type == "cpu")
        self.long_rope_from = long_rope_from(self.model)  # forward batches map positions to its rotary rows
        self.adapters: Adapters | None = None
        if enable_lora or lora_adapters:
            if is_moe(self.config):
                raise ValueError("LoRA adapters do not run on mixture-of-experts models yet")
            if world is not None:
                raise ValueError("LoRA adapters do not run with tensor parallelism (--tp-size > 1) yet")
            self.adapters = Adapters(self.config, self.device, max_lora_rank, self.dtype)
            for name, path in lora_adapters or ():
                adapter = self.adapters.load(name, path)
                logger.info("LoRA adapter %r from %s: rank %d on %s", name, path, adapter.rank,
                            ", ".join(adapter.targets))
        layout = KVLayout(
            num_layers=self.config.num_hidden_layers,
            kv_heads=self.config.num_key_value_heads * kv_replicas(self.config, tp.size) // tp.size,
            head_dim=head_dim_of(self.config),
            page_size=page_size,
            dtype=self.dtype,
        )
        if kv_memory_gb is None and mem_fraction_static is not None:
            kv_memory_gb = fraction_budget_bytes(self.device, mem_fraction_static) / 1024**3
        if world is not None:
            num_pages = world.agree_min(num_pages or self._pages_per_rank(layout, kv_memory_gb, world))
            self.pool = (MirroredPagePool if world.rank == 0 else PagePool)(layout, num_pages, self.device)
        elif num_pages is not None:
            self.pool = PagePool(layout, num_pages, self.device)
        else:
            self.pool = PagePool.from_memory_budget(layout, kv_memory_gb, self.device)
        self.attention: AttentionBackend = create_attention_backend(self.pool, attention_backend, deterministic)
        self.graphs: GraphRunner | None = None
        self._graph_capture: tuple[GraphFactory, int] | None = None  # how the graphs were captured
        if self.device.type == "cuda" and world is None:  # ranks would have to warm up in step
            self._warm_up()
        if self.embedding_only:
            graph_factory, disable_cuda_graph = None, True  # an embedding model never decodes
        # graphs need a forward that never syncs: the Triton backend's (the torch one plans on the host)
        if (graph_factory is None and self.device.type == "cuda" and world is None and not disable_cuda_graph
                and self.attention.backend == "triton"):
            refusal = graph_refusal(self.config)
            if refusal is None:
                graph_factory = CudaGraphFactory(self.device)
            else:
                logger.info("decode graphs off: %s", refusal)
        if graph_factory is not None:
            self._capture_graphs(graph_factory, cuda_graph_max_bs or DEFAULT_CUDA_GRAPH_MAX_BS)
        self.load_seconds = time.perf_counter() - started

    def _build_model(self, model_path: Path, device: torch.device, pack: bool,
                     overlay: dict[str, torch.Tensor] | None = None):
        """The served model with the weights of ``model_path`` (those named in ``overlay`` replaced by its tensors),
        ready to run (``pack``: its linear layers packed for this CPU's kernels); returns it and how many weights
        were packed."""
        config = self.config
        # Parameters are created with torch.empty, so building the modules costs no initialisation.
        with torch.device(device):
            model = model_class(config)(config, max_positions=self.context_length, tp=self.tp)
            if self.classifier:
                model.add_classifier(config.num_labels)
            elif self.embedding_only:
                model.drop_head()
        model.fp8_scheme = fp8_scheme(config, self.quantization)
        tensors = iterate_safetensors(model_path)
        if overlay:
            tensors = ((name, overlay.get(name, tensor)) for name, tensor in tensors)
        model.load_weights(text_model_tensors(tensors))
        model.to(self.dtype)
        model.eval()
        packed = model.pack_linear_weights(self.deterministic) if pack else 0
        model.dequantize_fp8_weights()  # those no fp8 kernel runs here (on CUDA all)
        model.bind_attributes()  # the model is final: its weights are read as plain attributes
        return model, packed

    def update_weights(self, model_path: Path) -> None:
        """Serve the weights of ``model_path`` from the next forward on (radixrt.model.reload says how). A
        ``ValueError`` (or the loader's error) leaves the served weights as they were."""
        check_same_model(self.config, load_config(model_path, self.model_overrides))
        self._replace_model(model_path, {})

    def update_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Serve these tensors (checkpoint names, any subset) in place of the served ones from the next forward on;
        the rest stay. A ``ValueError`` names a tensor the checkpoint lacks or holds in another shape."""
        self._check_one_rank()
        check_tensor_names(checkpoint_shapes(self.model_path), tensors)
        if self.model.fp8_scheme is None:  # each copied into its place (a packed layer packed again)
            self.model.update_weights_in_place(text_model_tensors(tensors.items()), self.deterministic)
            self.weights_diverged = True
            logger.info("%d tensors loaded in place", len(tensors))
        else:
            self._replace_model(self.model_path, {**self.overlay, **{n: t.cpu() for n, t in tensors.items()}})

    def read_weight(self, name: str) -> torch.Tensor:
        """The served values of checkpoint tensor ``name`` in the checkpoint's layout (``lm_head.weight`` of a model
        whose head is its embedding: the embedding); a ``KeyError`` for a name the checkpoint lacks, a
        ``ValueError`` for one the model does not hold as one tensor."""
        shapes = checkpoint_shapes(self.model_path)
        tied_head = name == "lm_head.weight" and self.model.lm_head is None and "model.embed_tokens.weight" in shapes
        if tied_head:
            shapes.setdefault(name, shapes["model.embed_tokens.weight"])
        if name not in shapes:
            raise KeyError(f"{name!r} is not a tensor of the served checkpoint (names as in its safetensors files)")
        return self.model.read_weight(name, shapes[name])

    def _check_one_rank(self, what: str = "weights cannot be updated") -> None:
        if self.world is not None:
            raise ValueError(f"{what} under tensor parallelism (--tp-size > 1) yet")

    def _replace_model(self, model_path: Path, overlay: dict[str, torch.Tensor]) -> None:
        self._check_one_rank()
        started = time.perf_counter()
        in_place = self.packed_linears == 0
        model, _ = self._build_model(model_path, torch.device("cpu"), pack=not in_place, overlay=overlay)
        if in_place:  # the graphs replay the served tensors: the new values go into them
            copy_parameters(self.model, model)
        else:
            self.model = model
        self.model_path, self.overlay, self.weights_diverged = Path(model_path), overlay, False
        logger.info("weights of %s%s loaded %s in %.1f s", model_path, f" and {len(overlay)} tensors" if overlay else "",
                    "in place" if in_place else "and swapped in", time.perf_counter() - started)

    def release_memory(self, tags: set[str], backup_weights: bool = False) -> None:
        """Give back the memory of ``tags`` (of ``MEMORY_TAGS``; the module doc says how), every KV page free. The
        graphs go with the weights or the pool, whose addresses they replay. ``backup_weights``: the weights move to
        host memory instead (``model/offload.py``; on a CPU they are there already and stay), and come back as
        they were."""
        self._check_one_rank("memory cannot be released")
        self.graphs = None  # whatever the tags: captured again on resume
        if "kv_cache" in tags:
            self.pool.release_memory()
        if "weights" in tags and "weights" not in self.released:
            if not backup_weights:
                self.model = None
            elif self.device.type != "cpu":
                self._offloaded = offload(self.model)
        self.released |= tags
        gc.collect()  # modules hold reference cycles
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        else:
            release_freed_memory()
        logger.info("memory released: %s", ", ".join(sorted(self.released)))

    def resume_memory(self, tags: set[str]) -> bool:
        """Take the memory of ``tags`` again; returns whether the weights came back without tensors that had been
        copied in place (``weights_diverged``): their checkpoint's values, not the ones served before."""
        started, lost_updates = time.perf_counter(), False
        if "weights" in tags and self.model is None:
            lost_updates = self.weights_diverged
            self.model, self.packed_linears = self._build_model(self.model_path, self.device,
                                                                self.device.type == "cpu", self.overlay)
            self.weights_diverged = False
        elif "weights" in tags and self._offloaded is not None:
            restore(self._offloaded)
            self._offloaded = None
        if "kv_cache" in tags:
            self.pool.restore_memory()
        self.released -= tags
        if self._graph_capture is not None and self.graphs is None and not self.released:
            self._capture_graphs(*self._graph_capture)
        logger.info("memory resumed: %s in %.1f s", ", ".join(sorted(tags)), time.perf_counter() - started)
        return lost_updates

    def _warm_up(self) -> None:
        """Compile and autotune the kernels of prefill, extend and decode now, not on the first requests: a few
        small batches whose K/V land in pages no request holds yet (every request writes its pages before it
        reads them)."""
        started = time.perf_counter()
        size = self.page_size
        pages = list(range(min(self.pool.num_pages, -(-96 // size))))
        tokens = [1 + i % 100 for i in range(len(pages) * size)]
        half = len(tokens) // 2
        with torch.inference_mode():
            self.forward(ForwardBatch.build([SeqChunk(tokens[:half], 0, pages)], size, self.device))
            self.forward(ForwardBatch.build([SeqChunk(tokens[half:-1], half, pages)], size, self.device))
            self.forward(ForwardBatch.build([SeqChunk(tokens[-1:], len(tokens) - 1, pages)], size, self.device))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        logger.info("kernels warmed up in %.1f s", time.perf_counter() - started)

    def _capture_graphs(self, factory: GraphFactory, max_bs: int) -> None:
        max_pages = math.ceil(self.context_length / self.page_size)
        self._graph_capture = factory, max_bs
        self.graphs = GraphRunner(self._eager_forward, max_bs, max_pages, self.device, factory)
        try:
            with torch.inference_mode():
                self.graphs.capture()
        except torch.OutOfMemoryError as exc:
            raise RuntimeError("capturing the decode graphs ran out of device memory: lower --kv-memory-gb or "
                               "--cuda-graph-max-bs, or pass --disable-cuda-graph") from exc
        logger.info("decode graphs: %d batch sizes up to %d captured in %.1f s, %.0f MB",
                    len(self.graphs.buckets), self.graphs.max_bs, self.graphs.capture_seconds,
                    self.graphs.capture_bytes / 2**20)

    @classmethod
    def from_args(cls, model_path: Path, args: ServerArgs, world: TPWorld | None = None) -> "ModelRunner":
        num_pages = args.max_total_pages
        if num_pages is None and args.max_total_tokens is not None:
            num_pages = -(-args.max_total_tokens // args.page_size)
        return cls(model_path, dtype=args.dtype, page_size=args.page_size, num_pages=num_pages,
                   kv_memory_gb=args.kv_memory_gb, mem_fraction_static=args.mem_fraction_static,
                   attention_backend=args.attention_backend,
                   context_length=args.context_length, device=args.device, world=world,
                   disable_cuda_graph=args.disable_cuda_graph,
                   deterministic=args.enable_deterministic_inference,
                   enable_lora=args.enable_lora, lora_adapters=args.lora_adapters(),
                   max_lora_rank=args.max_lora_rank, quantization=args.quantization,
                   is_embedding=args.is_embedding, model_overrides=args.model_overrides(),
                   cuda_graph_max_bs=args.cuda_graph_max_bs or min(args.max_running_requests, DEFAULT_CUDA_GRAPH_MAX_BS))

    def _pages_per_rank(self, layout: KVLayout, kv_memory_gb: float | None, world: TPWorld) -> int:
        """A rank's pages: ``kv_memory_gb`` each, or by default its share of what this node's ranks share."""
        if kv_memory_gb is not None:
            budget = kv_memory_gb * 1024**3
        else:
            shared = 1 if self.device.type == "cuda" else world.size // world.args.nnodes
            budget = default_budget_bytes(self.device) / shared
        return max(1, layout.pages_for_budget(budget))

    def apply_page_copies(self, copies: list[tuple[int, int, int]]) -> None:
        """A follower: repeat rank 0's page copies (``MirroredPagePool``) before the forward they precede."""
        for src, dst, num_tokens in copies:
            self.pool.copy_page_prefix(src, dst, num_tokens)

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    def _eager_forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model(batch, self.attention)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits (fp32) of the batch's logits rows. From a graph replay they are a view of the graph's output:
        read them before the next forward."""
        if batch.lora_spans is not None:
            if self.adapters is None:
                raise RuntimeError("a batch asks for LoRA adapters but none is enabled")
            batch.lora = self.adapters.batch(batch.lora_spans, batch.input_ids.shape[0])
        elif self.graphs is not None and not batch.return_hidden and self.graphs.can_run(batch):
            return self.graphs.run(batch)  # graphs hold the base model only: adapter batches run eagerly
        if self.world is None:
            return self.model(batch, self.attention)
        if self.world.rank == 0:
            copies, self.pool.pending_copies = self.pool.pending_copies, []
            self.world.send_batch(batch, copies)
        try:
            return self.model(batch, self.attention)
        except BaseException as exc:
            self.world.abort(f"a forward failed on rank {self.world.rank}, leaving the ranks out of step: {exc!r}")
            raise
