import os

# Triton kernels can only run in triton's interpreter where no GPU driver exists; the switch is read when
# a kernel module is imported, so it is set here, before any test imports triton.
if not (os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/kfd")):
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path

import pytest

# Keep tests on the machine's two cores predictable and quiet.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Under pytest-xdist (`make test` runs the suite on two workers) each worker and every server it starts computes
# on one thread: two workers with two OpenMP threads each fight over two cores and finish no sooner than one. The
# variable is read when torch loads, after this file; tests marked `serial` run afterwards with every core.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"


@pytest.fixture(scope="module", autouse=True)
def _return_freed_memory():
    """After each module, give back the memory its engines and models freed: the runtime's allocator settings
    (radixrt.model.cpu_malloc) keep it for the next forward, and without this a worker of the suite grew past
    12 GB and two of them did not fit the machine."""
    yield
    import gc

    from radixrt.model.cpu_malloc import release_freed_memory

    gc.collect()
    release_freed_memory()


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    from radixrt.model.weights import resolve_model_path
    from radixrt.server_args import DEFAULT_MODEL

    return resolve_model_path(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def hf_model(default_model_path):
    """transformers' default model in fp32, the reference of the exactness tests (loaded once a session)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tokenizer(default_model_path):
    """The default model's tokenizer, as the runtime loads it (loaded once a session; tests must not change it)."""
    from radixrt.tokenizer import load_tokenizer

    return load_tokenizer(default_model_path)


@pytest.fixture(scope="session")
def shared_server(default_model_path):
    """One `radixrt serve` for every module whose `SERVER_ARGS` are `shared_server.ARGS`."""
    from shared_server import ARGS

    from radixrt.server.server_process import ServerProcess

    srv = ServerProcess(ARGS, die_with_parent=True).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def server(request, default_model_path):
    """`radixrt serve` started once for a test module, with that module's `SERVER_ARGS`: the session's shared
    server where those are `shared_server.ARGS` itself (the same list, not an equal one: a module that changes its
    server, updating its weights, writes its arguments out and gets a server of its own)."""
    from shared_server import ARGS

    from radixrt.server.server_process import ServerProcess

    if request.module.SERVER_ARGS is ARGS:
        yield request.getfixturevalue("shared_server")
        return
    srv = ServerProcess(request.module.SERVER_ARGS, die_with_parent=True).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(request, server):
    """An HTTP client of the module's server; `HTTP_TIMEOUT` in the module overrides 120 s."""
    import httpx

    with httpx.Client(base_url=server.url, timeout=getattr(request.module, "HTTP_TIMEOUT", 120)) as client:
        yield client


@pytest.fixture(scope="session")
def cpu_kernel_module():
    """The built C++ CPU kernels. Skips only where they are off by design (switched off, no compiler or no
    ninja); where the toolchain is present a failed build raises here, so the tests error instead of skipping."""
    from radixrt.kernels import cpu_kernels

    reason = cpu_kernels.unavailable_reason()
    if reason is not None:
        pytest.skip(f"CPU kernels off here: {reason}")
    module = cpu_kernels.load()
    assert module is not None
    return module


@pytest.fixture(scope="session")
def tiny_hd64(tmp_path_factory):
    """A two-layer llama with head_dim 64 (the bf16 decode kernel's span walk) and GQA 2:1, seeded weights: for
    tests that compare runs to the last bit (test_batch_invariance.py, test_deterministic.py)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    folder = tmp_path_factory.mktemp("llama-hd64")
    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                         rms_norm_eps=1e-6, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.08)
    model.save_pretrained(folder)
    return folder
