"""Our paged forward against transformers on tiny random checkpoints of every supported family."""

import pytest
import torch

from radixrt.model.forward_batch import ForwardBatch, SeqChunk
from radixrt.model.runner import ModelRunner
from tiny_models import FAMILIES, save_tiny_model

PROMPTS = [[5, 9, 3, 77, 12, 40, 8, 1, 99, 23, 64, 7, 15, 2, 31, 88, 45, 19, 120, 6], [17, 2, 3], [100, 42, 42, 42, 8, 9, 61]]


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf_model = save_tiny_model(request.param, folder)
    with torch.no_grad():
        expected = [hf_model(torch.tensor([p])).logits[0] for p in PROMPTS]
    return folder, expected


def run_ours(runner: ModelRunner, prompts: list[list[int]], mode: str,
             lora_uids: list[int] | None = None) -> list[torch.Tensor]:
    """Logits at every prompt position, computing the prompts as asked by ``mode`` (each through the LoRA adapter
    ``lora_uids`` gives it, if any)."""
    lora_uids = lora_uids or [0] * len(prompts)
    pool, size, long_from = runner.pool, runner.page_size, runner.long_rope_from
    # LongRoPE: a prompt longer than the original context rotates long at every position, as transformers does
    long = [long_from is not None and len(p) > long_from for p in prompts]
    pages = [pool.alloc(-(-len(p) // size)) for p in prompts]
    if mode == "one_extend":
        splits = [[len(p)] for p in prompts]
    elif mode == "prefix_then_rest":
        splits = [[len(p) // 2, len(p) - len(p) // 2] if len(p) > 1 else [1] for p in prompts]
    elif mode == "mixed":  # one request extends while the others advance a token a step, in the same batches
        splits = [[5, len(p) - 5] if r == 0 else [1] * len(p) for r, p in enumerate(prompts)]
    else:  # one token at a time: prompts of different lengths drop out of the batch as they end
        splits = [[1] * len(p) for p in prompts]
    done = [0] * len(prompts)
    logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    step = 0
    while any(step < len(s) for s in splits):
        rows = [r for r, s in enumerate(splits) if step < len(s)]
        chunks = [SeqChunk(prompts[r][done[r] : done[r] + splits[r][step]], done[r], pages[r], logits_from=0,
                           lora_uid=lora_uids[r], long_rope=long[r]) for r in rows]
        out = runner.forward(ForwardBatch.build(chunks, size, long_rope_from=long_from)).split(
            [len(c.tokens) for c in chunks])
        for r, chunk, rows_out in zip(rows, chunks, out):
            logits[r].append(rows_out)
            done[r] += len(chunk.tokens)
        step += 1
    for p in pages:
        pool.decref(p)
    assert pool.num_used == 0
    return [torch.cat(parts) for parts in logits]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("mode", ["one_extend", "prefix_then_rest", "decode_steps", "mixed"])
def test_logits_equal_transformers_fp32(family_model, page_size, mode):
    folder, expected = family_model
    runner = ModelRunner(folder, dtype="float32", page_size=page_size, num_pages=64)
    got = run_ours(runner, PROMPTS, mode)
    for ours, ref in zip(got, expected):
        assert (ours - ref).abs().max().item() <= 1e-4


def test_bf16_close_to_transformers(family_model):
    folder, expected = family_model
    runner = ModelRunner(folder, dtype="bfloat16", page_size=4, num_pages=64)
    assert runner.pool.k_caches[0].dtype == torch.bfloat16
    for ours, ref in zip(run_ours(runner, PROMPTS, "prefix_then_rest"), expected):
        assert (ours - ref).abs().max().item() <= 0.05 * ref.abs().max().item() + 0.02
        assert torch.equal(ours[-1].argmax(), ref[-1].argmax()) or (ref[-1].topk(2).values.diff().abs() < 0.05).item()


def test_unsupported_architecture_is_rejected(tmp_path):
    import json

    save_tiny_model("llama", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="not supported"):
        ModelRunner(tmp_path, num_pages=4)
