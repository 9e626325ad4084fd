"""Lab 09's spy (solutions/lab09_async_worker.py, part 2): the check's small quadratic problem,
whose gradient at a batch is A·w − b + that batch's noise (every gradient differs, so a spy can
tell which batch and which weights each came from), a spy server that keeps every version of
the weights and every push, and :func:`trace_loop`, which runs the learner's loop on it and
returns what happened as plain data; with the diagnosis every run shares, a gradient computed
later than right after its pull.

Used by :mod:`dpcourse.checks.lab09` and :mod:`dpcourse.checks._lab09_others`, which diagnose
the traces; every name is exported by :mod:`dpcourse.checks.lab09`.
"""

from __future__ import annotations

import torch

from . import fail

__all__ = ["STEPS", "trace_loop"]

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


def _diagnose_order(trace: dict, at: str) -> None:
    __tracebackhide__ = True
    if trace.get("late"):
        k, what = trace["late"][0]
        if k >= STEPS:   # every batch had its gradient: this pull belongs to none
            fail(f"your loop pulled once more after the gradients of all {STEPS} batches were "
                 f"computed ({at}): each gradient must be computed on the weights of its own "
                 f"pull, right after it, so a loop pulls once per batch — one that pulls for "
                 f"the next batch before it has taken one pulls once too often when the "
                 f"batches run out.", fix="pull after taking a batch, then compute its gradient "
                                          "at once.")
        fail(f"you kept the weights of batch {k}'s pull and computed its gradient only after "
             f"your loop's next {what} ({at}): a worker computes while nothing else happens — "
             f"what waits in flight is a gradient, not weights still to be used.",
             fix="compute each gradient right after its own pull.")
