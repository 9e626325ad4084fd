"""Lab 09: the learner's loop beside other workers (solutions/lab09_async_worker.py, part 2).
Their updates land before the loop's pulls, so the version pull() returns is no longer the
loop's own count of pushes (with the batches as a one-pass iterator); and, on a server that
refuses a push more than REFUSAL_BOUND updates stale while the others' updates land in bursts
(one of them between the pull and the push of the refused batch's retry), every batch must still
change the weights once, in batch order.

Run by :func:`dpcourse.checks.lab09.check_async_worker`; every name is exported by
:mod:`dpcourse.checks.lab09`.
"""

from __future__ import annotations

from . import fail
from ._lab09_spy import STEPS, _diagnose_order, _expected, trace_loop

__all__ = ["REFUSAL_TAU", "REFUSAL_BOUND", "REFUSAL_BURSTS", "REFUSAL_RETRY_BURST"]


def _check_versions_with_other_workers(loop, tau: int = 3, others: int = 2) -> None:
    """One worker among several: the others' updates land before each of this loop's pulls, so
    the version pull() returns is no longer this loop's own count of pushes; and the batches
    come as a one-pass iterator, whose length is known only when it runs out."""
    __tracebackhide__ = True
    trace = trace_loop(loop, tau, others=others, one_pass=True)
    at = f"with τ = {tau}, {others} other workers pushing too, the batches an iterator"
    if "raised" in trace and trace["raised"].startswith("TypeError") and any(
            word in trace["raised"] for word in ("len()", "subscriptable", "reversed")):
        fail(f"your loop raised {trace['raised']!r} ({at}): it asked how many batches there "
             f"are, or for one by its index, but the batches may be a stream read once, whose "
             f"end the loop learns only when it runs out.",
             fix="iterate over the batches once, and finish when they run out.")
    if "misuse" in trace:
        fail(f"{trace['misuse']} ({at}).", fix=trace.get("misuse_fix"))
    if "raised" in trace:
        fail(f"your loop raised {trace['raised']!r} ({at}).")
    if len(trace["computed"]) != STEPS:
        fail(f"your loop computed {len(trace['computed'])} gradients for {STEPS} batches ({at}): "
             f"an iterator read once gives each batch once — read it twice and the second pass "
             f"finds nothing.", fix="take every batch in one pass over the iterator.")
    computed = trace["computed"]
    tags = [version for _, version, _ in trace["pushes"]]
    want = [computed[k][1] for k, _, _ in trace["pushes"]]
    if tags != want:
        if tags == _expected(tau):
            fail(f"you pushed your own count of pushes as the version ({at}: {tags}), not the "
                 f"version pull() returned ({want}): with one worker the two agree, but the "
                 f"other workers' updates move the server's version too.",
                 fix="push each gradient with the version its own pull returned.")
        fail(f"the versions pushed ({at}) were {tags}, but the pulls that gave each gradient's "
             f"weights returned {want}.", fix="push each gradient with the version its own pull "
                                             "returned.")
    if sorted(k for k, _, _ in trace["pushes"]) != list(range(STEPS)):
        fail(f"you pushed the gradients of batches {[k for k, _, _ in trace['pushes']]} ({at}): "
             f"every gradient reaches the server exactly once.")
    _diagnose_order(trace, at)


# The bounded server's run: τ = 2, a server that takes at most 3 updates of staleness, and
# other workers' updates landing in bursts before two of the loop's pulls (pull number -> how
# many): the gradients in flight across a burst come back too stale and are refused.
REFUSAL_TAU, REFUSAL_BOUND = 2, 3
REFUSAL_BURSTS = {3: 2, 7: 3}
# and after the first refusal, this many between the retry's pull and its push: the retry is
# refused too (a retry is a push like any other, and other workers do not wait for it)
REFUSAL_RETRY_BURST = REFUSAL_BOUND + 1


def _check_refusals(loop) -> tuple:
    """One worker on a server that refuses a push staler than REFUSAL_BOUND (it raises
    async_sgd.TooStale and applies nothing): every batch must still be applied once, in batch
    order, each gradient computed right after its own pull and pushed with that pull's
    version."""
    __tracebackhide__ = True
    bound = REFUSAL_BOUND
    trace = trace_loop(loop, REFUSAL_TAU, bound=bound, bursts=REFUSAL_BURSTS,
                       retry_burst=REFUSAL_RETRY_BURST)
    at = (f"with τ = {REFUSAL_TAU} on a server that refuses a gradient more than {bound} "
          f"updates stale, other workers' updates landing in bursts")
    computed, applied, refused = trace["computed"], trace["applied"], trace["refused"]
    if "misuse" in trace:
        fail(f"{trace['misuse']} ({at}).", fix=trace.get("misuse_fix"))
    for n, version, _, *_ in applied + refused:
        if n >= 0 and version != computed[n][1]:
            fail(f"a gradient of batch {computed[n][0]} was pushed with version {version}, but "
                 f"the pull that gave its weights returned {computed[n][1]} ({at}): the server "
                 f"judges a gradient's staleness by that number.",
                 fix="push each gradient with the version its own pull returned.")
    if not refused:
        fail(f"the server refused nothing ({at}): your loop never let a gradient wait long "
             f"enough to be refused — the gradients in flight are what the bound is about.")
    first_n, first_v, first_at, _ = refused[0]
    first = computed[first_n][0] if first_n >= 0 else -1
    said = (f"the server refused the gradient of batch {first} (computed on version {first_v}, "
            f"{first_at - first_v} updates stale at version {first_at}, more than {bound})")
    for n, v, _, then in refused:   # a refused batch's gradient computed again on old weights
        if n < 0:
            continue
        redo = next((m for m in range(then, len(computed))
                     if computed[m][0] == computed[n][0] and computed[m][1] <= v), None)
        if redo is not None:
            fail(f"the server refused the gradient of batch {computed[n][0]} (computed on "
                 f"version {v}), and your loop computed it again on version "
                 f"{computed[redo][1]}, weights it already had before the refusal ({at}): the "
                 f"same weights give the same gradient, as stale as the refused one — the "
                 f"weights made it stale, not the arithmetic.",
                 fix="pull again before computing the refused batch's gradient anew.")
    entries = [n for n, *_ in refused]
    again = next((n for n in entries if entries.count(n) > 1 or any(
        m == n for m, *_ in applied)), None)
    if again is not None:
        v, then = next((v, then) for n, v, then, _ in refused if n == again)
        fail(f"the server refused the gradient of batch {computed[again][0]} (computed on "
             f"version {v}, {then - v} updates stale at version {then}, more than {bound}), "
             f"and your loop pushed that same gradient again ({at}): it was computed "
             f"on version {computed[again][1]}, and every update since made it only staler — "
             f"no later push of it can be fresher than the refused one.",
             fix="a refused batch needs a new gradient, on weights pulled after the refusal.")
    _diagnose_retry_given_up(trace, said, at)
    if "raised" in trace and trace["raised"].startswith("TooStale"):
        fail(f"{said} and your loop stopped there: the refusal escaped from it as TooStale, so "
             f"batch {first} and every batch after it never changed the weights ({at}).",
             fix="catch async_sgd.TooStale where you push, and decide what the refused batch "
                 "needs.")
    if "raised" in trace:
        fail(f"{said}, and then your loop raised {trace['raised']!r} ({at}).")
    got = [computed[n][0] if n >= 0 else -1 for n, *_ in applied]
    if -1 in got:
        fail(f"you pushed something that compute_gradient did not return ({at}).")
    missing = [k for k in range(STEPS) if k not in got]
    twice = sorted({k for k in got if got.count(k) > 1})
    refused_batches = sorted({computed[n][0] for n, *_ in refused})
    then = refused[0][3]
    nxt = computed[then][0] if then < len(computed) else None
    if missing and twice and nxt is not None and nxt != first:
        fail(f"{said}; the next gradient your loop computed was for batch {nxt}, not batch "
             f"{first}: batches {missing} never changed the weights, and batches {twice} did "
             f"twice ({at}) — the refused gradient's batch is the one owed, and the loop had "
             f"moved on from it.",
             fix="keep each gradient's batch with it while it is in flight.")
    if missing:
        lost = [k for k in missing if k in refused_batches] or missing
        fail(f"{said}, and your loop went on without batch {lost[0]}: batches {missing} never "
             f"changed the weights ({at}) — every batch is applied exactly once, a refused one "
             f"too; a refused gradient is not applied.",
             fix="when a push is refused, compute that batch's gradient again on fresh weights "
                 "and push it.")
    if twice:
        fail(f"batches {twice} changed the weights more than once ({at}, applied in this order: "
             f"{got}): every batch is applied exactly once.")
    if got != sorted(got):
        fail(f"{said}; the updates then landed in the order of batches {got} ({at}): the "
             f"refused batch's new gradient waited behind newer ones — updates land in batch "
             f"order, so the batch that was refused is still the one owed first.",
             fix="land the refused batch's new gradient before any newer one.")
    _diagnose_order(trace, at)
    retried = [b for b, *_ in trace.get("retry_bursts", [])]
    return len(refused), sorted(set(refused_batches)), retried


def _diagnose_retry_given_up(trace: dict, said: str, at: str) -> None:
    """The refused batch's retry was refused too (other workers' updates landed between its
    pull and its push), and the loop gave up on it: let the second refusal escape, or went on
    without the batch."""
    __tracebackhide__ = True
    computed, applied, refused = trace["computed"], trace["applied"], trace["refused"]
    if not trace.get("retry_bursts") or len(refused) < 2:
        return
    batch, landed, position = trace["retry_bursts"][0]
    again = next(((n, v, then) for n, v, then, _ in refused[1:] if n == position), None)
    if again is None:
        return
    n, v, then = again
    got = [computed[m][0] for m, *_ in applied if m >= 0]
    escaped = "raised" in trace and trace["raised"].startswith("TooStale")
    if not escaped and batch in got:
        return
    ending = ("and your loop let this second refusal escape as TooStale" if escaped else
              f"and your loop went on without batch {batch}, which never changed the weights")
    fail(f"{said}; your loop pulled version {v} and computed batch {batch}'s gradient again — "
         f"then {landed} other workers' updates landed before its push, and the server refused "
         f"the retry too ({then - v} updates stale at version {then}), {ending} ({at}): your "
         f"loop retries once, but a retry is a push like any other — the other workers do not "
         f"wait for it, so nothing bounds how often the same batch is refused.",
         fix="keep retrying the refused batch, each time on weights pulled after the last "
             "refusal, until a push is taken.")
