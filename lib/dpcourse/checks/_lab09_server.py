"""Lab 09's stretch (solutions/lab09_async_worker.py): a staleness-aware server, a
:class:`dpcourse.async_sgd.SimulatedServer` subclass whose ``push`` takes a step
lr / max(1, staleness). :func:`check_staleness_aware` runs it under the reference loop for each
τ, replays the candidate step rules to name the one used and the bookkeeping mistakes, then
compares ``my_steps``, the learner's own account of the step each update of the τ = 5 run takes,
with the steps the learner's server takes.

Exported by :mod:`dpcourse.checks.lab09`, where the lab calls it.
"""

from __future__ import annotations

import torch

from . import fail, passed, recorded, require_answer
from ._lab09_spy import LR, STEPS, _problem

__all__ = ["AWARE_TAUS", "STEPS_TAU", "run_server", "diagnose_server", "server_steps",
           "check_staleness_aware"]

AWARE_TAUS = (0, 2, 5)


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


def diagnose_server(run: dict, server_cls=None) -> None:
    """Raise LabCheckError naming the mistake in one run of :func:`run_server`, or return
    quietly; with ``server_cls``, a rule no candidate matches is tried at τ = 0 too."""
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
    if server_cls is not None:
        _check_fresh_step(server_cls)
    fail(f"your weights after {STEPS} updates {at} differ from the staleness-aware step's, by "
         f"a rule the check does not recognise.")


def _check_fresh_step(server_cls) -> None:
    """A run at τ = 0 (every gradient fresh) must be plain SGD: name a server that is not."""
    __tracebackhide__ = True
    fresh = run_server(server_cls, 0)
    if "raised" in fresh or not isinstance(fresh.get("w"), torch.Tensor):
        return
    plain = run_server(_rule_server(_RULES["plain"]), 0)["w"]
    if fresh["w"].shape != plain.shape or float((fresh["w"].double() - plain).abs().max()) <= 1e-5:
        return
    try:
        step = f" ({server_steps(server_cls, tau=0, steps=1)[0]:.3g}·lr)"
    except Exception:  # noqa: BLE001 - the sentence stands without the number
        step = ""
    fail(f"at τ = 0 (every gradient fresh) your server must be plain SGD with step lr; yours "
         f"took a different step for a fresh gradient{step}.",
         fix="give a gradient of staleness 0 the step lr, the contract's τ = 0 run.")


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
        diagnose_server(run_server(server_cls, tau), server_cls)
    steps = _check_my_steps(server_cls, my_steps)
    full = [k for k, x in enumerate(steps) if abs(x - 1) < 1e-5]
    passed(f"steps of lr / max(1, staleness) for τ = {', '.join(map(str, taus))}; in the "
           f"τ = {STEPS_TAU} run your steps {_steps_text(steps)} · lr, as you wrote them: "
           f"updates {', '.join(map(str, full))} take the full lr, the fresh gradient as much "
           f"as one a single update stale — and with τ = 0, every gradient fresh, the run is "
           f"plain SGD")
