"""What every check of lab 11 shares: the world sizes it runs, how long a rank may wait, and the
sentences and guards each part uses (a TODO still raising, the library's answer passed as the
learner's, a collective only some ranks reach). The checks are in :mod:`dpcourse.checks.lab11`."""

from __future__ import annotations

from . import has_todo


WORLD_SIZES = (2, 3)
DEFAULT_TIMEOUT = 30.0

_OWN = "the lab asks you to write it, and the library's passes every check by construction"

_HANG = ("every rank must make the same collectives in the same order — an all_reduce that "
         "only some ranks reach (inside `if rank == 0:`, or in a backward that only some ranks "
         "run) leaves the others waiting.")


def _todo(*objs) -> None:
    for obj in objs:
        if has_todo(obj):
            raise NotImplementedError(f"{getattr(obj, '__name__', 'your code')} still raises "
                                      f"NotImplementedError: replace the TODO with your answer.")


def _communicating(log) -> int:
    return sum(1 for c in log if c.op != "barrier")
