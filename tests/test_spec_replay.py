"""The drafting policy's offline replay: a chain as the Speculator drafts it, a tree of candidates beside it, and
what each costs."""

import pytest

from radixrt.bench.spec_ceiling import Request
from radixrt.bench.spec_replay import main, nodes, replay, tree_of


def test_a_tree_takes_other_candidates_cut_to_the_chain_and_counts_shared_tokens_once():
    chain = [1, 2, 3]
    others = [[1, 2, 4, 5], [1, 2, 3, 9], [7, 8], [1, 2]]
    assert tree_of(chain, others, 1) == [chain]
    # [1, 2, 3, 9] cut to the chain's length is the chain itself, [1, 2] a path already taken
    assert tree_of(chain, others, 4) == [[1, 2, 3], [1, 2, 4], [7, 8]]
    assert tree_of(chain, others, 2) == [[1, 2, 3], [1, 2, 4]]
    assert nodes([[1, 2, 3], [1, 2, 4], [7, 8]]) == 6  # 1, 1 2, 1 2 3, 1 2 4, 7, 7 8
    assert nodes([chain]) == 3


def test_a_tree_finds_the_older_occurrence_the_chain_passes_over_and_pays_for_its_tokens():
    # "5" was followed by 60 61 62 63 9 and later by 70 71 72 73 9; the output takes the older one. The chain
    # drafts the newer (no token agrees); with the older as a second branch the whole output comes in one step.
    request = Request([5, 60, 61, 62, 63, 9, 5, 70, 71, 72, 73, 9, 3, 5], [60, 61, 62, 63, 9])
    chain, tree = replay(request, [], 0.0, 1), replay(request, [], 0.0, 2)
    # chain: step 1 drafts the 7 tokens after the newer "5" (none agree; 60 from the model), step 2 matches
    # "5 60" and drafts 8 tokens, of which 61 62 63 9 agree
    assert chain == dict(speedup=5 / 2, steps=2, drafted=7 + 8, accepted=4)
    # tree: the same 7, and the older occurrence's 7 (no shared prefix): all 5 tokens in one step
    assert tree == dict(speedup=5.0, steps=1, drafted=7 + 7, accepted=5)
    costly = replay(request, [], 0.1, 2)
    assert costly["speedup"] == pytest.approx(5 / (costly["steps"] + 0.1 * costly["drafted"]))
    # where no draft pays, neither drafts
    assert replay(request, [], 1.0, 1)["speedup"] == replay(request, [], 1.0, 3)["speedup"] == 1.0


def test_earlier_requests_are_drafted_from():
    earlier = [Request([1, 2], [50, 51, 52, 53, 9])]
    request = Request([7, 2, 50], [51, 52, 53, 60])
    assert replay(request, earlier, 0.0, 1)["speedup"] == 4.0  # 51 52 53 drafted and 60 from the model: one step
    assert replay(request, [], 0.0, 1)["speedup"] == 1.0


@pytest.mark.model
def test_spec_replay_prints_each_workload_cost_and_width(capsys, default_model_path):
    assert main(["--workloads", "extraction", "--seeds", "1", "--max-new-tokens", "16", "--dtype", "float32",
                 "--token-costs", "0,0.5", "--widths", "1,2"]) == 0
    out = capsys.readouterr().out
    assert "| workload | draft token cost | chain | tree of 2 |" in out
    rows = [line.strip(" |").split(" | ") for line in out.splitlines() if line.startswith("| extraction")]
    assert [row[1] for row in rows] == ["0", "0.5"]
    for row in rows:
        assert all(float(cell) > 0 for cell in row[2:])
    assert float(rows[0][2]) > 1.0  # the invoice's fields are copied from the prompt
