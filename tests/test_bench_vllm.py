"""`radixrt bench vllm`: the workloads' ids and shapes, the peer runner's result, the ratio table, and the whole
command with radixrt in the peer slot (no vLLM here)."""

import json
import subprocess
import sys

import pytest
import torch

from radixrt.bench import peer_run
from radixrt.bench import vs_vllm as v

# Alone after the parallel part of `make test`: it compares two engines' speeds.
pytestmark = pytest.mark.serial


def _encode(text):
    """A stand-in tokenizer: one id per word or punctuation-free chunk, stable across runs."""
    return [sum(ord(ch) * 31 ** i for i, ch in enumerate(word)) % 40000 + 100 for word in text.split()]


def test_workloads_are_deterministic_and_have_the_documented_shapes():
    wl = v.build_workloads(_encode)
    assert wl == v.build_workloads(_encode)
    assert wl["output_tokens"] == 64
    assert len(wl["a"]) == 64 and all(len(p) == 200 for p in wl["a"])
    assert len({tuple(p) for p in wl["a"]}) == 64
    assert wl["b_prefix_len"] == 1000 and len(wl["b"]) == 64
    assert all(len(p) == 1030 and p[:1000] == wl["b"][0][:1000] for p in wl["b"])
    assert len({tuple(p[1000:]) for p in wl["b"]}) == 64
    waves = wl["c"]
    assert len(waves) == 4 and all(len(wave) == 32 for wave in waves)
    system = waves[0][0][:300]
    for turn, wave in enumerate(waves):
        assert all(len(p) == 300 + turn * 100 + 40 and p[:300] == system for p in wave)
        if turn:  # each turn re-sends the conversation so far
            assert all(p[:len(prev)] == prev for p, prev in zip(wave, waves[turn - 1]))
    assert not any(p[:300] == system for p in wl["a"] + wl["b"])


def test_workload_knobs_shrink_a_b_and_c():
    wl = v.build_workloads(_encode, num_prompts=6, output_len=5)
    full = v.build_workloads(_encode)
    assert wl["output_tokens"] == 5 and len(wl["a"]) == 6 and len(wl["b"]) == 6
    assert len(wl["c"]) == 4 and all(len(wave) == 3 for wave in wl["c"])
    assert wl["a"] == full["a"][:6] and wl["c"][3] == full["c"][3][:3]  # the same ids, fewer of them


def test_parse_workloads():
    assert v.parse_workloads(v.DEFAULT_WORKLOADS) == [("a", False, False), ("b", False, False), ("b", True, False),
                                                      ("c", True, False)]
    assert v.parse_workloads("a:nocache:lora") == [("a", False, True)]
    for bad in ("d:cache", "a:maybe", "a", "", "a:cache:lorax"):
        with pytest.raises(ValueError):
            v.parse_workloads(bad)


def test_resolve_dtype_follows_radixrts_auto_rule(monkeypatch):
    monkeypatch.setenv("RADIXRT_AUTO_DTYPE", "float32")
    assert v.resolve_dtype("auto") == "float32"
    monkeypatch.setenv("RADIXRT_AUTO_DTYPE", "bf16")
    assert v.resolve_dtype("auto") == "bfloat16"
    assert v.resolve_dtype("fp32") == "float32"


def test_machine_line_names_the_cpu_and_speed_flags(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("model name\t: Test CPU 9000\nflags\t\t: fpu sse avx2 avx512f amx_tile amx_bf16\n"
                    "model name\t: Test CPU 9000\nflags\t\t: fpu\n")
    line = v.machine_line(str(info))
    assert "cpu='Test CPU 9000'" in line and "isa=avx2,avx512f,amx_bf16,amx_tile" in line
    assert "cores=" in line and "date=" in line


def test_vllm_env_defaults_and_respects_settings(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-3")
    env = v.vllm_env()
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "4" and env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-3" and env["PYTHONSAFEPATH"] == "1"


def test_ratio_table_from_result_lines():
    def line(slot, workload, cache, rate, cached, init):
        fields = dict(engine="x", workload=workload, prefix_caching=cache, dtype="float32", init_s=init,
                      total_s=1.0, out_tok_s=rate, total_tok_s=rate * 2, cached_prompt_tokens=cached)
        return f"noise\nRESULT_JSON {json.dumps(fields)}\n", slot

    outputs = [line("radixrt", "a", False, 100.0, 0, 2.0), line("peer", "a", False, 50.0, 0, 90.0),
               line("radixrt", "a", False, 120.0, 0, 2.5), line("peer", "a", False, 40.0, 0, 80.0),
               line("radixrt", "b", True, 300.0, 64000, 2.0), line("peer", "b", True, 200.0, 63000, 70.0)]
    results = [{**v.parse_result(out), "slot": slot} for out, slot in outputs]
    assert v.parse_result("no result here") is None
    rows = v.ratio_rows(results)
    assert [(r["workload"], r["cache"]) for r in rows] == [("a", False), ("b", True)]
    a, b = rows
    assert a["radixrt_out_tok_s"] == 120.0 and a["peer_out_tok_s"] == 50.0 and a["ratio"] == pytest.approx(2.4)
    assert a["radixrt_init_s"] == 2.5 and a["peer_init_s"] == 90.0  # the best run's own figures
    assert b["ratio"] == pytest.approx(1.5) and b["radixrt_cached"] == 64000 and b["peer_cached"] == 63000
    table = v.format_ratio_table(rows)
    assert "vLLM tok/s" in table.splitlines()[0]
    assert "2.40" in table.splitlines()[1] and "63000" in table.splitlines()[2]


def _runs_by_path_without_radixrt(path) -> None:
    code = ("import runpy, sys; runpy.run_path(sys.argv[1]); "
            "assert not [m for m in sys.modules if m.startswith('radixrt')], 'radixrt imported'")
    subprocess.run([sys.executable, "-c", code, str(path)], check=True)


def test_peer_run_imports_nothing_of_radixrt():
    _runs_by_path_without_radixrt(v.PEER_RUN)
    assert peer_run.main(["nope"]) == 2


@pytest.mark.model
def test_peer_run_result_has_the_fields(tmp_path, capsys):
    from radixrt.model.weights import resolve_model_path
    from radixrt.server_args import DEFAULT_MODEL

    model = str(resolve_model_path(DEFAULT_MODEL))
    path = tmp_path / "workload.json"
    path.write_text(json.dumps(v.build_workloads(v.tokenizer_encoder(model), num_prompts=2, output_len=3)))
    assert peer_run.main(["radixrt", model, str(path), "c", "cache", "float32", "--profile"]) == 0
    out = capsys.readouterr().out
    result = v.parse_result(out)
    assert set(result) == {"engine", "workload", "prefix_caching", "dtype", "init_s", "total_s", "out_tok_s",
                           "total_tok_s", "cached_prompt_tokens"}
    assert result["engine"] == "radixrt" and result["workload"] == "c" and result["prefix_caching"] is True
    assert result["out_tok_s"] > 0 and result["cached_prompt_tokens"] >= 300  # later turns reuse the system prompt
    # the profile sees the scheduler thread's operators, by class
    profile = json.loads(next(line for line in out.splitlines() if line.startswith("PROFILE_JSON")).split(" ", 1)[1])
    assert profile["self_cpu_s"]["gemm"] > 0 and profile["self_cpu_s"]["attention"] > 0
    assert profile["wall_s"] > 0 and len(profile["top"]) == 10


@pytest.mark.model
def test_peer_run_serves_each_prompt_through_an_adapter(tmp_path, capsys):
    from radixrt.bench.random_adapters import write_random_adapters
    from radixrt.model.weights import resolve_model_path
    from radixrt.server_args import DEFAULT_MODEL

    model = str(resolve_model_path(DEFAULT_MODEL))
    path = tmp_path / "workload.json"
    path.write_text(json.dumps(v.build_workloads(v.tokenizer_encoder(model), num_prompts=3, output_len=3)))
    adapters = write_random_adapters(model, tmp_path / "adapters", count=2, rank=4)
    assert peer_run.main(["radixrt", model, str(path), "a", "nocache", "float32", "--lora",
                          ",".join(map(str, adapters))]) == 0
    result = v.parse_result(capsys.readouterr().out)
    assert result["workload"] == "a+2lora" and result["out_tok_s"] > 0


@pytest.mark.model
def test_random_adapters_target_every_projection(tmp_path, default_model_path):
    from radixrt.bench.random_adapters import write_random_adapter
    from radixrt.model.lora import Adapters
    from radixrt.model.runner import load_config

    adapters = Adapters(load_config(default_model_path), torch.device("cpu"))
    adapter = adapters.load("x", str(write_random_adapter(default_model_path, tmp_path / "x", rank=4)))
    assert adapter.rank == 4 and len(adapter.targets) == 7
    assert len(adapter.updates) == 4 * load_config(default_model_path).num_hidden_layers  # qkv, o, gate_up, down


def test_operators_are_classed_by_name():
    assert peer_run.op_class("aten::linear") == peer_run.op_class("_C::onednn_mm") == "gemm"
    assert peer_run.op_class("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert peer_run.op_class("radixrt::paged_decode") == "attention"
    assert peer_run.op_class("aten::multinomial") == "sampling"
    assert peer_run.op_class("Torch-Compiled Region: 0/1") == "compiled region"
    assert peer_run.op_class("aten::add_") == "other"


@pytest.mark.model
@pytest.mark.slow
def test_whole_command_with_radixrt_as_the_peer(tmp_path):
    out = tmp_path / "vs.json"
    proc = subprocess.run([sys.executable, "-m", "radixrt.cli", "bench", "vllm", "--peer-engine", "radixrt",
                           "--workloads", "b:cache", "--num-prompts", "4", "--output-len", "8", "--dtype", "float32",
                           "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("machine: cpu=") and "ratio" in proc.stdout
    report = json.loads(out.read_text())
    assert [r["slot"] for r in report["results"]] == ["radixrt", "peer"]
    (row,) = report["rows"]
    assert row["workload"] == "b" and row["cache"] is True and row["dtype"] == "float32"
    assert 0.25 < row["ratio"] < 4  # the same engine twice; a shared machine drifts
    assert row["radixrt_cached"] == row["peer_cached"] > 0


def test_a_result_printed_before_a_crash_counts_only_where_asked(tmp_path):
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\necho \'RESULT_JSON {"engine": "vllm"}\'\nexit 134\n')
    fake.chmod(0o755)
    assert v.run_engine([str(fake)], {}, timeout=30) is None
    assert v.run_engine([str(fake)], {}, timeout=30, result_despite_exit=True) == {"engine": "vllm"}


def test_a_failing_peer_run_exits_non_zero(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho boom >&2\nexit 3\n")
    fake.chmod(0o755)
    assert v.run_engine([str(fake)], {}, timeout=30) is None
    missing = subprocess.run([sys.executable, "-m", "radixrt.cli", "bench", "vllm", "--vllm-python",
                              str(tmp_path / "absent")], capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "--vllm-python" in missing.stderr


# ----- radixrt bench embed ---------------------------------------------------------------------------------


def test_embedding_workloads_have_the_documented_shapes():
    from radixrt.bench import embed_vs_vllm as e

    wl = e.build_workloads(_encode)
    assert wl == e.build_workloads(_encode)
    instruction = _encode(e.INSTRUCTION)
    assert len(wl["queries"]) == 256 and all(q[: len(instruction)] == instruction for q in wl["queries"])
    assert len({tuple(q) for q in wl["queries"]}) == 256
    assert len(wl["documents"]) == 64 and all(len(d) == 400 for d in wl["documents"])
    assert e.min_cosine([[1.0, 0.0], [0.0, 2.0]], [[2.0, 0.0], [1.0, 1.0]]) == pytest.approx(0.5 ** 0.5)
    pairs = wl["rerank"]  # each query against the same passages, the query first
    assert len(pairs) == e.RERANK_QUERIES * e.RERANK_PASSAGES == 256
    assert all(len(p) == e.QUERY_LEN + e.PASSAGE_LEN for p in pairs)
    first = pairs[: e.RERANK_PASSAGES]
    assert len({tuple(p[: e.QUERY_LEN]) for p in first}) == 1 and len({tuple(p[e.QUERY_LEN:]) for p in first}) == 32
    second = pairs[e.RERANK_PASSAGES : 2 * e.RERANK_PASSAGES]
    assert [p[e.QUERY_LEN:] for p in second] == [p[e.QUERY_LEN:] for p in first]
    assert e.agreement("rerank", [[0.5], [0.25]], [[0.5], [0.5]]) == "max |diff| 0.25000"


def test_embed_run_imports_nothing_of_radixrt():
    from radixrt.bench import embed_run, embed_vs_vllm

    _runs_by_path_without_radixrt(embed_vs_vllm.EMBED_RUN)
    assert embed_run.main(["nope"]) == 2


@pytest.mark.model
def test_embed_run_result_has_the_fields(tmp_path, capsys):
    from radixrt.bench import embed_run
    from radixrt.model.weights import resolve_model_path

    path = tmp_path / "w.json"
    prompts = [[1, 504, 3458, 282], [1, 504, 3458, 282, 4649, 314], [1, 2000, 300]]
    path.write_text(json.dumps({"queries": prompts}))
    assert embed_run.main(["radixrt", str(resolve_model_path("smollm2-135m")), str(path), "queries", "float32"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("RESULT_JSON "))
    result = json.loads(line.split(" ", 1)[1])
    assert result["engine"] == "radixrt" and result["prompt_tok_s"] > 0 and len(result["vectors"]) == 3
    assert all(abs(sum(x * x for x in vec) - 1) < 1e-3 for vec in result["vectors"])


@pytest.mark.model
def test_a_reranking_run_scores_pairs_through_the_saved_cross_encoder(tmp_path, capsys):
    """``save_cross_encoder`` puts a one-label score head on a causal checkpoint; embed_run serves it as a classifier
    and reports each pair's relevance: transformers' sigmoid of the score."""
    import math

    import torch
    from tiny_models import tiny_config
    from transformers import AutoModelForSequenceClassification, LlamaForCausalLM

    from radixrt.bench import embed_run, embed_vs_vllm

    import shutil

    from radixrt.model.weights import resolve_model_path

    config = tiny_config("llama")
    config.vocab_size = 512  # the run's warm-up prompts reach id 403
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "causal")
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the Engine loads a tokenizer
        shutil.copy(resolve_model_path("smollm2-135m") / name, tmp_path / "causal" / name)
    folder = embed_vs_vllm.save_cross_encoder(str(tmp_path / "causal"), tmp_path / "cross-encoder")
    pairs = [[5, 9, 3, 77, 12], [5, 9, 3, 40, 8, 6]]  # none ends in the pad id (transformers would pool before it)
    (tmp_path / "w.json").write_text(json.dumps({"rerank": pairs}))
    assert embed_run.main(["radixrt", folder, str(tmp_path / "w.json"), "rerank", "float32"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("RESULT_JSON "))
    result = json.loads(line.split(" ", 1)[1])
    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    assert model.config.num_labels == 1 and result["cached_prompt_tokens"] >= 0
    for pair, (got,) in zip(pairs, result["vectors"]):
        with torch.no_grad():
            want = torch.sigmoid(model(torch.tensor([pair])).logits[0, 0]).item()
        assert math.isclose(got, want, rel_tol=1e-4)
