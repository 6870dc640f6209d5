"""The families with layers, scalings or layouts of their own (Gemma 3, OLMo 2, Granite, Phi-3) through the
scheduler: several requests batched together get transformers' greedy tokens for each alone; Gemma's final logit
soft-cap is applied as transformers applies it; a multimodal Gemma 3 checkpoint serves its text model; what radixrt
does not compute is refused by name. Logits of every mode against transformers: tests/test_model_exact.py; LoRA
adapters on Gemma 3: tests/test_lora.py."""

from __future__ import annotations

import pytest
import torch

from radixrt.model.forward_batch import ForwardBatch, SeqChunk
from radixrt.model.gemma import Gemma3ForCausalLM
from radixrt.model.runner import ModelRunner
from radixrt.sampling.params import SamplingParams
from exact_runs import logprob_runs
from tiny_models import save_tiny_model, tiny_config

PROMPTS = [[5, 9, 3, 77, 12, 40, 8, 1, 99, 23, 64, 7], [17, 2, 3], [100, 42, 42, 42, 8, 9, 61, 30, 31]]
NEW_TOKENS = 12


@pytest.mark.parametrize("family", ["gemma3", "olmo2", "granite", "phi3"])
def test_batched_greedy_tokens_equal_transformers_for_each_request_alone(tmp_path, family):
    hf_model = save_tiny_model(family, tmp_path)
    greedy = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    outputs, _ = logprob_runs(tmp_path, "float32", [[(p, greedy) for p in PROMPTS]])
    for prompt, output in zip(PROMPTS, outputs):
        with torch.no_grad():
            # every prompt token attended (OLMo 2's config names token 1 its padding)
            expected = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=int),
                                         max_new_tokens=NEW_TOKENS, do_sample=False,
                                         min_new_tokens=NEW_TOKENS)[0, len(prompt):].tolist()
        assert [token for token, _, _ in output] == expected


def _save(config, folder):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.3)  # large logits, so that the cap bends them
    model.eval()
    model.save_pretrained(folder)
    return model


def test_a_final_logit_soft_cap_is_applied_as_transformers_applies_it(tmp_path):
    config = tiny_config("gemma3")
    config.final_logit_softcapping = 2.0
    hf_model = _save(config, tmp_path)
    runner = ModelRunner(tmp_path, dtype="float32", page_size=4, num_pages=16)
    assert isinstance(runner.model, Gemma3ForCausalLM)
    pages = runner.pool.alloc(3)
    ours = runner.forward(ForwardBatch.build([SeqChunk(PROMPTS[0], 0, pages, logits_from=0)], 4))
    with torch.no_grad():
        expected = hf_model(torch.tensor([PROMPTS[0]])).logits[0]
    assert expected.abs().max().item() > 1.5  # near the cap: without it the logits would differ widely
    assert (ours - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("field, value, message", [
    ("attn_logit_softcapping", 50.0, "soft-capped attention scores"),
    ("use_bidirectional_attention", True, "bidirectional attention"),
])
def test_gemma_variants_radixrt_does_not_compute_are_refused(tmp_path, field, value, message):
    config = tiny_config("gemma3")
    setattr(config, field, value)
    _save(config, tmp_path)
    with pytest.raises(ValueError, match=message):
        ModelRunner(tmp_path, num_pages=4)


def test_a_multimodal_gemma_3_checkpoint_serves_its_text_model(tmp_path):
    """Gemma 3's 4B-27B checkpoints hold a vision tower beside the language model: radixrt reads the text config and
    the language model's tensors (the tower and projector stay unread) and gives transformers' text-only logits."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    config = Gemma3Config(text_config=tiny_config("gemma3").to_dict(), vision_config=vision.to_dict(),
                          mm_tokens_per_image=4, image_token_index=127, boi_token_index=125, eoi_token_index=126)
    torch.manual_seed(0)
    hf_model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for param in hf_model.parameters():
            param.normal_(0.0, 0.08)
    hf_model.save_pretrained(tmp_path)
    runner = ModelRunner(tmp_path, dtype="float32", page_size=4, num_pages=16)
    assert isinstance(runner.model, Gemma3ForCausalLM) and runner.config.model_type == "gemma3_text"
    pages = runner.pool.alloc(3)
    ours = runner.forward(ForwardBatch.build([SeqChunk(PROMPTS[0], 0, pages, logits_from=0)], 4))
    with torch.no_grad():
        expected = hf_model(input_ids=torch.tensor([PROMPTS[0]])).logits[0]
    assert (ours - expected).abs().max().item() <= 1e-4


def test_olmo_2_refuses_tensor_parallelism():
    from radixrt.model.olmo import Olmo2ForCausalLM
    from radixrt.model.parallel import TPGroup

    with pytest.raises(ValueError, match="its q/k norms span every head"):
        Olmo2ForCausalLM(tiny_config("olmo2"), max_positions=64, tp=TPGroup(rank=0, size=2))


def test_rotary_over_part_of_each_head_is_refused(tmp_path):
    """Phi-4-mini rotates 3/4 of each head: radixrt's rotary kernels rotate whole heads, so such a model is refused."""
    config = tiny_config("phi3")
    config.rope_parameters = {**config.rope_parameters, "partial_rotary_factor": 0.75}
    _save(config, tmp_path)
    with pytest.raises(ValueError, match="partial_rotary_factor 0.75"):
        ModelRunner(tmp_path, num_pages=4)
