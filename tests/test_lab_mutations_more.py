"""The other half of the labs' mutation tests (see test_lab_mutations.py, whose HERE says which
labs run there): every lab not run there runs here, in a file of its own so that pytest-xdist's
`--dist loadfile` runs the two halves on different workers."""

import pytest

from test_lab_mutations import SOLUTIONS_ELSEWHERE, check_mutants


@pytest.mark.parametrize("solution", SOLUTIONS_ELSEWHERE, ids=lambda p: p.stem)
def test_the_check_catches_broken_answers(solution):
    check_mutants(solution)
