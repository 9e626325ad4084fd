"""What an all-reduce should cost, under the alpha-beta model (lesson 06, §2-§4): a step of the
critical path that moves b bytes over a link takes ``alpha + b * beta``. :func:`cost` prices
naive, parameter server, ring, a binomial tree and Rabenseifner's; :func:`cheapest`,
:func:`cheapest_by_n` and :func:`ring_cheapest_up_to` say which wins where;
:func:`fit_alpha_beta` fits alpha and beta to measured all-reduce times;
:func:`blocking_ring_time` counts the transfer times of a ring of blocking sends and receives,
by the order each rank calls them in.

The simulator these prices describe and the real ring are in :mod:`dpcourse.ring`, which
re-exports every name here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np


# --------------------------------------------------------------------------------------------
# Cost models under alpha-beta
# --------------------------------------------------------------------------------------------

ALGORITHMS = ("naive", "parameter-server", "ring", "tree")  # the first four of lesson 06, §2
COST_MODELS = ALGORITHMS + ("rabenseifner",)  # everything :func:`cost` prices (the explorer's)

_EXPLAIN = {
    "naive": "every worker sends its whole array to worker 0, which sums and sends the result "
             "back to each worker, one message at a time",
    "parameter-server": "a separate server: all N workers push K bytes at once, then pull the "
                        "K-byte result, all through the server's one link",
    "ring": "reduce-scatter then all-gather around a ring, 2(N-1) steps of K/N bytes",
    "tree": "binomial-tree reduce then broadcast, ceil(log2 N) rounds each of K bytes",
    "rabenseifner": "reduce-scatter by recursive halving then all-gather by recursive "
                    "doubling, log2 N rounds each, halving then doubling the bytes",
}


@dataclass(frozen=True)
class Cost:
    """What one all-reduce of ``nbytes`` over ``n`` workers costs with ``algorithm``.

    ``steps`` are latency terms (alpha each) on the critical path; ``critical_path_bytes`` the
    bytes the time pays for (beta each) on the critical path: for the ring one direction of a
    link, 2(N-1)K/N; for the naive way, the server and the tree, a link's bytes in *then* out
    (2(N-1)K, 2NK, 2 ceil(log2 N) K), which is twice what one direction of their busiest link
    carries; for Rabenseifner's, 2(p-1)K/p (+ 2K when N is not a power of two p: the extra
    K in, then the result out), where one direction of the busiest link carries 2(p-1)K/p
    (+ K) — :func:`simulate_rabenseifner` counts it.
    ``seconds`` = steps*alpha + critical_path_bytes*beta.
    """

    algorithm: str
    n: int
    nbytes: float
    steps: int
    critical_path_bytes: float
    seconds: float


def cost(algorithm: str, n: int, nbytes: float, alpha: float, beta: float) -> Cost:
    """The alpha-beta cost of one all-reduce (alpha: seconds per step of the critical path,
    beta: seconds per byte). Every algorithm here but the parameter server sends one message
    per step and link, so its alpha is also a cost per message; the server's link takes the N
    messages of each of its two steps at once, for one alpha (the most favourable case for
    it). gloo's ring (``gloo/allreduce.cc``, ``ring``) cuts K into max(ceil(K / 1 MiB), 2N)
    segments, rounded up to a multiple of N, pipelined: a ring step there is two messages
    while K <= 2N MiB, so an alpha fitted to it is a cost per step; above that a step is more
    messages (8 at 16 MiB on 2 ranks), and what each extra one costs lands in beta.

    * naive: 2(N-1) messages of K, one after another, all through worker 0: 2(N-1)(a + Kb).
    * parameter-server: one unsharded server; one pull round and one push round, but N*K bytes
      through its link each way: 2a + 2NKb (the link carries NK out and NK in; we count the
      critical path, out then in, as ps_sync_server runs it). S servers, each holding K/S,
      would carry NK/S each.
    * ring: 2(N-1) steps of K/N bytes: 2(N-1)a + 2(N-1)/N K b. Each rank sends 2(N-1)K/N to
      one neighbour and receives as much from the other (a one-directional ring: each link
      between neighbours carries 2(N-1)K/N one way), which grows with N (K at N = 2, 1.75K at
      N = 8) but stays under 2K, a bound independent of N — why the ring's bandwidth term
      scales (its latency term, 2(N-1)a, still grows with N).
    * tree: ceil(log2 N) rounds of reduce and as many of broadcast, each of K bytes:
      2 ceil(log2 N)(a + Kb). Few latency terms, but every round moves all K.
    * rabenseifner (Thakur, Rabenseifner, Gropp 2005): with N = p a power of two, log2 p rounds
      of recursive halving (exchange half of what is left with the partner at distance p/2,
      p/4, ...: K/2 + K/4 + ... = (p-1)K/p) then log2 p of recursive doubling, the same bytes
      back: 2 log2(p) a + 2(p-1)/p K b — the ring's bandwidth with the tree's latency. Any
      other N: the r = N - p ranks above the largest power of two p < N first hand their K
      bytes to a partner and get the result back at the end, one step of K each way more:
      2 log2(p) a + 2(p-1)/p K b + 2(a + Kb).

    Shown in lesson 06, §2.
    """
    if algorithm not in COST_MODELS:
        raise ValueError(f"unknown algorithm {algorithm!r}: choose one of "
                         f"{', '.join(COST_MODELS)}")
    if not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"n must be a positive number of workers, got {n!r}")
    if nbytes < 0 or alpha < 0 or beta < 0:
        raise ValueError("nbytes, alpha and beta must be non-negative")
    if n == 1:
        return Cost(algorithm, 1, nbytes, 0, 0.0, 0.0)
    # critical: the bytes the time pays for on the critical path (Cost.critical_path_bytes)
    if algorithm == "naive":
        steps, critical = 2 * (n - 1), 2 * (n - 1) * nbytes
    elif algorithm == "parameter-server":
        steps, critical = 2, 2 * n * nbytes
    elif algorithm == "ring":
        steps, critical = 2 * (n - 1), 2 * (n - 1) * nbytes / n
    elif algorithm == "rabenseifner":
        p = 1 << (int(n).bit_length() - 1)  # the largest power of two <= n
        steps, critical = 2 * (p.bit_length() - 1), 2 * (p - 1) * nbytes / p
        if p != n:  # the extra ranks fold into partners first and get the result last
            steps, critical = steps + 2, critical + 2 * nbytes
    else:
        rounds = math.ceil(math.log2(n))
        steps, critical = 2 * rounds, 2 * rounds * nbytes
    return Cost(algorithm, int(n), nbytes, steps, critical, steps * alpha + critical * beta)


def cheapest(n: int, nbytes: float, alpha: float, beta: float,
             algorithms: Sequence[str] = COST_MODELS) -> str:
    """The algorithm with the smallest :func:`cost` at ``n`` workers, among ``algorithms``
    (by default all five :func:`cost` prices, Rabenseifner's included; ties: the ring).

    Shown in lesson 06, §3."""
    unknown = [a for a in algorithms if a not in COST_MODELS]
    if unknown or not algorithms:
        raise ValueError(f"algorithms must be a non-empty choice of {', '.join(COST_MODELS)}, "
                         f"got {list(algorithms)!r}")
    order = (["ring"] if "ring" in algorithms else []) + [a for a in algorithms if a != "ring"]
    return min(order, key=lambda alg: cost(alg, n, nbytes, alpha, beta).seconds)


def cheapest_by_n(nbytes: float, alpha: float, beta: float, n_max: int = 64,
                  algorithms: Sequence[str] = COST_MODELS) -> dict:
    """``{algorithm: [N, ...]}``: at which N (2..n_max) each of ``algorithms`` is the
    :func:`cheapest` (only the algorithms that are, in the order of ``algorithms``). Lesson 06's
    explorer shades and titles its figure with it; :func:`spans` writes a list as ranges.

    Shown in lesson 06, §3."""
    where: dict = {}
    for n in range(2, int(n_max) + 1):
        where.setdefault(cheapest(n, nbytes, alpha, beta, algorithms), []).append(n)
    return {a: where[a] for a in algorithms if a in where}


def spans(ns: Sequence[int]) -> str:
    """Sorted integers as ranges: ``[2, 3, 5, 6, 7, 8]`` -> ``"2–3, 5–8"``; one alone: ``"4"``."""
    out, run = [], []
    for n in sorted(int(v) for v in ns):
        if run and n == run[-1] + 1:
            run.append(n)
            continue
        if run:
            out.append(str(run[0]) if len(run) == 1 else f"{run[0]}–{run[-1]}")
        run = [n]
    if run:
        out.append(str(run[0]) if len(run) == 1 else f"{run[0]}–{run[-1]}")
    return ", ".join(out)


@dataclass(frozen=True)
class RingUpTo:
    """What :func:`ring_cheapest_up_to` found. ``n``: the largest N of the searched range such
    that the ring is the cheapest at every N from 2 up to it; None if it is not the cheapest at
    N = 2. ``censored``: True when the ring was still the cheapest at ``n_max``, the last N
    searched, so ``n`` is the search's cap, not where the ring stops (it stops later, if
    anywhere). ``str()`` says so: ``"128 or more (the search stopped at 128)"``."""

    n: int | None
    censored: bool
    n_max: int

    def __str__(self) -> str:
        if self.n is None:
            return "nowhere (not even at N = 2)"
        if self.censored:
            return f"{self.n} or more (the search stopped at {self.n_max})"
        return str(self.n)


def ring_cheapest_up_to(nbytes: float, alpha: float, beta: float, n_max: int = 64,
                        algorithms: Sequence[str] = COST_MODELS) -> RingUpTo:
    """Up to which N the ring is the :func:`cheapest` of ``algorithms``, searched over
    N = 2..n_max: a :class:`RingUpTo` whose ``n`` is the largest N such that the ring is the
    cheapest for every N from 2 up to it (None if not at N = 2) and whose ``censored`` says
    that the ring was still the cheapest at ``n_max``, so the true answer is n_max or more.
    Among the first four (:data:`ALGORITHMS`) the ring's latency term 2(N-1)·alpha grows faster
    than the tree's 2·ceil(log2 N)·alpha, so the ring wins at small N, if anywhere: this is
    where it stops. With Rabenseifner's in (the default), it stops at N = 3 at the latest
    (alpha > 0): at N = 4 Rabenseifner's sends the ring's bytes in 4 steps instead of 6.

    Shown in lesson 06, §3."""
    n_max = int(n_max)
    if n_max < 2:
        raise ValueError(f"n_max must be at least 2, got {n_max}")
    upto = None
    for n in range(2, n_max + 1):
        if cheapest(n, nbytes, alpha, beta, algorithms) != "ring":
            return RingUpTo(upto, False, n_max)
        upto = n
    return RingUpTo(upto, True, n_max)


@dataclass
class AlphaBetaFit:
    """alpha (s per ring step) and beta (s per byte) fitted to measured ring all-reduce times.

    ``cores``: None for the plain model; a number C for the model with a *contention* term —
    with more ranks than cores, ranks take turns on them, so every term is slowed by
    max(1, N / C) (see :func:`fit_alpha_beta`). :meth:`predict` applies that term at any N,
    also one the fit never measured.

    Shown in lesson 06, §3."""

    alpha: float
    beta: float
    world_sizes: np.ndarray
    nbytes: np.ndarray
    seconds: np.ndarray
    cores: float | None = None

    @property
    def bandwidth(self) -> float:
        """1/beta in bytes per second."""
        return 1.0 / self.beta if self.beta > 0 else math.inf

    def slowdown(self, world_size) -> np.ndarray:
        """max(1, N / cores): how much sharing the cores stretches every term (1 without)."""
        n = np.asarray(world_size, dtype=float)
        return np.ones_like(n) if self.cores is None else np.maximum(1.0, n / self.cores)

    def predict(self, world_size, nbytes) -> np.ndarray:
        n = np.asarray(world_size, dtype=float)
        k = np.asarray(nbytes, dtype=float)
        return self.slowdown(n) * (2 * (n - 1) * self.alpha + 2 * (n - 1) / n * k * self.beta)

    @property
    def relative_errors(self) -> np.ndarray:
        pred = self.predict(self.world_sizes, self.nbytes)
        return np.abs(pred - self.seconds) / self.seconds


def fit_alpha_beta(world_sizes, nbytes, seconds, cores: float | None = None) -> AlphaBetaFit:
    """Least-squares fit of t = s(N) [2(N-1) alpha + 2(N-1)/N K beta] to measurements, where
    s(N) = 1 (``cores=None``: the plain ring model) or max(1, N / ``cores``) (the contention
    term: N ranks on fewer cores run at cores/N speed, latency and copies alike).

    Each row is weighted by 1/t, so a 1 KiB point (microseconds) counts as much as a 64 MiB
    one (tenths of a second): we minimise relative, not absolute, error. Raises ValueError if
    the data cannot give positive alpha and beta (too few sizes, or all sizes alike).

    Shown in lesson 06, §3.
    """
    n = np.asarray(world_sizes, dtype=float).ravel()
    k = np.asarray(nbytes, dtype=float).ravel()
    t = np.asarray(seconds, dtype=float).ravel()
    if not (len(n) == len(k) == len(t)) or len(t) < 2:
        raise ValueError("fit_alpha_beta needs at least two (world_size, nbytes, seconds) rows "
                         "of equal length")
    if np.any(n < 2) or np.any(t <= 0) or np.any(k < 0):
        raise ValueError("world sizes must be >= 2, times positive and sizes non-negative")
    if cores is not None and not cores > 0:
        raise ValueError(f"cores must be a positive number (or None), got {cores!r}")
    slow = np.ones_like(n) if cores is None else np.maximum(1.0, n / cores)
    a = np.stack([2 * (n - 1), 2 * (n - 1) / n * k], axis=1) * slow[:, None] / t[:, None]
    coef, *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
    alpha, beta = float(coef[0]), float(coef[1])
    if alpha <= 0 or beta <= 0:
        raise ValueError(f"the fit gave alpha={alpha:.3g}, beta={beta:.3g}: measure more sizes, "
                         f"from about 1 KiB (latency) to several MiB (bandwidth)")
    return AlphaBetaFit(alpha, beta, n, k, t, cores)


def fit_alpha_beta_per_n(world_sizes, nbytes, seconds) -> dict:
    """One plain :func:`fit_alpha_beta` per world size: ``{N: AlphaBetaFit}``. On the measured N
    its sum of squared relative errors is the lowest (both fits of :func:`fit_alpha_beta`, with
    and without ``cores``, are special cases of it), but it predicts nothing for an N it has not
    seen.

    Shown in lesson 06, §3."""
    n = np.asarray(world_sizes, dtype=float).ravel()
    k = np.asarray(nbytes, dtype=float).ravel()
    t = np.asarray(seconds, dtype=float).ravel()
    return {int(w): fit_alpha_beta(n[n == w], k[n == w], t[n == w]) for w in sorted(set(n))}


# --------------------------------------------------------------------------------------------
# A ring of blocking sends and receives: transfer times, by call order
# --------------------------------------------------------------------------------------------


def blocking_ring_time(sends_first: Sequence[bool]) -> int:
    """Transfer times of a blocking ring all-reduce (2(N-1) steps, N = ``len(sends_first)``),
    rank r calling send before receive if ``sends_first[r]``: each transfer takes one unit and
    starts once its sender and its receiver have both reached it (gloo sends only into a posted
    receive).

    Shown in lesson 06, §4 (folded: open after lab 06 passes)."""
    from functools import cache

    n = len(sends_first)

    @cache
    def done(r, t):   # when rank r's step-t send (rank r+1's step-t receive) completes
        if t < 0:
            return 0
        right = (r + 1) % n
        sender_ready = done((r - 1) % n, t - 1 if sends_first[r] else t)   # after its receive
        receiver_ready = done(right, t) if sends_first[right] else done(right, t - 1)
        return 1 + max(sender_ready, receiver_ready)
    return max(done(r, 2 * (n - 1) - 1) for r in range(n))


def blocking_ring_orders(world_sizes: Sequence[int]) -> dict:
    """For two call orders, ``{order: (per_step, derived)}``: transfer times per step from
    :func:`blocking_ring_time` at each N, and what lesson 06's folded text derives for them.

    Shown in lesson 06, §4 (folded: open after lab 06 passes)."""
    orders = {
        "even ranks send first, odd ranks receive first":
            (lambda n: [r % 2 == 0 for r in range(n)],
             lambda n: 2 if n % 2 == 0 else 2 * n / (n - 1)),
        "only rank 0 receives first (a chain)":
            (lambda n: [r != 0 for r in range(n)], lambda n: n),
    }
    return {name: ({n: blocking_ring_time(order(n)) / (2 * (n - 1)) for n in world_sizes},
                   {n: derived(n) for n in world_sizes})
            for name, (order, derived) in orders.items()}
