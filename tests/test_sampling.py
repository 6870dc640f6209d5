import pytest
import torch

from radixrt.sampling import draws
from radixrt.sampling.logits_processor import apply_penalties, ban_tokens, token_logprobs
from radixrt.sampling.params import SamplingParams
from radixrt.sampling.sampler import SamplingBatch, _filter, sample


def test_penalties_follow_their_definitions():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, 3.0]])
    params = [SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)]
    out = apply_penalties(logits.clone(), params, prompts=[[0]], outputs=[[1, 2, 2]])
    # repetition over prompt+output: positive / 2, negative * 2; then frequency and presence over the output
    expected = torch.tensor([[1.0, -4.0 - 0.5 - 0.25, 0.5 - 1.0 - 0.25, 0.5, 3.0]])
    torch.testing.assert_close(out, expected)


def test_ban_tokens_and_logprobs():
    logits = ban_tokens(torch.zeros(2, 4), [[1, 3], []])
    assert torch.isinf(logits[0, 1]) and torch.isinf(logits[0, 3]) and not torch.isinf(logits[1]).any()
    logprobs = torch.log_softmax(torch.tensor([[0.0, 1.0, 2.0]]), -1)
    chosen, top = token_logprobs(logprobs, torch.tensor([1]), 2)
    assert chosen == pytest.approx([logprobs[0, 1].item()])
    assert [t for _, t in top[0]] == [2, 1]


def test_filters_restrict_the_support():
    torch.manual_seed(0)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 4))
    params = [SamplingParams(top_k=2), SamplingParams(top_p=0.6), SamplingParams(min_p=0.5),
              SamplingParams(temperature=0.0)]
    batch = SamplingBatch.build(params, 4)
    seen = [set() for _ in params]
    for _ in range(300):
        for row, token in enumerate(sample(logits, batch).tolist()):
            seen[row].add(token)
        batch = batch.advanced()
    assert seen == [{0, 1}, {0, 1}, {0, 1}, {0}]


def test_a_row_s_token_does_not_depend_on_the_filters_other_rows_ask_for():
    """Where another row asks for top_p, a row without it keeps its whole distribution: over a 49k vocabulary the
    fp32 mass before the last tail tokens rounds past 1.0, and dropping them there changed seeded draws near the
    top of the CDF with the batch a request was sampled in (speculation samples verify rows apart)."""
    logits = torch.randn(1, 49152, generator=torch.Generator().manual_seed(0)) * 5
    alone = SamplingParams(temperature=1.2)
    sorted_probs = torch.softmax(logits / 1.2, dim=-1).sort(descending=True).values
    assert (sorted_probs.cumsum(dim=-1) - sorted_probs > 1.0).sum() > 1000  # the case: fp32 mass rounds past 1
    for other in (SamplingParams(top_p=0.9), SamplingParams(top_k=50), SamplingParams(min_p=0.1)):
        batch = SamplingBatch.build([alone, other], 49152)
        probs = torch.softmax(logits.repeat(2, 1) / batch.temperatures, dim=-1)
        assert torch.equal(_filter(probs, batch)[0], probs[0]), other
    for draw in (0.999999, 0.9999999, 1.0 - 1e-9):  # draws at the top of the CDF, where the tail tokens lie
        tokens = []
        for other in (SamplingParams(temperature=1.2), SamplingParams(top_p=0.9)):
            batch = SamplingBatch.build([alone, other], 49152)
            uniform = torch.tensor([[draw], [0.5]], dtype=torch.float64)
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(draws, "uniforms", lambda *args, **kwargs: uniform.view(-1).clone())
                tokens.append(int(sample(logits.repeat(2, 1), batch)[0]))
        assert tokens[0] == tokens[1], draw


# chi-square critical values at p = 0.001 by degrees of freedom
CHI2_CRITICAL = {3: 16.27, 5: 20.52, 7: 24.32}


def chi2(counts: list[int], p: list[float]) -> float:
    total = sum(counts)
    return sum((c - total * q) ** 2 / (total * q) for c, q in zip(counts, p) if q > 0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_tokens_follow_the_softmax_distribution(temperature):
    """A batch of rows, some with seeds of their own and some drawing one, each drawing from
    softmax(logits / temperature), token after token (the counters advancing)."""
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, 1.5]] * 8)
    p = torch.softmax(logits[0] / temperature, dim=-1).tolist()
    seeds = [None, 1, None, 2, None, 3, None, 4]
    batch = SamplingBatch.build([SamplingParams(temperature=temperature)] * 8, 8, seeds)
    counts = [[0] * 8 for _ in range(2)]  # rows that drew a seed, rows with their own
    for _ in range(1500):
        for row, token in enumerate(sample(logits, batch).tolist()):
            counts[seeds[row] is not None][token] += 1
        batch = batch.advanced()
    for c in counts:
        assert chi2(c, p) < CHI2_CRITICAL[7], (c, [round(sum(c) * q) for q in p])


def test_filtered_distribution_is_renormalised_and_zero_tokens_are_never_drawn():
    """top-k 4 of 6: the kept tokens in proportion to their probabilities, the dropped ones (the last token
    among them, where a rounding of the draw could otherwise land) never."""
    torch.manual_seed(1)
    logits = torch.log(torch.tensor([[0.3, 0.25, 0.2, 0.15, 0.06, 0.04]] * 16))
    batch = SamplingBatch.build([SamplingParams(top_k=4)] * 16, 6)
    counts = [0] * 6
    for _ in range(1000):
        for token in sample(logits, batch).tolist():
            counts[token] += 1
        batch = batch.advanced()
    assert counts[4] == counts[5] == 0
    assert chi2(counts[:4], [0.3 / 0.9, 0.25 / 0.9, 0.2 / 0.9, 0.15 / 0.9]) < CHI2_CRITICAL[3]


def test_a_draw_at_the_very_top_of_the_cdf_lands_on_a_token_with_probability(monkeypatch):
    """A uniform just under 1 times the row's total may round up to the total itself (a draw of 1.0 stands for
    that here): the token found is still one of probability > 0, not the zero-probability last one."""
    logits = torch.tensor([[0.0, 0.0, float("-inf")]])
    batch = SamplingBatch.build([SamplingParams(temperature=1.0)], 3)
    monkeypatch.setattr(draws, "uniforms", lambda *a, **kw: torch.ones(1, dtype=torch.float64))
    assert int(sample(logits, batch)[0]) == 1


def test_a_rows_draw_is_its_seed_and_counter_in_any_batch():
    """A sampled row's token depends on its seed and the index of the token it draws, not on its batch: the same
    seed and counter give the same token in another row, beside other requests; another counter (the next token)
    or another seed draws anew."""
    logits = torch.zeros(1, 1000)  # uniform over 1,000 tokens: the token is the draw, scaled
    params = SamplingParams(temperature=1.0)

    def token(seed: int, counter: int, row: int = 0, rows: int = 1) -> int:
        seeds = [seed if i == row else 100 + i for i in range(rows)]
        counters = [counter if i == row else 7 for i in range(rows)]
        batch = SamplingBatch.build([params] * rows, 1000, seeds, counters)
        return int(sample(logits.repeat(rows, 1), batch)[row])

    assert token(3, 5) == token(3, 5, row=2, rows=4) == token(3, 5, row=0, rows=3)
    assert token(3, 5) == int(draws.reference_uniform(3, 5) * 1000)
    assert len({token(3, k) for k in range(20)}) > 15  # the counter moves the draw
    assert len({token(s, 5) for s in range(20)}) > 15  # and so does the seed
    advanced = SamplingBatch.build([params] * 2, 1000, [3, 4], [5, 9]).advanced()
    assert sample(logits.repeat(2, 1), advanced).tolist() == [token(3, 6), token(4, 10)]


def test_draws_equal_their_reference_across_the_int64_range():
    """The device hash wraps its products modulo 2**64 and shifts logically, as the reference's unsigned integers
    do, for seeds anywhere in (and beyond) the int64 range."""
    import random

    rng = random.Random(0)
    seeds = [0, 1, -1, 2**63 - 1, -(2**63), 2**64 + 5, -(2**70)] + [rng.getrandbits(64) - 2**63 for _ in range(300)]
    counters = [rng.randrange(0, 2**40) for _ in seeds]
    got = draws.uniforms(torch.tensor([draws.seed_word(s) for s in seeds]), torch.tensor(counters)).tolist()
    assert got == [draws.reference_uniform(s, c) for s, c in zip(seeds, counters)]
    assert all(0.0 <= u < 1.0 for u in got)
    many = draws.uniforms(torch.full((200_000,), draws.seed_word(42)), torch.arange(200_000))
    assert abs(many.mean().item() - 0.5) < 0.005 and abs(many.var().item() - 1 / 12) < 0.002


@pytest.mark.parametrize("bad, message", [
    ({"temperature": -0.1}, "temperature"), ({"top_p": 1.5}, "top_p"), ({"top_k": 0}, "top_k"),
    ({"min_p": 2}, "min_p"), ({"repetition_penalty": 0}, "repetition_penalty"), ({"n": 0}, "n must"),
    ({"max_new_tokens": -1}, "max_new_tokens"), ({"min_new_tokens": 5, "max_new_tokens": 2}, "min_new_tokens"),
    ({"stop": [""]}, "stop strings"), ({"regex": "a", "json_schema": "{}"}, "only one"),
])
def test_bad_sampling_values_are_named(bad, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams.from_dict(bad).validate()


@pytest.mark.parametrize("processing", [
    {}, {"repetition_penalty": 1.3}, {"frequency_penalty": 0.5}, {"logit_bias": {"2": 5.0}}, {"min_new_tokens": 3},
])
def test_next_tokens_never_writes_into_the_logits_it_is_given(processing):
    """The scheduler hands it views of the forward's logits (radixrt.scheduler.output._stacked)."""
    from types import SimpleNamespace

    from radixrt.scheduler.logits import next_tokens

    params = SamplingParams(max_new_tokens=8, temperature=0.0, **processing)
    reqs = [SimpleNamespace(params=params, prompt_ids=[1, 2], output_ids=[2], grammar=None, seed=None,
                            return_logprob=logprob, top_logprobs_num=0, token_ids_logprob=None,
                            pending_output_logprobs=[], pending_output_top=[]) for logprob in (False, True)]
    logits = torch.randn(2, 8)
    before = logits.clone()
    tokens = next_tokens(reqs, logits, eos_ids={0}, vocab_size=8, grammars=None)
    assert torch.equal(logits, before) and len(tokens) == 2
    assert reqs[1].pending_output_logprobs[0][0] == pytest.approx(
        torch.log_softmax(before[1], -1)[tokens[1]].item())  # logprobs of the raw logits


def test_a_decode_steps_rows_are_sampled_without_a_copy():
    from radixrt.scheduler.output import _stacked

    logits = torch.randn(4, 10)
    rows = list(logits.split(1))
    last = [r[-1] for r in rows]
    view = _stacked(last)
    assert torch.equal(view, logits) and view.data_ptr() == logits.data_ptr()
    shuffled = [last[1], last[0], last[2]]  # not back to back: a copy, as torch.stack
    assert torch.equal(_stacked(shuffled), torch.stack(shuffled))
    assert _stacked(shuffled).data_ptr() != logits.data_ptr()
    other = torch.randn(1, 10)
    mixed = [last[0], other[0]]
    assert torch.equal(_stacked(mixed), torch.stack(mixed))


def test_a_verify_steps_blocks_are_sampled_without_a_copy():
    """A verify step's requests each have a block of rows; back to back they are read in place, else copied."""
    from radixrt.scheduler.output import _stacked

    logits = torch.randn(9, 10)
    blocks = list(logits.split([3, 1, 5]))
    view = _stacked(blocks)
    assert torch.equal(view, logits) and view.data_ptr() == logits.data_ptr()
    later = _stacked(blocks[1:])  # starting past the first row of the tensor
    assert torch.equal(later, logits[3:]) and later.data_ptr() == logits[3:].data_ptr()
    for parts in ([blocks[0], blocks[2]], [blocks[2], blocks[0]], [blocks[0], torch.randn(2, 10)],
                  [logits[:3, :5], logits[3:, :5]]):  # a gap, out of order, another tensor, strided columns
        assert torch.equal(_stacked(parts), torch.cat(parts))


@pytest.mark.parametrize("kernel", [True, False], ids=["cpu-kernel", "torch"])
def test_greedy_tokens_are_argmax_on_ties_and_non_finite_rows(kernel, monkeypatch):
    from radixrt.kernels import cpu_kernels
    from radixrt.sampling.sampler import greedy_tokens

    if kernel and cpu_kernels.load() is None:
        pytest.fail(f"the CPU kernels did not build: {cpu_kernels.unavailable_reason()}")
    if not kernel:
        monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(64, 49152, generator=gen) * 4).round() / 4  # many equal values a row
    logits[:8, torch.randint(0, 49152, (3,), generator=gen)] = 100.0  # three maxima
    logits[8] = float("-inf")  # a row a grammar mask emptied
    logits[9, 7] = float("nan")
    logits[10, [40000, 3]] = float("nan")  # the first NaN, wherever the lanes meet it
    logits[11, 49151] = float("inf")  # in the last vector
    assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))
    assert greedy_tokens(logits)[9] == 7 and greedy_tokens(logits)[10] == 3
    assert torch.equal(greedy_tokens(logits[::3, 5:]), logits[::3, 5:].argmax(dim=-1))  # strided rows, odd width
    for width in (1, 7, 16, 17, 33):  # narrower than a vector, and a vector plus a tail
        few = (torch.randn(5, width, generator=gen) * 2).round()
        few[4, -1] = 50.0
        assert torch.equal(greedy_tokens(few), few.argmax(dim=-1)), width


def _kernels():
    from radixrt.kernels import cpu_kernels

    if cpu_kernels.load() is None:
        pytest.fail(f"the CPU kernels did not build: {cpu_kernels.unavailable_reason()}")
    return cpu_kernels


@pytest.mark.parametrize("vocab", [1, 7, 37, 1000, 49152])  # narrower than a vector, a tail, a real vocabulary
def test_the_sampling_kernel_finds_where_each_draw_falls_in_the_cumulative_weights(vocab):
    """Row by row against an fp64 reference of the same rule: the token's interval of the cumulative weights holds
    the draw (up to fp32 rounding of the weights), its weight is positive, masked tokens are never drawn."""
    cpu_kernels = _kernels()
    gen = torch.Generator().manual_seed(vocab)
    rows = 64
    logits = torch.randn(rows, vocab + 3, generator=gen) * 4
    logits[:, torch.randint(0, vocab + 3, (vocab // 3,), generator=gen)] = float("-inf")  # a grammar's mask
    logits[:, 0] = 0.0  # every row keeps a token
    logits = logits[:, 3:] if vocab > 1 else logits[:, :1]  # rows a stride apart
    temperatures = torch.rand(rows, generator=gen) * 1.5 + 0.1
    uniforms = torch.rand(rows, dtype=torch.float64, generator=gen)
    uniforms[:2] = torch.tensor([0.0, 1.0 - 2**-53], dtype=torch.float64)  # the ends of [0, 1)
    tokens = cpu_kernels.sample_tokens(logits, temperatures, uniforms).tolist()
    for r, t in enumerate(tokens):
        x = logits[r].double()
        w = torch.exp((x - x.max()) / temperatures[r].double())
        cdf = w.cumsum(0)
        total = cdf[-1].item()
        point = uniforms[r].item() * total
        below = cdf[t - 1].item() if t else 0.0
        assert w[t] > 0, (r, t)
        assert below - 1e-6 * total <= point <= cdf[t].item() + 1e-6 * total, (r, t)


def test_the_sampling_kernel_draws_the_softmax_distribution_and_names_bad_arguments():
    cpu_kernels = _kernels()
    gen = torch.Generator().manual_seed(3)
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, 1.5]]).repeat(20000, 1)
    tokens = cpu_kernels.sample_tokens(logits, torch.full((20000,), 0.7),
                                       torch.rand(20000, dtype=torch.float64, generator=gen))
    p = torch.softmax(logits[0] / 0.7, dim=-1).tolist()
    assert chi2(torch.bincount(tokens, minlength=8).tolist(), p) < CHI2_CRITICAL[7]
    one = torch.zeros(1, 8)
    with pytest.raises(RuntimeError, match="temperatures must be > 0"):
        cpu_kernels.sample_tokens(one, torch.zeros(1), torch.zeros(1, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="uniforms must be"):
        cpu_kernels.sample_tokens(one, torch.ones(1), torch.zeros(1))
    with pytest.raises(RuntimeError, match="logits must be fp32"):
        cpu_kernels.sample_tokens(one.double(), torch.ones(1), torch.zeros(1, dtype=torch.float64))


@pytest.mark.parametrize("kernel", [True, False], ids=["cpu-kernel", "torch"])
def test_a_row_with_a_nan_or_infinite_logit_gets_the_last_token_either_way(kernel, monkeypatch):
    cpu_kernels = _kernels()
    if not kernel:
        monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    logits = torch.randn(5, 40)
    logits[0, 3] = float("nan")
    logits[1] = float("-inf")  # a row a grammar mask emptied
    logits[2, 35] = float("inf")
    logits[3, 39] = float("nan")  # in the tail past the last whole vector
    batch = SamplingBatch.build([SamplingParams(temperature=1.0)] * 5, 40)
    tokens = sample(logits, batch).tolist()
    assert tokens[:4] == [39] * 4 and 0 <= tokens[4] < 40


def test_the_kernel_samples_the_rows_that_ask_for_temperature_alone(monkeypatch):
    """Beside a top-p row and a greedy one, a temperature-only row still goes through the kernel, so its token is
    the one it gets in any batch (the kernel's and the torch ops' rounding differ)."""
    cpu_kernels = _kernels()
    real, seen = cpu_kernels.sample_tokens, []

    def spy(logits, temperatures, uniforms):
        seen.append(logits.shape[0])
        return real(logits, temperatures, uniforms)

    monkeypatch.setattr(cpu_kernels, "sample_tokens", spy)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 49152, generator=gen) * 5
    params = [SamplingParams(temperature=1.2), SamplingParams(top_p=0.5), SamplingParams(temperature=0.0)]
    for draw in torch.rand(20, dtype=torch.float64, generator=gen).tolist() + [1.0 - 1e-9]:
        uniforms = torch.full((3, 1), draw, dtype=torch.float64)
        monkeypatch.setattr(draws, "uniforms", lambda seeds, counters: uniforms[: seeds.shape[0], 0].clone())
        mixed = sample(logits, SamplingBatch.build(params, 49152)).tolist()
        alone = sample(logits[:1], SamplingBatch.build(params[:1], 49152)).tolist()
        direct = real(logits[:1], torch.tensor([1.2]), uniforms[:1, 0]).tolist()
        assert mixed[0] == alone[0] == direct[0], draw
        assert mixed[2] == int(logits[2].argmax())
        top = torch.softmax(logits[1], -1).sort(descending=True)
        kept = top.indices[: int((top.values.cumsum(0) - top.values < 0.5).sum())].tolist()
        assert mixed[1] in kept  # top-p's row from the torch ops, inside its nucleus
    assert set(seen) == {3, 1}
