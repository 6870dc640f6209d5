"""The default model (SmolLM2-135M-Instruct) against transformers `generate` on the same weights."""

import pytest
import torch

from radixrt.bench.gpu_check_parts import TIE
from radixrt.model.runner import ModelRunner
from radixrt.lockstep import generate_ids
from radixrt.sampling.params import SamplingParams
from radixrt.tokenizer import apply_chat_template, eos_token_ids

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain what a radix tree is in one sentence.",
]

pytestmark = pytest.mark.model


def transformers_model(model_path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()


def transformers_greedy(model, tokenizer) -> list[list[int]]:
    """transformers' greedy continuation (32 tokens) of each chat prompt."""
    outputs = []
    for prompt in CHAT_PROMPTS:
        ids = apply_chat_template(tokenizer, [{"role": "user", "content": prompt}])
        # The pad id (<|im_end|>) occurs inside chat prompts: without an explicit mask, generate() would
        # treat those prompt tokens as padding and mask them out.
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=32, do_sample=False, eos_token_id=None,
                                 pad_token_id=tokenizer.pad_token_id)
        outputs.append(out[0, len(ids):].tolist())
    return outputs


@pytest.fixture(scope="module")
def hf_greedy(default_model_path, tokenizer):
    return transformers_greedy(transformers_model(default_model_path, torch.float32), tokenizer)


@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_equals_transformers_generate(default_model_path, tokenizer, hf_greedy, page_size):
    runner = ModelRunner(default_model_path, dtype="float32", page_size=page_size, kv_memory_gb=0.25)
    prompts = [apply_chat_template(tokenizer, [{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
    ours = generate_ids(runner, prompts, SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True))
    assert ours == hf_greedy
    assert runner.pool.num_used == 0


def test_bf16_greedy_follows_transformers_bf16_up_to_a_near_tie(default_model_path, tokenizer, hf_model):
    """bf16 against transformers in bf16 on this machine, never against fp32's tokens: two bf16 forwards round
    differently (kernels, summation order), so a greedy step whose two best tokens lie within a bf16 tie
    (``TIE``, as the GPU check judges) may go either way. Every one of our tokens is judged on our own prefix:
    transformers' logprob of its best token there may exceed that of ours by a tie at most, in bf16 or in fp32 (a
    pair of tokens fp32 finds within a tie is one, however far apart transformers' own bf16 rounding puts them: on
    an AVX2 CPU a pair 0.14 apart in fp32 came out 0.375 apart in transformers' bf16)."""
    runner = ModelRunner(default_model_path, dtype="bfloat16", kv_memory_gb=0.25)
    prompts = [apply_chat_template(tokenizer, [{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
    ours = generate_ids(runner, prompts, SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True))
    model = transformers_model(default_model_path, torch.bfloat16)
    for prompt, got in zip(prompts, ours):
        gaps = []
        for reference in (model, hf_model):
            with torch.no_grad():
                logits = reference(torch.tensor([prompt + got[:-1]])).logits[0, len(prompt) - 1:].float()
            logprobs = torch.log_softmax(logits, -1)
            gaps.append(logprobs.max(-1).values - logprobs[torch.arange(len(got)), torch.tensor(got)])
        gap = torch.minimum(*gaps)
        assert len(got) == 32 and float(gap.max()) <= TIE["bfloat16"], (prompt, gaps[0].tolist(), gaps[1].tolist())


def test_eos_ends_generation(default_model_path, tokenizer):
    runner = ModelRunner(default_model_path, dtype="float32", kv_memory_gb=0.25)
    prompt = apply_chat_template(tokenizer, [{"role": "user", "content": "Say OK."}])
    eos = eos_token_ids(default_model_path, tokenizer)
    (out,) = generate_ids(runner, [prompt], SamplingParams(max_new_tokens=200, temperature=0.0), eos)
    assert out[-1] in eos and len(out) < 200


def test_fp8_at_load_gives_transformers_greedy_tokens_on_the_same_fp8_weights(default_model_path, tokenizer,
                                                                               hf_greedy):
    """``--quantization fp8`` through the Engine on the default model (its 576-wide projections end in partial
    128-blocks; the tied embedding stays unquantized): in fp32 the greedy tokens of transformers running the
    weights fp8 gives them (quantized and dequantized in plain torch), which are not the unquantized model's."""
    from radixrt import Engine
    from radixrt.model.fp8 import quantize

    model = transformers_model(default_model_path, torch.float32)
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith("_proj") and isinstance(module, torch.nn.Linear):
                bits, scales = quantize(module.weight, (128, 128))
                rows, cols = bits.shape
                grid = scales.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
                module.weight.copy_(bits.view(torch.float8_e4m3fn).float() * grid)
    want = transformers_greedy(model, tokenizer)
    prompts = [apply_chat_template(tokenizer, [{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
    with Engine(model=str(default_model_path), dtype="float32", quantization="fp8", kv_memory_gb=0.25,
                log_interval=0) as engine:
        results = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 32, "temperature": 0,
                                                                      "ignore_eos": True})
    assert [r["output_ids"] for r in results] == want
    assert want != hf_greedy
