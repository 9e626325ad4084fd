"""Lab 09, part 1 (solutions/lab09_async_worker.py): the server calls of the worker loop for
τ = 2 and 5 batches, one worker, written by hand by the learner; :func:`check_trace` compares
them call by call with the reference loop's (:func:`reference_trace`) and names, at the first
call that differs, what the calls before it left behind.

Exported by :mod:`dpcourse.checks.lab09`, where the lab calls it; part 2's check holds the
learner's loop to this trace.
"""

from __future__ import annotations

import torch

from . import fail, passed, recorded
from ._lab09_spy import _MAX_CALLS, _Endless

__all__ = ["TRACE_TAU", "TRACE_BATCHES", "reference_trace", "check_trace"]

TRACE_TAU, TRACE_BATCHES = 2, 5


class _TraceServer:
    def __init__(self):
        self.version, self.calls = 0, []

    def _limit(self):
        if len(self.calls) > _MAX_CALLS:
            raise _Endless(f"more than {_MAX_CALLS} pulls and pushes for {TRACE_BATCHES} "
                           f"batches")

    def pull(self):
        """The weights are the pull's own number (0, 1, …): the check can tell which pull's
        weights a gradient was computed on."""
        self._limit()
        number = sum(c[0] == "pull" for c in self.calls)
        self.calls.append(("pull", self.version))
        return torch.full((1,), float(number)), self.version

    def push(self, grad, version):
        self._limit()
        self.calls.append(("push", int(grad), int(version)))
        self.version += 1


def reference_trace(tau: int = TRACE_TAU, batches: int = TRACE_BATCHES) -> list[tuple]:
    """The server calls of the reference loop, as the lab asks the learner to write them:
    ``("pull", version returned)`` and ``("push", batch index of the gradient, version)``."""
    from dpcourse import async_sgd

    server = _TraceServer()
    async_sgd.async_worker_loop(server, lambda w, batch: batch, range(batches), tau)
    return server.calls


def _as_call(item):
    if isinstance(item, (tuple, list)) and item and item[0] in ("pull", "push") and \
            len(item) == (2 if item[0] == "pull" else 3) and \
            all(isinstance(x, int) and not isinstance(x, bool) for x in item[1:]):
        return tuple(item)
    return None


@recorded
def check_trace(trace) -> None:
    """The lab's first deliverable: the server calls of the loop for τ = 2 and 5 batches, one
    worker, written by hand; compared call by call with the reference loop's."""
    __tracebackhide__ = True
    if trace is None or trace is Ellipsis:
        raise NotImplementedError("write your τ = 2 trace first (a list of server calls), then "
                                  "run this cell")
    if not isinstance(trace, (list, tuple)):
        fail(f"the trace is a list of server calls, got {type(trace).__name__}.")
    calls = []
    for i, item in enumerate(trace):
        call = _as_call(item)
        if call is None:
            fail(f"call {i + 1} of your trace is {item!r}: write each call as (\"pull\", v), "
                 f"the version pull() returns, or (\"push\", k, v), the gradient of batch k "
                 f"pushed with version v (integers, counted from 0).")
        calls.append(call)
    want = reference_trace()
    tau, n = TRACE_TAU, TRACE_BATCHES
    pulls = sum(c[0] == "pull" for c in calls)
    pushes = [c[1] for c in calls if c[0] == "push"]
    if pulls != n:
        fail(f"your trace pulls {pulls} times for {n} batches: a worker pulls once per batch, "
             f"just before computing that batch's gradient.")
    if sorted(pushes) != list(range(n)):
        fail(f"your trace pushes the gradients of batches {pushes}: each of the {n} gradients "
             f"reaches the server exactly once, the ones still in flight when the batches run "
             f"out included.")
    for i, (got, exp) in enumerate(zip(calls, want)):
        if got == exp:
            continue
        # the calls before this one are the loop's: count what they left behind
        updates = sum(c[0] == "push" for c in want[:i])
        pulled = [k for k, c in enumerate(c for c in want[:i] if c[0] == "pull")]
        pushed = [c[1] for c in want[:i] if c[0] == "push"]
        waiting = [k for k in pulled if k not in pushed]
        here = f"call {i + 1} of your trace is {got}"
        if exp[0] == "push" and got[0] == "pull":
            fail(f"{here}: a pull here sets off another gradient while {len(waiting)} are already "
                 f"in flight (batches {waiting}), more than τ = {tau}: the oldest of them, "
                 f"computed on version {exp[2]}, would land after more than τ newer gradients "
                 f"had been set off.",
                 fix="a gradient lands as soon as more than τ gradients are in flight.")
        if exp[0] == "pull" and got[0] == "push":
            fail(f"{here}, too early: only {len(waiting)} gradients are in flight here (batches "
                 f"{waiting}), "
                 f"τ = {tau} or fewer, so this push makes gradient {got[1]} update {updates} "
                 f"before τ newer gradients have been set off — fresher than the contract's "
                 f"max(0, k - τ) for update k.",
                 fix="pull the next batch first: a gradient waits until more than τ are in "
                     "flight.")
        if exp[0] == "pull":
            fail(f"{here}: {updates} pushes come before this pull in your trace, and pull() "
                 f"returns the server's version — the number of updates applied so far.",
                 fix="count the pushes before each pull.")
        if got[1] != exp[1]:
            earlier = [k for k in waiting if k < got[1]] or waiting
            fail(f"{here}: gradient{'s' if len(earlier) > 1 else ''} "
                 f"{', '.join(map(str, earlier))} {'were' if len(earlier) > 1 else 'was'} "
                 f"computed earlier and still wait{'' if len(earlier) > 1 else 's'}, so "
                 f"gradient {got[1]} would land as update {updates}, not update {got[1]} — "
                 f"and gradient k is update k.",
                 fix="push the gradients in the order they were computed.")
        fail(f"{here}: gradient {got[1]} was computed on the weights its own pull returned, "
             f"and that pull returned version {exp[2]}, not {got[2]} — the version a push "
             f"carries is the version of the weights the gradient came from.",
             fix="push each gradient with the version its own pull returned.")
    versions = [c[2] for c in want if c[0] == "push"]
    stale = [k - v for k, v in enumerate(versions)]
    passed(f"your τ = {tau} trace is the loop's: {n} pulls, {n} pushes with versions {versions}, "
           f"so updates 0..{n - 1} were {stale} updates stale")
