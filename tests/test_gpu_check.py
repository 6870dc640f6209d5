"""The GPU check (python -m radixrt.bench.gpu_check): its CPU dry run passes, and failures fail it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from radixrt.bench import gpu_check, gpu_check_parts
from radixrt.model.runner import ModelRunner
from tiny_models import save_tiny_model


@pytest.fixture
def isolated_env(monkeypatch):
    """The check sets the Triton switches in os.environ; put them back afterwards."""
    for name in ("RADIXRT_TRITON_AUTOTUNE", "TRITON_INTERPRET"):
        monkeypatch.setenv(name, os.environ.get(name, "0" if name == "RADIXRT_TRITON_AUTOTUNE" else "1"))


def test_a_failing_step_fails_the_run_and_the_other_parts_still_run(monkeypatch, tmp_path, isolated_env):
    def broken(ctx, part):
        raise RuntimeError("boom")

    monkeypatch.setitem(gpu_check_parts.PARTS, "kernels", broken)
    monkeypatch.setitem(gpu_check_parts.TOL, "bfloat16", -1.0)  # no difference can pass now
    code = gpu_check.main(["--device", "cpu", "--parts", "kernels,bandwidth", "--json", str(tmp_path / "r.json")])
    report = json.loads((tmp_path / "r.json").read_text())
    assert code == 1 and report["ok"] is False
    kernels, bandwidth = report["parts"]["kernels"], report["parts"]["bandwidth"]
    assert kernels["ok"] is False and kernels["error"] == "RuntimeError: boom"
    assert bandwidth["ok"] is False and len(bandwidth["failures"]) == len(gpu_check.CPU_SIZES.bandwidth_cases)
    assert any("needs CUDA" in s for s in bandwidth["skipped"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown where no CUDA device exists")
def test_without_cuda_it_asks_for_the_dry_run(capsys, isolated_env):
    assert gpu_check.main([]) == 2
    assert "--device cpu" in capsys.readouterr().err


def test_synthetic_weights_are_seeded_random_and_load(tmp_path):
    source = tmp_path / "source"
    save_tiny_model("llama", source)
    first = gpu_check.synthetic_model(source, tmp_path / "a")
    second = gpu_check.synthetic_model(source, tmp_path / "b")
    a, b = load_file(first / "model.safetensors"), load_file(second / "model.safetensors")
    original = load_file(source / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], original["model.embed_tokens.weight"])
    runner = ModelRunner(first, dtype="float32", page_size=4, num_pages=8)
    assert runner.config.vocab_size == 128


@pytest.mark.slow
@pytest.mark.model
def test_cpu_dry_run_passes(default_model_path, tmp_path):
    """The dry run the GPU check is rehearsed with: every part, tiny sizes, synthetic weights (as on a GPU
    machine that cannot fetch the model) with the default model's tokenizer and config, cut to 2 layers (every
    code path the same, a layer's output feeding the next; triton's interpreter runs each layer's kernels, so 30
    took over a minute, and 4 took 23 s more than 2)."""
    files = tmp_path / "model-files"
    files.mkdir()
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (default_model_path / name).exists():
            shutil.copy(default_model_path / name, files / name)
    config = json.loads((default_model_path / "config.json").read_text())
    (files / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    out, scratch = tmp_path / "out", tmp_path / "tmp"
    out.mkdir()
    scratch.mkdir()
    run = subprocess.run([sys.executable, "-m", "radixrt.bench.gpu_check", "--device", "cpu",
                          "--synthetic-weights", str(files)], env={**os.environ, "OUT": str(out), "TMPDIR": str(scratch)},
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert "# summary" in run.stdout and "needs CUDA" in run.stdout
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["ok"] and set(report["parts"]) == {"kernels", "engine", "moe", "server", "bandwidth", "graphs", "speed"}
    assert all(part["ok"] and part["error"] is None for part in report["parts"].values())
    assert report["parts"]["kernels"]["figures"]["draws_checked"] > 0  # the sampler's draws against their reference
    engine = report["parts"]["engine"]["figures"]
    assert engine["float32"]["tokens_compared"] > 0 and engine["float32"]["logprob_max_abs_diff"] <= 1e-3
    assert engine["bfloat16"]["tokens_compared"] > 0
    moe = report["parts"]["moe"]["figures"]
    assert moe["float32"]["tokens_compared"] > 0 and moe["float32"]["logprob_max_abs_diff"] <= 1e-3
    graphs = report["parts"]["graphs"]["figures"]
    assert graphs["batches_checked"] == [1, 2] and graphs["float32"]["tokens_compared"] > 0
    assert set(graphs["memory_release"]) == {"backup", "checkpoint"}  # released, resumed, replayed the same
    assert graphs["float32"]["launched_steps"] > 0  # the overlap scheduler ran
    speed = report["parts"]["speed"]["figures"]
    assert set(speed["radixrt"]) >= {"batch1", "random", "shared_prefix"} and set(speed["transformers"]) == {"batch1", "random"}
    assert not list(scratch.glob("radixrt-gpu-check-*"))  # the synthetic weights are deleted


def test_synthetic_weights_take_a_shape_and_a_dtype(tmp_path):
    source = tmp_path / "source"
    save_tiny_model("llama", source)
    made = gpu_check.synthetic_model(source, tmp_path / "c", overrides={"num_hidden_layers": 1}, dtype="bfloat16")
    weights = load_file(made / "model.safetensors")
    assert {k.split(".")[2] for k in weights if k.startswith("model.layers.")} == {"0"}
    assert weights["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert ModelRunner(made, dtype="float32", page_size=4, num_pages=8).config.num_hidden_layers == 1
