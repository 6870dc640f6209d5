"""The families with layers, scalings or layouts of their own (Gemma 3, OLMo 2, Granite, Phi-3, Phi-4-mini's partial
rotary and LongRoPE) through the scheduler: several requests batched together get transformers' greedy tokens for
each alone; Gemma's final logit
soft-cap is applied as transformers applies it; a multimodal Gemma 3 checkpoint serves its text model; what radixrt
does not compute is refused by name. Logits of every mode against transformers: tests/test_model_exact.py; LoRA
adapters on Gemma 3: tests/test_lora.py."""

from __future__ import annotations

import pytest
import torch

from radixrt.model.forward_batch import ForwardBatch, SeqChunk
from radixrt.model.gemma import Gemma3ForCausalLM
from radixrt.lockstep import generate_ids
from radixrt.model.runner import ModelRunner
from radixrt.sampling.params import SamplingParams
from exact_runs import logprob_runs
from tiny_models import save_tiny_model, tiny_config

PROMPTS = [[5, 9, 3, 77, 12, 40, 8, 1, 99, 23, 64, 7], [17, 2, 3], [100, 42, 42, 42, 8, 9, 61, 30, 31]]
NEW_TOKENS = 12


@pytest.mark.parametrize("family", ["gemma3", "olmo2", "granite", "phi3", "phi4-mini", "smollm3"])
def test_batched_greedy_tokens_equal_transformers_for_each_request_alone(tmp_path, family):
    hf_model = save_tiny_model(family, tmp_path)
    greedy = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    outputs, _ = logprob_runs(tmp_path, "float32", [[(p, greedy) for p in PROMPTS]])
    for prompt, output in zip(PROMPTS, outputs):
        with torch.no_grad():
            # every prompt token attended (OLMo 2's config names token 1 its padding)
            run = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=int),
                                    max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS,
                                    output_logits=True, return_dict_in_generate=True)
        expected = run.sequences[0, len(prompt):].tolist()
        assert [token for token, _, _ in output] == expected
        # the chosen tokens' logprobs too: a difference that flips no token shows there
        logprobs = [torch.log_softmax(step[0].float(), -1)[token].item() for step, token in zip(run.logits, expected)]
        assert [logprob[0] for _, logprob, _ in output] == pytest.approx(logprobs, abs=1e-4)


@pytest.fixture(scope="module")
def long_rope_model(tmp_path_factory):
    """A tiny Phi-4-mini (LongRoPE past an original context of 8) and transformers' greedy tokens and their logprobs
    for two prompts longer than that and two shorter that outgrow it while generating, one of them repeated text
    (so that n-gram drafts find something before and after it crosses)."""
    folder = tmp_path_factory.mktemp("phi4-mini")
    hf_model = save_tiny_model("phi4-mini", folder)
    prompts = PROMPTS + [[7, 8, 9, 7, 8, 9, 7]]
    expected = []
    for prompt in prompts:
        with torch.no_grad():
            run = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=int),
                                    max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS,
                                    output_logits=True, return_dict_in_generate=True)
        tokens = run.sequences[0, len(prompt):].tolist()
        expected.append((tokens, [torch.log_softmax(step[0], -1)[t].item() for step, t in zip(run.logits, tokens)]))
    return folder, prompts, expected


@pytest.mark.parametrize("how", ["overlap", "speculative", "chunked"])
def test_long_rope_tokens_equal_transformers_however_scheduled(long_rope_model, how, monkeypatch):
    """Sequences past the original context rotate long throughout (transformers' generation computes a sequence
    that outgrows it again, long, and so does the scheduler); the short-rotated pages of a cached 8-token prefix are
    never shared with a sequence rotated long. Through the overlap scheduler (which leaves a crossing step to the
    synchronous loop), with speculative drafts (none past the context while rotated short), or in prefill chunks
    of 4 tokens."""
    from radixrt.scheduler.speculation import StepCost

    folder, prompts, expected = long_rope_model
    greedy = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    monkeypatch.setattr(StepCost, "token_cost", lambda self, batch: 0.125)  # drafts pay, however busy the machine
    stats: dict = {}
    outputs, accepted = logprob_runs(folder, "float32", [[(p, greedy) for p in prompts]], page_size=4,
                                     cached=prompts[0][:8], overlap=how == "overlap", logprobs=how != "overlap",
                                     speculative=how == "speculative", chunk=4 if how == "chunked" else 2048,
                                     stats=stats)
    for output, (tokens, logprobs) in zip(outputs, expected):
        assert [token for token, _, _ in output] == tokens
        if how != "overlap":  # the overlap scheduler runs requests without logprobs only
            assert [logprob[0] for _, logprob, _ in output] == pytest.approx(logprobs, abs=1e-4)
    if how == "speculative":
        assert accepted > 0
    if how == "overlap":
        assert stats["launched_steps"] > 0
    # the two requests that crossed (prompts of 3 and 7 tokens) were computed again, not retracted for memory
    assert stats["scheduler"].num_long_rope_restarts == 2 and stats["scheduler"].num_retractions == 0


def test_long_rope_tokens_equal_transformers_in_lockstep(long_rope_model):
    """``generate_ids`` (the lock-step loop of ``radixrt generate``) computes a sequence again, long, as it crosses."""
    folder, prompts, expected = long_rope_model
    runner = ModelRunner(folder, dtype="float32", num_pages=64, page_size=4)
    outputs = generate_ids(runner, prompts, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    assert outputs == [tokens for tokens, _ in expected]


def test_a_long_rope_config_in_the_hubs_layout_loads_as_transformers_loads_it(tmp_path):
    """Phi-3.5-mini's and Phi-4-mini's config.json keep LongRoPE in ``rope_scaling`` (``type``), with
    ``original_max_position_embeddings`` and ``partial_rotary_factor`` beside it at the top: the same model as
    transformers reads from that file, prompts past the original context and within it."""
    import json

    from transformers import AutoModelForCausalLM

    save_tiny_model("phi4-mini", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config.update(rope_theta=rope["rope_theta"], partial_rotary_factor=rope["partial_rotary_factor"],
                  original_max_position_embeddings=rope["original_max_position_embeddings"],
                  rope_scaling={"type": "longrope", "long_factor": rope["long_factor"],
                                "short_factor": rope["short_factor"]})
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf_model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager")
    runner = ModelRunner(tmp_path, dtype="float32", num_pages=16, page_size=4)
    assert runner.long_rope_from == 8
    for prompt in PROMPTS[:2]:  # 12 tokens: rotated long; 3: short
        long = len(prompt) > 8
        pages = runner.pool.alloc(-(-len(prompt) // 4))
        batch = ForwardBatch.build([SeqChunk(prompt, 0, pages, logits_from=0, long_rope=long)], 4, long_rope_from=8)
        with torch.no_grad():
            expected = hf_model(torch.tensor([prompt])).logits[0]
        assert (runner.forward(batch) - expected).abs().max().item() <= 1e-4
        runner.pool.decref(pages)


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


def test_a_rotary_share_of_each_head_that_is_not_an_even_number_of_elements_is_refused(tmp_path):
    """Rotary pairs split a head's rotated elements in halves: 5 of 16 cannot be rotated."""
    config = tiny_config("phi3")
    config.rope_parameters = {**config.rope_parameters, "partial_rotary_factor": 0.3125}
    _save(config, tmp_path)
    with pytest.raises(ValueError, match="partial_rotary_factor 0.3125 of head_dim 16 gives a rotary dim of 5"):
        ModelRunner(tmp_path, num_pages=4)
