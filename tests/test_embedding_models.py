"""Embedding models as SGLang and vLLM serve them: checkpoints in the hub's embedding layout (a decoder without its
LM head, its tensors without the ``model.`` prefix: Qwen3-Embedding, gte-Qwen2, e5-mistral) or a whole causal
checkpoint under ``--is-embedding``; the pooling of their sentence-transformers files (last token, mean, first
token; normalized or not) giving sentence-transformers' own vectors through the scheduler (batched, in prefill
chunks, beside a cached prefix, after a preemption); Matryoshka ``dimensions``; generation refused on a model
without a head. The HTTP routes over such a model: tests/test_embedding_server.py."""

from __future__ import annotations

import json

import pytest
import torch

from radixrt.model.pooling import Pooling, read_pooling
from radixrt.protocol.errors import RequestError
from radixrt.protocol.limits import ModelLimits
from radixrt.protocol.messages import BatchTokenOut, GenerateReq
from radixrt.protocol.validation import validate_kind
from radixrt.sampling.params import SamplingParams
from radixrt.server_args import ServerArgs
from tiny_models import save_embedding_model

PREFIX = [5, 9, 3, 77, 12, 40, 8, 1, 99, 23]  # an instruction several prompts share
PROMPTS = [PREFIX + [64, 7, 17], PREFIX + [2, 3], [100, 42, 42, 42, 8, 9, 61, 30, 31], [17]]
PAGE = 4
EMBED = SamplingParams(max_new_tokens=0)


def reference(st_model, ids: list[int]) -> torch.Tensor:
    """sentence-transformers' vector of one prompt (its own modules over the checkpoint's files)."""
    with torch.no_grad():
        t = torch.tensor([ids])
        return st_model.forward({"input_ids": t, "attention_mask": torch.ones_like(t)})["sentence_embedding"][0]


def sentence_transformer(folder):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(folder), device="cpu")


class Run:
    """A scheduler over a ModelRunner of ``folder`` (fp32, pages of 4), fed token ids; each request's answer."""

    def __init__(self, folder, chunk: int = 2048, num_pages: int = 64, **args) -> None:
        from radixrt.model.runner import ModelRunner
        from radixrt.scheduler.scheduler import Scheduler

        self.out: dict[str, object] = {}
        self.meta: dict[str, object] = {}
        server_args = ServerArgs(log_interval=0, page_size=PAGE, chunked_prefill_size=chunk, debug_checks=True,
                                 **args)
        self.runner = ModelRunner(folder, dtype="float32", page_size=PAGE, num_pages=num_pages,
                                  is_embedding=server_args.is_embedding,
                                  model_overrides=server_args.model_overrides())
        self.scheduler = Scheduler(server_args, self.runner, None, {0}, self._sink)

    def _sink(self, msg: BatchTokenOut) -> None:
        for delta in msg.deltas:
            if delta.finish_reason is not None:
                self.out[delta.rid] = delta.embedding if delta.embedding is not None else delta.finish_reason
                self.meta[delta.rid] = delta.cached_tokens

    def submit(self, rid: str, ids: list[int], embed: bool = True, **fields) -> None:
        params = EMBED if embed else SamplingParams(max_new_tokens=2)
        self.scheduler.submit(GenerateReq(rid, ids, params, embed=embed, **fields))

    def drain(self) -> None:
        while self.scheduler.step() or not self.scheduler.idle:
            pass

    def embed(self, prompts: list[list[int]], **fields) -> list[list[float]]:
        start = len(self.out)
        rids = [f"e{start + i}" for i in range(len(prompts))]
        for rid, ids in zip(rids, prompts):
            self.submit(rid, ids, **fields)
        self.drain()
        return [self.out[rid] for rid in rids]


def _close(vector, expected: torch.Tensor) -> bool:
    return torch.allclose(torch.tensor(vector), expected.float(), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("family,pooling,normalize", [
    ("qwen3", "last", True), ("qwen3", "mean", True), ("mistral", "cls", True), ("qwen3", "mean", False),
    ("mistral", "last", False),
])
def test_vectors_equal_sentence_transformers(tmp_path, default_model_path, family, pooling, normalize):
    save_embedding_model(family, tmp_path, pooling, normalize, tokenizer_from=default_model_path)
    st_model = sentence_transformer(tmp_path)
    expected = [reference(st_model, ids) for ids in PROMPTS]
    run = Run(tmp_path, chunk=4)  # every prompt over several prefill chunks
    assert not run.runner.model.has_head and run.runner.model.lm_head is None
    assert run.runner.pooling == Pooling(pooling, normalize)
    alone = run.embed(PROMPTS[:1])  # its pages cached: the others share its first two pages
    together = run.embed(PROMPTS)
    assert _close(alone[0], expected[0])
    for vector, want in zip(together, expected):
        assert _close(vector, want)
    # the second prompt's shared prefix (a partial page too) from the cache, unless pooled over every token
    assert run.meta["e2"] == (0 if pooling != "last" else len(PREFIX))


def test_an_every_token_pooling_preempted_mid_prompt_starts_its_pooling_again(tmp_path, default_model_path):
    save_embedding_model("qwen3", tmp_path, "mean", tokenizer_from=default_model_path)
    want = reference(sentence_transformer(tmp_path), PROMPTS[2])
    run = Run(tmp_path, chunk=4, max_running_requests=1)
    run.submit("low", PROMPTS[2], priority=0)
    run.scheduler.step()  # its first 4-token chunk
    run.scheduler.step()  # and its second
    run.submit("urgent", PROMPTS[0], priority=100)  # outranks it: the only slot is taken back
    run.drain()
    assert run.scheduler.stats().num_preemptions == 1
    assert _close(run.out["low"], want)


def test_a_causal_checkpoint_under_is_embedding_loads_no_head_and_refuses_generation(tmp_path):
    base = save_embedding_model("mistral", tmp_path, "last", causal=True)  # untied: its LM head is in the file
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["MistralForCausalLM"]
    run = Run(tmp_path, is_embedding=True)
    assert run.runner.embedding_only and run.runner.model.packed_head is None
    with torch.no_grad():
        hidden = base(torch.tensor([PROMPTS[0]])).last_hidden_state[0, -1]
    assert _close(run.embed(PROMPTS[:1])[0], torch.nn.functional.normalize(hidden, dim=-1))
    run.submit("gen", PROMPTS[1], embed=False)
    run.drain()
    assert run.out["gen"].status_code == 400 and "embeddings only" in run.out["gen"].message
    assert run.embed(PROMPTS[1:2])  # and it keeps serving


def test_an_untied_checkpoint_without_its_head_asks_for_is_embedding(tmp_path):
    # Qwen3-Embedding-4B's layout: a ForCausalLM architecture, untied, no lm_head tensor
    from radixrt.model.runner import ModelRunner

    save_embedding_model("mistral", tmp_path, "last")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["MistralForCausalLM"]}))
    with pytest.raises(ValueError, match="no LM head.*--is-embedding"):
        ModelRunner(tmp_path, dtype="float32", page_size=PAGE, num_pages=8)
    assert Run(tmp_path, is_embedding=True).embed(PROMPTS[:1])


def test_a_generating_model_still_embeds_with_the_last_token(tmp_path):
    from tiny_models import save_tiny_model

    model = save_tiny_model("qwen3", tmp_path)
    run = Run(tmp_path)
    assert run.runner.model.has_head and not run.runner.embedding_only
    with torch.no_grad():
        hidden = model(torch.tensor([PROMPTS[2]]), output_hidden_states=True).hidden_states[-1][0, -1]
    assert _close(run.embed(PROMPTS[2:3])[0], torch.nn.functional.normalize(hidden, dim=-1))
    run.submit("gen", PROMPTS[1], embed=False)
    run.drain()
    assert run.out["gen"].type == "length"  # two tokens generated: the model keeps its head


@pytest.mark.parametrize("fields,ok,bad,error", [
    ({"is_matryoshka": True}, (1, 17, 64), 65, "in [1, 64]"),
    ({"matryoshka_dimensions": [16, 32]}, (16, 32), 24, "one of this model's matryoshka_dimensions"),
    ({}, (), 16, "not a Matryoshka model"),
])
def test_matryoshka_dimensions_cut_then_normalize(tmp_path, fields, ok, bad, error):
    base = save_embedding_model("qwen3", tmp_path, "last", **fields)
    run = Run(tmp_path)
    with torch.no_grad():
        hidden = base(torch.tensor([PROMPTS[0]])).last_hidden_state[0, -1]
    for dims in ok:
        (vector,) = run.embed(PROMPTS[:1], dimensions=dims)
        assert len(vector) == dims and _close(vector, torch.nn.functional.normalize(hidden[:dims], dim=-1))
    run.submit("bad", PROMPTS[0], dimensions=bad)
    run.drain()
    assert run.out["bad"].status_code == 400 and error in run.out["bad"].message


def test_json_model_override_args_declares_a_matryoshka_model(tmp_path):
    save_embedding_model("qwen3", tmp_path, "last")
    run = Run(tmp_path, json_model_override_args='{"is_matryoshka": true}')
    assert len(run.embed(PROMPTS[:1], dimensions=8)[0]) == 8


def test_a_config_override_changes_the_model_as_transformers_does(tmp_path):
    from transformers import AutoModel

    save_embedding_model("qwen3", tmp_path, "last")
    run = Run(tmp_path, json_model_override_args='{"rms_norm_eps": 0.5}')
    overridden = AutoModel.from_pretrained(tmp_path, rms_norm_eps=0.5)
    plain = AutoModel.from_pretrained(tmp_path)
    with torch.no_grad():
        want = overridden(torch.tensor([PROMPTS[0]])).last_hidden_state[0, -1]
        other = plain(torch.tensor([PROMPTS[0]])).last_hidden_state[0, -1]
    (vector,) = run.embed(PROMPTS[:1])
    assert _close(vector, torch.nn.functional.normalize(want, dim=-1))
    assert not _close(vector, torch.nn.functional.normalize(other, dim=-1))


# ----- what is checked before anything runs ---------------------------------------------------------------


def _write_modules(folder, modules: list[str], pooling: dict | None = None) -> None:
    folder.mkdir(exist_ok=True)
    entries = [{"idx": i, "name": str(i), "path": "" if kind == "Transformer" else f"{i}_{kind}",
                "type": f"sentence_transformers.models.{kind}"} for i, kind in enumerate(modules)]
    (folder / "modules.json").write_text(json.dumps(entries))
    for i, kind in enumerate(modules):
        if kind == "Pooling":
            (folder / f"{i}_Pooling").mkdir(exist_ok=True)
            (folder / f"{i}_Pooling" / "config.json").write_text(json.dumps(pooling or {}))


@pytest.mark.parametrize("modules,pooling,words", [
    (["Transformer", "Pooling", "Dense", "Normalize"], {"pooling_mode_mean_tokens": True}, "['Dense']"),
    (["Transformer", "Pooling"], {"pooling_mode_max_tokens": True}, "pooling_mode_max_tokens"),
    (["Transformer", "Pooling"], {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True},
     "exactly one pooling"),
    (["Transformer", "Pooling"], {"pooling_mode_lasttoken": True, "include_prompt": False}, "include_prompt"),
    (["Transformer", "Normalize"], None, "exactly one Pooling"),
])
def test_pooling_radixrt_does_not_compute_is_refused_by_name(tmp_path, modules, pooling, words):
    _write_modules(tmp_path, modules, pooling)
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        read_pooling(tmp_path)


def test_the_pooling_files_and_their_absence(tmp_path):
    assert read_pooling(tmp_path) == Pooling("last", True)  # SGLang's pooling of a causal model
    _write_modules(tmp_path, ["Transformer", "Pooling"], {"pooling_mode_cls_token": True})
    assert read_pooling(tmp_path) == Pooling("cls", False) and Pooling("cls").every_token
    assert not Pooling("last").every_token


@pytest.mark.parametrize("embed,dimensions,limits,words", [
    (False, None, {"generates": False}, "embeddings only"),
    (False, 8, {}, "embedding request only"),
    (True, 0, {"matryoshka": ()}, "in [1, 64]"),
    (True, True, {"matryoshka": ()}, "in [1, 64]"),
    (True, 65, {"matryoshka": ()}, "in [1, 64]"),
    (True, 8, {}, "not a Matryoshka model"),
    (True, 8, {"matryoshka": (16, 32)}, "[16, 32]"),
])
def test_request_kinds_a_model_cannot_serve_are_refused(embed, dimensions, limits, words):
    model = ModelLimits(vocab_size=128, context_length=64, page_size=4, num_pages=8, embedding_size=64, **limits)
    with pytest.raises(RequestError, match=words.replace("[", r"\[").replace("]", r"\]")):
        validate_kind(embed, dimensions, model)
    validate_kind(True, None, model)


# ----- classifiers and reward models -----------------------------------------------------------------------


@pytest.mark.parametrize("family,labels", [("qwen3", ["negative", "neutral", "positive"]), ("llama", ["reward"])])
def test_a_classifier_gives_transformers_scores_at_the_last_token(tmp_path, family, labels):
    from tiny_models import save_classifier_model

    model = save_classifier_model(family, tmp_path, labels)
    run = Run(tmp_path, chunk=4)
    assert run.runner.classifier and run.runner.embedding_only and run.runner.pooling == Pooling("last", False)
    run.embed(PROMPTS[:1])  # cached: the next prompt's shared prefix comes from the cache
    got = run.embed(PROMPTS)
    assert run.meta["e2"] == len(PREFIX)
    for ids, scores in zip(PROMPTS, got):
        with torch.no_grad():
            want = model(torch.tensor([ids])).logits[0]
        assert len(scores) == len(labels) and _close(scores, want)
    run.submit("gen", PROMPTS[0], embed=False)
    run.drain()
    assert run.out["gen"].status_code == 400
