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
with the old version. A loop whose τ = 2 calls differ from part 1's trace is named by the spy's
run for τ = 2 (an off-by-one in the gradients in flight, arguments swapped) before the call
that differs.

``check_staleness_aware`` (the stretch) runs the learner's server class under the reference
loop for τ = 0, 2 and 5 and replays the candidate step rules to name the one used: no
scaling, lr / (s + 1), lr · s, lr / √s, self.lr itself divided (the step shrinks for good), a
division by zero for fresh gradients; and the bookkeeping
mistakes: staleness not recorded, counted the wrong way round or after the version moved,
the version never increased. Then ``my_steps``, the step each of the τ = 5 run's 10 updates
takes as a multiple of lr, written by the learner before the run (from part 1's trace and the
learner's own rule, the fresh step included), must be what the learner's server does: a
staleness that grows without bound, every gradient τ stale, staleness one off, and a fresh step
that is not the server's are named.
"""

from __future__ import annotations


import torch

from . import fail, passed, recorded, require_answer

__all__ = ["check_async_worker", "check_staleness_aware", "check_trace", "reference_trace",
           "check_prediction", "first_above_start", "above_for_good", "measure_sweep",
           "lr_tau_verdict", "PREDICTION_LR", "PREDICTION_TAUS", "PREDICTION_STEPS", "ALONG",
           "TAUS", "AWARE_TAUS", "STEPS", "trace_loop", "diagnose_loop", "run_server", "diagnose_server"]

TAUS = (0, 3, 1, 12)   # 3 before 1: an ignored τ and an off-by-one look alike at τ = 1
AWARE_TAUS = (0, 2, 5)
STEPS = 10
LR = 0.1
_MAX_CALLS = 20 * STEPS


class Batch:
    """One batch of the check's problem: its index and its noise."""

    def __init__(self, index: int, noise: torch.Tensor):
        self.index, self.noise = index, noise

    def __repr__(self):
        return f"Batch({self.index})"


def _problem(steps: int = STEPS):
    g = torch.Generator().manual_seed(9)
    m = torch.randn(4, 4, generator=g, dtype=torch.float64)
    a = m @ m.T / 4 + torch.eye(4, dtype=torch.float64)
    b = torch.randn(4, generator=g, dtype=torch.float64)
    w0 = torch.randn(4, generator=g, dtype=torch.float64)
    batches = [Batch(i, torch.randn(4, generator=g, dtype=torch.float64)) for i in range(steps)]
    return a, b, w0, batches


class _Misuse(BaseException):
    """A call to the spy server or the spy compute_gradient with its arguments mixed up (a
    BaseException: a loop that retries on ``except Exception`` must not swallow it)."""


class _Endless(BaseException):
    """The spy's limit on server calls reached (a BaseException, for the same reason)."""


class _SpyServer:
    """The simulator's server, keeping every version of the weights and every push. With
    ``others`` > 0, that many other workers each push one (fresh) update before every pull of
    the learner's loop, so the server's version is no longer the loop's own count of pushes."""

    def __init__(self, w, lr, others: int = 0, bound=None, bursts=None, retry_burst=0):
        self.w, self.lr, self.version = w.clone(), lr, 0
        self.history = [w.clone()]
        self.pushes = []       # (gradient, version pushed, server's version at the push)
        self.refused = []      # (gradient, version, server's version, gradients computed so far)
        self.calls = 0
        self.pulls = 0
        self.others = others
        self.bound = bound     # the most staleness a push may have, or None: no bound
        self.bursts = dict(bursts or {})   # pull number -> other workers' updates just before
        self.gradients = 0     # compute_gradient calls so far
        self.late = []         # (batch pulled, server call) where a pulled batch had no gradient
        # after the first refusal, the first push of a new gradient for the refused batch (its
        # retry) has this many other workers' updates land between its pull and its push
        self.retry_burst = retry_burst
        self.origin = None     # gradient -> (batch index, position in computed), set by the run
        self.retry_bursts = []  # (batch, updates landed, position of the retried gradient)

    def _order(self, what):
        if self.gradients < self.pulls and not self.late:
            self.late.append((self.gradients, what))

    def _count(self):
        self.calls += 1
        if self.calls > _MAX_CALLS:
            raise _Endless(f"more than {_MAX_CALLS} pulls and pushes for {STEPS} batches")

    def _update(self, grad):
        self.w.add_(torch.as_tensor(grad, dtype=self.w.dtype), alpha=-self.lr)
        self.version += 1
        self.history.append(self.w.clone())

    def pull(self):
        self._count()
        self._order("pull")
        for _ in range(self.others + self.bursts.get(self.pulls, 0)):  # others' updates land
            self._update(0.01 * torch.ones_like(self.w) * (1 + self.version % 3))
        self.pulls += 1
        return self.w.clone(), self.version

    def _burst_before_retry(self, grad):
        if not (self.retry_burst and self.refused and not self.retry_bursts and self.origin):
            return
        batch, position = self.origin(grad)
        first = self.refused[0]
        refused_batch, _ = self.origin(first[0])
        if batch >= 0 and batch == refused_batch and position >= first[3]:
            for _ in range(self.retry_burst):   # other workers' updates land before it
                self._update(0.01 * torch.ones_like(self.w) * (1 + self.version % 3))
            self.retry_bursts.append((batch, self.retry_burst, position))

    def push(self, grad, version):
        self._count()
        if isinstance(version, torch.Tensor) and version.numel() > 1 and not (
                isinstance(grad, torch.Tensor) and grad.numel() > 1):
            raise _Misuse(f"push got a tensor of {version.numel()} numbers where the version "
                          f"belongs (its second argument): the gradient and the version are "
                          f"swapped, so the server cannot count the gradient's staleness",
                          "call push(grad, version), the gradient first.")
        self._order("push")
        self._burst_before_retry(grad)
        if self.bound is not None and isinstance(version, int) and \
                self.version - version > self.bound:
            from dpcourse import async_sgd

            self.refused.append((grad, version, self.version, self.gradients))
            raise async_sgd.TooStale(f"a gradient of version {version} is "
                                     f"{self.version - version} updates stale at version "
                                     f"{self.version}; this server takes at most {self.bound}")
        self.pushes.append((grad, version, self.version))
        self._update(grad)


def trace_loop(loop, tau: int, others: int = 0, one_pass: bool = False, bound=None,
               bursts=None, retry_burst: int = 0) -> dict:
    """Run ``loop`` for one τ on the spy server (``others``: other workers' updates before each
    pull; ``one_pass``: the batches as an iterator that can be read once, of unknown length;
    ``bound``: the server refuses a push more than that many updates stale, raising
    :class:`dpcourse.async_sgd.TooStale`; ``bursts``: pull number -> other workers' updates
    landing just before that pull; ``retry_burst``: after the first refusal, that many other
    workers' updates land between the pull and the push of the refused batch's first new
    gradient); what happened, as plain data."""
    __tracebackhide__ = True
    a, b, w0, batches = _problem()
    server = _SpyServer(w0, LR, others, bound=bound, bursts=bursts, retry_burst=retry_burst)
    computed = []              # (batch index, version of the weights or -1, gradient)
    pulls_before = []          # the loop's pulls made before each gradient was computed
    returned = []              # the tensors compute_gradient returned, to know them by identity

    def compute_gradient(w, batch):
        if isinstance(w, Batch) or isinstance(batch, torch.Tensor) and batch.numel() > 1:
            raise _Misuse(f"compute_gradient got {w!r} where the weights belong (its first "
                          f"argument) and the weights where the batch belongs: the two "
                          f"arguments are swapped, so no gradient could be computed",
                          "call compute_gradient(w, batch), the weights first.")
        if not isinstance(w, torch.Tensor) or w.dim() == 0:
            raise _Misuse(f"compute_gradient got {w!r} as the weights: that is the version, "
                          f"the second of the two things pull() returns",
                          "unpack pull()'s pair as (weights, version), in that order.")
        version = next((v for v in range(len(server.history) - 1, -1, -1)
                        if torch.equal(w, server.history[v])), -1)
        grad = a @ w - b + batch.noise
        computed.append((batch.index, version, grad.clone()))
        returned.append(grad)
        pulls_before.append(server.pulls)
        server.gradients += 1
        return grad

    def entry(grad):
        """The position in ``computed`` of the gradient pushed (the very tensor returned, else
        the first equal one), or -1."""
        same = next((n for n, g in enumerate(returned) if g is grad), -1)
        if same >= 0 and torch.equal(computed[same][2], torch.as_tensor(grad)):
            return same
        grad = torch.as_tensor(grad)
        return next((n for n, (_, _, g) in enumerate(computed) if g.shape == grad.shape
                     and torch.equal(g, grad)), -1)

    def origin(grad):
        try:
            n = entry(grad)
        except Exception:  # noqa: BLE001 - not a tensor: the diagnosis names it
            return -1, -1
        return (computed[n][0] if n >= 0 else -1), n

    server.origin = origin
    out = {"tau": tau, "computed": [(i, v) for i, v, _ in computed]}
    try:
        loop(server, compute_gradient, iter(batches) if one_pass else list(batches), tau)
    except _Misuse as exc:
        out["misuse"], out["misuse_fix"] = exc.args[0], exc.args[1] if len(exc.args) > 1 \
            else None
    except _Endless as exc:
        out["raised"] = f"RuntimeError: {exc}"
    except Exception as exc:
        out["raised"] = f"{type(exc).__name__}: {exc}"
    out["computed"] = [(i, v) for i, v, _ in computed]
    out["pulls_before"] = list(pulls_before)

    applied = [(entry(grad), version, at) for grad, version, at in server.pushes]
    out["applied"] = applied   # (entry in computed, version pushed, server's version then)
    out["pushes"] = [(computed[n][0] if n >= 0 else -1, version, at)
                     for n, version, at in applied]
    # (entry, version pushed, server's version then, gradients computed before the refusal)
    out["refused"] = [(entry(grad), version, at, before)
                      for grad, version, at, before in server.refused]
    out["bound"] = bound
    out["retry_bursts"] = list(server.retry_bursts)
    out["w"] = server.w
    out["late"] = list(server.late)
    return out


def _expected(tau: int, steps: int = STEPS):
    """The reference trace: gradient k computed on version max(0, k − τ), pushed k-th."""
    return [max(0, k - tau) for k in range(steps)]


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


def _diagnose_order(trace: dict, at: str) -> None:
    __tracebackhide__ = True
    if trace.get("late"):
        k, what = trace["late"][0]
        fail(f"you kept the weights of batch {k}'s pull and computed its gradient only after "
             f"your loop's next {what} ({at}): a worker computes while nothing else happens — "
             f"what waits in flight is a gradient, not weights still to be used.",
             fix="compute each gradient right after its own pull.")


def _refuse_reference(loop) -> None:
    __tracebackhide__ = True
    import functools

    from dpcourse import async_sgd

    inner = loop.func if isinstance(loop, functools.partial) else loop
    if inner is async_sgd.async_worker_loop:
        fail("that is dpcourse.async_sgd.async_worker_loop itself, the lesson's reference loop: "
             "it passes by construction, so passing proves nothing about your loop.",
             fix="write your own loop in the lab's cell.")


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
    try:
        loop(server, lambda w, batch: torch.tensor(float(batch)), list(range(TRACE_BATCHES)),
             TRACE_TAU)
    except (Exception, _Misuse, _Endless):  # noqa: BLE001 - the runs below name it
        return
    made = server.calls
    if made == calls:
        return
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


# --------------------------------------------------------------------------------------------
# The learner's τ = 2 trace
# --------------------------------------------------------------------------------------------

TRACE_TAU, TRACE_BATCHES = 2, 5


class _TraceServer:
    def __init__(self):
        self.version, self.calls = 0, []

    def _limit(self):
        if len(self.calls) > _MAX_CALLS:
            raise _Endless(f"more than {_MAX_CALLS} pulls and pushes for {TRACE_BATCHES} "
                           f"batches")

    def pull(self):
        self._limit()
        self.calls.append(("pull", self.version))
        return torch.zeros(1), self.version

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


# --------------------------------------------------------------------------------------------
# Predict, then measure: the smallest τ that ends above the start at lr 0.2
# --------------------------------------------------------------------------------------------

PREDICTION_LR = 0.2
PREDICTION_TAUS = tuple(range(17))   # τ = 0 … 16, as far as lesson 09's table goes
PREDICTION_STEPS = 400               # lesson 09's table's budget of updates
ALONG = 300                          # the same runs, read after this many updates too
CLOSE_WITHIN = 2                     # a prediction within 2 of the measured τ counts as right


def first_above_start(losses: dict, start_loss: float):
    """The smallest τ ≥ 1 whose run ended at or above the loss it started from, or None."""
    return next((t for t in sorted(losses) if t > 0 and not losses[t] < start_loss), None)


def above_for_good(losses: dict, start_loss: float):
    """The smallest τ ≥ 1 from which every run, up to the largest τ, ended at or above the loss
    it started from, or None (the largest τ ended below it). Unlike the first τ above the
    start, it does not move when one run near the boundary ends on the other side."""
    taus = sorted(t for t in losses if t > 0)
    found = None
    for t in reversed(taus):
        if losses[t] < start_loss:
            break
        found = t
    return found


def measure_sweep(problem, loop, steps: int = PREDICTION_STEPS, along=(ALONG,),
                  lr: float = PREDICTION_LR, taus=PREDICTION_TAUS) -> tuple[float, dict]:
    """Part 3's runs: ``loop`` (the learner's worker loop) drives lesson 09's MLP through
    ``async_sgd.run_stale`` for every τ in ``taus`` at ``lr``, ``steps`` updates each, on the
    same batches; the test loss is read at the end and, in the same runs, after each number
    of updates in ``along``. Returns (the loss before any update, {updates: {τ: test loss}})."""
    from dpcourse import async_sgd

    batches = async_sgd.batch_schedule(len(problem.x_train), 32, steps)
    model = async_sgd.make_model()
    start = async_sgd.evaluate(model, async_sgd.flat_params(model), problem.x_test,
                               problem.y_test)[0]
    marks = sorted(a for a in along if 0 < a < steps)
    seen: dict = {}

    class ReadAlong(async_sgd.SimulatedServer):
        """The lesson's server; after the updates in ``marks`` it notes the test loss."""

        def push(self, grad, version):
            super().push(grad, version)
            if self.version in marks:
                seen[self.version] = async_sgd.evaluate(model, self.w, problem.x_test,
                                                        problem.y_test)[0]

    losses: dict = {a: {} for a in marks + [steps]}
    for tau in taus:
        seen.clear()
        end = async_sgd.run_stale(problem, tau, lr, batches, loop=loop, server_cls=ReadAlong)
        losses[steps][tau] = end["loss"]
        for a in marks:
            losses[a][tau] = seen.get(a, float("nan"))
    return start, losses


def _taus_text(taus) -> str:
    taus = list(taus)
    return ", ".join(map(str, taus[:-1])) + (" and " if len(taus) > 1 else "") + \
        (str(taus[-1]) if taus else "")


def lr_tau_verdict(value, boundary, last: int, lr: float = PREDICTION_LR, steps=None,
                   along=None) -> str:
    """What the learner's τ said in lr · τ, against the runs' boundary ``boundary`` (None: τ =
    ``last`` still ended below the start) after ``steps`` updates and, when measured, after
    ``along`` = (updates, boundary there) — and whether a fixed lr · τ could place it."""
    if not isinstance(value, (int, float)) or value != value:
        return ""
    g = value
    said = (f"Your {g:g} said no τ up to {last} stays above the start." if g > last else
            f"Your τ = {g:g} is lr · τ = {lr * g:.2g}.")
    if boundary is None:
        at = f"no τ up to {last} stayed above the start here"
        verdict = " Right." if g > last else f" The runs: {at}."
    else:
        at = f"lr · τ = {lr * boundary:.2g} (τ = {boundary})"
        verdict = (" Right on it." if g == boundary else
                   f" The runs: {at}; yours is {abs(g - boundary):g} τ too "
                   f"{'high' if g > boundary else 'low'}.")
    out = said + verdict
    if along is not None and steps is not None:
        updates, there = along
        if there != boundary:
            there_text = (f"beyond τ = {last}" if there is None else
                          f"at lr · τ = {lr * there:.2g} (τ = {there})")
            here_text = (f"beyond τ = {last}" if boundary is None else
                         f"at lr · τ = {lr * boundary:.2g} (τ = {boundary})")
            out += (f" At the same lr, the same runs put the boundary {there_text} after "
                    f"{updates} updates and {here_text} after {steps}: it moves with the budget, "
                    f"so no fixed lr · τ places it.")
    return out


def check_prediction(guess, losses: dict, start_loss: float, lr: float = PREDICTION_LR) -> None:
    """Compare the learner's τ — the smallest τ at ``lr`` from which every run, up to the
    largest τ, ends above its starting loss — with the runs. ``losses`` is
    {updates: {τ: test loss}} (:func:`measure_sweep`; the largest number of updates is the
    budget, the others the same runs read earlier), or {τ: test loss} after the budget alone.
    The explanation says only what the runs show: where they stay above the start, the runs
    below that boundary that ended above it anyway, and how the boundary moved with the
    budget."""
    from dpcourse.checks import reveal

    if losses and all(isinstance(v, dict) for v in losses.values()):
        by_budget = {int(k): v for k, v in losses.items()}
    else:
        by_budget = {None: losses}
    steps = max(by_budget, key=lambda k: -1 if k is None else k)
    final = by_budget[steps]
    taus = sorted(final)
    last = taus[-1]
    earlier = [k for k in by_budget if k is not None and k != steps]
    along = None
    if earlier:
        a = max(earlier)
        along = (a, above_for_good(by_budget[a], start_loss))
    budget = f"after {steps} updates" if steps is not None else "after the budget"
    boundary = above_for_good(final, start_loss)
    value = guess.value if isinstance(guess.value, (int, float)) else float("nan")
    stray = [t for t in taus if t > 0 and not final[t] < start_loss and
             (boundary is None or t < boundary)]
    if boundary is None:
        measured = f"none up to τ = {last}"
        close = value > last
        text = (f"at lr {lr:g} {budget}, τ = {last} ended at {final[last]:.2f}, below the start's "
                f"{start_loss:.2f}, so no τ up to {last} stays above it")
    else:
        measured = boundary
        close = abs(value - boundary) <= CLOSE_WITHIN
        below = max(t for t in taus if t < boundary)
        text = (f"at lr {lr:g} {budget}, τ = 0 ended at {final[0]:.2f}, below the start's "
                f"{start_loss:.2f}; from τ = {boundary} on every run up to τ = {last} ended above "
                f"it (τ = {boundary} at {final[boundary]:.2f}), and τ = {below} ended at "
                f"{final[below]:.2f}")
    if stray:
        last_below = boundary if boundary is not None else last + 1
        kept = [t for t in taus if min(stray) < t < last_below and final[t] < start_loss]
        text += (f". τ = {_taus_text(stray)} ended above the start too"
                 + (f", τ = {_taus_text(kept)} below it" if kept else "")
                 + ": one run per τ — one seed, one batch order — so near the boundary a "
                   "single run's end falls on either side, and the boundary is read where the "
                   "runs stay above")
    reveal(guess, measured, close=close, explanation=text + ". " + lr_tau_verdict(
        value, boundary, last, lr, steps, along))


# --------------------------------------------------------------------------------------------
# Stretch: the staleness-aware server
# --------------------------------------------------------------------------------------------


def _rule_server(rule):
    __tracebackhide__ = True
    from dpcourse import async_sgd

    class RuleServer(async_sgd.SimulatedServer):
        def push(self, grad, version):
            s = self.version - version
            self.staleness.append(s)
            self.w.add_(grad, alpha=-rule(self.lr, s))
            self.version += 1

    return RuleServer


_RULES = {
    "right": lambda lr, s: lr / max(1, s),
    "plain": lambda lr, s: lr,
    "plus_one": lambda lr, s: lr / (s + 1),
    "times": lambda lr, s: lr * s,
    "times_or_one": lambda lr, s: lr * max(1, s),
    "sqrt": lambda lr, s: lr / max(1, s) ** 0.5,
    "fresh_zero": lambda lr, s: lr / s if s else 0.0,
}


def _overwrite_server():
    """The step lr / s taken by overwriting self.lr: every later step starts from the shrunken
    lr, so the step shrinks for good."""
    from dpcourse import async_sgd

    class OverwriteServer(async_sgd.SimulatedServer):
        def push(self, grad, version):
            s = self.version - version
            self.staleness.append(s)
            self.lr = self.lr / max(1, s)
            self.w.add_(grad, alpha=-self.lr)
            self.version += 1

    return OverwriteServer

# the rule each candidate follows: (the cause, what to change)
_RULE_MISTAKES = {
    "plain": ("the step was not scaled: every gradient took the full lr, however stale",
              "scale each step by its gradient's staleness, as Zhang et al.'s rule says."),
    "plus_one": ("you divided by staleness + 1: a gradient one update stale took lr / 2, but "
                 "the rule's step for a staleness s ≥ 1 is lr / s, lr / 1 here",
                 "keep lr / s for s ≥ 1: only the fresh gradient's step (s = 0) is not given "
                 "by lr / s, and the lab's contract for a τ = 0 run settles it."),
    "times": ("you multiplied the lr by the staleness: the stalest gradients took the largest "
              "steps, and a fresh one none",
              "make stale gradients take smaller steps, not larger."),
    "times_or_one": ("you multiplied the lr by the staleness: the stalest gradients took the "
                     "largest steps", "make stale gradients take smaller steps, not larger."),
    "sqrt": ("you divided the lr by the square root of the staleness: Zhang et al.'s step "
             "shrinks a gradient s updates stale by s itself", "divide by s, not √s."),
    "fresh_zero": ("a fresh gradient (staleness 0) took no step at all {at} (update 0, "
                   "computed on version 0 and applied to it); and in a τ = 0 run, where every "
                   "gradient is fresh, the server would never move — a run without staleness "
                   "must still train",
                   "decide the fresh gradient's step so that a τ = 0 run is plain SGD."),
    "overwrite": ("you divided self.lr itself, so every later step starts from the shrunken lr "
                  "and the step keeps shrinking for good",
                  "scale only this gradient's step; leave the server's lr as it was given."),
}


def run_server(server_cls, tau: int) -> dict:
    """The reference loop on the learner's server class, for one τ."""
    __tracebackhide__ = True
    from dpcourse import async_sgd

    a, b, w0, batches = _problem()
    out = {"tau": tau}
    try:
        server = server_cls(w0, LR)
        # the gradient in the weights' own dtype: a server that keeps float32 weights is right
        async_sgd.async_worker_loop(
            server, lambda w, batch: (a @ w.double() - b + batch.noise).to(w.dtype), batches, tau)
    except Exception as exc:
        out["raised"] = f"{type(exc).__name__}: {exc}"
        return out
    out.update(w=server.w.clone(), staleness=list(server.staleness), version=server.version)
    return out


def diagnose_server(run: dict) -> None:
    __tracebackhide__ = True
    tau = run["tau"]
    at = f"with τ = {tau}"
    if "raised" in run:
        if "ZeroDivisionError" in run["raised"]:
            fail(f"a fresh gradient has staleness 0 {at}, and lr / s divided by it: the rule "
                 f"has no value there — the one case lr / s does not settle (the lab's "
                 f"contract for a τ = 0 run does).",
                 fix="decide the fresh gradient's step so that a τ = 0 run is plain SGD.")
        fail(f"your server raised {run['raised']!r} {at}")
    if run["version"] != STEPS:
        fail(f"the server's version is {run['version']} after {STEPS} updates {at}: the "
             f"version counts the updates applied, and pull() hands it to every worker.",
             fix="move self.version on by one at each push, as SimulatedServer.push does.")
    want = [min(k, tau) for k in range(STEPS)]
    got = run["staleness"]
    if not got:
        fail(f"self.staleness is empty after {STEPS} updates {at}: the server's books record "
             f"each update's staleness, as SimulatedServer.push does.",
             fix="keep every line of the parent's push besides the step.")
    if got == [-s for s in want] and any(want):
        fail(f"your staleness is negative {at} ({got[:4]} ...): the two versions were "
             f"subtracted the wrong way round.",
             fix="staleness = the server's version minus the version the gradient came from.")
    if got == [s + 1 for s in want]:
        fail(f"the staleness you recorded {at} starts at 1 ({got[:4]} ...): it was counted "
             f"after the version moved on, so a fresh gradient counts as one update stale.",
             fix="compute the staleness before moving the version on.")
    if got != want:
        fail(f"the staleness you recorded {at} is {got}; the reference loop's gradients were "
             f"{want} updates stale.")
    if not isinstance(run["w"], torch.Tensor) or run["w"].shape != (4,):
        fail(f"self.w became {type(run['w']).__name__} "
             f"{tuple(getattr(run['w'], 'shape', ()))} {at}, not the tensor of the 4 weights "
             f"it started as.", fix="update self.w in place.")
    if not bool(torch.isfinite(run["w"]).all()):
        fail(f"the weights became inf or nan {at}: a fresh gradient has staleness 0, and a "
             f"step of lr / 0 is infinite — the one case lr / s does not settle (the lab's "
             f"contract for a τ = 0 run does).",
             fix="decide the fresh gradient's step so that a τ = 0 run is plain SGD.")
    # The nearest rule names the step; float32 arithmetic (a step computed through a float32
    # tensor, weights kept in float32) lands ~1e-7 from its rule, the rules ~1e-2 apart.
    w = run["w"].double()
    candidates = {name: _rule_server(rule) for name, rule in _RULES.items()}
    candidates["overwrite"] = _overwrite_server()
    dists = {name: float((w - run_server(cls, tau)["w"]).abs().max())
             for name, cls in candidates.items()}
    name = min(dists, key=dists.get)
    if dists[name] <= 1e-5:
        if name == "right":
            return
        cause, fix = _RULE_MISTAKES[name]
        fail(cause.format(at=at) + "." if "{at}" in cause else f"{cause} ({at}).", fix=fix)
    fail(f"your weights after {STEPS} updates {at} differ from the staleness-aware step's, by "
         f"a rule the check does not recognise.")


# The stretch's checkable fact: the learner writes down, before the check runs, the step each
# update of the check's τ = STEPS_TAU run takes (a multiple of lr) — worked out from part 1's
# trace (update k is min(k, τ) updates stale) and the learner's own rule, the fresh gradient's
# step included; the check measures the learner's server and compares, number by number.
STEPS_TAU = 5


def server_steps(server_cls, tau: int = STEPS_TAU, steps: int = STEPS) -> list:
    """The step of each update ``server_cls`` takes (as a multiple of its lr) when update k's
    gradient is min(k, τ) updates stale — the reference loop's staleness."""
    server = server_cls(torch.zeros(4, dtype=torch.float64), LR)
    out = []
    for k in range(steps):
        before = server.w.clone()
        server.push(torch.ones(4, dtype=torch.float64), max(0, k - tau))
        out.append(float((before - server.w.double())[0]) / LR)
    return out


def _steps_text(steps) -> str:
    from fractions import Fraction

    return "[" + ", ".join(str(Fraction(x).limit_denominator(20)) for x in steps) + "]"


def _check_my_steps(server_cls, my_steps) -> list:
    __tracebackhide__ = True
    tau, n = STEPS_TAU, STEPS
    if my_steps is None or my_steps is Ellipsis:
        raise NotImplementedError(f"write my_steps (the step each of the {n} updates of the "
                                  f"τ = {tau} run takes, as a multiple of lr), then run this cell")
    import numbers

    if not isinstance(my_steps, (list, tuple)) or len(my_steps) != n or not all(
            isinstance(x, numbers.Real) and not isinstance(x, bool) for x in my_steps):
        fail(f"my_steps should be a list of {n} numbers, the step of each update of the τ = "
             f"{tau} run as a multiple of lr (0.5 for a step of lr / 2); got {my_steps!r}.")
    got = [float(x) for x in my_steps]
    want = server_steps(server_cls)

    def same(a, b):
        return all(abs(x - y) <= 1e-3 * max(1.0, abs(y)) for x, y in zip(a, b))

    if same(got, want):
        return want
    shown = _steps_text(got)
    if same(got, [1 / max(1, k) for k in range(n)]):
        fail(f"my_steps {shown} shrinks with every update, as if update k were k updates "
             f"stale; but in the τ = {tau} run a gradient waits behind at most τ newer ones: "
             f"from update {tau} on each is exactly {tau} updates stale (part 1's trace), so "
             f"the step stops shrinking at lr / {tau}.",
             fix=f"write update k's staleness as min(k, τ) first, then apply your rule to it.")
    if same(got[1:], [1 / tau] * (n - 1)):
        fail(f"my_steps {shown} gives the updates after the first a step of lr / {tau}, as if "
             f"each gradient were τ = {tau} updates stale; but the first gradients were computed "
             f"on version 0 with fewer updates since: update k is min(k, τ) updates stale.",
             fix="count, for each update k, the updates applied since its gradient's pull.")
    if same(got, [1 / (min(k, tau) + 1) for k in range(n)]) or same(
            got, [1 / max(1, min(k + 1, tau)) for k in range(n)]):
        fail(f"my_steps {shown} is one update of staleness off: it gives update 1 a step of "
             f"{got[1]:.3g}·lr, but your server — whose rule the check already measured — gives "
             f"it {want[1]:.3g}·lr. Update 1's gradient was computed on version 0 and lands on "
             f"version 1: one update stale, and your rule's step for that is {want[1]:.3g}·lr.",
             fix="staleness = the server's version at the push minus the version pulled.")
    if same(got[1:], want[1:]):
        fail(f"my_steps starts with {got[0]:.3g}·lr, but your server gave update 0 — a fresh "
             f"gradient, staleness 0 — a step of {want[0]:.3g}·lr: what you wrote for the "
             f"fresh gradient is not what your server does.",
             fix="read, in your push, the step a staleness of 0 gets.")
    first = next(k for k in range(n) if abs(got[k] - want[k]) > 1e-3 * max(1.0, abs(want[k])))
    fail(f"my_steps {shown} differs from your server's steps from update {first} on: update "
         f"{first}'s gradient is {min(first, tau)} updates stale in the τ = {tau} run, and your "
         f"server gave it {want[first]:.3g}·lr, not {got[first]:.3g}·lr.")


@recorded
def check_staleness_aware(server_cls, my_steps=None, taus=AWARE_TAUS) -> None:
    """The stretch's check: the reference loop on the learner's server, for each τ; then
    ``my_steps``, the learner's own account of the step each update of the τ = 5 run takes (a
    multiple of lr), compared with the steps the learner's server takes."""
    __tracebackhide__ = True
    require_answer(server_cls, getattr(server_cls, "__name__", "the server class"), "class")
    # τ = 0 last: there every gradient is fresh, and rules that differ only for stale ones (or
    # only for fresh ones) look alike, so the stale runs name the rule first
    for tau in sorted(taus, key=lambda t: t == 0):
        diagnose_server(run_server(server_cls, tau))
    steps = _check_my_steps(server_cls, my_steps)
    full = [k for k, x in enumerate(steps) if abs(x - 1) < 1e-5]
    passed(f"steps of lr / max(1, staleness) for τ = {', '.join(map(str, taus))}; in the "
           f"τ = {STEPS_TAU} run your steps {_steps_text(steps)} · lr, as you wrote them: "
           f"updates {', '.join(map(str, full))} take the full lr, the fresh gradient as much "
           f"as one a single update stale — and with τ = 0, every gradient fresh, the run is "
           f"plain SGD")
