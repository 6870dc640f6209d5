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
    with pytest.raises(ModelNotFoundError, match="not a folder"):
        resolve_model_path(str(tmp_path / "nope"))


def test_hub_id_offline_fails_cleanly(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError, match="could not fetch 'no-such-org/no-such-model'.*smollm2-135m"):
        resolve_model_path("no-such-org/no-such-model")
