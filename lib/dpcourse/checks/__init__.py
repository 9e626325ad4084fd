"""Lab checks: one short line when the learner's code is right, one sentence naming the mistake
when it is not.

Each lab has its own module (``dpcourse.checks.lab01`` ...). A check runs the learner's function
on small inputs, compares it with the reference in the library, and — where a plausible wrong
answer leaves a recognisable trace (gradients N times too big, weights unchanged, a rank that
never returns) — says which mistake it is. tests/test_lab*_checks.py prove that each named
mistake is caught.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

__all__ = ["LabCheckError", "ClaimError", "passed", "fail", "claim", "has_todo"]


class LabCheckError(AssertionError):
    """The learner's answer is wrong; the message names the mistake in one sentence."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


def passed(what: str) -> None:
    """Print the one-line success message.

    Returns None on purpose: a check is usually the last line of a lab cell, and a returned
    string would be echoed there as a second copy of the line.
    """
    print(f"✔ {what}")


def fail(message: str):
    """Raise LabCheckError without our own frames cluttering the learner's traceback."""
    __tracebackhide__ = True  # pytest and IPython hide this frame
    raise LabCheckError(message)


def has_todo(obj) -> bool:
    """True if a function, or any method of a class, still raises NotImplementedError at the
    top level of its body: a lab TODO left as generated. Checks call it before starting ranks,
    so an unfilled lab stops at once with NotImplementedError. False if the source is not
    available."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(obj)))
    except (OSError, TypeError, SyntaxError):
        return False
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for stmt in node.body:
                if isinstance(stmt, ast.Raise) and stmt.exc is not None:
                    exc = stmt.exc.func if isinstance(stmt.exc, ast.Call) else stmt.exc
                    if isinstance(exc, ast.Name) and exc.id == "NotImplementedError":
                        return True
    return False


class ClaimError(AssertionError):
    """A lesson's claim did not hold on this run; the message names the claim and its values."""


def claim(statement: str, condition, **values) -> None:
    """State a lesson's claim and prove it: print ``✔ statement`` if ``condition`` is true,
    otherwise raise :class:`ClaimError` naming the claim and the values it was judged on.

    Every fact a lesson prints goes through here (DESIGN.md § Conventions, "Claims"); a test
    (tests/test_notebooks.py) fails on a notebook that prints a bare boolean instead. Pass the
    numbers behind the claim as keyword arguments: they are shown only when the claim fails, so
    the stored output stays stable while a failure says exactly what was measured::

        claim("the loss fell", last < first, first=first, last=last)
    """
    __tracebackhide__ = True
    try:
        ok = bool(condition)
    except Exception as err:  # e.g. the truth value of a multi-element tensor
        raise TypeError(f"claim {statement!r}: the condition must be a single true/false value, "
                        f"got {type(condition).__name__} ({err})") from None
    if not ok:
        shown = ", ".join(f"{k}={_short(v)}" for k, v in values.items())
        raise ClaimError(f"claim failed: {statement}" + (f" ({shown})" if shown else ""))
    # Returns None on purpose: a returned string would be echoed a second time when the call
    # ends a notebook cell.
    print(f"✔ {statement}")


def _short(value, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
