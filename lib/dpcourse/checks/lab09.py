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
late, the server's current version pushed instead of the gradient's.

``check_staleness_aware`` (the stretch) runs the learner's server class under the reference
loop for τ = 0, 2 and 5 and replays the candidate step rules to name the one used: no
scaling, lr / (s + 1), lr · s, a division by zero for fresh gradients; and the bookkeeping
mistakes: staleness not recorded, counted the wrong way round or after the version moved,
the version never increased.
"""

from __future__ import annotations


import torch

from . import fail, passed, recorded, require_answer

__all__ = ["check_async_worker", "check_staleness_aware", "check_trace", "reference_trace",
           "check_prediction", "OUTCOMES", "TAUS", "AWARE_TAUS", "STEPS", "trace_loop",
           "diagnose_loop", "run_server", "diagnose_server"]

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


class _Misuse(Exception):
    """A call to the spy server or the spy compute_gradient with its arguments mixed up."""


class _SpyServer:
    """The simulator's server, keeping every version of the weights and every push. With
    ``others`` > 0, that many other workers each push one (fresh) update before every pull of
    the learner's loop, so the server's version is no longer the loop's own count of pushes."""

    def __init__(self, w, lr, others: int = 0):
        self.w, self.lr, self.version = w.clone(), lr, 0
        self.history = [w.clone()]
        self.pushes = []       # (gradient, version pushed, server's version at the push)
        self.calls = 0
        self.pulls = 0
        self.others = others

    def _count(self):
        self.calls += 1
        if self.calls > _MAX_CALLS:
            raise RuntimeError(f"more than {_MAX_CALLS} pulls and pushes for {STEPS} batches")

    def _update(self, grad):
        self.w.add_(torch.as_tensor(grad, dtype=self.w.dtype), alpha=-self.lr)
        self.version += 1
        self.history.append(self.w.clone())

    def pull(self):
        self._count()
        for _ in range(self.others):   # another worker's update lands first
            self._update(0.01 * torch.ones_like(self.w) * (1 + self.version % 3))
        self.pulls += 1
        return self.w.clone(), self.version

    def push(self, grad, version):
        self._count()
        if isinstance(version, torch.Tensor) and version.numel() > 1 and not (
                isinstance(grad, torch.Tensor) and grad.numel() > 1):
            raise _Misuse("you called push(version, grad): the server's signature is "
                          "push(grad, version), the gradient first")
        self.pushes.append((grad, version, self.version))
        self._update(grad)


def trace_loop(loop, tau: int, others: int = 0) -> dict:
    """Run ``loop`` for one τ on the spy server (``others``: other workers' updates before each
    pull); what happened, as plain data."""
    __tracebackhide__ = True
    a, b, w0, batches = _problem()
    server = _SpyServer(w0, LR, others)
    computed = []              # (batch index, version of the weights or -1, gradient)
    pulls_before = []          # the loop's pulls made before each gradient was computed

    def compute_gradient(w, batch):
        if isinstance(w, Batch) or isinstance(batch, torch.Tensor) and batch.numel() > 1:
            raise _Misuse("you called compute_gradient(batch, w): its signature is "
                          "compute_gradient(w, batch), the weights first")
        if not isinstance(w, torch.Tensor) or w.dim() == 0:
            raise _Misuse(f"compute_gradient got {w!r} as the weights: pull() returns the pair "
                          f"(weights, version), in that order")
        version = next((v for v in range(len(server.history) - 1, -1, -1)
                        if torch.equal(w, server.history[v])), -1)
        grad = a @ w - b + batch.noise
        computed.append((batch.index, version, grad.clone()))
        pulls_before.append(server.pulls)
        return grad

    out = {"tau": tau, "computed": [(i, v) for i, v, _ in computed]}
    try:
        loop(server, compute_gradient, list(batches), tau)
    except _Misuse as exc:
        out["misuse"] = str(exc)
    except Exception as exc:
        out["raised"] = f"{type(exc).__name__}: {exc}"
    out["computed"] = [(i, v) for i, v, _ in computed]
    out["pulls_before"] = list(pulls_before)
    out["pushes"] = []
    for grad, version, at in server.pushes:
        grad = torch.as_tensor(grad)
        which = next((i for i, _, g in computed if g.shape == grad.shape
                      and torch.equal(g, grad)), -1)
        out["pushes"].append((which, version, at))
    out["w"] = server.w
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
        fail(f"{trace['misuse']} ({at}).")
    if "raised" in trace:
        if trace["raised"].startswith("IndexError"):
            fail(f"your loop raised {trace['raised']!r} {at}: it took a gradient out of an empty "
                 "queue — push only when more than τ are in flight, then the rest after the loop")
        if "more than" in trace["raised"] and "pulls and pushes" in trace["raised"]:
            fail(f"your loop kept pulling or pushing {at} ({trace['raised']}): an endless loop? "
                 "Each pushed gradient must leave the queue")
        fail(f"your loop raised {trace['raised']!r} {at}")
    if len(computed) != STEPS:
        fail(f"compute exactly one gradient per batch: you computed {len(computed)} for "
             f"{STEPS} batches {at}")
    if [i for i, _ in computed] != list(range(STEPS)):
        fail(f"take the batches in order, each once: you computed on batches "
             f"{[i for i, _ in computed]} {at}")
    if any(v == -1 for _, v in computed):
        fail(f"a gradient was computed on weights the server never held {at}: pass the weights "
             "that pull() returned, unchanged")
    if any(k == -1 for k, _, _ in pushes):
        fail(f"you pushed something that compute_gradient did not return {at} (changed, "
             "scaled or summed?): push each gradient as it is")
    order = [k for k, _, _ in pushes]
    if len(set(order)) < len(order):
        fail(f"a gradient was pushed twice {at} (pushed in this order: {order}): take it out "
             "of the queue when you push it")
    if len(order) < STEPS:
        never = sorted(set(range(STEPS)) - set(order))
        if never == list(range(STEPS - len(never), STEPS)):
            fail(f"the last {len(never)} gradients were never pushed {at}: after the loop, push "
                 "the ones still in flight, oldest first")
        fail(f"the gradients of batches {never} never reached the server {at}")
    if order != list(range(STEPS)):
        fail(f"you pushed the newest gradient in flight, not the oldest ({at}, order {order}): "
             "the in-flight gradients are a first-in, first-out queue (popleft / pop(0))"
             if order != sorted(order) else f"the gradients reached the server out of order "
             f"{at}: {order}")
    versions = [v for _, v in computed]
    want = _expected(tau)
    if versions != want:
        if all(v == 0 for v in versions) and any(want):
            fail(f"you pulled the weights only once {at}: every gradient was computed on the "
                 "starting weights — pull before each gradient")
        late = [at_push - versions[k] for k, _, at_push in pushes]
        wanted = [min(k, tau) for k in range(STEPS)]
        if all(d == 0 for d in late) and tau > 0 and any(
                p > k + 1 for k, p in enumerate(trace.get("pulls_before", []))):
            fail(f"you computed each gradient when it was pushed, on the weights the server "
                 f"held then ({at}): a worker computes its gradient right after its own pull, "
                 f"on the weights that pull returned — the updates that land while it is in "
                 f"flight are what make it stale")
        if all(d == 0 for d in late):
            fail(f"your gradients are never late {at}: each is pushed right after it is "
                 "computed, so it lands on the weights it was computed on; gradient k must be "
                 "computed on version max(0, k - τ) and still be applied as update k")
        if late == [min(k, tau - 1) for k in range(STEPS)] and tau > 0:
            fail(f"your gradients are one update too early {at}: each must wait until τ newer "
                 "ones are in flight (push when len(in_flight) > τ, not ≥ τ)")
        if late == [min(k, tau + 1) for k in range(STEPS)] or \
                all(d >= w for d, w in zip(late, wanted)):
            fail(f"your gradients are later than τ {at}: staleness {late}, expected {wanted}")
        fail(f"gradient k was computed on the wrong weights {at}: staleness {late}, expected "
             f"{wanted}")
    tags = [version for _, version, _ in pushes]
    if tags != want:
        if tags == [at_push for _, _, at_push in pushes] and tags != want:
            fail(f"you pushed the server's version at push time {at}, not the version of the "
                 "weights the gradient was computed on: keep the version pull() returned with "
                 "the gradient")
        fail(f"each gradient must be pushed with the version pull() returned for its weights "
             f"{at}: you pushed {tags}, expected {want}")


def _refuse_reference(loop) -> None:
    __tracebackhide__ = True
    import functools

    from dpcourse import async_sgd

    inner = loop.func if isinstance(loop, functools.partial) else loop
    if inner is async_sgd.async_worker_loop:
        fail("that is dpcourse.async_sgd.async_worker_loop itself, the lesson's reference loop: "
             "the lab asks for your own loop, so that you decide what it keeps about a "
             "gradient between computing and pushing it.")


def _check_versions_with_other_workers(loop, tau: int = 3) -> None:
    """One worker among two: the other's updates land before each of this loop's pulls, so
    the version pull() returns is no longer this loop's own count of pushes."""
    __tracebackhide__ = True
    trace = trace_loop(loop, tau, others=1)
    at = f"with τ = {tau} and another worker pushing too"
    if "misuse" in trace or "raised" in trace:
        fail(f"your loop {trace.get('misuse') or 'raised ' + repr(trace['raised'])} ({at}).")
    computed = trace["computed"]
    tags = [version for _, version, _ in trace["pushes"]]
    want = [computed[k][1] for k, _, _ in trace["pushes"]]
    if tags != want:
        if tags == _expected(tau):
            fail(f"you pushed your own count of pushes as the version ({at}: {tags}), not the "
                 f"version pull() returned ({want}): with one worker the two agree, but the "
                 f"other workers' updates move the server's version too.")
        fail(f"each gradient must be pushed with the version pull() returned for its weights "
             f"({at}): you pushed {tags}, expected {want}")


@recorded
def check_async_worker(loop, taus=TAUS) -> None:
    """The lab's check: run ``loop`` for each τ and compare with the reference; then once as
    one of two workers (the versions must be the ones pull() returned)."""
    __tracebackhide__ = True
    require_answer(loop, "async_worker_loop")
    _refuse_reference(loop)
    from dpcourse import async_sgd

    original = async_sgd.async_worker_loop

    def refused(*args, **kwargs):
        raise _Misuse("your loop calls dpcourse.async_sgd.async_worker_loop, the lesson's "
                      "reference loop: the lab asks for your own")

    async_sgd.async_worker_loop = refused  # a loop that only wraps the reference is refused
    try:
        for tau in taus:
            trace = trace_loop(loop, tau)
            diagnose_loop(trace)
            reference = trace_loop(original, tau)
            if not torch.equal(trace["w"], reference["w"]):
                fail(f"the final weights differ from the reference's with τ = {tau}")
        _check_versions_with_other_workers(loop)
    finally:
        async_sgd.async_worker_loop = original
    passed(f"every gradient pushed once, in order, τ updates late, with its own version: "
           f"τ = {', '.join(map(str, taus))}, {STEPS} batches each, and beside another worker")


# --------------------------------------------------------------------------------------------
# The learner's τ = 2 trace
# --------------------------------------------------------------------------------------------

TRACE_TAU, TRACE_BATCHES = 2, 5


class _TraceServer:
    def __init__(self):
        self.version, self.calls = 0, []

    def pull(self):
        self.calls.append(("pull", self.version))
        return torch.zeros(1), self.version

    def push(self, grad, version):
        self.calls.append(("push", int(grad), version))
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
        where = f"call {i + 1} of your trace is {got}, the loop's is {exp}"
        updates = sum(c[0] == "push" for c in want[:i])
        if exp[0] == "push" and got[0] == "pull":
            fail(f"{where}: gradient {exp[1]} must land now; it was computed on version "
                 f"{exp[2]} and is update {exp[1]} (gradient k is computed on version "
                 f"max(0, k - τ) = max(0, k - {tau}) and applied as update k): held longer, "
                 f"it would be more than τ updates stale.")
        if exp[0] == "pull" and got[0] == "push":
            fail(f"{where}: too early — gradient {got[1]} would be update {updates}, but the "
                 f"contract makes gradient k update k computed on version max(0, k - {tau}); "
                 f"another batch must be pulled (and its gradient set off) first.")
        if exp[0] == "pull":
            fail(f"{where}: pull() returns the server's version, the number of updates applied "
                 f"so far — {updates} pushes came before this call.")
        if got[1] != exp[1]:
            fail(f"{where}: gradients reach the server in the order they were computed "
                 f"(gradient k is update k), so gradient {exp[1]} comes next.")
        fail(f"{where}: gradient {got[1]} is pushed with the version that its own pull "
             f"returned ({exp[2]}), the version of the weights it was computed on.")
    versions = [c[2] for c in want if c[0] == "push"]
    stale = [k - v for k, v in enumerate(versions)]
    passed(f"your τ = {tau} trace is the loop's: {n} pulls, {n} pushes with versions {versions}, "
           f"so updates 0..{n - 1} were {stale} updates stale")


# --------------------------------------------------------------------------------------------
# Predict, then measure: τ = 8 against τ = 0
# --------------------------------------------------------------------------------------------

OUTCOMES = ("lower", "about the same", "higher")


def check_prediction(guess, loss_fresh: float, loss_stale: float, tau: int) -> None:
    """Compare the learner's choice (τ's test loss lower / about the same / higher than τ = 0's)
    with the run's, and say why."""
    from dpcourse.checks import reveal

    ratio = loss_stale / loss_fresh
    measured = "higher" if ratio > 1.05 else "lower" if ratio < 1 / 1.05 else "about the same"
    why = {
        "higher": f"with τ = {tau} every gradient points downhill from where the weights were "
                  f"{tau} updates ago; at a step size chosen for fresh gradients, "
                  f"{tau} stale steps in a row overshoot, so the same budget ends higher "
                  f"({loss_stale:.3f} against {loss_fresh:.3f}).",
        "about the same": f"with τ = {tau} the weights move little within {tau} updates at this "
                          f"step size, so a gradient {tau} updates old still points nearly "
                          f"where a fresh one would ({loss_stale:.3f} against "
                          f"{loss_fresh:.3f}, within 5 %).",
        "lower": f"here the stale run ended lower ({loss_stale:.3f} against {loss_fresh:.3f}): "
                 f"the stale gradients acted like a smoother, averaged direction at this step "
                 f"size — staleness costs most when the step is large.",
    }[measured]
    reveal(guess, measured, close=guess.value == measured, explanation=why)


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
}

_RULE_MISTAKES = {
    "plain": "you did not scale the step: a gradient s updates stale must take lr / s",
    "plus_one": "you divided by staleness + 1 (or counted the staleness after moving the "
                "version): a fresh gradient (s = 0) and one update stale (s = 1) both take the "
                "full lr — divide by max(1, s)",
    "times": "you multiplied the lr by the staleness: stale gradients must take smaller steps, "
             "not larger",
    "times_or_one": "you multiplied the lr by the staleness: stale gradients must take smaller "
                    "steps, not larger",
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
            fail(f"a fresh gradient has staleness 0 {at}, and you divided by it: divide by "
                 "max(1, staleness)")
        fail(f"your server raised {run['raised']!r} {at}")
    if run["version"] != STEPS:
        fail(f"the server's version is {run['version']} after {STEPS} updates {at}: increase "
             "self.version by one at each push")
    want = [min(k, tau) for k in range(STEPS)]
    got = run["staleness"]
    if not got:
        fail(f"record each update's staleness in self.staleness {at}")
    if got == [-s for s in want] and any(want):
        fail(f"your staleness is negative {at}: it is the server's version minus the version "
             "the gradient was computed on")
    if got == [s + 1 for s in want]:
        fail(f"you counted the staleness after increasing the version {at}: a fresh gradient "
             "must count 0")
    if got != want:
        fail(f"the staleness you recorded {at} is {got}; expected {want}")
    if not isinstance(run["w"], torch.Tensor) or run["w"].shape != (4,):
        fail(f"self.w should stay a tensor of the 4 weights {at}, got "
             f"{type(run['w']).__name__} {tuple(getattr(run['w'], 'shape', ()))}")
    if not bool(torch.isfinite(run["w"]).all()):
        fail(f"the weights became inf or nan {at}: a fresh gradient has staleness 0 — divide by "
             "max(1, staleness)")
    # The nearest rule names the step; float32 arithmetic (a step computed through a float32
    # tensor, weights kept in float32) lands ~1e-7 from its rule, the rules ~1e-2 apart.
    w = run["w"].double()
    dists = {name: float((w - run_server(_rule_server(rule), tau)["w"]).abs().max())
             for name, rule in _RULES.items()}
    name = min(dists, key=dists.get)
    if dists[name] <= 1e-5:
        if name == "right":
            return
        fail(_RULE_MISTAKES[name] + f" ({at})")
    fail(f"your weights after {STEPS} updates {at} differ from the staleness-aware step's "
         "(lr / max(1, staleness))")


@recorded
def check_staleness_aware(server_cls, taus=AWARE_TAUS) -> None:
    """The stretch's check: the reference loop on the learner's server, for each τ."""
    __tracebackhide__ = True
    require_answer(server_cls, getattr(server_cls, "__name__", "the server class"), "class")
    for tau in taus:
        diagnose_server(run_server(server_cls, tau))
    stale = run_server(server_cls, max(taus))["staleness"]
    passed(f"steps of lr / max(1, staleness) for τ = {', '.join(map(str, taus))}: with "
           f"τ = {max(taus)} the last update took lr / {stale[-1]} = {LR / stale[-1]:g}")
