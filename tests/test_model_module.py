"""radixrt's model layers are called straight through their forward: no nn.Module hook machinery per call."""

import torch
from torch import nn

from radixrt.model.forward_batch import ForwardBatch, SeqChunk
from radixrt.model.module import InferenceModule
from radixrt.model.runner import ModelRunner
from tiny_models import save_tiny_model


def test_every_layer_is_an_inference_module_and_hooks_are_not_run(tmp_path):
    save_tiny_model("llama", tmp_path)
    runner = ModelRunner(tmp_path, dtype="float32", num_pages=16, page_size=4)
    kinds = {type(m) for m in runner.model.modules()}
    assert all(issubclass(kind, InferenceModule) or kind is nn.ModuleList for kind in kinds), kinds
    batch = [SeqChunk([1, 5, 9, 30, 2], 0, [1, 2])]
    want = runner.forward(ForwardBatch.build(batch, 4))
    seen = []
    handles = [m.register_forward_pre_hook(lambda module, args: seen.append(module)) for m in runner.model.modules()]
    got = runner.forward(ForwardBatch.build([SeqChunk([1, 5, 9, 30, 2], 0, [3, 4])], 4))
    for handle in handles:
        handle.remove()
    assert seen == []  # nn.Module.__call__ would have run each hook
    torch.testing.assert_close(got, want)  # and the forward is what it was
