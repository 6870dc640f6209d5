"""radixrt's model layers are called straight through their forward (no nn.Module hook machinery per call), and
read their weights and submodules as plain attributes once the model is final."""

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


def test_bound_attributes_are_the_registered_ones_and_stay_in_step(tmp_path):
    """Once the model is final its weights and submodules are plain attributes (no nn.Module.__getattr__), the
    very objects nn.Module registered; assigning or deleting one afterwards keeps both views the same."""
    save_tiny_model("llama", tmp_path)
    runner = ModelRunner(tmp_path, dtype="float32", num_pages=16, page_size=4)
    model = runner.model
    for module in model.modules():
        if isinstance(module, InferenceModule):
            for registry in (module._parameters, module._buffers, module._modules):
                for name, value in registry.items():
                    assert module.__dict__[name] is value, (type(module).__name__, name)
    norm = model.layers[0].input_layernorm
    before = runner.forward(ForwardBatch.build([SeqChunk([1, 5, 9, 30, 2], 0, [1, 2])], 4))
    original = norm.weight
    norm.weight = nn.Parameter(torch.zeros_like(original), requires_grad=False)
    assert norm.weight is norm._parameters["weight"] is norm.__dict__["weight"]
    changed = runner.forward(ForwardBatch.build([SeqChunk([1, 5, 9, 30, 2], 0, [3, 4])], 4))
    assert not torch.equal(changed, before)  # the forward reads the new weight
    norm.weight = original
    torch.testing.assert_close(runner.forward(ForwardBatch.build([SeqChunk([1, 5, 9, 30, 2], 0, [5, 6])], 4)), before)
    norm.register_buffer("probe", torch.ones(1))  # registered after binding: found through nn.Module
    norm.probe = torch.zeros(1)
    assert norm.probe is norm._buffers["probe"]
    del norm.probe
    assert "probe" not in norm.__dict__ and not hasattr(norm, "probe")
    model.bind_attributes(False)
    assert "weight" not in norm.__dict__ and norm.weight is original  # nn.Module's lookup again
