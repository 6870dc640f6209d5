"""Deterministic inference (``--enable-deterministic-inference``): a request gets the same logits, to the last bit,
whether its prompt was computed whole, in chunks, after a cached prefix of any length, or beside other requests,
and with speculation on or off; a seeded sampled request the same tokens too.

The logprobs (each token's and the top 5) are compared exactly: they come from the logits' bits, so a change in
rounding shows there even where it flips no token. Without the flag the same comparison fails (the control below):
a prompt in chunks sums its attention in another order than whole, and on the default model a prompt split between
a cached prefix and new tokens does too (in bfloat16, by up to 0.375 in a logit).

Both dtypes run on every CPU: float32 on radixrt's fp32 panel kernel (AVX2), bfloat16 on its AMX or AVX512-BF16
kernels; a CPU without those is refused bfloat16 with a message, and that refusal is what is tested there.
"""

from __future__ import annotations

import pytest
import torch

from radixrt.kernels import cpu_kernels
from radixrt.model import cpu_linear
from radixrt.sampling.params import SamplingParams
from radixrt.server_args import ServerArgs
from exact_runs import logprob_runs

# Alone after the parallel part of `make test`, on every core: the C++ kernels split their work over threads.
pytestmark = pytest.mark.serial

NEW_TOKENS = 24
# A prompt with a repeating stretch (n-gram drafts get accepted) and text of its own around it.
PROMPT = [3 + (i * 11) % 97 for i in range(40)] + [1 + (i * 7) % 23 for i in range(70)] + list(range(30, 70))
GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
SAMPLED = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.9, top_p=0.9, top_k=40, seed=7, ignore_eos=True)


def bf16_supported() -> bool:
    return cpu_kernels.load() is not None and (cpu_kernels.linear_amx_usable() or cpu_kernels.linear_bf16_built())


def run(folder, dtype: str, batch: list[tuple[list[int], SamplingParams]], deterministic: bool = True,
        cached: list[int] | None = None, chunk: int = 2048, speculative: bool = False) -> list[list]:
    """Each request of ``batch`` (submitted together) as its tokens with their logprobs and top-5 logprobs; first,
    on its own, ``cached`` (a prompt whose pages the radix cache then holds)."""
    outputs, accepted = logprob_runs(folder, dtype, [batch], deterministic=deterministic, chunk=chunk,
                                     speculative=speculative, cached=cached)
    if speculative:
        assert accepted > 0, "the drafts must really be verified for the comparison to mean much"
    return outputs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_request_gets_the_same_bits_however_its_prompt_is_split_and_whatever_runs_beside_it(tiny_hd64, dtype):
    if dtype == "bfloat16" and not bf16_supported():
        with pytest.raises(ValueError, match="deterministic inference needs radixrt's bf16 kernels"):
            run(tiny_hd64, dtype, [(PROMPT, GREEDY)])
        return
    alone = run(tiny_hd64, dtype, [(PROMPT, GREEDY), (PROMPT[:60], SAMPLED)])
    others = [(PROMPT[:90] + [5, 6, 7, 8] * 9, GREEDY), ([9] * 20 + PROMPT[20:100], GREEDY), ([4, 2] * 70, GREEDY)]
    ways = {
        **{f"after {cut} cached tokens": dict(cached=PROMPT[:cut]) for cut in (5, 37, 64, 101, len(PROMPT) - 2)},
        "in chunks of 16 tokens": dict(chunk=16),
        "in chunks of 40 tokens, its prefix cached": dict(chunk=40, cached=PROMPT[:23]),
        "with speculation": dict(speculative=True),
    }
    for way, kwargs in ways.items():
        assert run(tiny_hd64, dtype, [(PROMPT, GREEDY), (PROMPT[:60], SAMPLED)], **kwargs) == alone, way
    # beside requests that share part of its prompt, arrive with it, and finish at other steps
    batch = [others[0], (PROMPT, GREEDY), others[1], (PROMPT[:60], SAMPLED), others[2]]
    together = run(tiny_hd64, dtype, batch, cached=PROMPT[:50])
    assert [together[1], together[3]] == alone
    assert len({tuple(t for t, *_ in out) for out in together}) > 1, "the batch-mates must really decode other text"


def test_without_the_flag_a_prompt_in_chunks_gets_other_bits(tiny_hd64):
    """The control: the comparison above is fine enough to see what the flag removes. Without it a chunk of up to
    16 new tokens attends as decode rows and a longer one through torch's flash kernel, which sums in another
    order (float32: every CPU)."""
    alone = run(tiny_hd64, "float32", [(PROMPT, GREEDY)], deterministic=False)
    chunked = [run(tiny_hd64, "float32", [(PROMPT, GREEDY)], deterministic=False, chunk=chunk) for chunk in (16, 40)]
    assert any(out != alone for out in chunked)


def test_the_runner_takes_the_flag_from_server_args_and_runs_radixrt_kernels(tiny_hd64):
    from radixrt.model.runner import ModelRunner

    runner = ModelRunner.from_args(tiny_hd64, ServerArgs(dtype="float32", enable_deterministic_inference=True,
                                                         max_total_pages=32))
    assert runner.deterministic and runner.attention.all_rows
    assert runner.model.packed_head.kernel == "panels"
    assert all(m.packed.kernel == "panels" for m in runner.model.modules() if hasattr(m, "packed") and m.packed)
    plain = ModelRunner.from_args(tiny_hd64, ServerArgs(dtype="float32", max_total_pages=32))
    assert not plain.deterministic and not plain.attention.all_rows


def test_row_invariant_kernels_are_chosen_over_faster_ones_or_refused(monkeypatch):
    weight = torch.ones(32, 64)
    # an Intel CPU with AVX-512: oneDNN runs fp32 by default, whose rows may round with their neighbours
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: frozenset({"avx2", "fma", "avx512f"}))
    monkeypatch.setattr(cpu_kernels, "cpu_model", lambda: ("GenuineIntel", 6))
    monkeypatch.setattr(cpu_kernels, "linear_panels_usable", lambda: True)
    assert cpu_linear.choose_kernel(weight) == "onednn"
    assert cpu_linear.choose_kernel(weight, row_invariant=True) == "panels"
    monkeypatch.setattr(cpu_kernels, "linear_panels_usable", lambda: False)
    with pytest.raises(ValueError, match="fp32 panel kernel"):
        cpu_linear.choose_kernel(weight, row_invariant=True)
    monkeypatch.setattr(cpu_kernels, "linear_amx_usable", lambda: False)
    monkeypatch.setattr(cpu_kernels, "linear_bf16_built", lambda: False)
    with pytest.raises(ValueError, match="bf16 kernels"):
        cpu_linear.choose_kernel(weight.bfloat16(), row_invariant=True)
    monkeypatch.setattr(cpu_kernels, "linear_bf16_built", lambda: True)
    assert cpu_linear.choose_kernel(weight.bfloat16(), row_invariant=True) == "bf16"
    monkeypatch.setattr(cpu_kernels, "linear_amx_usable", lambda: True)
    assert cpu_linear.choose_kernel(weight.bfloat16(), row_invariant=True) == "amx"
    assert cpu_linear.choose_kernel(torch.ones(32, 48, dtype=torch.bfloat16), row_invariant=True) == "bf16"
    monkeypatch.setenv("RADIXRT_DISABLE_PACKED_LINEAR", "1")
    assert cpu_linear.pack_weight(weight) is None
    with pytest.raises(ValueError, match="packed linear layers"):
        cpu_linear.pack_weight(weight, row_invariant=True)


@pytest.mark.parametrize("kwargs, message", [
    (dict(device="cuda"), "runs on the CPU only"),
    (dict(tp_size=2), "tensor parallelism"),
    (dict(attention_backend="triton"), "torch attention backend"),
    (dict(dtype="float16"), "not float16"),
])
def test_what_deterministic_inference_cannot_run_with_is_refused_before_anything_starts(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(enable_deterministic_inference=True, **kwargs)
    ServerArgs(**kwargs)  # each is fine without the flag


def test_the_runner_refuses_a_device_or_world_it_cannot_keep_to_the_bit():
    from radixrt.model.runner import check_deterministic

    with pytest.raises(ValueError, match="CPU only"):
        check_deterministic(torch.device("cuda"), None)
    with pytest.raises(ValueError, match="tensor parallelism"):
        check_deterministic(torch.device("cpu"), object())
    check_deterministic(torch.device("cpu"), None)


def test_sglang_s_launch_flag_parses():
    import argparse

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args(["--model-path", "m", "--enable-deterministic-inference"]))
    assert args.enable_deterministic_inference
    assert not ServerArgs.from_cli_args(parser.parse_args([])).enable_deterministic_inference


def test_the_engine_gives_the_default_model_s_prompt_the_same_bits_cached_or_not(default_model_path):
    """The same through the Engine and its flag, on the default model (float32: every CPU)."""
    from radixrt.engine import Engine

    engine = Engine(model=str(default_model_path), dtype="float32", enable_deterministic_inference=True,
                    log_interval=0)
    try:
        text = ("Merchants came from the south, bringing salt, cloth and news of distant wars; over the centuries "
                "the town grew into a center of trade, and its bridges were rebuilt after every flood. ") * 5
        prompt = engine.tokenizer.encode(text)
        params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}

        def logprobs(ids):
            out = engine.generate(input_ids=ids, sampling_params=params, return_logprob=True, top_logprobs_num=5)
            return [o["meta_info"]["output_top_logprobs"] for o in (out if isinstance(out, list) else [out])]

        alone = logprobs(prompt)
        engine.flush_cache()
        engine.generate(input_ids=prompt[:100], sampling_params={"max_new_tokens": 1})
        assert logprobs(prompt) == alone
        engine.flush_cache()
        assert logprobs([prompt[:70] + prompt[:40], prompt, prompt[:150]])[1] == alone[0]
    finally:
        engine.shutdown()
