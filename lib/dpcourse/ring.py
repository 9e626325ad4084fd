"""Ring AllReduce: a step-by-step NumPy simulator, the alpha-beta cost models, and a real ring.

Lesson 06 (``lessons/06_ring_allreduce.py``) and lab 06 use everything here; the benchmark
``python -m dpcourse.bench allreduce`` times :func:`ring_allreduce` against ``dist.all_reduce``.

Three parts, from paper to wire:

* **Simulator** (:func:`simulate_ring`): N workers, each with a 1-D array of the same length L
  (any L, also not divisible by N, also L < N). Each array is cut into N chunks with NumPy's
  ``array_split`` rule (:func:`chunk_bounds`: the first ``L % N`` chunks are one element
  longer). Then N-1 *scatter-reduce* steps — at step s worker i sends chunk (i - s) mod N to
  worker i+1, which adds it into its own copy — after which worker i holds the full sum of chunk
  (i + 1) mod N; and N-1 *all-gather* steps — at step s worker i sends chunk (i + 1 - s) mod N
  to worker i+1, which overwrites its copy. The returned :class:`RingTrace` records every
  transfer and every worker's buffer after every step, so the lesson can print, draw and
  assert on it (bytes sent per worker = 2(N-1)L/N elements, rounded for uneven chunks).

* **Cost models** (:func:`cost`, :data:`ALGORITHMS`): naive (gather to one worker and send back
  one by one), parameter server, ring and a binomial tree, under the alpha-beta model: a
  message of b bytes takes ``alpha + b * beta``. :func:`fit_alpha_beta` fits alpha and beta to
  measured all-reduce times.

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
    "Transfer",
    "RingStep",
    "RingTrace",
    "simulate_ring",
    "ring_bytes_per_worker",
    "ALGORITHMS",
    "Cost",
    "cost",
    "AlphaBetaFit",
    "fit_alpha_beta",
    "ring_allreduce",
]


# --------------------------------------------------------------------------------------------
# The simulator
# --------------------------------------------------------------------------------------------


def chunk_bounds(length: int, n: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of each of ``n`` chunks of ``length`` elements, ``array_split``'s rule
    (``torch.tensor_split`` uses the same): the first ``length % n`` chunks are one longer."""
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
    in the all-gather: every chunk but (i + 1) once, then every chunk but (i + 2) once."""
    bounds = chunk_bounds(length, n)
    sizes = [b - a for a, b in bounds]
    total = sum(sizes)
    if n == 1:
        return [0]
    return [(2 * total - sizes[(i + 1) % n] - sizes[(i + 2) % n]) * itemsize for i in range(n)]


# --------------------------------------------------------------------------------------------
# Cost models under alpha-beta
# --------------------------------------------------------------------------------------------

ALGORITHMS = ("naive", "parameter-server", "ring", "tree")

_EXPLAIN = {
    "naive": "every worker sends its whole array to worker 0, which sums and sends the result "
             "back to each worker, one message at a time",
    "parameter-server": "a separate server: all N workers push K bytes at once, then pull the "
                        "K-byte result, all through the server's one link",
    "ring": "scatter-reduce then all-gather around a ring, 2(N-1) steps of K/N bytes",
    "tree": "binomial-tree reduce then broadcast, ceil(log2 N) rounds each of K bytes",
}


@dataclass(frozen=True)
class Cost:
    """What one all-reduce of ``nbytes`` over ``n`` workers costs with ``algorithm``.

    ``steps`` are latency terms (alpha each) on the critical path; ``busiest_bytes`` the bytes
    through the busiest link (one direction); ``seconds`` = steps*alpha + busiest_bytes*beta.
    """

    algorithm: str
    n: int
    nbytes: float
    steps: int
    busiest_bytes: float
    seconds: float


def cost(algorithm: str, n: int, nbytes: float, alpha: float, beta: float) -> Cost:
    """The alpha-beta cost of one all-reduce (alpha: seconds per message, beta: seconds/byte).

    * naive: 2(N-1) messages of K, one after another, all through worker 0: 2(N-1)(a + Kb).
    * parameter-server: one push round and one pull round, but N*K bytes through the server's
      link each way: 2a + 2NKb (the server's link carries NK in and NK out; we count the
      critical path, in then out).
    * ring: 2(N-1) steps of K/N bytes: 2(N-1)a + 2(N-1)/N K b. The busiest link carries
      2(N-1)K/N < 2K, *independent of N* — the reason rings scale.
    * tree: ceil(log2 N) rounds of reduce and as many of broadcast, each of K bytes:
      2 ceil(log2 N)(a + Kb). Few latency terms, but every round moves all K.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}: choose one of {', '.join(ALGORITHMS)}")
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
    else:
        rounds = math.ceil(math.log2(n))
        steps, busiest = 2 * rounds, 2 * rounds * nbytes
    return Cost(algorithm, int(n), nbytes, steps, busiest, steps * alpha + busiest * beta)


@dataclass
class AlphaBetaFit:
    """alpha (s per message) and beta (s per byte) fitted to measured ring all-reduce times."""

    alpha: float
    beta: float
    world_sizes: np.ndarray
    nbytes: np.ndarray
    seconds: np.ndarray

    @property
    def bandwidth(self) -> float:
        """1/beta in bytes per second."""
        return 1.0 / self.beta if self.beta > 0 else math.inf

    def predict(self, world_size, nbytes) -> np.ndarray:
        n = np.asarray(world_size, dtype=float)
        k = np.asarray(nbytes, dtype=float)
        return 2 * (n - 1) * self.alpha + 2 * (n - 1) / n * k * self.beta

    @property
    def relative_errors(self) -> np.ndarray:
        pred = self.predict(self.world_sizes, self.nbytes)
        return np.abs(pred - self.seconds) / self.seconds


def fit_alpha_beta(world_sizes, nbytes, seconds) -> AlphaBetaFit:
    """Least-squares fit of t = 2(N-1) alpha + 2(N-1)/N K beta to measurements.

    Each row is weighted by 1/t, so a 1 KiB point (microseconds) counts as much as a 64 MiB
    one (tenths of a second): we minimise relative, not absolute, error. Raises ValueError if
    the data cannot give positive alpha and beta (too few sizes, or all sizes alike).
    """
    n = np.asarray(world_sizes, dtype=float).ravel()
    k = np.asarray(nbytes, dtype=float).ravel()
    t = np.asarray(seconds, dtype=float).ravel()
    if not (len(n) == len(k) == len(t)) or len(t) < 2:
        raise ValueError("fit_alpha_beta needs at least two (world_size, nbytes, seconds) rows "
                         "of equal length")
    if np.any(n < 2) or np.any(t <= 0) or np.any(k < 0):
        raise ValueError("world sizes must be >= 2, times positive and sizes non-negative")
    a = np.stack([2 * (n - 1), 2 * (n - 1) / n * k], axis=1) / t[:, None]
    coef, *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
    alpha, beta = float(coef[0]), float(coef[1])
    if alpha <= 0 or beta <= 0:
        raise ValueError(f"the fit gave alpha={alpha:.3g}, beta={beta:.3g}: measure more sizes, "
                         f"from about 1 KiB (latency) to several MiB (bandwidth)")
    return AlphaBetaFit(alpha, beta, n, k, t)


# --------------------------------------------------------------------------------------------
# The real ring over torch.distributed
# --------------------------------------------------------------------------------------------


# One receive buffer per (dtype, device), kept between calls and grown when needed. Measured
# (2 ranks, 64 MiB, gloo on CPU): a fresh 32 MiB torch.empty per call made the scatter-reduce
# 185 ms instead of 110 ms — the OS maps new pages on first touch, every call, because the CPU
# allocator returns big blocks to the OS. Costs one chunk (K/N) of memory, kept until exit.
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
    """All-reduce ``tensor`` in place with a hand-written ring; returns ``tensor``.

    Same contract as ``dist.all_reduce(tensor)`` (``op="sum"``) or averaging (``op="average"``,
    floating-point tensors only): call it on every rank of the group with tensors of the same
    shape and dtype. Works for any world size and any number of elements (chunks may be
    uneven or even empty). Uses only ``isend``/``irecv``: at each step a rank posts its send
    to the right and its receive from the left *together*, so no rank ever waits for a send to
    complete before receiving — the deadlock of two blocking sends facing each other.

    ``segment_bytes``: in the scatter-reduce each step's chunk travels as segments of about
    this size, all posted at once, and each segment is added as soon as it has arrived, so
    adding one segment can overlap with receiving the next (gloo's own ring pipelines the same
    way). ``python -m dpcourse.bench allreduce`` measures what this buys on your machine.
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
    incoming = _receive_buffer(max(c.numel() for c in chunks), flat.dtype, flat.device)

    def exchange(send_chunk, recv_into):
        # Both posted before either is waited on. Empty chunks (length < N) are skipped on
        # both sides: sender and receiver compute the same chunk index, so they agree.
        works = []
        if send_chunk.numel():
            works.append(dist.isend(send_chunk, right, group=group))
        if recv_into.numel():
            works.append(dist.irecv(recv_into, left, group=group))
        for w in works:
            w.wait()

    seg = max(1, int(segment_bytes) // flat.element_size())
    # Scatter-reduce: at step s, send chunk (rank - s), receive chunk (rank - s - 1) and add it.
    for s in range(n - 1):
        send_c, recv_c = chunks[(rank - s) % n], chunks[(rank - s - 1) % n]
        # Segments: both sides cut the chunk the same way (same length, same seg), and gloo
        # matches messages between a pair of ranks in the order they were posted.
        sends = [dist.isend(send_c[a:a + seg], right, group=group)
                 for a in range(0, send_c.numel(), seg)]
        m = recv_c.numel()
        recvs = [(a, dist.irecv(incoming[a:min(a + seg, m)], left, group=group))
                 for a in range(0, m, seg)]
        for a, work in recvs:
            work.wait()
            recv_c[a:a + seg].add_(incoming[a:min(a + seg, m)])
        for work in sends:
            work.wait()
    # Now this rank holds the full sum of chunk (rank + 1). All-gather: pass the finished
    # chunks on; at step s send chunk (rank + 1 - s), receive chunk (rank - s) straight into place.
    for s in range(n - 1):
        exchange(chunks[(rank + 1 - s) % n], chunks[(rank - s) % n])
    if op == "average":
        flat.div_(n)
    if not tensor.is_contiguous():
        tensor.copy_(flat.view(tensor.shape))
    return tensor
