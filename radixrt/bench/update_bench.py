"""The time an update of weights takes between steps, by its source and the runner's layout.

    python -m radixrt.bench.update_bench [--model PATH] [--buckets 8] [--dtype float32] [--repeats 3]

On the model's runner, each way a trainer sends the same new weights (every tensor of the checkpoint moved a
little, as a training step moves them), best of ``--repeats`` runs, one line each:

- ``disk``: one update from a checkpoint folder (``update_weights``: the whole model built again);
- ``buckets, in place``: the tensors in ``--buckets`` calls of ``update_tensors`` on a runner with plain tensors
  (what CUDA serves): each bucket copied into its places;
- ``buckets, rebuilt``: the same buckets on that runner the way it updated them before (the model built again from
  the checkpoint and every tensor sent so far, each bucket), for comparison;
- ``buckets, packed``: the same buckets on a runner whose linear layers are packed for this CPU (each layer a bucket
  fills loaded and packed again).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch


def moved_tensors(model_path: Path) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    tensors: list[tuple[str, torch.Tensor]] = []
    for file in sorted(model_path.glob("*.safetensors")):
        tensors += sorted(load_file(file).items())
    return [(name, tensor * 1.001) for name, tensor in tensors]


def buckets_of(tensors: list, count: int) -> list[dict[str, torch.Tensor]]:
    size = -(-len(tensors) // count)
    return [dict(tensors[i : i + size]) for i in range(0, len(tensors), size)]


def best_of(repeats: int, run) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return min(times)


def measure(model_path: Path, buckets: int, dtype: str, repeats: int) -> dict[str, float]:
    """Seconds for each way (the module's docstring); the runners are built here."""
    from safetensors.torch import save_file

    from radixrt.model.runner import ModelRunner

    tensors = moved_tensors(model_path)
    parts = buckets_of(tensors, buckets)
    results: dict[str, float] = {}
    packed = ModelRunner(model_path, dtype=dtype, num_pages=8)
    results["buckets, packed"] = best_of(repeats, lambda: [packed.update_tensors(b) for b in parts])
    with tempfile.TemporaryDirectory() as folder:
        for file in model_path.iterdir():
            if file.suffix in (".json", ".txt", ".model", ".jinja"):
                (Path(folder) / file.name).write_bytes(file.read_bytes())
        save_file(dict(tensors), Path(folder) / "model.safetensors", metadata={"format": "pt"})
        results["disk"] = best_of(repeats, lambda: packed.update_weights(Path(folder)))
    del packed
    previous = os.environ.get("RADIXRT_DISABLE_PACKED_LINEAR")
    os.environ["RADIXRT_DISABLE_PACKED_LINEAR"] = "1"
    try:
        plain = ModelRunner(model_path, dtype=dtype, num_pages=8)
    finally:
        if previous is None:
            del os.environ["RADIXRT_DISABLE_PACKED_LINEAR"]
        else:
            os.environ["RADIXRT_DISABLE_PACKED_LINEAR"] = previous
    assert plain.packed_linears == 0
    results["buckets, in place"] = best_of(repeats, lambda: [plain.update_tensors(b) for b in parts])

    def rebuilt() -> None:
        overlay: dict[str, torch.Tensor] = {}
        for bucket in parts:
            overlay = {**overlay, **bucket}
            plain._replace_model(plain.model_path, overlay)

    results["buckets, rebuilt"] = best_of(repeats, rebuilt)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model folder (default: the default model)")
    parser.add_argument("--buckets", type=int, default=8)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    from radixrt.model.weights import resolve_model_path
    from radixrt.server_args import DEFAULT_MODEL

    path = resolve_model_path(args.model or DEFAULT_MODEL)
    results = measure(path, args.buckets, args.dtype, args.repeats)
    print(f"model {path.name}, {args.dtype}, {args.buckets} buckets, best of {args.repeats}, "
          f"{torch.get_num_threads()} threads")
    for way, seconds in results.items():
        print(f"{way:<20} {seconds * 1000:9.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
