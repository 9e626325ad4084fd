"""dpcourse.train.compare_rates: a timing sentence says "faster" only when the runs do not overlap."""

import statistics

import pytest

from dpcourse.train import compare_rates, rate_verdict, round_wins


def test_faster_slower_and_overlap():
    assert compare_rates("a", [1, 2, 3], "b", [4, 5, 6]).startswith("b was faster than a in every run")
    assert compare_rates("a", [4, 5, 6], "b", [1, 2, 3]).startswith("b was slower than a in every run")
    s = compare_rates("a", [1, 3], "b", [2, 4])
    assert s.startswith("no clear difference") and "1.67x" in s  # rounds' ratios 2 and 4/3
    # touching ranges are not a clear difference either
    assert compare_rates("a", [1, 2], "b", [2, 3]).startswith("no clear difference")


def test_one_outlier_round_does_not_hide_a_clear_difference():
    # interleaved rounds: run i of a and run i of b were measured back to back
    s = compare_rates("a", [10, 10, 10, 10, 10], "b", [12, 12, 1, 12, 12])
    assert s.startswith("b was faster than a in all but one of 5 rounds"), s
    s = compare_rates("a", [10, 10, 10, 10, 10], "b", [8, 8, 30, 8, 8])
    assert s.startswith("b was slower than a in all but one of 5 rounds"), s
    # with 3 rounds one lost round is too much; two lost rounds of 5 too
    assert compare_rates("a", [10, 10, 10], "b", [12, 12, 1]).startswith("no clear difference")
    assert compare_rates("a", [10] * 5, "b", [12, 12, 1, 1, 12]).startswith("no clear difference")


def test_a_paired_effect_points_the_way_the_rounds_voted():
    # the machine's speed moved between rounds: b lost 4 of 5 rounds, yet b's median is the
    # larger (49 against 10); the printed effect is the median round's own ratio, below 1
    a, b = [10, 50, 50, 10, 10], [9, 49, 49, 100, 9]
    assert statistics.median(b) / statistics.median(a) > 1
    s = compare_rates("a", a, "b", b)
    assert s.startswith("b was slower than a in all but one of 5 rounds"), s
    assert "median round: 0.98x a's speed" in s, s


def test_pairs_cancel_a_slow_moment_shared_by_both():
    # round 2 was slow for both; b still won every round
    s = compare_rates("a", [10, 3, 10], "b", [11, 4, 11])
    assert s.startswith("b was faster than a in every run of 3 rounds"), s


def test_unequal_counts_compare_ranges():
    assert compare_rates("a", [1, 2], "b", [4, 5, 6]).startswith("b was faster than a in every run")
    assert compare_rates("a", [1, 5], "b", [4, 5, 6]).startswith("no clear difference")
    assert "their runs overlap" in compare_rates("a", [1, 5], "b", [4, 5, 6])


def test_unclear_paired_sentence_names_the_rounds_rule():
    s = compare_rates("a", [10] * 9, "b", [12] * 7 + [1, 1])
    assert s.startswith("no clear difference between a and b: neither won enough rounds "
                        "(at best 7 of 9;"), s
    assert "sign test p = " in s and "overlap" not in s


def test_needs_runs():
    with pytest.raises(ValueError, match="at least one run"):
        compare_rates("a", [], "b", [1])


def test_rate_verdict_is_the_rule_behind_the_sentence():
    assert rate_verdict([1, 2, 3], [4, 5, 6]) == ("faster", "in every run of 3 rounds")
    assert rate_verdict([10] * 5, [8, 8, 30, 8, 8]) == ("slower", "in all but one of 5 rounds")
    assert rate_verdict([1, 2], [3, 4, 5]) == ("faster", "in every run")
    assert rate_verdict([1, 3], [2, 4]) == ("unclear", "")


def test_an_empty_loader_is_a_clear_error_not_a_division_by_zero():
    """train_one_epoch and evaluate given no sample raise ValueError saying so (they used to
    divide by zero)."""
    import torch
    from torch import nn

    from dpcourse import train

    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="no samples"):
        train.train_one_epoch(model, [], nn.CrossEntropyLoss(), opt)
    with pytest.raises(ValueError, match="no samples"):
        train.evaluate(model, [], nn.CrossEntropyLoss())


def test_time_breakdown_times_the_step_phases_and_trains():
    """The phases time_breakdown times are step_phases': the weights move, every part is > 0."""
    import torch
    from torch import nn

    from dpcourse import train

    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    before = model.weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [(torch.randn(4, 3), torch.tensor([0, 1, 0, 1]))] * 3
    parts = train.time_breakdown(model, batches, nn.CrossEntropyLoss(), opt, max_batches=5)
    assert set(parts) == {"data", "forward", "backward+step"}
    assert all(v > 0 for v in parts.values())
    assert not torch.equal(before, model.weight) and model.training


def test_sign_test_p_is_the_binomial_tail():
    from dpcourse.train import sign_test_p
    assert sign_test_p([1] * 7, [2] * 7) == 2 / 2 ** 7
    assert sign_test_p([1] * 7, [2] * 6 + [0]) == 2 * 8 / 2 ** 7
    assert sign_test_p([1] * 5, [2] * 4 + [0]) == 2 * 6 / 2 ** 5
    assert sign_test_p([1, 1], [1, 1]) == 1.0   # ties only
    assert "sign test p = 0.0156" in compare_rates("a", [1] * 7, "b", [2] * 7)


def test_rate_shape_names_the_steps_it_sees():
    """rate_shape: each size against the next by rate_verdict; never "flat" when a step fell."""
    from dpcourse.train import rate_shape

    up, same, down = [2] * 7, [1] * 7, [0] * 7
    # lesson 01's stored run: rose 16 -> 32 (6 of 7), unclear 32 -> 64, fell 64 -> 256 (6 of 7)
    stored = {16: [610, 802, 828, 682, 730, 713, 797], 32: [734, 826, 927, 685, 805, 640, 925],
              64: [888, 865, 825, 887, 759, 848, 672], 256: [610, 579, 640, 674, 629, 651, 855]}
    shape, sentence = rate_shape(stored)
    assert shape == "peak" and sentence.endswith("a peak at batches 32 to 64, then slower"), sentence
    # outliers=0: a step won in 6 of 7 rounds no longer counts, so the stored run shows no shape
    assert rate_shape(stored, outliers=0)[0] == "flat"
    assert rate_verdict([10] * 5, [8, 8, 30, 8, 8], outliers=0) == ("unclear", "")
    assert compare_rates("a", [1] * 7, "b", [2] * 7, outliers=0).startswith("b was faster than a in every run of 7")
    assert rate_shape({16: same, 32: up, 64: [3] * 7})[0] == "rising"
    assert rate_shape({16: same, 32: up, 64: up})[0] == "plateau"
    assert rate_shape({16: same, 32: up, 64: same})[1].endswith("a peak at batch 32, then slower")
    assert rate_shape({16: up, 32: up, 64: same})[0] == "falling"
    assert rate_shape({16: up, 32: same, 64: up})[0] == "up and down"
    assert rate_shape({16: same, 32: same}) == (
        "flat", "showed no clear change from batch 16 to 32; batch 32 against batch 16: no clear "
        "change either, flat within the noise")
    # no single step clear, but the ends are: no shape is named (a rise, a plateau and a peak
    # alike give it; lesson 01 once read a peak's 64-beats-256 rounds as "not yet saturated")
    shape, sentence = rate_shape({16: [0] * 7, 32: [1, 1, 1, 1, -1, -1, -1],
                                  64: [0.5, 0.5, 0.5, 0.5, 1, 1, 1]})
    assert shape == "ends differ" and sentence.startswith("showed no clear change from batch 16 to 64;"), sentence
    assert sentence.endswith("batch 64 faster than batch 16: the shape in between is not shown")
    # a step rose, none fell, but the largest did not beat the smallest: neither "rising" nor
    # "plateau" (lesson 01 once read such a run as "it paid off" beside "no clear difference")
    shape, sentence = rate_shape({4: same, 16: up, 256: [1] * 6 + [3]}, outliers=0)
    assert shape == "rose, ends unclear" and "paid off" not in sentence, sentence
    assert sentence.endswith("a rise is shown only from batch 4 to 16, not from the smallest "
                             "batch to the largest"), sentence
    with pytest.raises(ValueError, match="two batch sizes"):
        rate_shape({16: same})


def test_round_wins_counts_won_lost_and_leaves_ties_out():
    # rounds: b won the first, tied the second, lost the third and fourth
    assert round_wins([1.0, 2.0, 3.0, 4.0], [2.0, 2.0, 1.0, 3.0]) == (1, 2)
    assert round_wins([], []) == (0, 0)
