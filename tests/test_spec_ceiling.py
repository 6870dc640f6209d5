"""The speculation ceiling's offline replay: steps, costs and the history it drafts from."""

import pytest

from radixrt.bench.spec_ceiling import Request, main, replay


def test_a_copied_stretch_is_drafted_as_far_as_it_agrees_and_costs_what_it_drafts():
    prompt = list(range(10, 20))
    request = Request(prompt, list(range(10, 20)))
    # step 1: the prompt's last token never occurred before: one token (10); step 2: 10 occurred at the start,
    # its continuation 11..18 agrees for 8 tokens (the draft cap) and the step adds 19: 10 tokens in 2 steps
    gains = replay(request, [], [0.0, 1.0])
    assert gains["drafter"] == [5.0, 10 / (1 + 1 + 8)]
    assert gains["any match"] == gains["drafter"]


def test_earlier_requests_are_drafted_from_and_any_match_is_never_below_the_drafter():
    earlier = [Request([1, 2], [50, 51, 52, 53, 9])]
    request = Request([7, 2, 50], [51, 52, 53, 60])
    gains = replay(request, earlier, [0.0])
    assert gains["drafter"] == [4.0]  # "2 50" matches the earlier text: 51 52 53 drafted, 60 from the model
    assert replay(request, [], [0.0])["drafter"] == [1.0]  # cold: nothing to draft from
    # 5 is followed by 60 61 and later by 70 71: the drafter proposes the latest (wrong: one token), then drafts
    # 61 after 60 (two more tokens in a step); any match takes the occurrence that agrees: 3 tokens in one step
    branching = Request([5, 60, 61, 8, 5, 70, 71, 8, 3, 5], [60, 61, 62])
    got = replay(branching, [], [0.0])
    assert got["drafter"] == [1.5] and got["any match"] == [3.0]


@pytest.mark.model
def test_spec_ceiling_prints_each_workload_and_cost(capsys, default_model_path):
    assert main(["--workloads", "extraction", "--seeds", "1", "--max-new-tokens", "16", "--dtype", "float32",
                 "--token-costs", "0,0.5"]) == 0
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| extraction")]
    assert [row[1] for row in rows] == ["0", "0.5"]
    for row in rows:
        drafter, any_match = float(row[2]), float(row[3].rstrip(" |"))
        assert 0 < drafter <= any_match
    assert float(rows[0][2]) > 1.0  # the invoice's fields are copied from the prompt
