"""Lab checks: one short line when the learner's code is right, one sentence naming the mistake
when it is not.

Each lab has its own module (``dpcourse.checks.lab01`` ...). A check runs the learner's function
on small inputs, compares it with the reference in the library, and — where a plausible wrong
answer leaves a recognisable trace (gradients N times too big, weights unchanged, a rank that
never returns) — says which mistake it is. tests/test_lab*_checks.py prove that each named
mistake is caught.
"""

from __future__ import annotations

__all__ = ["LabCheckError", "passed", "fail"]


class LabCheckError(AssertionError):
    """The learner's answer is wrong; the message names the mistake in one sentence."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


def passed(what: str) -> str:
    """Print and return the one-line success message."""
    line = f"✔ {what}"
    print(line)
    return line


def fail(message: str):
    """Raise LabCheckError without our own frames cluttering the learner's traceback."""
    __tracebackhide__ = True  # pytest and IPython hide this frame
    raise LabCheckError(message)
