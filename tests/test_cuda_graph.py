"""The decode-graph runner (radixrt/model/cuda_graph.py) on a CPU, with a stand-in for CUDA graphs.

``ReplayByCall`` (the stand-in factory of radixrt/model/cuda_graph.py) captures a closure over the runner's
static buffers and replays it by calling it again, writing into the output tensor it captured: what a CUDA graph
does with the same buffers. The model runs
the Triton attention backend in triton's interpreter (the GPU path's kernels), so buckets, padding rows,
rows left from larger batches and buffer reuse are all checked on the code a GPU runs.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module imports triton

pytest.importorskip("triton")

from radixrt.model.cuda_graph import GraphRunner, HostSyncError, NoHostSync, ReplayByCall, default_buckets  # noqa: E402
from radixrt.model.forward_batch import ForwardBatch, SeqChunk  # noqa: E402
from radixrt.model.runner import ModelRunner  # noqa: E402
from tiny_models import save_tiny_model  # noqa: E402

PAGE = 4


@pytest.fixture(scope="module")
def runners(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_model("llama", folder)
    factory = ReplayByCall()
    graphed = ModelRunner(folder, dtype="float32", page_size=PAGE, num_pages=64, attention_backend="triton",
                          graph_factory=factory, cuda_graph_max_bs=4)
    eager = ModelRunner(folder, dtype="float32", page_size=PAGE, num_pages=64, attention_backend="triton")
    return graphed, eager, factory


PROMPTS = [[3, 9, 27, 81, 5, 15], [7, 14, 28], [1, 2, 3, 4, 5, 6, 7, 8, 9], [100, 50, 25, 12, 6], [11, 22]]
PAGES = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10, 11, 12], [13, 14]]


def prefill(runner, rows):
    runner.forward(ForwardBatch.build([SeqChunk(PROMPTS[r], 0, PAGES[r]) for r in rows], PAGE))


def decode_batch(rows, token=42):
    return ForwardBatch.build([SeqChunk([token + r], len(PROMPTS[r]), PAGES[r]) for r in rows], PAGE)


def test_default_buckets():
    assert default_buckets(1) == [1]
    assert default_buckets(6) == [1, 2, 4, 6]
    assert default_buckets(8) == [1, 2, 4, 8]
    assert default_buckets(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert default_buckets(100) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 100]
    assert default_buckets(256)[-3:] == [224, 240, 256]


def test_every_bucket_is_captured_largest_first(runners):
    graphed, _, factory = runners
    assert graphed.graphs.buckets == [1, 2, 4]
    assert factory.captured == [4, 2, 1]
    assert graphed.graphs.max_pages == 256 // PAGE  # the page table is as wide as the longest context


@pytest.mark.parametrize("rows", [[0], [0, 1], [0, 1, 2], [3, 1, 0, 2]])
def test_replay_equals_eager(runners, rows):
    """Logits equal the eager forward's, at every bucket, whether the batch fills it or is padded."""
    graphed, eager, _ = runners
    for runner in (graphed, eager):
        prefill(runner, rows)
    before = graphed.graphs.replays
    ours = graphed.forward(decode_batch(rows)).clone()
    ref = eager.forward(decode_batch(rows))
    assert graphed.graphs.replays == before + 1
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(graphed.pool.k_caches[0], eager.pool.k_caches[0])  # the same K/V, nothing more
    assert torch.equal(graphed.pool.v_caches[1], eager.pool.v_caches[1])


def test_replay_equals_eager_at_the_padded_shape_bitwise(runners):
    """At the bucket's shape (pad rows included) the eager forward and the replay compute the same bits."""
    graphed, _, _ = runners
    rows = [0, 1, 2]
    prefill(graphed, rows)
    batch = decode_batch(rows)
    ours = graphed.forward(batch).clone()
    graphs = graphed.graphs
    padded = graphs._static_batch(graphs.bucket_for(len(rows)))  # the static rows now hold batch + padding
    eager = graphed._eager_forward(padded)
    assert torch.equal(ours, eager[: len(rows)])


def test_padding_and_stale_rows_write_nothing(runners):
    graphed, _, _ = runners
    prefill(graphed, [0, 1, 2, 3])
    graphed.forward(decode_batch([0, 1, 2, 3]))  # fills all 4 rows of bucket 4
    snapshot = [t.clone() for t in graphed.pool.k_caches + graphed.pool.v_caches]
    slot_of_row3 = int(decode_batch([0, 1, 2, 3]).out_slots[3])
    for cache in graphed.pool.k_caches + graphed.pool.v_caches:  # another request now owns that slot
        cache.view(-1, *cache.shape[2:])[slot_of_row3] = 7.0
    batch = decode_batch([0, 1, 2], token=60)  # 3 rows: bucket 4, row 3 is padding now
    graphed.forward(batch)
    written = set(batch.out_slots.tolist())
    for before, after in zip(snapshot, graphed.pool.k_caches + graphed.pool.v_caches):
        flat_before, flat_after = before.view(-1, *before.shape[2:]), after.view(-1, *after.shape[2:])
        changed = {s for s in range(flat_after.shape[0]) if not torch.equal(flat_before[s], flat_after[s])}
        assert changed - {slot_of_row3} <= written
        assert torch.all(flat_after[slot_of_row3] == 7.0)  # the stale row wrote nothing


def test_outputs_are_views_of_each_buckets_buffer(runners):
    graphed, _, _ = runners
    prefill(graphed, [0, 1])
    first = graphed.forward(decode_batch([0, 1]))
    kept = first.clone()
    second = graphed.forward(decode_batch([0, 1], token=70))
    assert first.data_ptr() == second.data_ptr()  # the same bucket's output, overwritten by the next replay
    assert not torch.equal(kept, second)
    third = graphed.forward(decode_batch([0]))
    assert third.data_ptr() != first.data_ptr()  # another bucket, another buffer


def test_what_runs_eagerly(runners):
    graphed, _, _ = runners
    graphs = graphed.graphs
    before = graphs.replays
    prefill(graphed, [0, 1])  # a prefill
    graphed.forward(decode_batch([0, 1, 2, 3, 4]))  # larger than the largest bucket
    mixed = ForwardBatch.build([SeqChunk([5], len(PROMPTS[0]), PAGES[0]), SeqChunk([6, 7], 2, PAGES[1])], PAGE)
    graphed.forward(mixed)
    assert graphs.replays == before
    assert not graphs.can_run(ForwardBatch.build([SeqChunk([1], 300, list(range(80)))], PAGE))  # wider table


def test_capture_refuses_host_syncs_and_copies():
    with pytest.raises(HostSyncError, match="_local_scalar_dense"):
        with NoHostSync():
            torch.ones(3).sum().item()
    with pytest.raises(HostSyncError, match="nonzero"):
        with NoHostSync():
            torch.ones(3).nonzero()
    with pytest.raises(HostSyncError, match="lift_fresh"):
        with NoHostSync():
            torch.tensor([1, 2, 3])
    with NoHostSync():  # what a captured forward does is allowed
        x = torch.ones(4, 4)
        (x @ x).softmax(-1)[torch.arange(2)]


def test_a_forward_that_syncs_cannot_be_captured():
    def forward(batch):
        n = int(batch.seq_lens.max())  # a host read of a device value: not capturable
        return torch.zeros(batch.batch_size, 3) + n

    runner = GraphRunner(forward, max_bs=2, max_pages=4, device=torch.device("cpu"), factory=ReplayByCall())
    with pytest.raises(HostSyncError):
        runner.capture()


def test_the_model_forward_captures_without_a_sync(runners):
    """The real capture above ran under NoHostSync: the decode forward (Triton kernels) never syncs."""
    graphed, _, _ = runners
    assert len(graphed.graphs.graphs) == 3


@pytest.mark.parametrize("family", ["gemma3", "olmo2", "phi4-mini", "smollm3", "qwen3-moe"])
def test_other_families_capture_without_a_sync_but_experts(tmp_path, family):
    """Gemma 3's, OLMo 2's, Phi-4-mini's (a partial rotary) and SmolLM3's (layers without rotary) decode forwards
    capture (their norms, gate, rotary and scaled embedding make no host tensor and read no device value) and replay
    their eager logits; a mixture of experts reads its experts' row counts on the host, so it cannot be captured: the
    runner leaves graphs off for it on CUDA (test_moe.py)."""
    save_tiny_model(family, tmp_path)
    make = lambda **kw: ModelRunner(tmp_path, dtype="float32", page_size=PAGE, num_pages=64,  # noqa: E731
                                    attention_backend="triton", **kw)
    if family == "qwen3-moe":
        with pytest.raises(HostSyncError):
            make(graph_factory=ReplayByCall(), cuda_graph_max_bs=2)
        return
    graphed, eager = make(graph_factory=ReplayByCall(), cuda_graph_max_bs=2), make()
    for runner in (graphed, eager):
        prefill(runner, [0, 1])
    ours = graphed.forward(decode_batch([0, 1])).clone()
    assert graphed.graphs.replays == 1
    torch.testing.assert_close(ours, eager.forward(decode_batch([0, 1])), rtol=1e-5, atol=1e-5)


def test_released_memory_drops_the_graphs_and_resuming_it_captures_them_again(tmp_path):
    """Graphs replay the addresses of the weights and the pool: releasing either drops them, and they are captured
    again once nothing is released (radixrt.model.runner: release_memory, resume_memory); the new ones replay the
    eager logits."""
    save_tiny_model("llama", tmp_path)
    factory = ReplayByCall()
    graphed = ModelRunner(tmp_path, dtype="float32", page_size=PAGE, num_pages=64, attention_backend="triton",
                          graph_factory=factory, cuda_graph_max_bs=2)
    eager = ModelRunner(tmp_path, dtype="float32", page_size=PAGE, num_pages=64, attention_backend="triton")
    first = graphed.graphs
    for tags, steps in [({"kv_cache"}, [{"kv_cache"}]), ({"cuda_graph"}, [{"cuda_graph"}]),
                        ({"weights", "kv_cache"}, [{"weights"}, {"kv_cache"}])]:
        graphed.release_memory(tags)
        assert graphed.graphs is None
        for step in steps:
            graphed.resume_memory(step)
            assert (graphed.graphs is None) == bool(graphed.released)
    assert graphed.graphs is not first and factory.captured == [2, 1] * 4
    for runner in (graphed, eager):
        prefill(runner, [0, 1])
    ours = graphed.forward(decode_batch([0, 1])).clone()
    assert graphed.graphs.replays == 1
    torch.testing.assert_close(ours, eager.forward(decode_batch([0, 1])), rtol=1e-5, atol=1e-5)


def test_start_up_warm_up_runs_prefill_extend_and_decode(runners):
    """What a CUDA runner runs at start-up (so Triton compiles and autotunes there): here on the same kernels."""
    graphed, _, _ = runners
    before = graphed.graphs.replays
    graphed._warm_up()
    assert graphed.graphs.replays == before + 1  # its decode step is a graph replay of bucket 1


def test_a_device_named_with_or_without_its_index_is_the_same_device():
    """A runner built for "cuda" must replay batches whose tensors say "cuda:0" (here: cpu:0 and cpu)."""
    runner = GraphRunner(lambda batch: torch.zeros(batch.batch_size, 3), max_bs=2, max_pages=4,
                         device=torch.device("cpu", 0), factory=ReplayByCall())
    assert runner.can_run(ForwardBatch.build([SeqChunk([5], 3, [1])], PAGE))
