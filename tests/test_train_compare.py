"""dpcourse.train.compare_rates: a timing sentence says "faster" only when the runs do not overlap."""

import pytest

from dpcourse.train import compare_rates


def test_faster_slower_and_overlap():
    assert compare_rates("a", [1, 2, 3], "b", [4, 5, 6]).startswith("b was faster than a in every run")
    assert compare_rates("a", [4, 5, 6], "b", [1, 2, 3]).startswith("b was slower than a in every run")
    s = compare_rates("a", [1, 3], "b", [2, 4])
    assert s.startswith("no clear difference") and "1.50x" in s
    # touching ranges are not a clear difference either
    assert compare_rates("a", [1, 2], "b", [2, 3]).startswith("no clear difference")


def test_needs_runs():
    with pytest.raises(ValueError, match="at least one run"):
        compare_rates("a", [], "b", [1])
