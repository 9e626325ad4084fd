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

__all__ = ["check_async_worker", "check_staleness_aware", "TAUS", "AWARE_TAUS", "STEPS",
           "trace_loop", "diagnose_loop", "run_server", "diagnose_server"]

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


class _SpyServer:
    """The simulator's server, keeping every version of the weights and every push."""

    def __init__(self, w, lr):
        self.w, self.lr, self.version = w.clone(), lr, 0
        self.history = [w.clone()]
        self.pushes = []       # (gradient, version pushed, server's version at the push)
        self.calls = 0

    def _count(self):
        self.calls += 1
        if self.calls > _MAX_CALLS:
            raise RuntimeError(f"more than {_MAX_CALLS} pulls and pushes for {STEPS} batches")

    def pull(self):
        self._count()
        return self.w.clone(), self.version

    def push(self, grad, version):
        self._count()
        self.pushes.append((grad, version, self.version))
        self.w.add_(torch.as_tensor(grad, dtype=self.w.dtype), alpha=-self.lr)
        self.version += 1
        self.history.append(self.w.clone())


def trace_loop(loop, tau: int) -> dict:
    """Run ``loop`` for one τ on the spy server; what happened, as plain data."""
    __tracebackhide__ = True
    a, b, w0, batches = _problem()
    server = _SpyServer(w0, LR)
    computed = []              # (batch index, version of the weights or -1, gradient)

    def compute_gradient(w, batch):
        w = torch.as_tensor(w)
        version = next((v for v in range(len(server.history) - 1, -1, -1)
                        if torch.equal(w, server.history[v])), -1)
        grad = a @ w - b + batch.noise
        computed.append((batch.index, version, grad.clone()))
        return grad

    out = {"tau": tau, "computed": [(i, v) for i, v, _ in computed]}
    try:
        loop(server, compute_gradient, list(batches), tau)
    except Exception as exc:
        out["raised"] = f"{type(exc).__name__}: {exc}"
    out["computed"] = [(i, v) for i, v, _ in computed]
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
        if all(d == 0 for d in late):
            fail(f"your gradients are never late {at}: each must stay in flight until τ newer "
                 "ones are computed (and be computed when its batch is pulled, not at its push)")
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


@recorded
def check_async_worker(loop, taus=TAUS) -> None:
    """The lab's check: run ``loop`` for each τ and compare with the reference."""
    __tracebackhide__ = True
    require_answer(loop, "async_worker_loop")
    from dpcourse import async_sgd

    for tau in taus:
        trace = trace_loop(loop, tau)
        diagnose_loop(trace)
        reference = trace_loop(async_sgd.async_worker_loop, tau)
        if not torch.equal(trace["w"], reference["w"]):
            fail(f"the final weights differ from the reference's with τ = {tau}")
    passed(f"every gradient pushed once, in order, τ updates late, with its own version: "
           f"τ = {', '.join(map(str, taus))}, {STEPS} batches each")


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
