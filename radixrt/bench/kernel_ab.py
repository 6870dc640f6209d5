"""The CPU kernels of this tree against those of another commit: the same forwards, both builds loaded side by side
in one process, alternating.

    python -m radixrt.bench.kernel_ab --base REV [--batch 8] [--context 450] [--rows 1,5] [--repeats 20]
                                      [--dtype bfloat16] [--model smollm2-135m]
    python -m radixrt.bench.kernel_ab --base REV --extend 1x2048,2x1024,1x512+1500 [--repeats 9]

Builds ``kernels/csrc`` as it is at git revision ``REV`` (into a temporary folder, compiled with the runtime's own
flags) next to this tree's build, then times verify-step forwards with their rows' greedy tokens
(``verify_step_bench.verify_steps``: ``--batch`` requests of ``--context`` tokens, each adding k tokens a step),
switching the kernels module between the two builds forward by forward. Each figure is the median of
``--repeats`` forwards, in ms. A change inside the kernels shows here apart from the machine's drift, which two
runs minutes apart do not give on a VM. The Python side is this tree's for both builds, so the base must offer the
same kernel functions (a change inside the kernels, not to their signatures). Where the base's sources are this
tree's, both columns time the same build: the spread between them is the noise.

``--extend BxN[+P],...`` times the prefill attention kernel alone instead (``paged_extend``: B requests of N new
tokens after P cached ones, the default model's heads, bf16 pages in shuffled order), the two builds alternating
call by call.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from types import ModuleType

import torch

from radixrt.bench.verify_step_bench import verify_steps
from radixrt.kernels import cpu_kernels
from radixrt.sampling import sampler

ROOT = cpu_kernels.CSRC.parent.parent  # the repository's root
CSRC = cpu_kernels.CSRC.relative_to(ROOT).as_posix()


def base_sources(rev: str) -> dict[str, bytes]:
    """``kernels/csrc``'s files at ``rev``: name -> contents."""
    try:
        names = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:{CSRC}"], cwd=ROOT, check=True,
                               capture_output=True, text=True).stdout.split()
        return {name: subprocess.run(["git", "show", f"{rev}:{CSRC}/{name}"], cwd=ROOT, check=True,
                                     capture_output=True).stdout for name in names}
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        raise SystemExit(f"kernel_ab: cannot read {CSRC} at {rev!r} with git: {detail}") from exc


def tree_sources() -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(cpu_kernels.CSRC.iterdir()) if path.is_file()}


def build(sources: dict[str, bytes]) -> ModuleType:
    """The kernels built from ``sources`` with the runtime's flags (cached by their contents, as the runtime's)."""
    from torch.utils.cpp_extension import load as load_extension

    digest = hashlib.sha256(torch.__version__.encode())
    for file in sorted(sources):
        digest.update(file.encode() + sources[file])
    digest.update(" ".join(cpu_kernels.compile_flags()).encode())
    name = f"radixrt_cpu_ab_{digest.hexdigest()[:12]}"
    # the same sources keep the same paths and times, which is what lets the build's ninja find nothing to redo
    folder = Path(tempfile.gettempdir()) / name
    if not folder.is_dir():
        staging = Path(tempfile.mkdtemp(prefix=f"{name}-"))
        for file, text in sources.items():
            (staging / file).write_bytes(text)
        try:
            staging.rename(folder)
        except OSError:  # another process put the same sources there first
            shutil.rmtree(staging, ignore_errors=True)
    return load_extension(name=name,
                          sources=[str(folder / file) for file in sorted(sources) if file.endswith(".cpp")],
                          extra_cflags=cpu_kernels.compile_flags(), extra_ldflags=["-fopenmp"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the git revision whose kernels are the baseline")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=450)
    parser.add_argument("--rows", default="1,5", help="new tokens a request, comma-separated")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--extend", default=None, help="time paged_extend alone over these BxN[+P] shapes")
    args = parser.parse_args(argv)
    rows = [int(k) for k in args.rows.split(",")]
    own = cpu_kernels.load()
    if own is None:
        raise SystemExit(f"kernel_ab: the CPU kernels do not run here ({cpu_kernels.unavailable_reason()})")
    sources = base_sources(args.base)
    same = sources == tree_sources()
    builds = {"base": own if same else build(sources), "tree": own}
    if args.extend:
        print(f"paged_extend, kernels of {args.base}{' (the same sources as this tree)' if same else ''} against this "
              f"tree's, {torch.get_num_threads()} threads, median of {args.repeats} calls, ms")
        print(f"| requests x new tokens (+ cached) | {args.base} | this tree | base / tree |")
        print("|---|---:|---:|---:|")
        for shape in args.extend.split(","):
            base, tree = _extend_ms(builds, shape, args.repeats)
            print(f"| {shape} | {base:.2f} | {tree:.2f} | {base / tree:.2f} |", flush=True)
        return 0
    chosen = {"module": own}
    original = cpu_kernels._module
    cpu_kernels._module = lambda: chosen["module"]
    try:
        forward_ms = verify_steps(args.model, args.dtype, args.batch, args.context, max(rows))
        print(f"{args.dtype}, batch {args.batch}, {args.context} tokens of context each; kernels of {args.base}"
              f"{' (the same sources as this tree)' if same else ''} against this tree's: a forward and its rows' "
              "greedy tokens, ms")
        print(f"| new tokens a request (rows) | {args.base} | this tree | tree / base |")
        print("|---:|---:|---:|---:|")
        for k in rows:
            timed: dict[str, list[float]] = {name: [] for name in builds}
            for name, module in builds.items():  # a warm-up each
                chosen["module"] = module
                forward_ms(k, sampler.greedy_tokens)
            for _ in range(args.repeats):
                for name, module in builds.items():
                    chosen["module"] = module
                    timed[name].append(forward_ms(k, sampler.greedy_tokens))
            base, tree = statistics.median(timed["base"]), statistics.median(timed["tree"])
            print(f"| {k} ({k * args.batch}) | {base:.2f} | {tree:.2f} | {tree / base:.3f} |", flush=True)
    finally:
        cpu_kernels._module = original
    return 0


def _extend_ms(builds: dict[str, ModuleType], shape: str, repeats: int, heads: int = 9, kv_heads: int = 3,
               head_dim: int = 64, page_size: int = 16) -> tuple[float, float]:
    """Median ms of one ``paged_extend`` call of ``shape`` (``BxN[+P]``) for the base and the tree build."""
    try:
        batch, rest = shape.split("x")
        new, _, cached = rest.partition("+")
        batch, new, cached = int(batch), int(new), int(cached or 0)
    except ValueError:
        raise SystemExit(f"kernel_ab: --extend takes shapes like 2x1024 or 1x512+1500, got {shape!r}") from None
    gen = torch.Generator().manual_seed(0)
    width = -(-(cached + new) // page_size)
    pages = batch * width + 1
    k = torch.randn(pages, page_size, kv_heads, head_dim, generator=gen).bfloat16()
    v = torch.randn(pages, page_size, kv_heads, head_dim, generator=gen).bfloat16()
    table = (torch.randperm(pages - 1, generator=gen)[: batch * width] + 1).view(batch, width).int()
    q = torch.randn(batch * new, heads, head_dim, generator=gen).bfloat16()
    call = (q, k, v, table, torch.full((batch,), cached), torch.full((batch,), new), head_dim ** -0.5, 0)
    timed: dict[str, list[float]] = {name: [] for name in builds}
    for _ in range(repeats + 1):  # the first round warms up
        for name, module in builds.items():
            start = time.perf_counter()
            module.paged_extend(*call)
            timed[name].append((time.perf_counter() - start) * 1e3)
    return statistics.median(timed["base"][1:]), statistics.median(timed["tree"][1:])


if __name__ == "__main__":
    raise SystemExit(main())
