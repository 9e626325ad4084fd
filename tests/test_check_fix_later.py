"""A check's sentence names the cause first; what to change joins it only when the same mistake
comes back (dpcourse.checks.fail, fix=)."""

import pytest

from dpcourse import checks


@checks.recorded
def check_sign(x):
    if x < 0:
        checks.fail(f"the value is {x}, below zero: a distance cannot be negative.",
                    fix="Return abs(x) or clip at 0.")
    checks.passed("sign")


@checks.recorded
def check_other(x):
    if x < 0:
        checks.fail("negative.", fix="Return abs(x) or clip at 0.")


def test_first_meeting_names_the_cause_only_and_the_second_adds_the_fix():
    with pytest.raises(checks.LabCheckError) as first:
        check_sign(-1)
    assert "below zero" in first.value.message
    assert "abs(x)" not in first.value.message
    assert "same mistake comes back" in first.value.message
    with pytest.raises(checks.LabCheckError) as second:
        check_sign(-2)  # other numbers, same mistake
    assert "abs(x)" in second.value.message
    assert "same mistake comes back" not in second.value.message


def test_the_memory_is_per_check():
    with pytest.raises(checks.LabCheckError):
        check_sign(-1)
    with pytest.raises(checks.LabCheckError) as other:
        check_other(-1)
    assert "abs(x)" not in other.value.message


@pytest.mark.parametrize("raw, expected", [("1", 1), ("3", 3), ("0", 1), ("x", 2), ("", 2)])
def test_the_instructor_sets_when_the_fix_shows(monkeypatch, raw, expected):
    monkeypatch.setenv(checks.FIX_AFTER_ENV, raw)
    assert checks.fix_after() == expected
    if expected == 1:
        with pytest.raises(checks.LabCheckError, match="abs"):
            check_sign(-1)


def test_a_mistake_without_a_fix_is_said_whole_every_time():
    for _ in range(2):
        with pytest.raises(checks.LabCheckError) as info:
            checks.fail("plain sentence.")
        assert info.value.message == "plain sentence."


def test_the_fix_opens_its_own_sentence_after_a_full_stop():
    """Learners read "…on every rank. when a bucket is complete, …" as a typo: after a full
    stop the fix gets its own opening words; after a clause that runs on, it just continues."""
    for _ in range(2):
        with pytest.raises(checks.LabCheckError) as info:
            checks.fail("the sum is 3.", fix="add the fourth term")
    assert info.value.message == "the sum is 3. What to change: add the fourth term"
    checks.forget()
    for _ in range(2):
        with pytest.raises(checks.LabCheckError) as info:
            checks.fail("the sum is 3, so", fix="add the fourth term")
    assert info.value.message == "the sum is 3, so add the fourth term"


def test_ipython_shows_the_sentence_not_the_checks_source_with_its_held_back_fix(capsys):
    # A learner met this in lab 06: the traceback printed the check's own lines around the
    # failing call, fix="..." included, so the fix held back for later was on screen at once.
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.user_ns["check_sign"] = check_sign
    checks.reset_mistakes() if hasattr(checks, "reset_mistakes") else checks._mistakes_met.clear()
    shell.run_cell("check_sign(-5)")
    shown = capsys.readouterr().out
    assert "LabCheckError: the value is -5, below zero" in shown
    assert "abs(x)" not in shown and "fix=" not in shown
