"""Tensor parallelism over gloo on the CPU: greedy tokens of TP=2 (tiny random models, one with its single
K/V head replicated, a mixture of experts and a Gemma 3 whose vocabularies are padded) and TP=3 (the default
model) equal TP=1's in float32, through the Engine and through `radixrt serve`; two "nodes" over loopback; a
killed rank ends the Engine (EngineDead) and the server (exit code 1) with no process left; options that cannot
work fail at start."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from radixrt.distributed.options import check_dist_args
from radixrt.model.cpu_linear import packing_enabled
from radixrt.server.server_process import ServerProcess, free_port
from radixrt.server_args import ServerArgs

pytestmark = [pytest.mark.model, pytest.mark.slow]  # about four minutes on two cores: many rank processes

PROMPTS = [[1, 504, 3458, 282, 4649, 314], [1, 2000, 300, 12, 77]]
GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if fields[0] != "Z":
                children.setdefault(int(fields[1]), []).append(int(entry))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def followers_of(pid: int) -> list[int]:
    found = []
    for child in descendants(pid):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"radixrt.distributed.follower" in cmdline:
            found.append(child)
    return found


def save_model(folder: Path, default_model_path: Path, kv_heads: int, vocab_size: int, family: str) -> Path:
    """A random 2-layer model with 4 query heads and the default model's tokenizer."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, Qwen2MoeConfig, Qwen3Config

    torch.manual_seed(0)
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=256,
                  rms_norm_eps=1e-6, tie_word_embeddings=True, eos_token_id=2, bos_token_id=1)
    if family == "llama":
        config = LlamaConfig(**common)
    elif family == "qwen2-moe":  # 6 routed experts (2 a token), a shared one, layer 1 dense
        config = Qwen2MoeConfig(**common, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                                shared_expert_intermediate_size=48, mlp_only_layers=[1])
    elif family == "gemma3":  # a sliding-window layer and a full one, each with its own rotary
        config = Gemma3TextConfig(**common, head_dim=16, sliding_window=4, query_pre_attn_scalar=16,
                                  layer_types=["sliding_attention", "full_attention"])
    else:
        config = Qwen3Config(**common, head_dim=16)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.08)
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(default_model_path / name, folder / name)
    return folder


def greedy(model: str, tp_size: int, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    from radixrt import Engine

    with Engine(model=model, dtype="float32", tp_size=tp_size, max_total_pages=64, log_interval=0) as e:
        return [r["output_ids"] for r in e.generate(input_ids=prompts, sampling_params=GREEDY)]


def greedy_logprobs(engine, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """Each prompt's greedy tokens and their logprobs (which show K/V read from a wrong page where tokens may not)."""
    results = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
    return [(r["output_ids"], [lp for lp, _, _ in r["meta_info"]["output_token_logprobs"]]) for r in results]


@pytest.fixture(scope="module")
def default_tp1(default_model_path) -> list[list[int]]:
    return greedy(str(default_model_path), 1)


# ----- options that cannot work --------------------------------------------------------------------------


@pytest.mark.parametrize("changes, message", [
    ({"tp_size": 0}, "tp_size must be >= 1"),
    ({"nnodes": 2, "node_rank": 2, "tp_size": 2, "dist_init_addr": "127.0.0.1:1234"}, "node_rank must be"),
    ({"nnodes": 2, "tp_size": 3, "dist_init_addr": "127.0.0.1:1234"}, "does not split over 2 nodes"),
    ({"nnodes": 2, "tp_size": 2}, "need --dist-init-addr"),
    ({"tp_size": 2, "dist_init_addr": "nohost"}, "HOST:PORT"),
    ({"dp_size": 2}, "an Engine is one replica"),  # the Engine path; `radixrt serve` hands dp_size > 1 to dp_launch
])
def test_distributed_options_that_cannot_work_are_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        check_dist_args(ServerArgs(**changes))


def test_engine_refuses_a_tp_size_the_heads_do_not_divide_by_before_spawning(default_model_path):
    from radixrt import Engine

    with pytest.raises(ValueError, match="9 attention heads do not divide by tp_size 2"):
        Engine(dtype="float32", tp_size=2)
    with pytest.raises(ValueError, match="tp_size must be >= 1"):
        Engine(dtype="float32", tp_size=0)
    assert followers_of(os.getpid()) == []


def test_server_refuses_a_bad_tp_size_with_exit_code_1():
    proc = subprocess.run([sys.executable, "-m", "radixrt.cli", "serve", "--tp-size", "0"], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONSAFEPATH": "1"})
    assert proc.returncode == 1
    assert "tp_size must be >= 1" in proc.stderr


# ----- exact against one rank ------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen2-moe", "gemma3"])
def test_tp2_on_tiny_models_of_other_families_with_a_padded_vocabulary_matches_tp1(tmp_path, default_model_path,
                                                                                    family):
    # 49155 rows: not a multiple of 2, so each rank holds 24578 rows of which the last pads. A mixture of experts:
    # each expert's width split over the ranks, the router replicated, routed and shared experts' partial sums
    # all-reduced once. Gemma 3: its per-head q/k norms and scaled embedding on each rank's shard.
    from radixrt import Engine

    model = str(save_model(tmp_path / "tiny", default_model_path, kv_heads=2, vocab_size=49155, family=family))
    runs = []
    for tp_size in (1, 2):
        with Engine(model=model, dtype="float32", tp_size=tp_size, max_total_pages=64, log_interval=0) as engine:
            runs.append(greedy_logprobs(engine, PROMPTS))
    for (want_ids, want_lps), (ids, lps) in zip(*runs):
        assert ids == want_ids
        assert lps == pytest.approx(want_lps, abs=1e-4)


def test_tp2_embedding_model_gives_tp1s_vectors(tmp_path, default_model_path):
    # an embedding checkpoint (no LM head on any rank) pooled over every token: the final norm's output is whole on
    # rank 0 after the last all-reduce, so the vectors are tp 1's
    from radixrt import Engine
    from tiny_models import save_embedding_model

    save_embedding_model("qwen3", tmp_path, "mean", tokenizer_from=default_model_path)
    prompts = [[p % 128 for p in prompt] for prompt in PROMPTS]
    runs = []
    for tp_size in (1, 2):
        with Engine(model=str(tmp_path), dtype="float32", tp_size=tp_size, max_total_pages=64,
                    log_interval=0) as engine:
            runs.append([r["embedding"] for r in engine.encode(input_ids=prompts)])
    for want, got in zip(*runs):
        assert got == pytest.approx(want, abs=1e-5)


def test_tp2_with_fp8_weights_matches_tp1(tmp_path, default_model_path):
    # an FP8 checkpoint in blocks of 16 x 16: a column-split projection takes its rows' scales, a row-split one all
    # its blocks, its shard's inputs counted from the shard's first (rank 1 starts in block 2 of o_proj's 4)
    from radixrt import Engine
    from tiny_models import save_fp8_checkpoint

    source = save_model(tmp_path / "tiny", default_model_path, kv_heads=2, vocab_size=49155, family="llama")
    save_fp8_checkpoint(source, tmp_path / "fp8", (16, 16), quantizer="radixrt")
    runs = []
    for tp_size in (1, 2):
        with Engine(model=str(tmp_path / "fp8"), dtype="float32", tp_size=tp_size, max_total_pages=64,
                    log_interval=0) as engine:
            runs.append(greedy_logprobs(engine, PROMPTS))
    for (want_ids, want_lps), (ids, lps) in zip(*runs):
        assert ids == want_ids
        assert lps == pytest.approx(want_lps, abs=1e-4)


def test_tp2_replicates_a_single_kv_head_and_matches_tp1_over_cached_pages(tmp_path, default_model_path):
    from radixrt import Engine

    model = str(save_model(tmp_path / "tiny", default_model_path, kv_heads=1, vocab_size=49152, family="qwen3"))
    long_prompt = list(range(100, 150))  # three pages and two tokens
    # Shares 2 whole pages and 4 tokens of the third: those are copied into a fresh page (partial page reuse),
    # one that last held other K/V (`other`'s last page), so the copy must reach every rank's pool.
    branch = long_prompt[:36] + [7, 8, 9]
    other = list(range(300, 340))
    calls = (PROMPTS, [long_prompt], [long_prompt], [other], [branch])
    with Engine(model=model, dtype="float32", max_total_pages=64, log_interval=0) as engine:
        expected = [greedy_logprobs(engine, p) for p in calls]
    with Engine(model=model, dtype="float32", tp_size=2, max_total_pages=64, log_interval=0) as engine:
        assert engine.runner.pool.layout.kv_heads == 1  # the one K/V head, held by both ranks
        assert engine.runner.model.layers[0].self_attn.num_heads == 2
        got = [greedy_logprobs(engine, p) for p in calls]
        stats = engine.get_stats()
    assert stats["cache_hit_tokens"] >= 48 + 32 and stats["partial_tokens_reused"] == 4, stats
    for call, want, have in zip(range(len(calls)), expected, got):
        for (want_ids, want_lps), (ids, lps) in zip(want, have):
            assert ids == want_ids, call
            assert lps == pytest.approx(want_lps, abs=1e-4), call


def test_tp2_speculative_decoding_matches_tp1(tmp_path, default_model_path):
    """A verify step is one more batch for the ranks: the second request drafts its whole answer from the
    first one's pages in the radix cache, and every rank verifies it."""
    from radixrt import Engine

    model = str(save_model(tmp_path / "tiny", default_model_path, kv_heads=2, vocab_size=49152, family="llama"))
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    with Engine(model=model, dtype="float32", max_total_pages=64, log_interval=0) as engine:
        want = engine.generate(input_ids=PROMPTS[0], sampling_params=params)["output_ids"]
    with Engine(model=model, dtype="float32", tp_size=2, max_total_pages=64, log_interval=0,
                speculative_algorithm="NGRAM") as engine:
        first = engine.generate(input_ids=PROMPTS[0], sampling_params=params)
        again = engine.generate(input_ids=PROMPTS[0], sampling_params=params)
    assert first["output_ids"] == want and again["output_ids"] == want
    assert again["meta_info"]["spec_accepted_tokens"] > 0


def test_tp3_on_the_default_model_matches_tp1_with_a_third_of_the_kv_heads(default_tp1):
    from radixrt import Engine

    with Engine(dtype="float32", tp_size=3, max_total_pages=64, log_interval=0) as engine:
        assert engine.runner.pool.layout.kv_heads == 1
        if packing_enabled(torch.device("cpu")):  # the oneDNN-prepacked linears run on shards too
            assert engine.runner.packed_linears == 1 + 4 * engine.runner.config.num_hidden_layers
        got = [r["output_ids"] for r in engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
        followers = followers_of(os.getpid())
        assert len(followers) == 2
    assert got == default_tp1
    assert followers_of(os.getpid()) == []  # shutdown stopped them


# ----- a rank that dies ------------------------------------------------------------------------------------


def test_a_killed_follower_makes_the_engine_raise_and_leaves_no_process(tmp_path, default_model_path):
    from radixrt import Engine
    from radixrt.engine import EngineDead

    model = str(save_model(tmp_path / "tiny", default_model_path, kv_heads=2, vocab_size=49152, family="llama"))
    engine = Engine(model=model, dtype="float32", tp_size=2, max_total_pages=64, log_interval=0)
    try:
        engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
        (follower,) = followers_of(os.getpid())
        os.kill(follower, signal.SIGKILL)
        with pytest.raises(EngineDead, match="rank 1"):
            for _ in range(3):  # a step already under way may fail its batch first (RuntimeError)
                try:
                    engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
                except RuntimeError as exc:
                    if isinstance(exc, EngineDead):
                        raise
                time.sleep(0.2)
    finally:
        engine.shutdown()
    assert followers_of(os.getpid()) == []


def test_a_follower_that_dies_at_start_fails_the_engine_at_start(tmp_path, default_model_path, monkeypatch):
    from radixrt import Engine
    from radixrt.distributed import world
    from radixrt.distributed.world import RankFailure

    def crashing_follower(args, rank, init_addr):
        return subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])

    monkeypatch.setattr(world, "spawn_follower", crashing_follower)
    model = str(save_model(tmp_path / "tiny", default_model_path, kv_heads=2, vocab_size=49152, family="llama"))
    started = time.monotonic()
    with pytest.raises(RankFailure, match="rank 1 .* exited with code 3"):
        Engine(model=model, dtype="float32", tp_size=2, max_total_pages=64, log_interval=0)
    assert time.monotonic() - started < 60
    import torch.distributed as dist

    assert not dist.is_initialized()  # a later runtime in this process can start


def test_a_forward_failing_on_rank_0_stops_every_rank(tmp_path, default_model_path):
    from radixrt import Engine
    from radixrt.engine import EngineDead

    model = str(save_model(tmp_path / "tiny", default_model_path, kv_heads=2, vocab_size=49152, family="llama"))
    engine = Engine(model=model, dtype="float32", tp_size=2, max_total_pages=64, log_interval=0)
    try:
        assert len(followers_of(os.getpid())) == 1

        def broken(batch, attn):
            raise MemoryError("rank 0 ran out of memory")

        engine.runner.model.forward = broken  # after the batch went out: the follower has started its forward
        with pytest.raises(RuntimeError, match="out of memory"):  # that batch's requests fail ...
            engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
        with pytest.raises(EngineDead, match="forward failed on rank 0"):  # ... then the runtime stops
            for _ in range(50):
                engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
                time.sleep(0.1)
        assert followers_of(os.getpid()) == []
    finally:
        engine.shutdown()


# ----- through the server ----------------------------------------------------------------------------------


def _generate(url: str) -> list[list[int]]:
    with httpx.Client(base_url=url, timeout=120) as http:
        return [http.post("/generate", json={"input_ids": ids, "sampling_params": GREEDY}).json()["output_ids"]
                for ids in PROMPTS]


def test_server_tp3_matches_tp1_and_exits_1_when_a_rank_dies(default_tp1):
    server = ServerProcess(["--dtype", "float32", "--tp-size", "3", "--max-total-pages", "64", "--log-interval",
                            "0"], timeout=300)
    with server:
        assert _generate(server.url) == default_tp1
        followers = followers_of(server.proc.pid)
        assert len(followers) == 2
        everyone = descendants(server.proc.pid)
        os.kill(followers[0], signal.SIGKILL)
        assert server.proc.wait(timeout=60) == 1
    assert "exited with code -9" in server.output
    deadline = time.monotonic() + 15  # the other follower dies with the scheduler process (PR_SET_PDEATHSIG)
    while [pid for pid in everyone if _alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [pid for pid in everyone if _alive(pid)] == []


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_two_nodes_over_loopback_match_tp1(tmp_path, default_model_path):
    model = str(save_model(tmp_path / "tiny", default_model_path, kv_heads=2, vocab_size=49152, family="llama"))
    expected = greedy(model, 1)
    common = ["--model", model, "--dtype", "float32", "--tp-size", "2", "--nnodes", "2", "--max-total-pages", "64",
              "--log-interval", "0", "--dist-init-addr", f"127.0.0.1:{free_port()}"]
    node1 = subprocess.Popen([sys.executable, "-m", "radixrt.cli", "serve", *common, "--node-rank", "1"],
                             env={**os.environ, "PYTHONSAFEPATH": "1"}, stdin=subprocess.DEVNULL)
    try:
        with ServerProcess([*common, "--node-rank", "0"], timeout=300) as server:
            assert followers_of(server.proc.pid) == []  # node 0 runs rank 0 only
            assert len(followers_of(node1.pid)) == 1
            assert _generate(server.url) == expected
        assert node1.wait(timeout=60) == 0  # rank 0 stopped: the other node's ranks stop too
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()
