"""Mutation tests: break each lab solution one line at a time; its check must notice.

The suite runs a fixed, evenly spread sample of each lab's mutants (the whole set takes several
minutes on 2 cores); `DPCOURSE_MUTANTS=all python -m pytest tests/test_lab_mutations.py` or
`python -m dpcourse mutate` runs every one. Mutants that do not change behaviour are listed in
EQUIVALENT with the reason; every other survivor is a hole in a check.

A sample every check caught is recorded in tests/mutants_caught/<solution>.txt with the
fingerprint of the files it depends on (`mutate.fingerprint`: the solution, the whole library,
Python's and torch's versions, the sample's size and EQUIVALENT). The next run with the same
fingerprint skips that lab, saying so: the same files give the same mutants and the same checks.
Change a solution or any library file and the sample runs again (and, caught, records the new
fingerprint: commit it). `DPCOURSE_MUTANTS=all` always runs.
"""

from __future__ import annotations

import os
import sys
import textwrap

import pytest

from dpcourse.tools import authoring, mutate

ROOT = authoring.ROOT
SOLUTIONS = sorted((ROOT / "solutions").glob("lab*.py"))
SAMPLE = 3

# mutant key -> why it behaves like the solution (or is another right answer)
EQUIVALENT = {
    "lab01:delete: X, y = X.to(device), y.to(device)":
        "on the CPU profile the data is already on the device; on a GPU the check fails "
        "with a device mismatch",
    "lab03:swap 'True' -> 'False': optimizer.zero_grad(set_to_none=True)":
        "for SGD and Adam, gradients zeroed in place and gradients set to None give the same "
        "step: every parameter gets a gradient at every step",
    "lab05:swap 'True' -> 'False': losses = mirrored.per_example_loss(y, model(x, training=True))":
        "the stretch's model is one Dense layer, which behaves the same in training and "
        "inference mode (the main step's training=True is checked through the CNN)",
}


def _sample(found, k=SAMPLE):
    if os.environ.get("DPCOURSE_MUTANTS") == "all" or len(found) <= k:
        return found
    stride = len(found) / k
    return [found[int(i * stride)] for i in range(k)]


CAUGHT = ROOT / "tests" / "mutants_caught"


def _fingerprint(solution) -> str:
    return mutate.fingerprint(solution, SAMPLE, sorted(EQUIVALENT.items()))


def _recorded(solution) -> str | None:
    """The fingerprint of the last sample of ``solution`` that every check caught, if any."""
    path = CAUGHT / f"{solution.stem}.txt"
    return path.read_text().split()[0] if path.exists() else None


def check_mutants(solution):
    """Run the sample of ``solution``'s mutants; every one must be caught. Skipped when the
    files it depends on are those of a recorded run that caught them all."""
    fingerprint = _fingerprint(solution)
    if os.environ.get("DPCOURSE_MUTANTS") != "all" and _recorded(solution) == fingerprint:
        pytest.skip(f"{solution.stem}: this sample was caught on these very files "
                    f"(tests/mutants_caught/{solution.stem}.txt); a changed solution or library "
                    f"file runs it again")
    found = [m for m in mutate.mutants(solution) if m.key not in EQUIVALENT]
    assert len(found) >= 3, f"{solution.name}: too few mutants to say anything"
    chosen = _sample(found)
    # No baseline run here: nbval runs every solution notebook in this same suite (and the
    # full `python -m dpcourse mutate` run does check the baseline first).
    result = mutate.run(solution, chosen, timeout=90, baseline=False)
    assert result["baseline"] is None, f"the cells before the first TODO fail: {result['baseline']}"
    survived = [r["what"] for r in result["results"] if not r["caught"]]
    assert not survived, f"{solution.name}: the checks let these broken answers through: {survived}"
    CAUGHT.mkdir(exist_ok=True)
    (CAUGHT / f"{solution.stem}.txt").write_text(
        f"{fingerprint}\n# every one of these {len(chosen)} mutants was caught; the first line "
        f"is mutate.fingerprint of the files they ran on\n"
        + "".join(f"{m.key}\n" for m in chosen))


# Half the time here, half in test_lab_mutations_more.py: a file is what pytest-xdist's
# `--dist loadfile` keeps on one worker, and the longer file ends the suite. Split by measured
# time, not every other lab (which gave 622 s here and 263 s there). Seconds per lab's sample,
# the whole suite at load 6-24 on 2 cores (2026-11-27): lab11 201, lab03 134, lab01 110,
# lab07 92, lab04 91, lab06 68, lab08 51, lab05 50, lab02 29, lab09 26, lab10 24. These five
# come to 437 s; every other lab, a new one included, runs in the other file (439 s).
HERE = ("lab11", "lab07", "lab06", "lab05", "lab09")
assert {s.stem[:5] for s in SOLUTIONS} >= set(HERE), "a lab named in HERE has no solution"
SOLUTIONS_HERE = [s for s in SOLUTIONS if s.stem[:5] in HERE]
SOLUTIONS_ELSEWHERE = [s for s in SOLUTIONS if s.stem[:5] not in HERE]


@pytest.mark.parametrize("solution", SOLUTIONS_HERE, ids=lambda p: p.stem)
def test_the_check_catches_broken_answers(solution):
    check_mutants(solution)


def test_a_recorded_sample_is_skipped_only_on_the_same_files(tmp_path, monkeypatch):
    """The skip is decided from the files: a changed solution (or library) changes the
    fingerprint, and an unrecorded or stale lab runs."""
    solution = tmp_path / "lab99_demo.py"
    solution.write_text("# %%\nx = 1\n")
    first = _fingerprint(solution)
    assert first == _fingerprint(solution)
    solution.write_text("# %%\nx = 2\n")
    assert _fingerprint(solution) != first
    assert mutate.fingerprint(solution, 3) != mutate.fingerprint(solution, 4)
    monkeypatch.setattr(sys.modules[__name__], "CAUGHT", tmp_path / "caught")
    assert _recorded(solution) is None
    (tmp_path / "caught").mkdir()
    (tmp_path / "caught" / "lab99_demo.txt").write_text(f"{first}\n# a stale record\n")
    assert _recorded(solution) == first != _fingerprint(solution)


def test_a_labs_fingerprint_leaves_out_only_other_labs_checks(tmp_path):
    """Another lab's check module does not change this lab's fingerprint, unless this lab's
    checks import it (transitively); every other library file does."""
    (tmp_path / "lab01.py").write_text("x = 1\n")
    (tmp_path / "lab02.py").write_text("from .lab01 import x\n")
    (tmp_path / "_lab02_more.py").write_text("def f():\n    from dpcourse.checks.lab03 import y\n")
    (tmp_path / "lab03.py").write_text("y = 2\n")
    (tmp_path / "lab04.py").write_text("z = 3\n")
    (tmp_path / "__init__.py").write_text("")
    names = lambda lab: sorted(f.name for f in mutate._lab_check_files(tmp_path, lab))
    assert names("lab02") == ["_lab02_more.py", "lab01.py", "lab02.py", "lab03.py"]
    assert names("lab04") == ["lab04.py"] and names("lab09") == []
    real = {f.name for f in mutate._lab_check_files(ROOT / "lib/dpcourse/checks", "lab10")}
    assert {"lab10.py", "lab04.py"} <= real and "lab07.py" not in real


def test_equivalent_mutants_still_exist():
    """An accepted survivor whose line is gone from the solution is stale: remove it."""
    keys = {m.key for s in SOLUTIONS for m in mutate.mutants(s)}
    assert set(EQUIVALENT) <= keys, set(EQUIVALENT) - keys


def test_mutants_come_only_from_solution_regions(tmp_path):
    src = tmp_path / "lab99_demo.py"
    src.write_text(textwrap.dedent("""\
        # %%
        x = 1 + 2

        # %%
        def f(a, b):
            ### BEGIN SOLUTION: add them
            # a comment is not mutated
            total = a + b
            return total / 2
            ### END SOLUTION


        assert f(2, 4) == 3
        """))
    found = mutate.mutants(src)
    whats = [m.what for m in found]
    assert "delete: total = a + b" in whats
    assert "swap '+' -> '-': total = a + b" in whats
    assert "swap '/' -> '*': return total / 2" in whats
    assert not any("x = 1" in w or "comment" in w or "assert" in w for w in whats)
    result = mutate.run(src, found, timeout=20)
    assert result["baseline"] is None
    assert all(r["caught"] for r in result["results"]), result
