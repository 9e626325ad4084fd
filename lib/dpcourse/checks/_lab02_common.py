"""What lab 02's checks share: the refusal of the library's own answer (``dpcourse.dp``) or of
torch's, passed where the lab asks for the learner's. The checks are in
:mod:`dpcourse.checks.lab02`.
"""

from __future__ import annotations

from . import fail
from .lab01 import is_library_function


def _refuse_library(fn, ref, name: str, why: str) -> None:
    __tracebackhide__ = True
    if is_library_function(fn, ref):
        fail(f"{name} is the library's own dpcourse.dp.{ref.__name__}: {why}",
             fix=f"write {name} yourself.")


def _not_yours(name: str, called: list, why: str) -> None:
    __tracebackhide__ = True
    if called:
        fail(f"{name} called the library's dpcourse.dp.{called[0]}: {why}",
             fix=f"do in your own code what dp.{called[0]} did.")


_OWN = ("the lab asks you to write it yourself, so the check would only be comparing the "
        "reference with itself.")
