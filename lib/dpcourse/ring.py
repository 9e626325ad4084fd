"""Ring AllReduce: a step-by-step NumPy simulator, the alpha-beta cost models, and a real ring.

Lesson 06 (``lessons/06_ring_allreduce.py``) and lab 06 use everything here; the benchmark
``python -m dpcourse.bench allreduce`` times :func:`ring_allreduce` against ``dist.all_reduce``.

Three parts, from paper to wire:

* **Simulator** (:func:`simulate_ring`): N workers, each with a 1-D array of the same length L
  (any L, also not divisible by N, also L < N). Each array is cut into N chunks with NumPy's
  ``array_split`` rule (:func:`chunk_bounds`: the first ``L % N`` chunks are one element
  longer). Steps are numbered t = 1 .. 2(N-1) through both phases (t = 0 is the start), as in
  lesson 06 and its figures: at step t worker i sends chunk (i + 1 - t) mod N to worker i+1.
  In the N-1 *reduce-scatter* steps the receiver adds it into its own copy, after which worker
  i holds the full sum of chunk (i + 1) mod N; in the N-1 *all-gather* steps it overwrites its
  copy. The returned :class:`RingTrace` records every
  transfer and every worker's buffer after every step, so the lesson can print, draw and
  assert on it (bytes sent per worker = 2(N-1)L/N elements, rounded for uneven chunks).
  :func:`pipeline_schedule` lays those transfers on a time axis with each chunk sent as
  segments (a model: a chunk's transfer and addition times, one segment per link at a time), for
  lesson 06's timeline of the pipelined ring.

* **Cost models** (:func:`cost`, :data:`ALGORITHMS`, :data:`COST_MODELS`): naive (gather to
  one worker and send back one by one), parameter server, ring, a binomial tree and
  Rabenseifner's (reduce-scatter by recursive halving, all-gather by recursive doubling), under
  the alpha-beta model: a step of the critical path that moves b bytes over a link takes
  ``alpha + b * beta``. alpha is a cost per *step*: in these textbook algorithms one message per
  step, while gloo's ring sends each step's chunk as at least two pipelined segments (see
  :func:`cost`), so an alpha fitted to gloo is its cost per ring step, while K <= 2N MiB (above
  that, a step is more segments and their extra costs land in beta). :func:`fit_alpha_beta`
  fits alpha and beta to measured all-reduce times. They live in :mod:`dpcourse.ring_cost`
  (importable from here too).

* **The real ring** (:func:`ring_allreduce`): the same two phases over ``torch.distributed``
  point-to-point ``isend``/``irecv`` on the current process group (gloo on CPU, nccl on GPU),
  any world size, any shape and length, in place, ``op="sum"`` or ``"average"``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .ring_cost import (ALGORITHMS, AlphaBetaFit, COST_MODELS, Cost, RingUpTo,
                        blocking_ring_orders, blocking_ring_time, cheapest, cheapest_by_n, cost,
                        fit_alpha_beta, fit_alpha_beta_per_n, ring_cheapest_up_to, spans)

__all__ = [
    "blocking_ring_orders",
    "blocking_ring_time",
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
    phase: str  # "start", "reduce-scatter" or "all-gather"
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
        """Elements each worker sent over the whole run.

        Shown in lesson 06, §2."""
        sent = [0] * self.n
        for step in self.steps:
            for t in step.transfers:
                sent[t.src] += t.elements
        return sent

    def bytes_sent(self) -> list[int]:
        """Bytes each worker sent over the whole run: :meth:`elements_sent` × the item size.

        Shown in lesson 06, §2."""
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

    run_phase("reduce-scatter", 0, reduce=True)
    run_phase("all-gather", 1, reduce=False)
    return trace


def ring_bytes_per_worker(length: int, n: int, itemsize: int = 4) -> list[int]:
    """Bytes each worker sends in a ring all-reduce of ``length`` elements (exact, uneven
    chunks included). For ``length`` divisible by ``n`` every entry is 2(n-1)length/n*itemsize.

    Worker i sends chunks (i - s) for s = 0..n-2 in the reduce-scatter and chunks (i + 1 - s)
    in the all-gather: every chunk but (i + 1) once, then every chunk but (i + 2) once.

    Shown in lesson 06, §2; lesson 09, §1."""
    bounds = chunk_bounds(length, n)
    sizes = [b - a for a, b in bounds]
    total = sum(sizes)
    if n == 1:
        return [0]
    return [(2 * total - sizes[(i + 1) % n] - sizes[(i + 2) % n]) * itemsize for i in range(n)]


def simulate_rabenseifner(arrays: Sequence[np.ndarray], rounds: list | None = None
                          ) -> tuple[list[np.ndarray], list[int]]:
    """Rabenseifner's all-reduce run on real arrays: ``(results, sent)``, every worker's result
    and the bytes each worker sent (one direction of its link, over the whole all-reduce).

    With p the largest power of two <= N, the N - p workers above p first hand their whole
    array to worker r - p. The first p then run a reduce-scatter by *recursive halving*
    (partners p/2, p/4, ..., 1 apart: each keeps one half of the part it still reduces, sends
    the other half to its partner and adds the partner's half of its own) and an all-gather by
    *recursive doubling* (partners 1, 2, ..., p/2 apart: each sends the part it holds complete
    and takes its partner's). Last, the extra workers get the result back. Exchanges within a
    round use the buffers as they were at the round's start, as simultaneous messages would.
    The halving's order (far partner first) is the one Thakur, Rabenseifner and Gropp (2005)
    draw; MPICH's code runs the same exchanges nearest partner first and folds even ranks below
    2(N - p) onto rank + 1, at the same cost in the alpha-beta model.

    With ``rounds`` (a list), one dict per halving or doubling round is appended to it:
    ``phase``, ``distance`` (partners are ``distance`` apart), ``parts`` (each of the first p
    workers' part ``(lo, hi)`` after the round: the one it still reduces, or the one it holds
    complete) and ``sent`` (elements each of them sent in the round).

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
        if rounds is not None:
            rounds.append({"phase": "halving", "distance": d, "parts": list(zip(lo, hi)),
                           "sent": [len(g) for g in give]})
        d //= 2
    d = 1
    while d < p:  # recursive doubling: swap the complete parts, each part doubling
        parts = [(lo[i], hi[i], buf[i][lo[i]:hi[i]].copy()) for i in range(p)]
        for i in range(p):
            a, b, data = parts[i ^ d]
            buf[i][a:b] = data
            sent[i] += parts[i][2].nbytes
            lo[i], hi[i] = min(lo[i], a), max(hi[i], b)
        if rounds is not None:
            rounds.append({"phase": "doubling", "distance": d, "parts": list(zip(lo, hi)),
                           "sent": [len(part[2]) for part in parts]})
        d *= 2
    for r in range(p, n):  # hand the result back to the extra workers
        buf[r][:] = buf[r - p]
        sent[r - p] += buf[r].nbytes
    return buf, sent


@dataclass(frozen=True)
class Slot:
    """One interval of :func:`pipeline_schedule`: ``rank`` sends segment ``segment`` of chunk
    ``chunk`` to rank + 1 at ``step`` (``kind="send"``), or adds that segment into its own copy
    once it has arrived (``kind="add"``, reduce-scatter only), from ``start`` to ``end``."""

    rank: int
    kind: str
    step: int
    chunk: int
    segment: int
    start: float
    end: float


def pipeline_schedule(n: int, segments: int, transfer: float = 1.0,
                      add: float = 0.5) -> list[Slot]:
    """When each segment of each chunk is on each link, and when it is added, in a ring
    all-reduce whose chunks travel as ``segments`` segments (lesson 06's timeline figure).

    The chunk each rank sends at each step is :func:`simulate_ring`'s (the same transfers the
    lesson's trace prints). The timing is a model, not a measurement: a whole chunk takes
    ``transfer`` on a link and ``add`` to add, so a segment takes ``transfer / segments`` and
    ``add / segments``; each link (rank -> rank + 1) carries one segment at a time, in the order
    (step, segment); each rank adds one segment at a time, in that order, while its links go on
    sending; and a rank sends segment j of step t + 1 (the chunk it received at step t) once
    segment j of step t has arrived and, in the reduce-scatter, been added. With ``segments=1``
    that is the unpipelined ring: a step's transfer, then its addition, then the next step.
    No per-message latency (α) is charged, so in this model more segments are never slower; on a
    real link each segment pays α, which is what bounds the segment count.

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
    ready = [[0.0] * segments for _ in range(n)]  # ready[i][j]: segment j of i's next send
    slots: list[Slot] = []
    for step in trace.steps[1:]:
        reduce = step.phase == "reduce-scatter"
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
# The real ring over torch.distributed
# --------------------------------------------------------------------------------------------


# Receive buffers per (dtype, device), kept between calls and grown when needed. Measured
# (2 ranks, 64 MiB, gloo on CPU): a fresh 32 MiB torch.empty per call made the reduce-scatter
# 185 ms instead of 110 ms — the OS maps new pages on first touch, every call, because the CPU
# allocator returns big blocks to the OS. Costs two chunks (2K/N) of memory, kept until exit.
_RECV_BUFFERS: dict = {}


def receive_buffer(numel: int, dtype, device):
    """The first ``numel`` elements of this process's receive buffer for ``dtype`` on
    ``device``: one buffer per (dtype, device), kept in a module-level dict for the life of the
    process, shared by every :func:`ring_allreduce` call in it, and only ever grown (replaced
    by a larger one when a call needs more). So the ring's two chunk-sized receive buffers are
    allocated once, not per call, and stay allocated — the size of the largest all-reduce so
    far, 2K/N — until the process exits; two calls running at once in one process (threads)
    would write into the same memory.

    Shown in lesson 06, §"Lab 06: the ring, simulated then real".
    """
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

    The 2(N-1) steps t = 1 .. 2(N-1) are those of :func:`simulate_ring` (reduce-scatter, then
    all-gather), and the chunk a rank sends at step t+1 is always the chunk it received at step
    t. So each chunk
    travels as segments of about ``segment_bytes`` — ``ceil(longest chunk's bytes /
    segment_bytes)`` of them, so a chunk of at most ``segment_bytes`` (4 MiB by default) travels
    whole, as one segment, and nothing overlaps — and a segment moves on as soon as it is
    ready: received, added (reduce-scatter) — and forwarded to the right at once, while the
    next segments are still arriving. Adding segment j overlaps with receiving segment j+1, and
    the next step starts before this one has ended (gloo's and NCCL's rings pipeline the same
    way). Reduce-scatter segments arrive in two chunk-sized receive buffers used in turn, step
    by step (double buffering: the receives of step t+1 are posted while step t is still being
    added; :func:`receive_buffer` keeps them between calls); all-gather segments arrive
    straight in place. All of a step's segment receives are posted at once, and each is
    re-posted for the next step as soon as its segment has been handled: as many receives in
    flight as a chunk has segments (gloo's ring keeps two segments in flight).

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
    spare = receive_buffer(2 * longest, flat.dtype, flat.device)  # two chunks, kept between calls
    temp = [[spare[k * longest:][a:b] for a, b in chunk_bounds(longest, n_seg)]
            for k in (0, 1)]
    steps = 2 * (n - 1)
    # Steps t = 1 .. 2(N-1), numbered as in lesson 06 and the simulator's trace: at step t this
    # rank sends chunk (rank + 1 - t) and receives chunk (rank - t), mod N, in both phases;
    # steps 1 .. N-1 add what arrives (reduce-scatter), the others overwrite (all-gather). So
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
