"""Every tensor on the path from a ForwardBatch to sampled tokens lives on the runner's device.

Run on a stand-in accelerator (tests/simulated_device.py): tensors that compute on the CPU but report
another device, where each op refuses a CPU tensor or generator exactly where CUDA would. Each case also
checks the values against the same computation on the CPU.
"""

from __future__ import annotations

import pytest
import torch

from radixrt.constrained.masks import (
    allocate_bitmask,
    apply_bitmask,
    apply_bitmask_reference,
    apply_token_masks,
    fill_bitmasks,
)
from radixrt.protocol.messages import BatchTokenOut, GenerateReq
from radixrt.model.forward_batch import ForwardBatch, SeqChunk
from radixrt.model.runner import AUTO_DTYPE_ENV, ModelRunner, parse_dtype
from radixrt.sampling.logits_processor import apply_penalties, ban_tokens, token_logprobs
from radixrt.sampling.params import SamplingParams
from radixrt.sampling.sampler import SamplingBatch, sample
from radixrt.scheduler.scheduler import Scheduler
from radixrt.server_args import ServerArgs
from simulated_device import DeviceMismatch, OnDevice, simulated_device
from tiny_models import save_tiny_model

VOCAB = 300


def test_the_stand_in_refuses_what_cuda_refuses():
    with simulated_device() as device:
        x = torch.arange(6.0, device=device)
        assert isinstance(x, OnDevice) and x.device == device
        with pytest.raises(DeviceMismatch):
            x + torch.ones(6)
        with pytest.raises(DeviceMismatch):
            x.gather(0, torch.tensor([1, 2]))
        with pytest.raises(DeviceMismatch):
            torch.nn.functional.embedding(torch.tensor([1]), x.view(3, 2))
        with pytest.raises(DeviceMismatch):
            torch.empty(4, device=device).exponential_(generator=torch.Generator().manual_seed(0))
        # what CUDA accepts: CPU scalars, CPU indices, copies either way
        y = x * torch.tensor(2.0) + torch.ones(6).to(device)
        y[torch.tensor([0])] = 5.0
        assert y[torch.tensor([0, 1])].tolist() == [5.0, 3.0]
        back = y.cpu()
        assert type(back) is torch.Tensor and back.tolist() == [5.0, 3.0, 5.0, 7.0, 9.0, 11.0]


def _mixed_params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=20),
        SamplingParams(top_p=0.8, seed=11),
        SamplingParams(min_p=0.05, temperature=1.3, seed=12),
        SamplingParams(temperature=0.9),
    ]


def _sample_on(device, logits: torch.Tensor, build_on=None) -> torch.Tensor:
    params = _mixed_params()
    seeds = [p.seed if p.seed is not None else 20 + i for i, p in enumerate(params)]
    batch = SamplingBatch.build(params, VOCAB, seeds, [3, 1, 4, 1, 5], device=device if build_on is None else build_on)
    tokens = sample(logits.to(device), batch)
    assert tokens.device == torch.device(device)
    return tokens.cpu()


@pytest.mark.parametrize("built_on", ["device", "cpu"])
def test_sampler_runs_on_the_logits_device(built_on):
    logits = torch.randn(len(_mixed_params()), VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    want = _sample_on("cpu", logits)
    with simulated_device() as device:
        got = _sample_on(device, logits, build_on=device if built_on == "device" else "cpu")
        batch = SamplingBatch.build(_mixed_params(), VOCAB, device=device)
        assert all(t.device == device for t in (batch.temperatures, batch.top_ks, batch.top_ps, batch.min_ps,
                                                  batch.greedy, batch.seed_words, batch.counters))
        assert batch.to(device) is batch
        assert batch.advanced().counters.device == device
    # the draws are computed on the device from each row's seed and counter: the very tokens of the CPU run
    assert torch.equal(got, want)


def test_penalties_bans_and_logprobs_on_the_logits_device():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(repetition_penalty=1.3), SamplingParams(),
              SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)]
    prompts, outputs = [[1, 2, 3], [4], [5, 6]], [[7, 7, 8], [], [9, 9, 9, 10]]
    banned = [[0, 299], [], [5]]

    def run(x: torch.Tensor):
        x = ban_tokens(apply_penalties(x, params, prompts, outputs), banned)
        logprobs = torch.log_softmax(x, dim=-1)
        chosen, top = token_logprobs(logprobs, torch.tensor([3, 4, 9]), 5)  # token ids from the host
        return x.cpu(), chosen, top

    want = run(logits.clone())
    with simulated_device() as device:
        got = run(logits.to(device))
    assert torch.equal(got[0], want[0])
    assert got[1] == pytest.approx(want[1]) and got[2] == want[2]


class _RowMatcher:
    """What the mask functions read of a grammar matcher: its packed row (on the CPU, as grammars cache it)."""

    def __init__(self, row: torch.Tensor) -> None:
        self.row = row

    def allowed_row(self) -> torch.Tensor:
        return self.row


def test_grammar_masks_on_the_logits_device():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, VOCAB, generator=gen)
    words = -(-VOCAB // 32)
    packed = torch.randint(-(2**31), 2**31 - 1, (4, words), generator=gen, dtype=torch.int64).to(torch.int32)
    matchers = [_RowMatcher(packed[0]), None, _RowMatcher(packed[2]), _RowMatcher(packed[3])]
    full = allocate_bitmask(4, VOCAB)
    fill_bitmasks(full, matchers)
    want = apply_bitmask_reference(logits, full)
    with simulated_device() as device:
        host_mask = allocate_bitmask(4, VOCAB)  # the grammar backend keeps its bitmask on the host
        by_host_mask = apply_bitmask(logits.to(device), host_mask, fill_bitmasks(host_mask, matchers)).cpu()
        device_mask = allocate_bitmask(4, VOCAB, device)
        by_device_mask = apply_bitmask(logits.to(device), device_mask, fill_bitmasks(device_mask, matchers)).cpu()
        every_row = apply_bitmask(logits.to(device), full).cpu()
        by_matchers = apply_token_masks(logits.to(device), matchers).cpu()
    for got in (by_host_mask, by_device_mask, every_row, by_matchers):
        assert torch.equal(got, want)


def test_auto_dtype_is_bf16_on_cuda(monkeypatch):
    monkeypatch.delenv(AUTO_DTYPE_ENV, raising=False)
    assert parse_dtype("auto", "cuda") == torch.bfloat16
    assert parse_dtype("float32", "cuda") == torch.float32


@pytest.fixture(scope="module", params=["llama", "llama3-scaled", "mistral", "qwen3", "qwen2-moe", "gemma3", "olmo2"])
def tiny_model(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    save_tiny_model(request.param, folder)
    return folder


SHARED = [5, 9, 3, 77, 12, 40, 8, 1]  # two full pages of 4, read by two requests
PROMPTS = [SHARED + [99, 23, 4], SHARED + [17, 2, 3, 6, 7], [100, 42, 42]]


def _forward_steps(folder, device) -> list[torch.Tensor]:
    """Logits of: a prefill, an extend of three requests (two over a shared prefix: a cascade group), a
    decode step (the group again), and a mixed step, run on ``device``."""
    runner = ModelRunner(folder, dtype="float32", page_size=4, num_pages=32, device=device)
    assert all(t.device == device for t in [*runner.model.parameters(), *runner.model.buffers(),
                                            *runner.pool.k_caches, *runner.pool.v_caches])
    alloc = runner.pool.alloc
    shared_pages = alloc(2)
    pages = [shared_pages + alloc(2), shared_pages + alloc(2), alloc(2)]
    lens = [len(p) for p in PROMPTS]
    steps = [
        [SeqChunk(SHARED, 0, pages[0])],
        [SeqChunk(PROMPTS[0][8:], 8, pages[0], logits_from=0), SeqChunk(PROMPTS[1][8:], 8, pages[1], logits_from=0),
         SeqChunk(PROMPTS[2], 0, pages[2], logits_from=0)],
        [SeqChunk([7], n, p) for n, p in zip(lens, pages)],
        [SeqChunk([8], lens[0] + 1, pages[0]), SeqChunk([8], lens[1] + 1, pages[1]),
         SeqChunk([8, 9], lens[2] + 1, pages[2], logits_from=0)],
    ]
    out = []
    for chunks in steps:
        batch = ForwardBatch.build(chunks, runner.page_size, device)
        assert all(t.device == device for t in (batch.input_ids, batch.positions, batch.out_slots, batch.page_table,
                                                 batch.seq_lens, batch.logits_indices))
        logits = runner.forward(batch)
        assert logits.device == device
        out.append(logits.cpu())
    return out


def test_forward_runs_on_the_runner_device(tiny_model):
    want = _forward_steps(tiny_model, torch.device("cpu"))
    with simulated_device() as device:
        got = _forward_steps(tiny_model, device)
    for ours, ref in zip(got, want):
        assert (ours - ref).abs().max().item() <= 1e-5


def _serve(folder, device) -> dict[str, dict]:
    """Three requests through the scheduler on ``device``: greedy with prompt and output logprobs (over a
    prefix the second request shares), seeded sampling, and penalties with a minimum length."""
    runner = ModelRunner(folder, dtype="float32", page_size=4, num_pages=64, device=device)
    got: dict[str, dict] = {}

    def sink(batch: BatchTokenOut) -> None:
        for delta in batch.deltas:
            entry = got.setdefault(delta.rid, {"ids": [], "logprobs": [], "prompt_logprobs": None, "finish": None})
            entry["ids"] += delta.new_ids
            entry["logprobs"] += delta.output_logprobs or []
            entry["prompt_logprobs"] = delta.input_logprobs or entry["prompt_logprobs"]
            entry["finish"] = delta.finish_reason or entry["finish"]

    scheduler = Scheduler(ServerArgs(log_interval=0), runner, None, {0}, sink)  # it follows the runner's device
    shared = SHARED + [2, 3, 4, 5, 6, 7, 8, 9, 10]
    for msg in [
        GenerateReq("greedy", shared + [11], SamplingParams(max_new_tokens=6, temperature=0), return_logprob=True,
                    logprob_start_len=2, top_logprobs_num=2),
        GenerateReq("seeded", shared + [12], SamplingParams(max_new_tokens=6, temperature=0.9, top_p=0.9, seed=5)),
        GenerateReq("penalised", [3, 4, 5], SamplingParams(max_new_tokens=6, temperature=0, min_new_tokens=3,
                                                           repetition_penalty=1.5, frequency_penalty=1.0)),
    ]:
        scheduler.submit(msg)
    while scheduler.step():
        pass
    return got


@pytest.fixture(scope="module")
def llama_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    save_tiny_model("llama", folder)
    return folder


def test_scheduler_steps_on_the_runner_device(llama_model):
    want = _serve(llama_model, torch.device("cpu"))
    with simulated_device() as device:
        got = _serve(llama_model, device)
    assert set(got) == set(want) == {"greedy", "seeded", "penalised"}
    for rid, entry in want.items():
        assert entry["finish"].type == "length" and len(entry["ids"]) == 6
        assert got[rid]["ids"] == entry["ids"] and got[rid]["finish"] == entry["finish"]
        for key in ("logprobs", "prompt_logprobs"):  # (logprob, token id) pairs
            ours, ref = got[rid][key] or [], entry[key] or []
            assert [t for _, t in ours] == [t for _, t in ref]
            assert [lp for lp, _ in ours] == pytest.approx([lp for lp, _ in ref], abs=1e-5)
    assert len(want["greedy"]["logprobs"]) == 6 and len(want["greedy"]["prompt_logprobs"]) > 10


def test_fp8_weights_are_dequantized_on_the_runner_device(tmp_path):
    # off the CPU no fp8 kernel runs: the weights are dequantized at load, on the device, to the CPU's values
    from tiny_models import save_fp8_checkpoint

    save_tiny_model("qwen2-moe", tmp_path / "float")
    save_fp8_checkpoint(tmp_path / "float", tmp_path / "fp8", (16, 16), quantizer="radixrt")
    want = _forward_steps(tmp_path / "fp8", torch.device("cpu"))
    with simulated_device() as device:
        got = _forward_steps(tmp_path / "fp8", device)
    for ours, ref in zip(got, want):
        assert (ours - ref).abs().max().item() <= 1e-5
