"""Ring AllReduce: a step-by-step NumPy simulator, the alpha-beta cost models, and a real ring.

Lesson 06 (``lessons/06_ring_allreduce.py``) and lab 06 use everything here; the benchmark
``python -m dpcourse.bench allreduce`` times :func:`ring_allreduce` against ``dist.all_reduce``.

Three parts, from paper to wire:

* **Simulator** (:func:`simulate_ring`): N workers, each with a 1-D array of the same length L
  (any L, also not divisible by N, also L < N). Each array is cut into N chunks with NumPy's
  ``array_split`` rule (:func:`chunk_bounds`: the first ``L % N`` chunks are one element
  longer). Steps are numbered t = 1 .. 2(N-1) through both phases (t = 0 is the start), as in
  lesson 06 and its figures: at step t worker i sends chunk (i + 1 - t) mod N to worker i+1.
  In the N-1 *scatter-reduce* steps the receiver adds it into its own copy, after which worker
  i holds the full sum of chunk (i + 1) mod N; in the N-1 *all-gather* steps it overwrites its
  copy. The returned :class:`RingTrace` records every
  transfer and every worker's buffer after every step, so the lesson can print, draw and
  assert on it (bytes sent per worker = 2(N-1)L/N elements, rounded for uneven chunks).
  :func:`pipeline_schedule` lays those transfers on a time axis with each chunk sent as
  segments (a model: a chunk's transfer and addition times, one piece per link at a time), for
  lesson 06's timeline of the pipelined ring.

* **Cost models** (:func:`cost`, :data:`ALGORITHMS`, :data:`COST_MODELS`): naive (gather to
  one worker and send back one by one), parameter server, ring, a binomial tree and
  Rabenseifner's (reduce-scatter by recursive halving, all-gather by recursive doubling), under
  the alpha-beta model: a step of the critical path that moves b bytes over a link takes
  ``alpha + b * beta``. alpha is a cost per *step*: in these textbook algorithms one message per
  step, while gloo's ring sends each step's chunk as at least two pipelined segments (see
  :func:`cost`), so an alpha fitted to gloo is its cost per ring step. :func:`fit_alpha_beta`
  fits alpha and beta to measured all-reduce times.

* **The real ring** (:func:`ring_allreduce`): the same two phases over ``torch.distributed``
  point-to-point ``isend``/``irecv`` on the current process group (gloo on CPU, nccl on GPU),
  any world size, any shape and length, in place, ``op="sum"`` or ``"average"``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

__all__ = [
    "chunk_bounds",
    "cheapest",
    "cheapest_by_n",
    "spans",
    "RingUpTo",
    "ring_cheapest_up_to",
    "Transfer",
    "RingStep",
    "RingTrace",
    "simulate_ring",
    "ring_bytes_per_worker",
    "simulate_rabenseifner",
    "Slot",
    "pipeline_schedule",
    "ALGORITHMS",
    "COST_MODELS",
    "Cost",
    "cost",
    "AlphaBetaFit",
    "fit_alpha_beta",
    "fit_alpha_beta_per_n",
    "ring_allreduce",
]


# --------------------------------------------------------------------------------------------
# The simulator
# --------------------------------------------------------------------------------------------


def chunk_bounds(length: int, n: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of each of ``n`` chunks of ``length`` elements, ``array_split``'s rule
    (``torch.tensor_split`` uses the same): the first ``length % n`` chunks are one longer.

    Shown in lesson 06, §"Lab 06: the ring, simulated then real".
    """
    if not isinstance(length, (int, np.integer)) or length < 0:
        raise ValueError(f"length must be a non-negative int, got {length!r}")
    if not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"n must be a positive number of chunks, got {n!r}")
    base, extra = divmod(int(length), int(n))
    bounds, start = [], 0
    for c in range(n):
        stop = start + base + (1 if c < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


@dataclass(frozen=True)
class Transfer:
    """One message of one step: ``src`` sends chunk ``chunk`` (``elements`` long) to ``dst``."""

    src: int
    dst: int
    chunk: int
    elements: int


@dataclass
class RingStep:
    """One step of the ring: its phase, its transfers, and every buffer *after* it.

    ``contributions[w][c]`` is how many workers' inputs are summed in worker w's chunk c now
    (1 = only its own, N = complete) — what the figures colour.
    """

    index: int  # 0 = the initial state, then 1 .. 2(N-1)
    phase: str  # "start", "scatter-reduce" or "all-gather"
    transfers: list[Transfer]
    buffers: list[np.ndarray]
    contributions: np.ndarray


@dataclass
class RingTrace:
    """Everything :func:`simulate_ring` did. ``steps[0]`` is the initial state."""

    n: int
    length: int
    bounds: list[tuple[int, int]]
    itemsize: int
    steps: list[RingStep] = field(default_factory=list)

    @property
    def result(self) -> list[np.ndarray]:
        """Every worker's buffer at the end."""
        return self.steps[-1].buffers

    def elements_sent(self) -> list[int]:
        """Elements each worker sent over the whole run."""
        sent = [0] * self.n
        for step in self.steps:
            for t in step.transfers:
                sent[t.src] += t.elements
        return sent

    def bytes_sent(self) -> list[int]:
        return [e * self.itemsize for e in self.elements_sent()]

    def describe(self, step: int) -> str:
        """One line per transfer of ``step``, e.g. ``w0 -> w1: chunk 0 (3 elements)``."""
        s = self.steps[step]
        if not s.transfers:
            return f"step {step}: start (every worker holds only its own array)"
        moves = "; ".join(f"w{t.src}->w{t.dst}: chunk {t.chunk}" for t in s.transfers)
        return f"step {step} ({s.phase}): {moves}"


def simulate_ring(arrays: Sequence[np.ndarray]) -> RingTrace:
    """Run ring all-reduce (sum) over ``arrays``, one per worker, and record every step.

    The inputs are not modified. All workers send at once in a step; each worker's message is
    taken from its buffer *before* the step (in a ring a worker never sends the chunk it is
    receiving in the same step, so the order would not matter anyway — the trace checks it).

    Shown in lesson 06, §1.
    """
    if isinstance(arrays, np.ndarray) and arrays.ndim == 2:
        arrays = list(arrays)
    if not isinstance(arrays, (list, tuple)) or len(arrays) < 1:
        raise ValueError("simulate_ring needs a list with one 1-D array per worker")
    buffers = [np.array(a, copy=True) for a in arrays]
    if any(b.ndim != 1 for b in buffers):
        raise ValueError("every worker's array must be 1-D (flatten it first)")
    length = buffers[0].shape[0]
    if any(b.shape[0] != length for b in buffers):
        raise ValueError(f"all arrays must have the same length, got "
                         f"{[b.shape[0] for b in buffers]}")
    n = len(buffers)
    bounds = chunk_bounds(length, n)
    trace = RingTrace(n, length, bounds, buffers[0].itemsize)
    contrib = np.ones((n, n), dtype=int)  # contrib[w, c]
    trace.steps.append(RingStep(0, "start", [], [b.copy() for b in buffers], contrib.copy()))

    def run_phase(phase: str, first_chunk_offset: int, reduce: bool) -> None:
        for s in range(n - 1):
            transfers = []
            for i in range(n):
                c = (i + first_chunk_offset - s) % n
                start, stop = bounds[c]
                transfers.append(Transfer(i, (i + 1) % n, c, stop - start))
            # Snapshot what is sent before anyone receives: the step is simultaneous.
            payload = [buffers[t.src][slice(*bounds[t.chunk])].copy() for t in transfers]
            sent_contrib = [contrib[t.src, t.chunk] for t in transfers]
            for t, data, k in zip(transfers, payload, sent_contrib):
                view = buffers[t.dst][slice(*bounds[t.chunk])]
                if reduce:
                    view += data
                    contrib[t.dst, t.chunk] += k
                else:
                    view[...] = data
                    contrib[t.dst, t.chunk] = k
            trace.steps.append(RingStep(len(trace.steps), phase, transfers,
                                        [b.copy() for b in buffers], contrib.copy()))

    run_phase("scatter-reduce", 0, reduce=True)
    run_phase("all-gather", 1, reduce=False)
    return trace


def ring_bytes_per_worker(length: int, n: int, itemsize: int = 4) -> list[int]:
    """Bytes each worker sends in a ring all-reduce of ``length`` elements (exact, uneven
    chunks included). For ``length`` divisible by ``n`` every entry is 2(n-1)length/n*itemsize.

    Worker i sends chunks (i - s) for s = 0..n-2 in the scatter-reduce and chunks (i + 1 - s)
    in the all-gather: every chunk but (i + 1) once, then every chunk but (i + 2) once.

    Shown in lesson 06, §2; lesson 09, §1."""
    bounds = chunk_bounds(length, n)
    sizes = [b - a for a, b in bounds]
    total = sum(sizes)
    if n == 1:
        return [0]
    return [(2 * total - sizes[(i + 1) % n] - sizes[(i + 2) % n]) * itemsize for i in range(n)]


def simulate_rabenseifner(arrays: Sequence[np.ndarray]) -> tuple[list[np.ndarray], list[int]]:
    """Rabenseifner's all-reduce run on real arrays: ``(results, sent)``, every worker's result
    and the bytes each worker sent (one direction of its link, over the whole all-reduce).

    With p the largest power of two <= N, the N - p workers above p first hand their whole
    array to worker r - p. The first p then run a reduce-scatter by *recursive halving*
    (partners p/2, p/4, ..., 1 apart: each keeps one half of the part it still reduces, sends
    the other half to its partner and adds the partner's half of its own) and an all-gather by
    *recursive doubling* (partners 1, 2, ..., p/2 apart: each sends the part it holds complete
    and takes its partner's). Last, the extra workers get the result back. Exchanges within a
    round use the buffers as they were at the round's start, as simultaneous messages would.

    Shown in lesson 06, §2."""
    n = len(arrays)
    if n < 1 or len({np.shape(a) for a in arrays}) != 1 or np.ndim(arrays[0]) != 1:
        raise ValueError("arrays must be one or more 1-D arrays of the same length")
    p = 1 << (n.bit_length() - 1)  # the largest power of two <= n
    buf = [np.array(a, copy=True) for a in arrays]
    sent = [0] * n
    for r in range(p, n):  # fold the extra workers in
        buf[r - p] += buf[r]
        sent[r] += buf[r].nbytes
    lo, hi = [0] * p, [len(buf[0])] * p  # the part [lo, hi) each worker still reduces
    d = p // 2
    while d:  # recursive halving: give one half away, add the partner's copy of the other
        mids = [(lo[i] + hi[i]) // 2 for i in range(p)]
        keep = [(lo[i], mids[i]) if i & d == 0 else (mids[i], hi[i]) for i in range(p)]
        give = [buf[i][mids[i]:hi[i]] if i & d == 0 else buf[i][lo[i]:mids[i]]
                for i in range(p)]
        give = [g.copy() for g in give]  # what is on the wire, taken before anyone adds
        for i in range(p):
            (a, b), partner = keep[i], i ^ d
            buf[i][a:b] += give[partner]
            sent[i] += give[i].nbytes
            lo[i], hi[i] = a, b
        d //= 2
    d = 1
    while d < p:  # recursive doubling: swap the complete parts, each part doubling
        parts = [(lo[i], hi[i], buf[i][lo[i]:hi[i]].copy()) for i in range(p)]
        for i in range(p):
            a, b, data = parts[i ^ d]
            buf[i][a:b] = data
            sent[i] += parts[i][2].nbytes
            lo[i], hi[i] = min(lo[i], a), max(hi[i], b)
        d *= 2
    for r in range(p, n):  # hand the result back to the extra workers
        buf[r][:] = buf[r - p]
        sent[r - p] += buf[r].nbytes
    return buf, sent


@dataclass(frozen=True)
class Slot:
    """One interval of :func:`pipeline_schedule`: ``rank`` sends piece ``segment`` of chunk
    ``chunk`` to rank + 1 at ``step`` (``kind="send"``), or adds that piece into its own copy
    once it has arrived (``kind="add"``, scatter-reduce only), from ``start`` to ``end``."""

    rank: int
    kind: str
    step: int
    chunk: int
    segment: int
    start: float
    end: float


def pipeline_schedule(n: int, segments: int, transfer: float = 1.0,
                      add: float = 0.5) -> list[Slot]:
    """When each piece of each chunk is on each link, and when it is added, in a ring
    all-reduce whose chunks travel as ``segments`` pieces (lesson 06's timeline figure).

    The chunk each rank sends at each step is :func:`simulate_ring`'s (the same transfers the
    lesson's trace prints). The timing is a model, not a measurement: a whole chunk takes
    ``transfer`` on a link and ``add`` to add, so a piece takes ``transfer / segments`` and
    ``add / segments``; each link (rank -> rank + 1) carries one piece at a time, in the order
    (step, piece); each rank adds one piece at a time, in that order, while its links go on
    sending; and a rank sends piece j of step t + 1 (the chunk it received at step t) once
    piece j of step t has arrived and, in the scatter-reduce, been added. With ``segments=1``
    that is the unpipelined ring: a step's transfer, then its addition, then the next step.
    No per-message latency (α) is charged, so in this model more pieces are never slower; on a
    real link each piece pays α, which is what bounds the segment count.

    Shown in lesson 06, §"Lab 06: the ring, simulated then real"."""
    if not isinstance(n, (int, np.integer)) or n < 2:
        raise ValueError(f"n must be at least 2 ranks, got {n!r}")
    if not isinstance(segments, (int, np.integer)) or segments < 1:
        raise ValueError(f"segments must be a positive int, got {segments!r}")
    if transfer <= 0 or add < 0:
        raise ValueError(f"transfer must be > 0 and add >= 0, got {transfer!r} and {add!r}")
    trace = simulate_ring([np.zeros(n) for _ in range(n)])  # chunk c is element c
    piece, piece_add = transfer / segments, add / segments
    link_free = [0.0] * n  # when rank i's link to rank i + 1 is next free
    adder_free = [0.0] * n  # when rank i can start its next addition
    ready = [[0.0] * segments for _ in range(n)]  # ready[i][j]: piece j of i's next send
    slots: list[Slot] = []
    for step in trace.steps[1:]:
        reduce = step.phase == "scatter-reduce"
        arrived = [[0.0] * segments for _ in range(n)]
        for j in range(segments):
            for tr in step.transfers:
                start = max(ready[tr.src][j], link_free[tr.src])
                end = link_free[tr.src] = start + piece
                slots.append(Slot(tr.src, "send", step.index, tr.chunk, j, start, end))
                if reduce:
                    a0 = max(end, adder_free[tr.dst])
                    a1 = adder_free[tr.dst] = a0 + piece_add
                    slots.append(Slot(tr.dst, "add", step.index, tr.chunk, j, a0, a1))
                    arrived[tr.dst][j] = a1
                else:
                    arrived[tr.dst][j] = end
        ready = arrived
    return slots


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
    "ring": "scatter-reduce then all-gather around a ring, 2(N-1) steps of K/N bytes",
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
    it). gloo's ring (``gloo/allreduce.cc``, ``ring``) cuts each chunk into at least two
    segments of at most 1 MiB, pipelined, so a ring step there is two or more messages, and
    an alpha fitted to it is a cost per step.

    * naive: 2(N-1) messages of K, one after another, all through worker 0: 2(N-1)(a + Kb).
    * parameter-server: one push round and one pull round, but N*K bytes through the server's
      link each way: 2a + 2NKb (the server's link carries NK in and NK out; we count the
      critical path, in then out).
    * ring: 2(N-1) steps of K/N bytes: 2(N-1)a + 2(N-1)/N K b. Each link carries 2(N-1)K/N
      each way, which grows with N (K at N = 2, 1.75K at N = 8) but stays under 2K, a bound
      independent of N — the reason rings scale.
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
    if algorithm == "naive":
        steps, busiest = 2 * (n - 1), 2 * (n - 1) * nbytes
    elif algorithm == "parameter-server":
        steps, busiest = 2, 2 * n * nbytes
    elif algorithm == "ring":
        steps, busiest = 2 * (n - 1), 2 * (n - 1) * nbytes / n
    elif algorithm == "rabenseifner":
        p = 1 << (int(n).bit_length() - 1)  # the largest power of two <= n
        steps, busiest = 2 * (p.bit_length() - 1), 2 * (p - 1) * nbytes / p
        if p != n:  # the extra ranks fold into partners first and get the result last
            steps, busiest = steps + 2, busiest + 2 * nbytes
    else:
        rounds = math.ceil(math.log2(n))
        steps, busiest = 2 * rounds, 2 * rounds * nbytes
    return Cost(algorithm, int(n), nbytes, steps, busiest, steps * alpha + busiest * beta)


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
    max(1, N / C) (see :func:`fit_alpha_beta`)."""

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
    """One plain :func:`fit_alpha_beta` per world size: ``{N: AlphaBetaFit}``. It describes the
    measured N best, but predicts nothing for an N it has not seen."""
    n = np.asarray(world_sizes, dtype=float).ravel()
    k = np.asarray(nbytes, dtype=float).ravel()
    t = np.asarray(seconds, dtype=float).ravel()
    return {int(w): fit_alpha_beta(n[n == w], k[n == w], t[n == w]) for w in sorted(set(n))}


# --------------------------------------------------------------------------------------------
# The real ring over torch.distributed
# --------------------------------------------------------------------------------------------


# Receive buffers per (dtype, device), kept between calls and grown when needed. Measured
# (2 ranks, 64 MiB, gloo on CPU): a fresh 32 MiB torch.empty per call made the scatter-reduce
# 185 ms instead of 110 ms — the OS maps new pages on first touch, every call, because the CPU
# allocator returns big blocks to the OS. Costs two chunks (2K/N) of memory, kept until exit.
_RECV_BUFFERS: dict = {}


def _receive_buffer(numel: int, dtype, device):
    import torch

    key = (dtype, str(device))
    buf = _RECV_BUFFERS.get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=dtype, device=device)
        _RECV_BUFFERS[key] = buf
    return buf[:numel]


def ring_allreduce(tensor, op: str = "sum", group=None, segment_bytes: int = 4 << 20):
    """All-reduce ``tensor`` in place with a hand-written, pipelined ring; returns ``tensor``.

    Same contract as ``dist.all_reduce(tensor)`` (``op="sum"``) or averaging (``op="average"``,
    floating-point tensors only): call it on every rank of the group with tensors of the same
    shape and dtype. Works for any world size and any number of elements (chunks may be
    uneven or even empty). Uses only ``isend``/``irecv``, which return at once, so no rank ever
    blocks in a send whose receive its neighbour has not posted — the deadlock of blocking
    sends facing each other: every send and receive is posted without blocking, and the
    waits come after, in the order the messages travel.

    The 2(N-1) steps t = 1 .. 2(N-1) are those of :func:`simulate_ring` (scatter-reduce, then
    all-gather), and the chunk a rank sends at step t+1 is always the chunk it received at step
    t. So each chunk
    travels as segments of about ``segment_bytes`` — ``ceil(longest chunk's bytes /
    segment_bytes)`` of them, so a chunk of at most ``segment_bytes`` (4 MiB by default) travels
    whole, as one segment, and nothing overlaps — and a segment moves on as soon as it is
    ready: received, added (scatter-reduce) — and forwarded to the right at once, while the
    next segments are still arriving. Adding segment j overlaps with receiving segment j+1, and
    the next step starts before this one has ended (gloo's and NCCL's rings pipeline the same
    way). Scatter-reduce segments arrive in two temporary buffers used in turn, step by step
    (double buffering: the receives of step t+1 are posted while step t is still being
    added); all-gather segments arrive straight in place.

    Shown in lesson 06, §"Lab 06: the ring, simulated then real".
    """
    import torch
    import torch.distributed as dist

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"ring_allreduce needs a torch.Tensor, got {type(tensor).__name__}")
    if op not in ("sum", "average"):
        raise ValueError(f"op must be 'sum' or 'average', got {op!r}")
    if op == "average" and not (tensor.is_floating_point() or tensor.is_complex()):
        raise TypeError(f"op='average' needs a floating-point tensor, got {tensor.dtype}")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ring_allreduce needs a process group: call "
                           "dist.init_process_group first (or run under dpcourse.launch.spawn "
                           "with backend='gloo')")
    n = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if n == 1:
        return tensor

    def peer(r: int) -> int:  # group rank -> global rank, which isend/irecv want
        return r if group is None else dist.get_global_rank(group, r)

    right, left = peer((rank + 1) % n), peer((rank - 1) % n)
    # Work on a flat contiguous view; a non-contiguous tensor gets a copy, written back at the end.
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
    chunks = [flat[a:b] for a, b in chunk_bounds(flat.numel(), n)]
    longest = max(c.numel() for c in chunks)
    n_seg = max(1, -(-longest * flat.element_size() // max(1, int(segment_bytes))))
    # Every rank cuts chunk c the same way (same length, same n_seg), and gloo matches the
    # messages between two ranks in the order they were posted: sends and receives below are
    # posted in (step, segment) order on both sides.
    segs = [[chunk[a:b] for a, b in chunk_bounds(chunk.numel(), n_seg)] for chunk in chunks]
    spare = _receive_buffer(2 * longest, flat.dtype, flat.device)
    temp = [[spare[k * longest:][a:b] for a, b in chunk_bounds(longest, n_seg)]
            for k in (0, 1)]
    steps = 2 * (n - 1)
    # Steps t = 1 .. 2(N-1), numbered as in lesson 06 and the simulator's trace: at step t this
    # rank sends chunk (rank + 1 - t) and receives chunk (rank - t), mod N, in both phases;
    # steps 1 .. N-1 add what arrives (scatter-reduce), the others overwrite (all-gather). So
    # the chunk received at step t is the chunk sent at step t + 1.
    def reducing(t: int) -> bool:
        return t <= n - 1

    sends_from: dict = {}   # (chunk, segment) -> the send works reading it

    def post_recv(t: int, j: int):
        c = (rank - t) % n
        target = segs[c][j]
        if not target.numel():
            return None
        if reducing(t):
            into = temp[t % 2][j][:target.numel()]
        else:
            into = target
            for earlier in sends_from.pop((c, j), ()):   # they read this segment: finish them
                earlier.wait()
        return dist.irecv(into, left, group=group), into

    def post_send(c: int, j: int):
        if segs[c][j].numel():
            sends_from.setdefault((c, j), []).append(dist.isend(segs[c][j], right, group=group))

    pending = [post_recv(1, j) for j in range(n_seg)]
    for j in range(n_seg):
        post_send(rank, j)                        # step 1: this rank's own chunk
    for t in range(1, steps + 1):
        following = []
        for j in range(n_seg):
            got = pending[j]
            c = (rank - t) % n
            if got is not None:
                work, into = got
                work.wait()
                if reducing(t):
                    segs[c][j].add_(into)
                if t < steps:
                    post_send(c, j)                # forward it at once: step t + 1's send
            if t < steps:
                following.append(post_recv(t + 1, j))
        pending = following
    for works in sends_from.values():
        for work in works:
            work.wait()
    if op == "average":
        flat.div_(n)
    if not tensor.is_contiguous():
        tensor.copy_(flat.view(tensor.shape))
    return tensor
