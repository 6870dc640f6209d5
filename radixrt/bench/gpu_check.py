"""The GPU check: one command that shows the CUDA path works, in under 5 minutes on one NVIDIA GPU.

    python -m radixrt.bench.gpu_check                  # on a machine with an NVIDIA GPU
    python -m radixrt.bench.gpu_check --device cpu     # a dry run of the same steps at tiny sizes

Parts, each reported as pass or fail with its error (the exit status is 1 when any part fails):

- ``kernels``: Triton ``store_kv`` (bit-exact), decode and extend attention against ``kernels/torch_ref`` on the
  same paged caches (pages in shuffled order, ragged lengths, a sliding window), fp32 and bf16.
- ``engine``: the Engine's greedy tokens against transformers' ``generate`` on the same device and dtype (fp32,
  bf16), and the largest difference between our logprobs and transformers'. Then one batch that mixes seeded
  and unseeded sampling, top-k/top-p/min-p, penalties, a regex constraint and logprobs, whose seeded twins
  must agree. Tokens may differ only after a near-tie: a step where transformers rates its token and ours
  within ``TIE`` of each other (bf16 rounding flips such steps); the tokens after it are not compared.
- ``moe``: the engine part's comparison with transformers (fp32, bf16) over a seeded random mixture-of-experts
  model of the engine model's width and tokenizer (Qwen3-MoE, 4 layers, 8 experts, 2 a token): the expert path,
  which runs eagerly on CUDA.
- ``server``: ``radixrt serve --device ...``, one ``/generate`` and one ``/v1/chat/completions``.
- ``bandwidth``: decode-kernel bandwidth (K/V bytes read / time) at a few batch x context sizes, against the
  card's peak, timed alone and under a CUDA graph (and up to batch 64 for each split count); each size is
  checked against torch_ref first.
- ``graphs``: CUDA-graph decode: replayed logits equal eager ones bit for bit (fp32) at every captured batch
  size, padding rows write nothing, greedy tokens with graphs and overlap scheduling equal those without.
- ``speed``: the Engine's defaults against transformers' eager ``generate``: batch-1 ms/token, a batch of random
  prompts, groups sharing a long prefix.

A readable summary goes to stdout; every figure goes to ``$OUT/gpu_check.json`` when ``OUT`` is set (or to
``--json``). Autotuning is off (``RADIXRT_TRITON_AUTOTUNE=0``: one fixed config per kernel, no
compile-and-time sweep) unless ``--autotune``. On the CPU the kernels run in triton's interpreter and the
Engine and server on the torch backend; timings are skipped there (they need CUDA), which the summary says.

Where the model's weights cannot be had (a machine that reaches no network, with no model cache), pass
``--synthetic-weights DIR``: DIR holds a model's config and tokenizer files only (for the default model, copy
``config.json``, ``generation_config.json``, ``tokenizer*`` and ``chat_template.jinja`` from its folder under
``~/.cache/radixrt/models``, about 4 MB) and the check writes seeded random weights next to copies of them.
The comparisons hold for any weights: ours and transformers' run the same ones.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

from radixrt.bench.gpu_check_fast import check_graphs, check_speed
from radixrt.bench.gpu_check_parts import PARTS, Context, Part, Sizes

PARTS.update(graphs=check_graphs, speed=check_speed)

CUDA_SIZES = Sizes(
    kernel_shapes=[("smollm2", 9, 3, 64, ["float32", "bfloat16"], [1, 16]),
                   ("llama-8b", 32, 8, 128, ["bfloat16"], [16])],
    decode_lens=[1, 17, 300, 1100], extend_lens=[(0, 7), (5, 1), (33, 40), (250, 130)], window=64,
    engine_prompts=4, new_tokens=24,
    bandwidth_shape=(32, 8, 128),
    bandwidth_cases=[(1, 4096), (8, 4096), (32, 4096), (64, 4096), (64, 8192), (128, 4096), (256, 1024)],
    server_dtype="bfloat16",
    graph_max_bs=256, graph_pages=8192, graph_context=400, graph_prompts=8,
    speed_latency_tokens=256, speed_batch=256, speed_prompt=512, speed_output=128, speed_groups=8,
    speed_per_group=32, speed_prefix=2000, speed_kv_gb=40.0,
)
CPU_SIZES = Sizes(
    kernel_shapes=[("tiny", 4, 2, 16, ["float32", "bfloat16"], [1, 4])],
    decode_lens=[1, 9, 30], extend_lens=[(0, 5), (3, 1), (9, 12)], window=5,
    engine_prompts=2, new_tokens=8,
    bandwidth_shape=(4, 1, 64), bandwidth_cases=[(1, 40), (3, 40)],
    server_dtype="float32",
    graph_max_bs=2, graph_pages=32, graph_context=20, graph_prompts=2,
)


def synthetic_model(source: Path, target: Path, seed: int = 0, overrides: dict | None = None, device: str = "cpu",
                    dtype: str = "float32") -> Path:
    """``target``: ``source``'s config (``overrides`` set on it) and tokenizer files with random weights, seeded,
    made on ``device`` in ``dtype``. The weights are spread (std 0.05) so that the logits are too: greedy steps are
    then rarely near-ties."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(source)
    for name, value in (overrides or {}).items():
        setattr(config, name, value)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:  # matrices; the norms' weights stay ones
                param.normal_(0.0, 0.05)
    model.save_pretrained(target)
    for file in Path(source).iterdir():
        if file.is_file() and (file.name.startswith(("tokenizer", "special_tokens", "chat_template"))
                               or file.name == "generation_config.json"):
            shutil.copy(file, Path(target) / file.name)
    return Path(target)


# ----- driver ----------------------------------------------------------------------------------------------


def run_part(name: str, ctx: Context) -> Part:
    part = Part(name)
    started = time.perf_counter()
    print(f"== {name} ...", flush=True)
    try:
        PARTS[name](ctx, part)
    except Exception as exc:  # the part fails; the others still run
        part.ok = False
        part.error = f"{type(exc).__name__}: {exc}"
        part.figures["traceback"] = traceback.format_exc()[-4000:]
    part.seconds = round(time.perf_counter() - started, 1)
    print(f"   {'PASS' if part.ok else 'FAIL'} in {part.seconds} s", flush=True)
    return part


def summary(parts: list[Part]) -> str:
    lines = []
    for p in parts:
        lines.append(f"{p.name:<10} {'PASS' if p.ok else 'FAIL'}  {p.seconds:>6.1f} s")
        if p.error:
            lines.append(f"    error: {p.error}")
        lines += [f"    failed: {f}" for f in p.failures]
        lines += [f"    skipped: {s}" for s in p.skipped]
        f = p.figures
        if p.name == "kernels" and "worst" in f:
            lines.append(f"    worst max abs diff vs torch_ref: decode {f['worst']['decode']:.2e}, "
                         f"extend {f['worst']['extend']:.2e} ({len(f['cases'])} cases)")
        if p.name == "engine":
            for dtype_name in ("float32", "bfloat16"):
                e = f.get(dtype_name)
                if e:
                    lines.append(f"    {dtype_name}: {e['tokens_compared']} tokens equal to transformers, "
                                 f"{len(e['near_ties'])} near-tie divergence(s), logprob max diff "
                                 f"{e['logprob_max_abs_diff']:.2e} ({e['attention_backend']} attention)")
            if "torch_backend" in f:
                lines.append(f"    float32 torch attention backend: tokens equal to triton's: "
                             f"{f['torch_backend']['tokens_equal_to_triton']}")
        if p.name == "server" and "startup_seconds" in f:
            lines.append(f"    ready in {f['startup_seconds']} s; /generate {f.get('generate_seconds')} s, "
                         f"chat {f.get('chat_seconds')} s")
        if p.name == "graphs" and "buckets" in f:
            lines.append(f"    {len(f['buckets'])} batch sizes captured in {f['capture_seconds']} s "
                         f"({f['capture_mb']} MB); replay == eager for batches {f.get('batches_checked')}")
            for dtype_name in ("float32", "bfloat16"):
                e = f.get(dtype_name)
                if e:
                    lines.append(f"    {dtype_name}: {e['tokens_compared']} tokens equal with graphs+overlap, "
                                 f"{len(e['near_ties'])} near-tie divergence(s); {e['graph_replays']} replays, "
                                 f"{e['launched_steps']} steps launched ahead")
        if p.name == "speed" and "radixrt" in f:
            for engine in ("radixrt", "transformers"):
                for name, r in f.get(engine, {}).items():
                    if isinstance(r, dict):
                        extra = f", {r['ms_per_token']} ms/token" if "ms_per_token" in r else ""
                        lines.append(f"    {engine:<12} {name:<14} {r['tok_s']:>9.1f} tok/s{extra}")
            if f.get("speedup"):
                lines.append(f"    speedup over transformers: {f['speedup']}")
        if p.name == "bandwidth":
            lines.append(f"    peak {f.get('peak')}")
            for c in f.get("cases", []):
                speed = f"{c['gb_per_s']:>8.1f} GB/s {c.get('percent_of_peak', '-')}%" if "gb_per_s" in c else ""
                if "graph_gb_per_s" in c:
                    speed += f", graphed {c['graph_gb_per_s']:>8.1f} GB/s {c.get('graph_percent_of_peak', '-')}%"
                lines.append(f"    batch {c['batch']:>4} x ctx {c['context']:>6}: splits {c['splits']:>2}, "
                             f"diff {c['max_abs_diff']:.1e} {speed}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Check the CUDA path of radixrt in one run (see the module doc)")
    parser.add_argument("--device", default=None, help="cuda (default where available) or cpu (a dry run)")
    parser.add_argument("--model", default=None, help="model for the engine and server parts (default: bundled)")
    parser.add_argument("--synthetic-weights", default=None, metavar="DIR",
                        help="use random weights with the config and tokenizer files in DIR instead of --model")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    parser.add_argument("--autotune", action="store_true", help="autotune the Triton kernels (compiles more)")
    parser.add_argument("--json", default=None, help="where to write the figures (default: $OUT/gpu_check.json)")
    args = parser.parse_args(argv)
    names = [n for n in args.parts.split(",") if n]
    unknown = [n for n in names if n not in PARTS]
    if unknown:
        parser.error(f"unknown part(s) {unknown}; choose from {list(PARTS)}")
    # Both switches are read when the kernel modules are imported, so they are set before any import of them.
    os.environ["RADIXRT_TRITON_AUTOTUNE"] = "1" if args.autotune else "0"
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else None)
    if device is None:
        print("no CUDA device here: run with --device cpu for the dry run", file=sys.stderr)
        return 2
    if device.startswith("cuda") and not torch.cuda.is_available():
        print(f"--device {device}: torch sees no CUDA device", file=sys.stderr)
        return 2
    if not device.startswith("cuda"):
        os.environ["TRITON_INTERPRET"] = "1"  # CPU tensors: the kernels run in triton's interpreter
    from radixrt.server_args import DEFAULT_MODEL

    with tempfile.TemporaryDirectory(prefix="radixrt-gpu-check-") as scratch:
        model = args.model or DEFAULT_MODEL
        if args.synthetic_weights and {"engine", "moe", "server", "graphs", "speed"} & set(names):
            model = str(synthetic_model(Path(args.synthetic_weights), Path(scratch) / "model"))
            print(f"# synthetic weights with the config of {args.synthetic_weights}", flush=True)
        ctx = Context(device=device, sizes=CUDA_SIZES if device.startswith("cuda") else CPU_SIZES, model=model,
                      autotune=args.autotune)
        gpu = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else None
        print(f"# radixrt gpu check on {device} ({gpu or 'dry run at tiny sizes'}), torch {torch.__version__}, "
              f"autotune {'on' if args.autotune else 'off'}", flush=True)
        started = time.perf_counter()
        parts = [run_part(name, ctx) for name in names]
    report = {"device": device, "gpu": gpu, "torch": torch.__version__, "triton": _triton_version(),
              "model": args.model or DEFAULT_MODEL, "synthetic_weights": args.synthetic_weights,
              "autotune": args.autotune, "seconds": round(time.perf_counter() - started, 1),
              "ok": all(p.ok for p in parts), "parts": {p.name: p.__dict__ for p in parts}}
    print("\n# summary\n" + summary(parts) + f"\n# {'PASS' if report['ok'] else 'FAIL'} in {report['seconds']} s")
    target = args.json or (str(Path(os.environ["OUT"]) / "gpu_check.json") if os.environ.get("OUT") else None)
    if target:
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        Path(target).write_text(json.dumps(report, indent=1, default=str))
        print(f"# figures: {target}")
    return 0 if report["ok"] else 1


def _triton_version() -> str | None:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return None


if __name__ == "__main__":
    sys.exit(main())
