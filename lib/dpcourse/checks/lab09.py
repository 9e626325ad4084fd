"""Checks for lab09: the asynchronous worker's pull–compute–push loop for the staleness
simulator, ``async_worker_loop(server, compute_gradient, batches, tau)``, and, for the stretch,
a staleness-aware server (a :class:`dpcourse.async_sgd.SimulatedServer` subclass whose
``push`` takes a step lr / max(1, staleness)).

Both run in this process, in milliseconds, on a small quadratic problem whose gradient at a
batch is A·w − b + that batch's noise: every gradient differs, so a spy can tell which batch
and which weights each one came from.

``check_async_worker`` runs the loop for τ = 0, 3, 1 and 12 (more than the 10 batches: every
gradient is still in flight when the batches run out) on a spy server that keeps every
version of the weights and a spy ``compute_gradient`` that records which batch it got and
which version of the weights. It then *replays* the trace against the reference loop's and
names: a loop that raised, not one gradient per batch, batches out of order, a pushed
gradient that is not one computed, gradients never pushed (the ones in flight at the end),
a gradient pushed twice, the newest gradient pushed instead of the oldest, weights pulled
only once, weights not from the server, gradients one update too early or too late or never
late, the server's current version pushed instead of the gradient's; and, once the numbers are
right, a gradient computed later than right after its pull (the pulled weights kept and used at
push time). Then it runs the loop once beside 2 other workers whose updates land before each of
its pulls, with the batches as a one-pass iterator: the versions pushed must be the ones pull()
returned, and a loop that asks for the number of batches or indexes them is named. Last, on a
server that refuses a push more than 3 updates stale (it raises async_sgd.TooStale, as
async_sgd.BoundedServer does) while other workers' updates land in bursts — one of them between
the pull and the push of the first refused batch's retry, so the retry is refused too: every
batch must still change the weights once, in batch order; it names a loop that retries only
once (the second refusal let escape, or the batch then dropped), the refusal let escape, the refused
batch dropped, the same gradient pushed again, a gradient recomputed on the refused one's
weights, a new gradient for the wrong batch, one queued behind newer ones, and a retry pushed
with the old version. A loop whose τ = 2 calls differ from part 1's trace is named first by
which pull's weights each gradient got (two gradients on one pull, a pull no gradient got),
then by the spy's run for τ = 2 (an off-by-one in the gradients in flight, arguments swapped),
before the call that differs.

``check_staleness_aware`` (the stretch) runs the learner's server class under the reference
loop for τ = 0, 2 and 5 and replays the candidate step rules to name the one used: no
scaling, lr / (s + 1), lr · s, lr / √s, self.lr itself divided (the step shrinks for good), a
division by zero for fresh gradients; and the bookkeeping
mistakes: staleness not recorded, counted the wrong way round or after the version moved,
the version never increased; a rule none of these matches is tried at τ = 0, where it must be
plain SGD. Then ``my_steps``, the step each of the τ = 5 run's 10 updates
takes as a multiple of lr, written by the learner before the run (from part 1's trace and the
learner's own rule, the fresh step included), must be what the learner's server does: a
staleness that grows without bound, every gradient τ stale, staleness one off, and a fresh step
that is not the server's are named.

Used in solutions/lab09_async_worker.py; tests in tests/test_lab09_checks.py. This module holds
part 2's check (``check_async_worker``: the loop held to part 1's trace, run on the spy for each
τ and diagnosed); one idea per module besides, every name importable from here:
:mod:`dpcourse.checks._lab09_spy` (the check's problem, the spy server and the run that records
a trace), :mod:`dpcourse.checks._lab09_others` (the loop beside other workers: the versions they
move, and a server that refuses stale pushes), :mod:`dpcourse.checks._lab09_trace` (part 1's
hand-written trace), :mod:`dpcourse.checks._lab09_predict` (part 3's prediction) and
:mod:`dpcourse.checks._lab09_server` (the stretch's staleness-aware server).
"""

from __future__ import annotations

import torch

from . import fail, passed, recorded, require_answer
from ._lab09_others import (REFUSAL_BOUND, REFUSAL_BURSTS, REFUSAL_RETRY_BURST, REFUSAL_TAU,
                            _check_refusals, _check_versions_with_other_workers)
from ._lab09_predict import (ALONG, CLOSE_WITHIN, PREDICTION_LR, PREDICTION_STEPS,
                             PREDICTION_TAUS, above_for_good, check_prediction,
                             first_above_start, lr_tau_verdict, measure_sweep)
from ._lab09_server import (AWARE_TAUS, STEPS_TAU, check_staleness_aware, diagnose_server,
                            run_server, server_steps)
from ._lab09_spy import (LR, STEPS, Batch, _diagnose_order, _Endless, _expected, _Misuse,
                         _problem, trace_loop)
from ._lab09_trace import (TRACE_BATCHES, TRACE_TAU, _as_call, _TraceServer, check_trace,
                           reference_trace)

# _problem is imported for tests/test_lab09_checks.py, which reads it through this module

__all__ = ["check_async_worker", "check_staleness_aware", "check_trace", "reference_trace",
           "check_prediction", "first_above_start", "above_for_good", "measure_sweep",
           "lr_tau_verdict", "PREDICTION_LR", "PREDICTION_TAUS", "PREDICTION_STEPS", "ALONG",
           "TAUS", "AWARE_TAUS", "STEPS", "trace_loop", "diagnose_loop", "run_server", "diagnose_server"]

TAUS = (0, 3, 1, 12)   # 3 before 1: an ignored τ and an off-by-one look alike at τ = 1


def diagnose_loop(trace: dict) -> None:
    """Raise LabCheckError naming the mistake in one trace, or return quietly."""
    __tracebackhide__ = True
    tau, computed, pushes = trace["tau"], trace["computed"], trace["pushes"]
    at = f"with τ = {tau}"
    if "misuse" in trace:
        fail(f"{trace['misuse']} ({at}).", fix=trace.get("misuse_fix"))
    if "raised" in trace:
        if trace["raised"].startswith("IndexError"):
            fail(f"your loop raised {trace['raised']!r} {at}: it took a gradient out of an empty "
                 "container — it pushed at a moment when no gradient was waiting.",
                 fix="push only when more than τ gradients are in flight, then the rest after the "
                     "loop.")
        if "more than" in trace["raised"] and "pulls and pushes" in trace["raised"]:
            fail(f"your loop kept pulling or pushing {at} ({trace['raised']}): a loop that never "
                 "ends — what it waits for never changes.",
                 fix="take each pushed gradient out of what your loop keeps.")
        fail(f"your loop raised {trace['raised']!r} {at}")
    if len(computed) != STEPS:
        fail(f"your loop computed {len(computed)} gradients for {STEPS} batches {at}: the "
             f"contract is one gradient per batch.")
    if [i for i, _ in computed] != list(range(STEPS)):
        fail(f"your loop computed on batches {[i for i, _ in computed]} {at}: gradient k, and "
             f"so update k, belongs to batch k, each batch once, in order.")
    if any(v == -1 for _, v in computed):
        fail(f"a gradient was computed on weights the server never held {at}: the weights "
             f"passed to compute_gradient were changed after the pull (or made up).",
             fix="pass the weights that pull() returned, unchanged.")
    if any(k == -1 for k, _, _ in pushes):
        fail(f"you pushed something that compute_gradient did not return {at}: a changed, "
             f"scaled or summed gradient is not the one its batch produced.",
             fix="push each gradient exactly as compute_gradient returned it.")
    order = [k for k, _, _ in pushes]
    if len(set(order)) < len(order):
        fail(f"a gradient was pushed twice {at} (pushed in this order: {order}): it stayed "
             f"among the waiting gradients after its push.",
             fix="take a gradient out of what your loop keeps when you push it.")
    if len(order) < STEPS:
        never = sorted(set(range(STEPS)) - set(order))
        if never == list(range(STEPS - len(never), STEPS)):
            fail(f"the last {len(never)} gradients were never pushed {at}: they were still in "
                 f"flight when the batches ran out, and the loop returned with them.",
                 fix="after the loop over the batches, push the ones still in flight.")
        fail(f"the gradients of batches {never} never reached the server {at}: every gradient "
             f"is pushed exactly once.")
    if order != list(range(STEPS)):
        if order != sorted(order):
            fail(f"you pushed the newest gradient in flight, not the oldest ({at}, order "
                 f"{order}): gradient k must be update k, so the one that has waited longest "
                 f"lands first.", fix="take from the end where the oldest waits (first in, "
                                      "first out).")
        fail(f"the gradients reached the server out of order {at}: {order}")
    versions = [v for _, v in computed]
    want = _expected(tau)
    if versions != want:
        if all(v == 0 for v in versions) and any(want):
            fail(f"you pulled the weights only once {at}: every gradient was computed on the "
                 "starting weights, which no update reaches.", fix="pull before each gradient.")
        late = [at_push - versions[k] for k, _, at_push in pushes]
        wanted = [min(k, tau) for k in range(STEPS)]
        if all(d == 0 for d in late) and tau > 0 and any(
                p > k + 1 for k, p in enumerate(trace.get("pulls_before", []))):
            fail(f"you computed each gradient when it was pushed, on the weights the server "
                 f"held then ({at}): a worker computes its gradient right after its own pull, "
                 f"on the weights that pull returned — the updates that land while it is in "
                 f"flight are what make it stale.",
                 fix="compute each gradient right after its own pull, and keep the gradient.")
        if all(d == 0 for d in late):
            fail(f"your gradients are never late {at}: each is pushed right after it is "
                 "computed, so it lands on the weights it was computed on, whatever τ is — but "
                 "gradient k is computed on version max(0, k - τ) and applied as update k.",
                 fix="hold gradients back until τ newer ones are in flight.")
        if late == [min(k, tau - 1) for k in range(STEPS)] and tau > 0:
            fail(f"your gradients are one update too early {at} (staleness {late}, expected "
                 f"{wanted}): an off-by-one in the gradients in flight — each gradient left "
                 f"while only {tau - 1} newer one{'' if tau == 2 else 's'} "
                 f"{'was' if tau == 2 else 'were'} in flight behind it, not τ = {tau}, because "
                 f"your loop pushed as soon as {tau} were waiting, the one it had just computed "
                 f"included.",
                 fix="push when more than τ are waiting, not when τ are.")
        if late == [min(k, tau + 1) for k in range(STEPS)] or \
                all(d >= w for d, w in zip(late, wanted)):
            fail(f"your gradients are later than τ {at}: staleness {late}, expected {wanted} — "
                 f"they waited for more newer gradients than τ.")
        fail(f"gradient k was computed on the wrong weights {at}: staleness {late}, expected "
             f"{wanted}.")
    tags = [version for _, version, _ in pushes]
    if tags != want:
        if tags == [at_push for _, _, at_push in pushes] and tags != want:
            fail(f"you pushed the server's version at push time {at}, not the version of the "
                 "weights the gradient was computed on: the server then counts every gradient "
                 "as fresh.", fix="keep the version pull() returned with its gradient.")
        fail(f"the versions pushed {at} were {tags}, but the pulls that gave each gradient's "
             f"weights returned {want}.", fix="push each gradient with the version its own pull "
                                             "returned.")


def _refuse_reference(loop) -> None:
    __tracebackhide__ = True
    import functools

    from dpcourse import async_sgd

    inner = loop.func if isinstance(loop, functools.partial) else loop
    if inner is async_sgd.async_worker_loop:
        fail("that is dpcourse.async_sgd.async_worker_loop itself, the lesson's reference loop: "
             "it passes by construction, so passing proves nothing about your loop.",
             fix="write your own loop in the lab's cell.")


def _check_against_own_trace(loop, trace) -> None:
    """Part 1's trace is the deliverable the loop is held to: the learner's loop, run for τ = 2
    and five batches on a server that only writes down its calls, must make the calls the
    learner wrote by hand (which part 1's check compared with the reference loop's)."""
    __tracebackhide__ = True
    calls = [_as_call(item) for item in trace] if isinstance(trace, (list, tuple)) else None
    if calls is None or None in calls or calls != reference_trace():
        fail("the trace passed with your loop (part 1's my_trace) does not pass part 1's check "
             "yet: this check holds your loop to the calls you wrote there.",
             fix="run part 1's check and finish the trace first.")
    server = _TraceServer()
    used = []   # per gradient: (its batch, the pull whose weights it got or -1, calls before)

    def compute_gradient(w, batch):
        pull = int(w.item()) if isinstance(w, torch.Tensor) and w.numel() == 1 else -1
        used.append((batch, pull, len(server.calls)))
        return torch.tensor(float(batch))

    try:
        loop(server, compute_gradient, list(range(TRACE_BATCHES)), TRACE_TAU)
    except (Exception, _Misuse, _Endless):  # noqa: BLE001 - the runs below name it
        return
    made = server.calls
    if made == calls:
        return
    _diagnose_own_pulls(made, used)
    # the spy's run for the same τ names the mistake by its cause where it can (a comparison
    # off by one, arguments swapped, ...); the call that differs is the fallback
    diagnose_loop(trace_loop(loop, TRACE_TAU))
    i = next((k for k, (a, b) in enumerate(zip(made, calls)) if a != b), min(len(made),
                                                                              len(calls)))
    mine = made[i] if i < len(made) else "nothing more"
    yours = calls[i] if i < len(calls) else "nothing more"
    fail(f"for τ = {TRACE_TAU} and {TRACE_BATCHES} batches your loop made {len(made)} server "
         f"calls, and call {i + 1} differs from your own trace of part 1: the loop made {mine}, "
         f"your trace says {yours}. The loop and your trace describe different workers.",
         fix="walk your loop through the five batches by hand, call by call, beside your trace.")


def _diagnose_own_pulls(made: list, used: list) -> None:
    """The contract's first rule, read from the τ = 2 run on the server that writes down its
    calls (its weights are the pull's own number): each gradient computed on the weights of a
    pull of its own, right after it. Names a gradient computed on another gradient's pull, and
    a pull whose weights no gradient got (a loop that pulls for the next batch before it has
    one)."""
    __tracebackhide__ = True
    pull_calls = [n for n, c in enumerate(made) if c[0] == "pull"]
    owner = {}   # pull number -> the batch of the first gradient computed on its weights
    for batch, pull, _ in used:
        if not 0 <= pull < len(pull_calls) or not isinstance(batch, int):
            continue
        if pull in owner:
            fail(f"for τ = {TRACE_TAU} and {TRACE_BATCHES} batches your loop computed two "
                 f"gradients on the weights of one pull (call {pull_calls[pull] + 1}): each "
                 f"gradient must be computed on the weights of its own pull, right after it; "
                 f"yours computed gradient {batch} on the weights pulled for gradient "
                 f"{owner[pull]}.",
                 fix="pull once for every batch, just before computing that batch's gradient.")
        owner[pull] = batch
    if len(owner) < len(used):   # some gradients' weights unknown: the runs below name it
        return
    unused = [p for p in range(len(pull_calls)) if p not in owner]
    if unused and len(used) == TRACE_BATCHES:
        p = unused[-1]
        fail(f"for τ = {TRACE_TAU} and {TRACE_BATCHES} batches your loop pulled "
             f"{len(pull_calls)} times, and no gradient was computed on the weights of pull "
             f"{p + 1} (call {pull_calls[p] + 1}): each gradient must be computed on the weights "
             f"of its own pull, right after it, so a loop pulls once per batch — one that pulls "
             f"for the next batch before it has taken one pulls once too often when the "
             f"batches run out.",
             fix="pull after taking a batch, then compute its gradient at once.")


@recorded
def check_async_worker(loop, trace=None, taus=TAUS) -> None:
    """The lab's check: with ``trace`` (part 1's hand-written τ = 2 trace), first hold the loop
    to it; then run ``loop`` for each τ and compare with the reference; then once as one of two
    workers (the versions must be the ones pull() returned)."""
    __tracebackhide__ = True
    require_answer(loop, "async_worker_loop")
    _refuse_reference(loop)
    from dpcourse import async_sgd

    if trace is not None:
        _check_against_own_trace(loop, trace)

    original = async_sgd.async_worker_loop

    def refused(*args, **kwargs):
        raise _Misuse("your loop calls dpcourse.async_sgd.async_worker_loop, the lesson's "
                      "reference loop: the lab asks for your own")

    async_sgd.async_worker_loop = refused  # a loop that only wraps the reference is refused
    try:
        traces = []
        for tau in taus:
            trace = trace_loop(loop, tau)
            diagnose_loop(trace)
            reference = trace_loop(original, tau)
            if not torch.equal(trace["w"], reference["w"]):
                fail(f"the final weights differ from the reference's with τ = {tau}, although "
                     f"every call looked right to the check.")
            traces.append(trace)
        for trace in traces:   # the right numbers, then the order they were made in
            _diagnose_order(trace, f"with τ = {trace['tau']}")
        _check_versions_with_other_workers(loop)
        refusals, batches, retried = _check_refusals(loop)
    finally:
        async_sgd.async_worker_loop = original
    passed(f"every gradient computed right after its pull and pushed once, in order, τ updates "
           f"late, with its own version: τ = {', '.join(map(str, taus))}, {STEPS} batches each, "
           f"and beside 2 other workers with the batches as a one-pass iterator; on a server "
           f"that refused {refusals} pushes more than {REFUSAL_BOUND} updates stale (batches "
           f"{', '.join(map(str, batches))}"
           + (f"; batch {retried[0]}'s retry refused too, {REFUSAL_RETRY_BURST} other updates "
              f"having landed between its pull and its push" if retried else "")
           + "), every batch still landed once, in order")
