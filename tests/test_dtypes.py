"""What `--dtype auto` resolves to, and bf16 serving on the default model against transformers in bf16.

bf16 is what `auto` serves on CPUs with AVX512-BF16 or AMX, so the engine in bf16 is held to transformers
in bf16 on the same weights: each greedy token must be transformers' own greedy choice given the same
prefix (up to a bf16 rounding step), and the logprobs must agree within the tolerances measured below.
"""

import pytest
import torch

from radixrt.model import runner as runner_module
from radixrt.model.runner import AUTO_DTYPE_ENV, parse_dtype

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "How many legs does a spider have?",
]
NEW_TOKENS = 16

# Measured on AMD EPYC (AVX2), the prompts above, 16 greedy tokens each, radixrt bf16 against transformers bf16
# on radixrt's tokens: generated tokens max |d logprob| 0.138, mean 0.021; prompt tokens max 0.346, mean 0.051
# (transformers bf16 against transformers fp32 on the same tokens: max 0.33, mean 0.051). Every greedy token was
# transformers' argmax or tied with it. The bounds are about twice the measurements.
OUTPUT_MAX, OUTPUT_MEAN = 0.3, 0.05
PROMPT_MAX, PROMPT_MEAN = 0.6, 0.1
# A greedy token must be transformers' bf16 argmax or within the per-token logprob disagreement that
# test_bf16_logprobs_match_transformers_bf16 allows (OUTPUT_MAX): two bf16 forwards that differ by that much can
# order a near-tie either way (one seen: 0.25 apart at logits of 16-32, two bf16 steps).
GREEDY_MARGIN = OUTPUT_MAX


def test_auto_follows_the_environment(monkeypatch):
    monkeypatch.setenv(AUTO_DTYPE_ENV, "bfloat16")
    assert parse_dtype("auto") == torch.bfloat16
    monkeypatch.setenv(AUTO_DTYPE_ENV, "float32")
    assert parse_dtype("auto") == torch.float32
    assert parse_dtype("bfloat16") == torch.bfloat16  # an explicit dtype is never overridden
    monkeypatch.setenv(AUTO_DTYPE_ENV, "int8")
    with pytest.raises(ValueError, match=AUTO_DTYPE_ENV):
        parse_dtype("auto")


@pytest.mark.parametrize("fast_bf16, expected", [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_without_the_environment_follows_the_cpu(monkeypatch, fast_bf16, expected):
    monkeypatch.delenv(AUTO_DTYPE_ENV, raising=False)
    monkeypatch.setattr(runner_module, "_cpu_has_fast_bf16", lambda: fast_bf16)
    assert parse_dtype("auto") == expected


@pytest.fixture(scope="module")
def bf16_run(default_model_path):
    """The engine's greedy outputs in bf16 (with logprobs) and transformers' bf16 logprobs on the same tokens."""
    from transformers import AutoModelForCausalLM

    import radixrt
    from radixrt.tokenizer import apply_chat_template

    with radixrt.Engine(dtype="bfloat16", log_interval=0, kv_memory_gb=0.1, debug_checks=True) as engine:
        assert engine.runner.dtype == torch.bfloat16
        prompts = [apply_chat_template(engine.tokenizer, [{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
        outputs = engine.generate(input_ids=prompts, return_logprob=True, logprob_start_len=0,
                                  sampling_params={"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True})
    model = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.bfloat16).eval()
    sequences = [p + o["output_ids"] for p, o in zip(prompts, outputs)]
    width = max(map(len, sequences))
    # Padding on the right leaves every real position's causal context, and so its logits, unchanged.
    ids = torch.tensor([s + [0] * (width - len(s)) for s in sequences])
    with torch.no_grad():
        logits = model(ids, attention_mask=(torch.arange(width) < torch.tensor([[len(s)] for s in sequences])).long()).logits
    reference = [torch.log_softmax(logits[row, : len(s)].float(), -1) for row, s in enumerate(sequences)]
    return prompts, outputs, reference


@pytest.mark.model
@pytest.mark.slow
def test_bf16_greedy_tokens_are_transformers_bf16_choices(bf16_run):
    prompts, outputs, reference = bf16_run
    for prompt, out, ref in zip(prompts, outputs, reference):
        rows = ref[len(prompt) - 1 : -1]  # the row that predicts each generated token
        chosen = rows[torch.arange(len(out["output_ids"])), torch.tensor(out["output_ids"])]
        deficit = rows.max(-1).values - chosen
        assert deficit.max().item() <= GREEDY_MARGIN, (prompt, out["output_ids"], deficit.tolist())


@pytest.mark.model
@pytest.mark.slow
def test_bf16_logprobs_match_transformers_bf16(bf16_run):
    prompts, outputs, reference = bf16_run
    output_diffs, prompt_diffs = [], []
    for prompt, out, ref in zip(prompts, outputs, reference):
        meta = out["meta_info"]
        assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
        for i, (logprob, token, _) in enumerate(meta["output_token_logprobs"]):
            output_diffs.append(abs(logprob - ref[len(prompt) + i - 1, token].item()))
        entries = meta["input_token_logprobs"]
        assert [t for _, t, _ in entries] == prompt and entries[0][0] is None  # nothing predicts the first token
        prompt_diffs += [abs(logprob - ref[j - 1, token].item()) for j, (logprob, token, _) in enumerate(entries) if j]
    output_diffs, prompt_diffs = torch.tensor(output_diffs), torch.tensor(prompt_diffs)
    assert output_diffs.max() <= OUTPUT_MAX and output_diffs.mean() <= OUTPUT_MEAN, output_diffs
    assert prompt_diffs.max() <= PROMPT_MAX and prompt_diffs.mean() <= PROMPT_MEAN, prompt_diffs
