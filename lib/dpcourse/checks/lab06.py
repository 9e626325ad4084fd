"""Checks for lab 06 (``solutions/lab06_ring_allreduce.py``): the ring, simulated then real.

* :func:`check_worker0_sends` judges the paper answer asked before part 1 (the chunks worker 0
  sends at steps 1 and 2 on a 3-ring) by what it would make the ring do;
* :func:`check_scatter_reduce` and :func:`check_all_gather` run the learner's NumPy phases on a
  few worker counts and lengths (uneven ones too): afterwards worker i must hold the full sum of
  chunk i (one chunk before lesson 06's simulator, so that the learner derives the indices).
* :func:`check_ring_allreduce` runs the learner's ``ring_allreduce(tensor, op)`` — defined in a
  notebook cell — in 3, 2 and then 4 processes through :func:`dpcourse.launch.spawn`
  (cloudpickle ships it), compares every rank's tensor with the sum / average, and spies on
  what it sends (no built-in collective; blocking ``send``/``recv`` only, so the order of a
  step's two calls is the learner's decision; 2(N-1) messages of about K/N elements per rank);
  :func:`demo_ring` runs given demo code and explains a deadlock by its cause, with no fix.
  The order of each step's calls is judged by the time a step takes in transfer times
  (:func:`_rounds`: one unit per transfer, a gloo send waiting for its receiver), from the calls
  the ranks made on 3, 2 and 4 ranks and, on 8 and 16 ranks, from a dry run of the learner's
  code with stand-ins that only note the calls (:func:`_dry_orders`): an order whose time per
  step grows with N is refused. Gloo ranks do not wait for one another between steps, so a
  start-up chain is paid once: measured with gloo on 8 and 12 ranks, each transfer padded to
  20 ms, "the first half of the ranks send first" took 2.36 transfer times per step on both
  (even/odd 2.24 and 2.19; rank 0 alone sending first 8.3 and 12.8; ranks 0 and 1 sending
  first 4.2 and 6.3), as the model says (2.2; 2.0; 8 and 12; 4.1 and 6.0);
* :func:`check_segmented_ring` (the stretch) does the same for a ring whose scatter-reduce sends
  each chunk in segments.

Wrong answers are recognised by simulating each plausible mistake and matching the learner's
numbers: a chunk index off by one, a wrong number of steps, a missing all-gather, an
all-gather that adds, summing where the average is asked. A ring in which every rank calls a
blocking ``dist.send`` before its ``dist.recv`` deadlocks: measured with gloo (torch 2.14, CPU),
two ranks doing that hang at *every* size we tried, from 1 element to 16 Mi elements — gloo's
send does not return before the peer has posted the matching receive. The check notices which
call each rank is stuck in, stops the ranks after ``timeout`` seconds and says so; every rank
calling ``dist.recv`` first deadlocks the same way. A second ``wait()`` on the same ``Work``
never returns either (measured, torch 2.14 gloo): the spy on the stretch's works names it.
The spy also notes the memory each non-blocking receive writes into, so that one buffer shared
by receives in flight (a race whose sum may come out right on one run) is named by its cause.
The stretch's design decision, the receives kept in flight, is declared before the ring is
written and held: the first number compared with the ring is kept, another one refused.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile

import numpy as np

from dpcourse.checks import (LabCheckError, Prediction, check_timeout, fail, keep, kept_prediction,
                             passed, recorded, run_ranks)
from dpcourse.ring import chunk_bounds

__all__ = ["LabCheckError", "check_worker0_sends", "check_scatter_reduce", "check_all_gather", "check_ring_allreduce",
           "check_segmented_ring", "measure_bytes_sent", "check_prediction",
           "reference_scatter_reduce", "reference_all_gather", "IN_FLIGHT_QUESTION",
           "demo_ring", "WORLD_SIZES", "RING_WORLD_SIZES"]

_CASES = [(3, 9), (4, 10), (5, 7), (3, 2)]  # (workers, length): even, uneven, L < N


def _inputs(n: int, length: int, seed: int = 6) -> list[np.ndarray]:
    # Distinct integers (as float64): sums are exact, so every mistake gives different numbers.
    rng = np.random.default_rng(seed + 31 * n + length)
    return [rng.integers(1, 1000, length).astype(np.float64) * (w + 1) for w in range(n)]


# --- the NumPy phases, the reference and its plausible mistakes -----------------------------


# Chunk rules a learner may use instead of ``chunk_bounds`` (NumPy's array_split rule): on a
# length that N divides they all agree, on any other they do not.
def _floor_bounds(length: int, n: int):      # length // n each: the remainder is in no chunk
    q = length // n
    return [(i * q, (i + 1) * q) for i in range(n)]


def _floor_last_bounds(length: int, n: int):  # length // n each, the last takes the remainder
    q = length // n
    return [(i * q, (i + 1) * q if i < n - 1 else length) for i in range(n)]


def _ceil_bounds(length: int, n: int):       # ceil(length / n) each (torch.chunk's size)
    q = -(-length // n)
    return [(min(i * q, length), min((i + 1) * q, length)) for i in range(n)]


_OTHER_CHUNK_RULES = (_floor_bounds, _floor_last_bounds, _ceil_bounds)


def _chunk_rule_sentence(what: str, n: int, length: int, rule) -> str:
    sizes = [b - a for a, b in chunk_bounds(length, n)]
    if rule is _floor_bounds:
        return (f"{what} ignores ring.chunk_bounds on a length that N does not divide ({length} "
                f"on N={n}): chunks of {length} // {n} = {length // n} leave the last "
                f"{length % n} element(s) in no chunk, so they are never summed; "
                f"ring.chunk_bounds gives chunks of {sizes} elements.")
    return (f"{what} ignores ring.chunk_bounds on a length that N does not divide ({length} on "
            f"N={n}): its chunks are not ring.chunk_bounds's {sizes} elements (the first "
            f"length % N chunks one longer), so the chunk each worker ends with is not the one "
            f"the contract names.")


# The lab's NumPy phases end with worker i holding the full sum of chunk i: one chunk before
# lesson 06's simulator (which ends with chunk (i + 1) mod N), so the lesson's index formulas
# do not answer the lab; the learner derives the lab's from the contract. ``base`` shifts the
# chunk index: -1 is the lab's convention, 0 the lesson's (used for the real ring, where any
# consistent convention gives the same sum).
LAB_BASE = -1


def _scatter_reduce(buffers, send_shift=0, recv_shift=0, steps=None, bounds=chunk_bounds,
                    base=LAB_BASE):
    n = len(buffers)
    b = bounds(len(buffers[0]), n)
    for s in range(n - 1 if steps is None else steps):
        out = [buffers[i][slice(*b[(i - s + base + send_shift) % n])].copy() for i in range(n)]
        for i in range(n):
            dst = (i + 1) % n
            target = buffers[dst][slice(*b[(i - s + base + send_shift + recv_shift) % n])]
            if target.shape == out[i].shape:
                target += out[i]
            else:  # sizes differ for uneven chunks: the mistake would crash; mark it garbage
                target[...] = np.nan
    return buffers


def _all_gather(buffers, send_shift=0, recv_shift=0, steps=None, add=False,
                bounds=chunk_bounds, base=LAB_BASE):
    n = len(buffers)
    b = bounds(len(buffers[0]), n)
    for s in range(n - 1 if steps is None else steps):
        out = [buffers[i][slice(*b[(i + 1 - s + base + send_shift) % n])].copy()
               for i in range(n)]
        for i in range(n):
            dst = (i + 1) % n
            target = buffers[dst][slice(*b[(i + 1 - s + base + send_shift + recv_shift) % n])]
            if target.shape != out[i].shape:
                target[...] = np.nan
            elif add:
                target += out[i]
            else:
                target[...] = out[i]
    return buffers


def reference_scatter_reduce(buffers):
    """Scatter-reduce in place: afterwards worker i holds the full sum of chunk i."""
    return _scatter_reduce(buffers)


def reference_all_gather(buffers):
    """All-gather in place, after :func:`reference_scatter_reduce`: every worker gets every sum."""
    return _all_gather(buffers)


_CHUNK_RULE_FIX = ("cut the chunks with ring.chunk_bounds(length, N) and index them by its "
                   "(start, stop) pairs.")
_SR_RULE = ("the chunk a worker adds into must be the chunk its left neighbour sent in that "
            "step. At the last step, t = N - 1, worker i - 1 must send chunk i (the last "
            "contribution worker i needs), and what a worker sends at step t + 1 is the chunk "
            "it added into at step t: work back from the last step to the chunk worker i sends "
            "at step t.")
_AG_RULE = ("in each step a worker must pass on the chunk it completed most recently, and its "
            "right neighbour must overwrite that same chunk.")


def _run_learner(fn, buffers, what):
    __tracebackhide__ = True
    try:
        out = fn(buffers)
    except NotImplementedError:
        raise  # an unsolved TODO: let the lab stop right there, with the TODO's own message
    except Exception as exc:  # noqa: BLE001 - the learner's code; name the error in one line
        fail(f"your {what} raised {type(exc).__name__}: {exc}")
    if isinstance(out, (list, tuple)) and len(out) == len(buffers):
        buffers = [np.asarray(o) for o in out]  # returning new arrays is fine too
    return buffers


def _same(a_list, b_list) -> bool:
    return all(a.shape == b.shape and np.array_equal(a, b) for a, b in zip(a_list, b_list))


def _wrong_steps_or_chunk(got, phase, start, what: str, chunk_rule: str) -> None:
    """Name the mistake if ``got`` is the reference ``phase`` run from ``start`` with a wrong
    number of steps, or with the sent or received chunk index off by one or two."""
    __tracebackhide__ = True
    n = len(start)
    for steps in (n, n - 2, 1):
        if steps != n - 1 and steps >= 0 and _same(got, phase([a.copy() for a in start],
                                                              steps=steps)):
            fail(f"{what} ran {steps} steps for N={n} workers; it takes exactly N-1 = {n - 1}: "
                 f"each step moves every chunk one hop, and N-1 hops carry a chunk past every "
                 f"worker once.", fix="loop over range(N - 1) steps, N being len(buffers).")
    for ds, dr in itertools.product((-1, 0, 1, 2), (-1, 0, 1)):
        if (ds, dr) != (0, 0) and _same(got, phase([a.copy() for a in start], ds, dr)):
            fail(f"off-by-one chunk index in {what} (N={n}): your result is what the ring gives "
                 f"when the chunk a worker sends is shifted by {ds} and the chunk its neighbour "
                 f"adds into (or overwrites) by {dr}, so a chunk ends on the wrong worker or "
                 f"mixes two chunks.", fix=chunk_rule)


_WORKER0_N = 3  # the paper question before part 1: worker 0's chunks on a 3-ring


@recorded
def check_worker0_sends(sends) -> None:
    """Before part 1's code, on paper: for N = 3 and this lab's layout (worker i ends the
    scatter-reduce with the full sum of chunk i), the chunks worker 0 sends at step 1 and at
    step 2, as a list of two chunk indices. The only answer is [2, 1]: the last message worker
    1 receives (worker 0's at step 2) must carry chunk 1, and the chunk worker 0 sends at step 1
    is added and passed on by worker 1 at step 2, so it ends complete on worker 2: chunk 2.
    A wrong answer is answered with what it would do (which worker would finish which chunk),
    the way back from the last step only on the second meeting."""
    __tracebackhide__ = True
    n = _WORKER0_N
    if sends is None or sends is Ellipsis:
        raise NotImplementedError("write worker0_sends, the chunks worker 0 sends at steps 1 "
                                  "and 2 for N = 3, first")
    if (not isinstance(sends, (list, tuple)) or len(sends) != n - 1 or any(
            isinstance(c, bool) or not isinstance(c, (int, np.integer)) for c in sends)):
        fail(f"worker0_sends must be a list of {n - 1} chunk indices, the chunk worker 0 sends "
             f"at step 1 and the one at step 2 (N = {n}: N - 1 steps), e.g. [0, 0]; got "
             f"{sends!r}.")
    if any(not 0 <= int(c) < n for c in sends):
        fail(f"worker0_sends holds {list(map(int, sends))}: with N = {n} the chunks are "
             f"numbered 0, 1 and 2.")
    first, last = (int(c) for c in sends)
    back = ("work back from the last step: the last message worker i receives must carry chunk "
            "i, so at step N - 1 worker i - 1 sends chunk i; and what a worker sends at a step "
            "is the chunk it added into at the step before.")
    if last != 1:
        lesson = (" These are lesson 06's chunks, whose worker i finishes chunk (i + 1) mod N."
                  if (first, last) == (0, 2) else "")
        fail(f"at step 2, the last, worker 0 sends chunk {last} to worker 1, which adds it to "
             f"its own copy, and nothing reaches worker 1 afterwards: that is the last "
             f"contribution to chunk {last} on worker 1, so the chunk worker 1 could finish "
             f"with is chunk {last} — and the contract asks worker 1 to finish chunk 1.{lesson}",
             fix=back)
    if first != 2:
        fail(f"at step 1 worker 0 sends chunk {first} to worker 1; worker 1 adds its own part "
             f"and, at step 2, passes that sum on to worker 2 (the chunk a worker sends at "
             f"step 2 is the one it added into at step 1), where it ends complete: worker 2 "
             f"would finish chunk {first}, and the contract gives worker 2 chunk 2"
             + (", while worker 0's chunk at step 2, chunk 1, is right." if first != 1 else
                ". Worker 0 sending chunk 1 twice would also give worker 1 worker 0's part of "
                "chunk 1 twice."), fix=back)
    passed(f"worker 0 sends chunk {first} at step 1 and chunk {last} at step 2: chunk 2 "
           f"collects worker 0's and worker 1's parts and ends on worker 2, and chunk 1, which "
           f"worker 0 received from worker 2 at step 1, ends on worker 1 (part 1 asks it of "
           f"every worker, for every N)")


@recorded
def check_scatter_reduce(fn) -> None:
    """``fn(buffers)``: N 1-D float arrays, changed in place; after it worker i must hold the
    full sum of chunk i (chunks as in ``ring.chunk_bounds``)."""
    __tracebackhide__ = True
    for n, length in _CASES:
        inputs = _inputs(n, length)
        got = _run_learner(fn, [a.copy() for a in inputs], "scatter_reduce")
        want = _scatter_reduce([a.copy() for a in inputs])
        if _same(got, want):
            continue
        if _same(got, inputs):
            fail(f"scatter_reduce left the buffers unchanged (N={n}): nothing a worker received "
                 f"reached its own array (a copy or a rebound name does not change it).",
                 fix="in every step, add the chunk received from the left neighbour into the "
                     "worker's own copy of that chunk, in place.")
        if _same(got, _scatter_reduce([a.copy() for a in inputs], base=0)):
            fail(f"scatter_reduce ends with worker i holding the full sum of chunk (i + 1) mod N "
                 f"(N={n}): that is lesson 06's finishing layout, not the one this lab's "
                 f"contract names, so every finished sum sits on the wrong worker.",
                 fix="at the last step, t = N - 1, worker i - 1 must send chunk i, the last "
                     "contribution worker i needs; your worker i - 1 sends chunk i + 1 then. "
                     "Compare your index at t = N - 1 with the chunks you worked out for "
                     "worker 0 on N = 3.")
        if length % n:
            for rule in _OTHER_CHUNK_RULES:
                if _same(got, _scatter_reduce([a.copy() for a in inputs], bounds=rule)):
                    fail(_chunk_rule_sentence("scatter_reduce", n, length, rule),
                         fix=_CHUNK_RULE_FIX)
        _wrong_steps_or_chunk(got, _scatter_reduce, inputs, "scatter_reduce", _SR_RULE)
        bad = [w for w in range(n) if not np.array_equal(got[w], want[w])]
        fail(f"scatter_reduce gives wrong numbers on worker(s) {bad} for N={n}, length "
             f"{length}: after it worker i must hold the full sum of chunk i.", fix=_SR_RULE)
    return passed("scatter_reduce: every worker i ends with the full sum of chunk i, "
                  "for N = 3, 4, 5 and uneven lengths")


@recorded
def check_all_gather(fn) -> None:
    """``fn(buffers)``: run on the state after the reference scatter-reduce; afterwards every
    worker must hold the whole sum."""
    __tracebackhide__ = True
    for n, length in _CASES:
        inputs = _inputs(n, length)
        reduced = _scatter_reduce([a.copy() for a in inputs])
        total = np.sum(inputs, axis=0)
        got = _run_learner(fn, [a.copy() for a in reduced], "all_gather")
        if all(np.array_equal(g, total) for g in got):
            continue
        if _same(got, reduced):
            fail(f"all_gather left every worker's array as the scatter-reduce left it (N={n}): "
                 f"nothing a worker received was written into its own array (a copy or a "
                 f"rebound name does not change it), so each still holds only one finished "
                 f"chunk.",
                 fix="in every step, write the chunk that arrives into the receiving worker's "
                     "own array, through a slice of it (buffers[j][a:b] = ...), not into a "
                     "copy or a new name.")
        if _same(got, _all_gather([a.copy() for a in reduced], add=True)):
            fail("all_gather adds the incoming chunk to the worker's own: the chunk that arrives "
                 "is already the complete sum, so adding it counts values twice.",
                 fix="overwrite the worker's copy of the chunk with the one that arrives.")
        if _same(got, _all_gather([a.copy() for a in reduced], base=0)):
            fail(f"all_gather passes the chunks on as if worker i had finished chunk (i + 1) mod "
                 f"N (lesson 06's layout, N={n}); after this lab's scatter-reduce worker i holds "
                 f"chunk i complete, not chunk (i + 1) mod N.",
                 fix="start each worker's all-gather with the chunk it completed, chunk i.")
        if length % n:
            for rule in _OTHER_CHUNK_RULES:
                if _same(got, _all_gather([a.copy() for a in reduced], bounds=rule)):
                    fail(_chunk_rule_sentence("all_gather", n, length, rule),
                         fix=_CHUNK_RULE_FIX)
        _wrong_steps_or_chunk(got, _all_gather, reduced, "all_gather", _AG_RULE)
        bad = [w for w in range(n) if not np.array_equal(got[w], total)]
        fail(f"all_gather leaves wrong numbers on worker(s) {bad} for N={n}, length {length}: "
             f"afterwards every worker must hold the whole sum.", fix=_AG_RULE)
    return passed("all_gather: every worker ends with the whole sum, for N = 3, 4, 5 and "
                  "uneven lengths")


# --- the real ring ----------------------------------------------------------------------------

_REAL_CASES = [  # (shape, dtype name, op)
    ((12,), "float64", "sum"),
    ((10,), "float64", "sum"),
    ((4, 5), "float32", "sum"),
    ((2,), "float64", "sum"),
    ((11,), "float64", "average"),
]


def _real_input(rank: int, shape, seed: int = 6) -> np.ndarray:
    rng = np.random.default_rng(seed + 1000 * rank + int(np.prod(shape)))
    return rng.integers(1, 1000, shape).astype(np.float64) * (rank + 1)


def _mark(marker_dir: str, rank: int, text: str) -> None:
    with open(os.path.join(marker_dir, f"rank{rank}"), "w") as f:
        f.write(text)


class _WatchedWork:
    """A ``Work`` that notes in ``events`` when it is waited on (the segmented stretch is judged
    by the order of posts and waits, not only by its messages)."""

    def __init__(self, work, events, kind, index, fingerprint):
        self._work, self._events, self._kind, self._index = work, events, kind, index
        self._fingerprint = fingerprint  # what the tensor holds when the wait begins
        self._waited = False

    def wait(self, *args, **kwargs):
        if self._waited:
            # Measured (torch 2.14, gloo, CPU): a second wait() on a work that has already
            # completed never returns. Stop here and say so, rather than hang to the timeout.
            raise RuntimeError(f"{_DOUBLE_WAIT} {self._kind} {self._index}")
        self._waited = True
        self._events.append(("wait", self._kind, self._index, self._fingerprint()))
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


_DOUBLE_WAIT = "dpcourse-lab06: wait() called a second time on the work of"


class _LibraryRingUsed(RuntimeError):
    pass


def _refuse_library_ring(*args, **kwargs):
    raise _LibraryRingUsed("dpcourse.ring.ring_allreduce")


def _real_worker(rank, world_size, fn, cases, marker_dir, kwargs=None, dry_sizes=()):
    __tracebackhide__ = True
    out = _run_real_cases(rank, world_size, fn, cases, marker_dir, kwargs)
    # The order of calls on more ranks than this machine can run: on rank 0 only, once the real
    # cases have run (and only for a ring that used nothing but blocking send / recv).
    if rank == 0 and dry_sizes and "traffic" in out and not any(
            t["builtins"] or t["nonblocking"] for t in out["traffic"]):
        out["orders"] = _dry_orders(fn, dry_sizes)
    return out


def _run_real_cases(rank, world_size, fn, cases, marker_dir, kwargs=None):
    __tracebackhide__ = True
    import torch

    from dpcourse import ring as ring_module

    from ..collectives import record_collectives

    # The lab asks for the learner's own ring: the library's, called from inside theirs, is
    # refused (the check in the parent refuses it when passed directly).
    ring_module.ring_allreduce = _refuse_library_ring
    # Spy on what the ring sends (messages and elements) and on built-in collectives, which the
    # lab is about replacing, and note which blocking call this rank is in, so a hang can be
    # explained afterwards; log every send and receive with its peer and size, so a crash can be
    # traced to the first message whose two ends disagree.
    traffic = {"messages": 0, "elements": 0, "sizes": [], "builtins": [], "events": [],
               "nonblocking": []}
    counts = {"send": 0, "recv": 0}
    batch_seen: dict = {}
    p2p_log = open(os.path.join(marker_dir, f"p2p{rank}"), "a", buffering=1)
    current = {"x": None}  # the tensor of the case being run: has a piece been added yet?
    live: list = []  # the non-blocking receives' buffers, kept alive so no address is reused

    def fingerprint():
        return hash(current["x"].detach().numpy().tobytes())

    def before(call):
        if call.function in ("send", "recv"):
            _mark(marker_dir, rank, call.function)
        elif call.op in ("send", "recv") and call.function not in traffic["nonblocking"]:
            traffic["nonblocking"].append(call.function)  # isend, irecv, batch_isend_irecv
        if call.op in ("send", "recv"):
            numel = call.numel if call.op == "send" else call.out_numel
            p2p_log.write(f"{call.op} {call.peer} {numel}\n")
        if call.op == "send":
            if isinstance(call.peer, int) and not 0 <= call.peer < world_size:
                # gloo would wait forever for a rank that does not exist
                raise ValueError(f"dist.{call.function} to rank {call.peer}, but there are "
                                 f"only {world_size} ranks (0..{world_size - 1}): compute the "
                                 f"neighbours from dist.get_world_size(), not a fixed number")
            if call.numel > 0:
                traffic["messages"] += 1
                traffic["elements"] += call.numel
                traffic["sizes"].append(call.numel)
        elif call.op not in ("recv", "barrier"):
            traffic["builtins"].append(call.function)

    def after(call):
        if call.function in ("send", "recv"):
            _mark(marker_dir, rank, "")
        if call.op in ("send", "recv"):
            index = counts[call.op]
            counts[call.op] += 1
            traffic["events"].append(("post", call.op, index, _recv_span(call, live)))
            result = call.result
            if call.function in ("isend", "irecv") and result is not None:
                return _WatchedWork(result, traffic["events"], call.op, index, fingerprint)
            if isinstance(result, list) and call.function == "batch_isend_irecv":
                # gloo returns one work per P2POp, in the ops' order: wrap this call's one
                k = batch_seen.get(id(result), 0)
                batch_seen[id(result)] = k + 1
                if k < len(result) and not isinstance(result[k], _WatchedWork):
                    result[k] = _WatchedWork(result[k], traffic["events"], call.op, index,
                                             fingerprint)
                return None
            if call.function in ("send", "recv"):  # blocking: waited as it returns
                traffic["events"].append(("wait", call.op, index, fingerprint()))
        return None

    with record_collectives(before=before, after=after):
        torch.set_num_threads(1)
        results, per_case = [], []
        for shape, dtype, op in cases:
            x = torch.tensor(_real_input(rank, shape), dtype=getattr(torch, dtype))
            current["x"] = x
            traffic.update(messages=0, elements=0, sizes=[], builtins=[], events=[],
                           nonblocking=[])
            counts.update(send=0, recv=0)
            live.clear()
            try:
                ret = fn(x, op=op, **(kwargs or {}))
            except _LibraryRingUsed:
                return {"library": True}
            returned = ret.detach().cpu().numpy().astype(np.float64) if isinstance(
                ret, torch.Tensor) else None
            results.append((x.numpy().astype(np.float64), returned))
            per_case.append(dict(traffic, builtins=list(traffic["builtins"]),
                                 nonblocking=list(traffic["nonblocking"]),
                                 sizes=list(traffic["sizes"]), events=list(traffic["events"])))
        p2p_log.close()
        return {"results": results, "traffic": per_case}


def _recv_span(call, live: list):
    """The memory a non-blocking receive writes into, as (first byte, end byte), or None (a
    send, a blocking receive, an empty buffer). The buffer is appended to ``live`` so that its
    memory cannot be freed and handed to a later buffer while the case runs: two spans that
    overlap are then one buffer shared, never an address reused."""
    if call.op != "recv" or call.function not in ("irecv", "batch_isend_irecv"):
        return None
    args = call.args or {}
    t = args.get("tensor") if call.function == "irecv" else getattr(args.get("op"), "tensor",
                                                                      None)
    if t is None or not hasattr(t, "untyped_storage") or t.numel() == 0:
        return None
    live.append(t)
    start = t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size()
    return (start, start + t.numel() * t.element_size())


def _first_shared_buffer(events):
    """The first pair (earlier, later) of non-blocking receives whose buffers overlap while the
    earlier one is still in flight (posted, not yet waited on): one buffer shared by receives in
    flight, so a later message may overwrite an earlier one before it is used. None if none."""
    open_spans: dict[int, tuple[int, int]] = {}
    for kind, op, index, info in events:
        if op != "recv":
            continue
        if kind == "wait":
            open_spans.pop(index, None)
        elif info is not None:
            lo, hi = info
            for earlier, (a, b) in open_spans.items():
                if lo < b and a < hi:
                    return earlier, index
            open_spans[index] = info
    return None


class _DryRunStop(Exception):
    pass


_DRY_NUMEL = 5  # elements per rank in the dry run: 2N + 5, so that no chunk is empty


def _dry_orders(fn, sizes):
    """The order in which ``fn`` makes its blocking calls on every rank of each group size in
    ``sizes``, found without sending anything: ``fn`` runs once per rank in this process, with
    ``torch.distributed``'s ``get_rank``, ``get_world_size``, ``send`` and ``recv`` replaced by
    stand-ins that only note the call (a receive leaves its buffer as it was). Returns
    ``{N: [[("send"|"recv", peer), ...] for each rank]}``, or a string saying why the order
    could not be found (any other torch.distributed call stops the dry run: it is not judged)."""
    import torch
    import torch.distributed as dist

    from ..collectives import RECORDED

    def stop(*args, **kwargs):
        raise _DryRunStop("another torch.distributed call")

    # every built-in collective too: one called with a stand-in rank could wait forever
    replaced = ["get_rank", "get_world_size", "send", "recv", "isend", "irecv",
                "batch_isend_irecv", *RECORDED]
    saved = {name: getattr(dist, name) for name in replaced if hasattr(dist, name)}
    orders: dict = {}
    try:
        for name in saved:
            setattr(dist, name, stop)
        for n in sizes:
            orders[n] = []
            for r in range(n):
                calls: list = []

                def send(tensor, dst=None, group=None, tag=0, group_dst=None, _calls=calls):
                    _calls.append(("send", dst if dst is not None else group_dst))

                def recv(tensor=None, src=None, group=None, tag=0, group_src=None,
                         _calls=calls):
                    peer = src if src is not None else group_src
                    _calls.append(("recv", peer))
                    return peer

                dist.get_rank = lambda *a, _r=r, **k: _r
                dist.get_world_size = lambda *a, _n=n, **k: _n
                dist.send, dist.recv = send, recv
                x = torch.arange(1.0, 2 * n + _DRY_NUMEL + 1, dtype=torch.float64)
                fn(x, op="sum")
                orders[n].append(calls)
    except _DryRunStop as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001 - the learner's code, run with stand-ins
        return f"{type(exc).__name__}: {exc}"
    finally:
        for name, real in saved.items():
            setattr(dist, name, real)
    return orders


def _rounds(orders):
    """How many transfer times a ring takes if every transfer takes one and a gloo send goes
    out only once its receiver is in the matching recv (``Pair::send``): ``orders[r]`` is rank
    r's blocking calls in order, as (op, peer). Each time unit, every send whose peer is at the
    matching receive completes, and both ranks move on to their next call. Returns (time units,
    None), or (None, the ranks still waiting) when no pair can meet: a deadlock."""
    n = len(orders)
    at = [0] * n
    clock = [0] * n  # when each rank's last call completed
    while True:
        meets = []
        for i in range(n):
            if at[i] < len(orders[i]) and orders[i][at[i]][0] == "send":
                j = orders[i][at[i]][1]
                if (isinstance(j, int) and 0 <= j < n and at[j] < len(orders[j])
                        and orders[j][at[j]] == ("recv", i)):
                    meets.append((i, j))
        if not meets:
            break
        for i, j in meets:
            clock[i] = clock[j] = max(clock[i], clock[j]) + 1
            at[i] += 1
            at[j] += 1
    waiting = [r for r in range(n) if at[r] < len(orders[r])]
    return (None, waiting) if waiting else (max(clock), None)


def _recorded_orders(case_traffic, n: int):
    """A real run's blocking calls per rank, in order, as (op, peer): the contract's peers (the
    check has already compared the results, so every send went right and every receive came
    from the left)."""
    return [[(op, (r + 1) % n if op == "send" else (r - 1) % n)
             for kind, op, _, _ in t["events"] if kind == "post"] for r, t in
            enumerate(case_traffic)]


def _simulate_real(n, cases, sr=(0, 0), ag=(0, 0), gather=True, average=True, divisor=None,
                   bounds=chunk_bounds):
    """What a ring with these chunk-index shifts would leave on each rank, per case (averages
    divided by ``divisor`` instead of N if given; chunks cut by ``bounds``)."""
    out = []
    for shape, _, op in cases:
        bufs = [_real_input(r, shape).ravel() for r in range(n)]
        _scatter_reduce(bufs, *sr, bounds=bounds, base=0)
        if gather:
            _all_gather(bufs, *ag, bounds=bounds, base=0)
        if op == "average" and average:
            bufs = [b / (divisor or n) for b in bufs]
        out.append([b.reshape(shape) for b in bufs])
    return out


def _matches(results, sim) -> bool:
    for case_results, case_sim in zip(results, sim):
        for (got, _), want in zip(case_results, case_sim):
            if got.shape != want.shape or not np.allclose(got, want, rtol=1e-6, atol=0,
                                                          equal_nan=False):
                return False
    return True


WORLD_SIZES = (3, 2)  # 3 first: more chunks tell more mistakes apart; 2 catches what fits 3
# Part 3's ring is built from blocking send/recv, so the order of each step's calls must work
# for odd and even numbers of ranks: 3, 2 and 4 (2 before 4: a ring tied to N = 3 is named
# there, where its sends go to a rank that does not exist).
RING_WORLD_SIZES = (3, 2, 4)


def _rebinds_division(fn) -> bool:
    """Does ``fn`` bind a true division to a plain name (``flat = flat / n``)?"""
    import ast
    import inspect
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return False
    return any(isinstance(node, ast.Assign) and isinstance(node.value, ast.BinOp)
               and isinstance(node.value.op, ast.Div)
               and all(isinstance(t, ast.Name) for t in node.targets)
               for node in ast.walk(tree))


@recorded
def check_ring_allreduce(fn, world_size=None, timeout: float | None = None,
                         world_sizes=RING_WORLD_SIZES) -> None:
    """Run ``fn(tensor, op="sum"|"average")`` on 3, 2 and then 4 gloo ranks (``world_size``:
    only that many), on several shapes (lengths not divisible by N, and shorter than N), and
    compare with the sum / average; spy on the messages it sends. Part 3's contract: blocking
    ``dist.send`` / ``dist.recv`` only (``isend``, ``irecv`` and ``batch_isend_irecv`` are
    refused), so the order of each step's calls is the learner's decision.

    ``timeout`` bounds each launch (20 s, or ``DPCOURSE_CHECK_TIMEOUT`` if more): a ring that
    deadlocks ends with a LabCheckError that says so instead of hanging the notebook.
    """
    __tracebackhide__ = True
    timeout = check_timeout(timeout, 20.0)
    if not callable(fn):
        fail(f"check_ring_allreduce needs your ring_allreduce function, got {type(fn).__name__}")
    _refuse_reference(fn)
    sizes = (world_size,) if world_size else tuple(world_sizes)
    per_step: dict = {}  # N -> transfer times per step, from the order of the ring's calls
    dry = None
    for n in sizes:
        seen = _check_ring_once(fn, n, timeout, DRY_SIZES if n == sizes[-1] and n >= 4 else ())
        if seen["recorded"] is not None:
            units, _ = _rounds(seen["recorded"])
            if units is not None:
                per_step[n] = units / (2 * (n - 1))
        dry = seen["dry"] if seen["dry"] is not None else dry
    modelled = _refuse_growing_steps(dry, per_step) if dry is not None else {}
    shown = ", ".join(f"{per_step[n]:.1f}" + (" transfer times" if i == 0 else "") + f" on {n}"
                      + (" ranks" if i == 0 else "")
                      for i, n in enumerate(n for n in sizes if n in per_step))
    if modelled:
        shown += (", and, modelled from the order of its calls on more ranks than this machine "
                  "runs, " + " and ".join(f"{v:.1f} on {n}" for n, v in modelled.items()))
    in_parallel = (f" (counting each transfer as one time unit, a send going out only once its "
                   f"receiver is in dist.recv, a step took about {shown}),"
                   if shown else ",")
    passed(f"ring_allreduce, built from blocking dist.send/dist.recv only, finished without "
           f"deadlock{in_parallel} and equals the sum (and the average) on "
           f"{', '.join(map(str, sizes))} "
           f"ranks for lengths 12, 10, 20, 2 and 11; for every length of at least N, each rank "
           f"sent exactly 2(N-1) messages and at most 2(N-1) chunks' worth of elements (with "
           f"length 2 < N only the results were compared: empty chunks may be skipped)")


def demo_ring(fn, world_size: int = 3, timeout: float = 10) -> None:
    """Run given demo code ``fn`` (part 4's ``blocking_ring``) on ``world_size`` gloo ranks and
    say how it ended. Not a check of the learner's code: a deadlock is explained by its cause,
    never with a fix to apply (the learner does not change the demo)."""
    __tracebackhide__ = True
    if not callable(fn):
        fail(f"demo_ring needs a ring function, got {type(fn).__name__}")
    _launch_ring(fn, world_size, check_timeout(timeout, timeout), _REAL_CASES[:1], demo=True)
    print(f"the ring finished on {world_size} ranks without a deadlock")


# The two deadlocks are broken from opposite ends: when every rank is stuck in dist.send, a
# rank that calls dist.recv first takes its left neighbour's message and unblocks it; when
# every rank is stuck in dist.recv, a rank that calls dist.send first hands its right neighbour
# the message it waits for.
_DEADLOCK_FIX_ALL_SEND = (
    "in each step, let some ranks call dist.recv first and the others dist.send first, with a "
    "rule that gives both kinds of rank for every N (try N = 3 and N = 4 on paper): a rank "
    "that RECEIVES first takes its left neighbour's pending send and breaks the cycle of waits. "
    "Have many of them, spread around the ring: with a single one nothing deadlocks, but each "
    "step's sends then complete one after another around the ring, N transfers in a row.")
_DEADLOCK_FIX_ALL_RECV = (
    "in each step, let some ranks call dist.send first and the others dist.recv first, with a "
    "rule that gives both kinds of rank for every N (try N = 3 and N = 4 on paper): a rank "
    "that SENDS first gives its right neighbour the message that neighbour waits for, and "
    "breaks the cycle of waits. Have many of them, spread around the ring: with a single one "
    "nothing deadlocks, but each step's transfers then run one after another around the ring, "
    "N in a row.")


def _launch_ring(fn, world_size: int, timeout: float, cases, kwargs=None,
                 demo: bool = False, dry_sizes=()) -> list:
    __tracebackhide__ = True
    marker_dir = tempfile.mkdtemp(prefix="dpcourse-lab06-")

    def hang(exc) -> str:
        where = {}
        for r in range(world_size):
            try:
                with open(os.path.join(marker_dir, f"rank{r}")) as f:
                    where[r] = f.read()
            except OSError:
                where[r] = ""
        # A blocked rank sits in dist.send with nobody in dist.recv; a rank whose small send
        # the OS buffered may be between calls (marker empty) when it is stopped, so "every
        # marked rank in send, none in recv" is the deadlock's signature.
        in_send = [r for r, v in where.items() if v == "send"]
        in_recv = [r for r, v in where.items() if v == "recv"]
        demo_or = (lambda text: None if demo else text)  # a demo is given code: no fix
        if in_send and not in_recv:
            # Diagnosed: not slowness, so no "try a longer timeout" (fail here, not via return).
            fail(f"deadlock on {world_size} ranks: every rank called a blocking dist.send "
                 f"before its dist.recv, so all {world_size} waited for a receive nobody had "
                 f"posted (gloo's send waits for the matching receive); they were stopped after "
                 f"{timeout:g} s. A longer timeout would not help.",
                 fix=demo_or(_DEADLOCK_FIX_ALL_SEND))
        if len(in_recv) == world_size:
            fail(f"deadlock on {world_size} ranks: every rank called a blocking dist.recv "
                 f"before its dist.send, so all {world_size} waited for a message their left "
                 f"neighbour would only send after its own receive; they were stopped after "
                 f"{timeout:g} s. A longer timeout would not help.",
                 fix=demo_or(_DEADLOCK_FIX_ALL_RECV))
        stuck = ", ".join(f"rank {r} in dist.{v}" for r, v in where.items() if v) or \
            "no rank inside dist.send/recv"
        return (f"your ring did not finish within {timeout:g} s on {world_size} ranks and was "
                f"stopped ({stuck}): some send or receive has no partner — check that every "
                f"rank does the same number of steps and sends to rank+1, receives from rank-1")

    def failed(exc) -> None:
        if _DOUBLE_WAIT in str(exc.summary):
            kind, index = str(exc.summary).split(_DOUBLE_WAIT, 1)[1].split()[:2]
            what = "dist.isend" if kind == "send" else "dist.irecv"
            fail(f"rank {exc.rank} of {world_size} called wait() a second time on the work that "
                 f"its {what} number {int(index) + 1} returned (counting from the first of the "
                 f"ring): with gloo a second wait() on a work that has already completed never "
                 f"returns, so the ring would hang here, though every message has a partner.",
                 fix="wait on each work exactly once: after its wait(), drop it from the list "
                     "of works still pending.")
        mismatch = _size_mismatch(marker_dir, world_size)
        if mismatch:
            fail(mismatch)
        if "'tuple' object does not support item assignment" in str(exc.summary):
            fail(f"your ring raised TypeError on rank {exc.rank} of {world_size}: it assigns to "
                 f"an element of the tuple that tensor_split returns (like chunks[i] += "
                 f"incoming); a tuple cannot be changed, but the chunks in it are views of the "
                 f"tensor.", fix="add into the view itself, in place (chunks[i].add_(incoming)), "
                                 "and the tensor changes with it.")
        fail(f"your ring raised on rank {exc.rank} of {world_size}: {exc.summary}")

    try:
        per_rank = run_ranks(_real_worker, world_size, fn, cases, marker_dir, kwargs, dry_sizes,
                             timeout=timeout, hang=hang, failed=failed,
                             todo="ring_allreduce is not written yet ({summary}): replace the "
                                  "`raise NotImplementedError` under the TODO.")
        if any(r.get("library") for r in per_rank):
            fail(_LIBRARY)
        return per_rank
    finally:
        shutil.rmtree(marker_dir, ignore_errors=True)


_LIBRARY = ("your ring calls dpcourse.ring.ring_allreduce, the course's reference ring: the lab "
            "asks for your own, built from point-to-point messages, so that you are the one who "
            "works out which chunk goes where in each step.")


def _refuse_reference(fn) -> None:
    __tracebackhide__ = True
    import functools

    from dpcourse import ring as ring_module

    inner = fn.func if isinstance(fn, functools.partial) else fn
    if inner is ring_module.ring_allreduce or getattr(inner, "__module__", "") == "dpcourse.ring":
        fail("that is dpcourse.ring.ring_allreduce itself, the course's reference ring: the lab "
             "asks for your own function, built from point-to-point messages.")


def _size_mismatch(marker_dir: str, world_size: int) -> str | None:
    """After a crash: the first message whose two ends disagree on its size, as a sentence.
    (gloo aborts the receiving process when a message is longer than the receive buffer:
    "Received data size doesn't match expected size".)"""
    logs = {}
    for r in range(world_size):
        try:
            with open(os.path.join(marker_dir, f"p2p{r}")) as f:
                logs[r] = [line.split() for line in f if line.strip()]
        except OSError:
            logs[r] = []
    for src in range(world_size):
        for dst in range(world_size):
            sent = [int(n) for op, peer, n in logs[src] if op == "send" and peer == str(dst)]
            got = [int(n) for op, peer, n in logs[dst] if op == "recv" and peer == str(src)]
            for k, (a, b) in enumerate(zip(sent, got)):
                if a != b:
                    return (f"message {k + 1} from rank {src} to rank {dst} had {a} elements but "
                            f"rank {dst} received it into a buffer of {b} (gloo then aborts the "
                            f"process): in that step the chunk a rank receives into is not the "
                            f"chunk its left neighbour sends — their chunk indices are off by "
                            f"one (on a length N divides the sizes agree and only the numbers "
                            f"come out wrong).")
    return None


def _longest_same_run(first: list) -> tuple[int, int]:
    """The longest run of neighbouring ranks (around the ring) whose first call is the same:
    (its length, the rank it starts at)."""
    n = len(first)
    if len(set(first)) == 1:
        return n, 0
    best = (0, 0)
    for start in range(n):
        if first[start] == first[start - 1]:
            continue  # not the start of a run
        length = 1
        while length < n and first[(start + length) % n] == first[start]:
            length += 1
        best = max(best, (length, start))
    return best


def _refuse_serialised_steps(cases, traffic, n: int) -> None:
    """Part 3's contract: no step's transfers wait for one another around the ring. With gloo a
    send goes out only once its receiver has posted the receive (gloo/transport/tcp/pair.cc,
    ``Pair::send``), so a run of r neighbouring ranks that all send first (or all receive first)
    makes a chain of about r + 1 transfers, one after another. With N = 4 a run of N - 1 = 3 is
    a single rank doing the other order: each step then costs N transfer times, not two. (At
    N <= 3 every right order has a run of N - 1, so only N >= 4 is judged.)"""
    __tracebackhide__ = True
    if n < 4:
        return
    for (shape, _, _), case in zip(cases, traffic):
        if int(np.prod(shape)) < n:
            continue
        calls = [[op for kind, op, _, _ in t["events"] if kind == "post"] for t in case]
        for step in range(2 * (n - 1)):
            first = [c[2 * step] if len(c) > 2 * step else None for c in calls]
            if None in first:
                return
            run, start = _longest_same_run(first)
            if run >= n - 1:
                ranks = [(start + j) % n for j in range(run)]
                other = [r for r in range(n) if r not in ranks]
                verb = "dist.send" if first[start] == "send" else "dist.recv"
                fail(f"your ring finished without a deadlock, but not in parallel: in step "
                     f"{step + 1} on {n} ranks, ranks {', '.join(map(str, ranks))} all called "
                     f"{verb} first and only rank {other[0]} the other way round. A gloo send "
                     f"goes out only once its receiver is in dist.recv, so that step's {n} "
                     f"transfers ran one after another around the ring: about {n} transfer "
                     f"times per step instead of two, and the ring's time grows with N like "
                     f"the naive all-reduce's.",
                     fix="choose the order so that no long run of neighbouring ranks makes the "
                         "same first call: then each step's sends find their receivers waiting "
                         "at once, whatever N.")
        return  # one case of length >= N shows the order of every step


DRY_SIZES = (8, 16)  # part 3's order of calls is modelled on these group sizes too


def _refuse_growing_steps(dry, per_step: dict) -> dict:
    """Part 3's contract: a step takes about the same time whatever N. ``dry`` is
    :func:`_dry_orders`'s answer for :data:`DRY_SIZES`; each size's order of calls is run
    through :func:`_rounds` (one time unit per transfer, a gloo send waiting for its receiver).
    A rule that deadlocks on a larger group is named; so is one whose time per step grows from
    8 to 16 ranks (by more than half a transfer: the rules that keep the contract stay within a
    few hundredths, e.g. even/odd at 2.0 and "the first half of the ranks send first" at 2.2 on
    both). Returns ``{N: transfer times per step}`` (empty when the order could not be found)."""
    __tracebackhide__ = True
    if not isinstance(dry, dict):
        return {}  # the ring needs more than send/recv/rank/size: its order is not judged
    modelled = {}
    for n, orders in dry.items():
        units, waiting = _rounds(orders)
        if units is None:
            firsts = {orders[r][0][0] if orders[r] else None for r in waiting}
            how = (f"all call dist.{firsts.pop()} first" if len(firsts) == 1 else
                   "wait for calls their neighbours never make")
            fail(f"your ring is right on {', '.join(map(str, sorted(per_step)))} ranks, but run "
                 f"with {n} ranks (its calls found without sending anything) its order of calls "
                 f"deadlocks: ranks {_ranks_text(waiting)} {how}. The contract asks for every "
                 f"N >= 2, and the rule that decides who sends first is the place to look.",
                 fix="decide the order from the rank (and N) so that, for every N, both kinds "
                     "of rank exist and alternate around the ring as far as N allows.")
        modelled[n] = units / (2 * (n - 1))
    small, large = min(modelled), max(modelled)
    if modelled[large] > modelled[small] + 0.5:
        orders = dry[large]
        first = [o[0][0] if o else None for o in orders]
        senders = [r for r in range(large) if first[r] == "send"]
        receivers = [r for r in range(large) if first[r] == "recv"]
        steady = all(o[k][0] == o[0][0] and o[k + 1][0] == o[1][0]
                     for o in orders if len(o) >= 2 for k in range(0, len(o) - 1, 2))
        few = min(len(senders), len(receivers))
        cap = (f" A transfer needs a rank in dist.send and its right neighbour in dist.recv, "
               f"and in your ring each rank keeps its order in every step, so no more than "
               f"{few} transfer{'s' if few > 1 else ''} can run at once: the other "
               f"{large - few} of a step's {large} wait their turn." if steady and few else "")
        costs = [f"{v:.1f} on {n}" for n, v in {**per_step, **modelled}.items()]
        fail(f"your ring is right, but its time per step grows with N. Counting each transfer "
             f"as one time unit and a send as waiting for its receiver's dist.recv (gloo's "
             f"rule), the order of its calls costs about {costs[0]} ranks, "
             f"{', '.join(costs[1:-1])} and {costs[-1]} transfer times per step (on {small} "
             f"and {large} ranks found by running your code with stand-ins that only note the "
             f"calls). On {large} ranks, {len(senders)} rank(s) ({_ranks_text(senders)}) call "
             f"dist.send first in step 1 and {len(receivers)} call dist.recv first.{cap} The "
             f"contract asks for a step time that stays about the same whatever N.",
             fix="choose the rule so that the number of ranks that send first, and the number "
                 "that receive first, both grow with N (about half each), spread around the "
                 "ring: then about N/2 transfers run at once, whatever N.")
    return modelled


def _ranks_text(ranks) -> str:
    ranks = list(ranks)
    return ", ".join(map(str, ranks)) if len(ranks) <= 6 else (
        f"{', '.join(map(str, ranks[:4]))}, …, {ranks[-1]}")


def _check_ring_once(fn, world_size: int, timeout: float, dry_sizes=()) -> dict:
    """Run and judge the ring on ``world_size`` ranks; once it is right, return the order of
    its calls: ``{"recorded": [per rank (op, peer)...] of the first case with no empty chunk,
    "dry": _dry_orders's answer for ``dry_sizes`` (None if not asked)}``."""
    __tracebackhide__ = True
    cases = _REAL_CASES
    per_rank = _launch_ring(fn, world_size, timeout, cases, dry_sizes=dry_sizes)
    dry = per_rank[0].get("orders") if dry_sizes else None
    traffic = [[per_rank[r]["traffic"][i] for r in range(world_size)] for i in range(len(cases))]
    per_rank = [per_rank[r]["results"] for r in range(world_size)]
    results = [[per_rank[r][i] for r in range(world_size)] for i in range(len(cases))]
    correct = _simulate_real(world_size, cases)
    used = sorted({b for case in traffic for t in case for b in t["builtins"]})
    if used:
        fail(f"your ring_allreduce called dist.{used[0]}: the lab is to build the all-reduce "
             f"yourself, from point-to-point messages (dist.send / dist.recv) only.")
    nonblocking = sorted({f for case in traffic for t in case for f in t["nonblocking"]})
    if nonblocking:
        fail(f"your ring_allreduce called dist.{nonblocking[0]}, which returns before its "
             f"message has gone: part 3's contract is the blocking dist.send and dist.recv "
             f"only, so that the order of each step's two calls is yours to decide, and a wrong "
             f"order deadlocks (isend/irecv wait for the stretch).",
             fix="replace the non-blocking calls and their waits with dist.send and dist.recv, "
                 "and decide which ranks send first in a step and which receive first.")
    if _matches(results, correct):
        n = world_size
        for (shape, _, _), case in zip(cases, traffic):
            k = int(np.prod(shape))
            if k < n:
                continue  # some chunks are empty; a ring may skip sending them
            for rank, t in enumerate(case):
                if t["messages"] != 2 * (n - 1):
                    fail(f"rank {rank} sent {t['messages']} messages for a tensor of {k} "
                         f"elements on {n} ranks; a ring sends exactly 2(N-1) = {2 * (n - 1)}: "
                         f"N-1 steps of scatter-reduce, then N-1 of all-gather.",
                         fix="send one chunk per step, and run each phase N-1 steps.")
                if t["elements"] > 2 * (n - 1) * -(-k // n):
                    fail(f"rank {rank} sent {t['elements']} elements for a tensor of {k} on {n} "
                         f"ranks, more than 2(N-1) chunks of about K/N = {k / n:.1f} elements: "
                         f"some message carried more than one chunk.",
                         fix="send one chunk per message, not the whole tensor.")
        _refuse_serialised_steps(cases, traffic, n)
        recorded = next((_recorded_orders(case, n) for (shape, _, _), case in zip(cases, traffic)
                         if int(np.prod(shape)) >= n), None)
        return {"recorded": recorded, "dry": dry}
    # Which mistake? In the order a learner most likely makes them.
    for i, ((shape, _, op), res) in enumerate(zip(cases, results)):
        got = [g for g, _ in res]
        inputs = [_real_input(r, shape) for r in range(world_size)]
        if all(np.array_equal(g, x) for g, x in zip(got, inputs)):
            returned = [rv for _, rv in res]
            if all(rv is not None and np.allclose(rv, w) for rv, w in zip(returned, correct[i])):
                fail("ring_allreduce returns the right result but leaves the tensor it was "
                     "given unchanged: the caller, like dist.all_reduce's, reads that tensor.",
                     fix="write the result into the tensor you were given (in place).")
    if _matches(results, _simulate_real(world_size, cases, average=False)):
        if _rebinds_division(fn):
            fail("with op='average' the caller's tensor still holds the sum: the division made "
                 "a new tensor (like flat = flat / n) and left the one you were given untouched.",
                 fix="divide in place: flat /= n or flat.div_(n).")
        fail("summing without averaging: with op='average' the tensor holds the sum of the "
             "ranks' tensors, N times the average.",
             fix="divide by the world size when op='average'.")
    for k in (2, 3, 4):
        if k != world_size and _matches(results, _simulate_real(world_size, cases, divisor=k)):
            fail(f"with op='average' on {world_size} ranks you divided by {k}, a fixed number "
                 f"that is not this group's size.",
                 fix="divide by dist.get_world_size().")
    for rule in _OTHER_CHUNK_RULES:
        if _matches(results, _simulate_real(world_size, cases, bounds=rule)):
            shape = next(sh for sh, _, _ in cases if int(np.prod(sh)) % world_size)
            fail(_chunk_rule_sentence("your ring", world_size, int(np.prod(shape)), rule),
                 fix=_CHUNK_RULE_FIX)
    shifts = [(a, b) for a in (-1, 0, 1) for b in (-1, 0, 1)]
    n = world_size
    gathered = all(t["messages"] >= 2 * (n - 1) for (shape, _, _), case in zip(cases, traffic)
                   if int(np.prod(shape)) >= n for t in case)
    for sr in shifts:
        for average in (True, False):
            if _matches(results, _simulate_real(world_size, cases, sr, gather=False,
                                                average=average)):
                if gathered:
                    fail("your all-gather sends and receives its N-1 messages, but what a rank "
                         "receives never reaches its tensor: the receive lands in a buffer that "
                         "is not a view of the tensor (or a copy of it) and is never written "
                         "back, so each rank keeps only its one finished chunk.",
                         fix="receive the all-gather's chunks into the tensor's own chunk "
                             "views (or copy them there).")
                fail("missing all-gather: the tensors hold what the scatter-reduce leaves, each "
                     "rank only its one finished chunk.",
                     fix="add N-1 steps that pass the finished chunks around the ring.")
    for sr in shifts:
        for ag in shifts:
            if (sr, ag) != ((0, 0), (0, 0)) and _matches(
                    results, _simulate_real(world_size, cases, sr, ag)):
                phase = "scatter-reduce" if sr != (0, 0) else "all-gather"
                fail(f"off-by-one chunk index in the {phase}: the results are those of a ring "
                     f"whose {phase} sends or receives the chunk next to the right one.",
                     fix="in every step the chunk a rank receives into must be the one its "
                         "left neighbour sends, and what a rank sends next is the chunk it "
                         "received (and completed) in the step before.")
    for i, ((shape, _, op), res) in enumerate(zip(cases, results)):
        for r, (got, _) in enumerate(res):
            want = correct[i][r]
            if got.shape != want.shape or not np.allclose(got, want, rtol=1e-6):
                fail(f"wrong result on rank {r} of {world_size} for a tensor of shape {shape} "
                     f"with op='{op}': "
                     f"it should equal the {'average' if op == 'average' else 'sum'} of all "
                     f"ranks' tensors.")
    fail("ring_allreduce gives wrong results.")  # unreachable in practice, but never pass


# --- predict, then measure: the bytes one rank sends ----------------------------------------


def measure_bytes_sent(fn, world_size: int = 4, numel: int = 10,
                       timeout: float | None = None) -> list[int]:
    """Run the learner's ``fn(tensor, op="sum")`` on ``world_size`` gloo ranks with a float32
    tensor of ``numel`` elements and return the bytes each rank sent (point-to-point only)."""
    __tracebackhide__ = True
    timeout = check_timeout(timeout, 20.0)
    if not callable(fn):
        fail(f"measure_bytes_sent needs your ring_allreduce function, got {type(fn).__name__}")
    _refuse_reference(fn)
    per_rank = _launch_ring(fn, world_size, timeout, [((numel,), "float32", "sum")])
    return [int(per_rank[r]["traffic"][0]["elements"]) * 4 for r in range(world_size)]


def check_prediction(guess, measured, world_size: int = 4, numel: int = 10) -> None:
    """Compare the learner's prediction of the most bytes any one rank sends (N = 4, K = 10
    float32: chunks of 3, 3, 2, 2 elements) with :func:`measure_bytes_sent`'s per-rank bytes, and
    say why the number is what it is (never raises for a wrong prediction).

    A rank sends every chunk but one in each phase: not, in the scatter-reduce, the chunk it
    finishes (its last contribution arrives; there is nothing to pass on), and not, in the
    all-gather, the chunk it receives last (its right neighbour finished it). Those two chunks
    are neighbours in the ring's order, whatever the layout, so the most any rank sends is 2K
    minus the two smallest neighbouring chunks; 2(N-1)K/N is only the average over ranks."""
    from dpcourse.checks import reveal

    n, k = world_size, numel
    sizes = [hi - lo for lo, hi in chunk_bounds(k, n)]
    pairs = [sizes[i] + sizes[(i + 1) % n] for i in range(n)]
    most = (2 * k - min(pairs)) * 4
    least = (2 * k - max(pairs)) * 4
    average = 2 * (n - 1) * k / n * 4
    worst = max(measured)
    close = abs(float(guess.value) - worst) < 0.5
    explanation = (
        f"A rank sends every chunk but one in each phase: in the scatter-reduce not the chunk it "
        f"finishes (nothing is left to pass on), in the all-gather not the one it receives last "
        f"(its right neighbour finished it) — two chunks next to each other in the ring. With "
        f"chunks of {', '.join(map(str, sizes))} elements, the rank that skips two "
        f"{min(sizes)}-element chunks sends 2K − {min(pairs)} = {2 * k - min(pairs)} float32 "
        f"({most} bytes) and the one that skips two {max(sizes)}-element chunks "
        f"{2 * k - max(pairs)} ({least} bytes): 2(N−1)K/N × 4 = {average:g} bytes is only the "
        f"average over the ranks, exact when N divides K. Your ring's ranks sent "
        f"{', '.join(map(str, measured))} bytes.")
    if worst != most or sum(measured) != round(average * n):
        explanation += (f" That is not {most} at most and {round(average * n)} in all: does "
                        f"your ring send exactly one chunk per step, every chunk of "
                        f"ring.chunk_bounds's size?")
    reveal(guess, worst, close=close, explanation=explanation)


# --- stretch: the scatter-reduce in segments -------------------------------------------------

_SEGMENT_CASES = [((48,), "float64", "sum"), ((50,), "float64", "sum"),
                  ((4, 13), "float32", "average")]


def _first_unpipelined(events, n: int, segments: int):
    """The index of the first scatter-reduce receive that was waited on before the next piece's
    send and receive were both posted (None if every piece but a step's last had its successor
    in flight). Receives and sends are numbered in the order they were posted; the first
    (N-1)·S receives are the scatter-reduce's pieces. A receive never waited on (polled, or
    through its future) is not judged."""
    posted = {"send": 0, "recv": 0}
    for kind, op, index, _ in events:
        if kind == "post":
            posted[op] = max(posted[op], index + 1)
        elif op == "recv" and index < (n - 1) * segments and (index + 1) % segments:
            if posted["recv"] <= index + 1 or posted["send"] <= index + 1:
                return index
    return None


def _posted_before_wait(events, index: int) -> tuple[int, int]:
    """How many sends and receives had been posted when receive ``index`` was first waited on
    (everything posted, if it never was)."""
    posted = {"send": 0, "recv": 0}
    for kind, op, i, _ in events:
        if kind == "post":
            posted[op] = max(posted[op], i + 1)
        elif op == "recv" and i == index:
            break
    return posted["send"], posted["recv"]


def _first_added_late(events, n: int, segments: int):
    """The index of the first scatter-reduce piece j that was not yet added into the tensor when
    piece j + 1 (of the same step) was waited on: the tensor held the same values when the two
    receives were waited on (None if every such piece was added in between). Receives never
    waited on are not judged."""
    at_wait = {index: fp for kind, op, index, fp in events if kind == "wait" and op == "recv"}
    for index in range((n - 1) * segments):
        if (index + 1) % segments and index in at_wait and index + 1 in at_wait:
            if at_wait[index] == at_wait[index + 1]:
                return index
    return None


def _most_in_flight(events, n: int, segments: int) -> int:
    """The most scatter-reduce receives posted and not yet waited on at one moment: how many
    receive buffers the ring needed at once (the stretch's design decision)."""
    open_now = most = 0
    for kind, op, index, _ in events:
        if op == "recv" and index < (n - 1) * segments:
            open_now += 1 if kind == "post" else -1 if kind == "wait" else 0
            most = max(most, open_now)
    return most


def _receive_name(index: int, n: int, segments: int) -> str:
    if index < (n - 1) * segments:
        return f"piece {index % segments} of scatter-reduce step {index // segments + 1}"
    return f"receive {index + 1} (an all-gather one)"


def _shared_buffer_sentence(shared, rank: int, n: int, segments: int, k: int) -> str:
    earlier, later = shared
    return (f"rank {rank} posted the receive of {_receive_name(later, n, segments)} into memory "
            f"that the receive of {_receive_name(earlier, n, segments)} was still writing into "
            f"(posted, not yet waited on; N={n}, segments={segments}, {k} elements): one "
            f"receive buffer shared by messages in flight, so the later message can overwrite "
            f"the earlier one before it is added, and the sum depends on which arrives when "
            f"(the ring may even pass on one run and fail on the next). It is not a piece "
            f"index: every piece may be added to the right place, from a buffer that no longer "
            f"holds it.")


_SHARED_BUFFER_FIX = ("give every receive that is in flight at the same time a buffer of its "
                      "own (one per piece of the step, or as many as you keep in flight, reused "
                      "only after the receive that used it was waited on and added).")


IN_FLIGHT_QUESTION = "scatter-reduce receives in flight at most, segments=4"


def _declared_in_flight(in_flight, segments: int):
    """``in_flight`` as a Prediction, validated; None when not declared. Refuses (unrecorded) a
    number no ring that keeps the contract can have, and a number other than the one already
    compared with a measurement in this kernel."""
    __tracebackhide__ = True
    if in_flight is None:
        return None
    declared = in_flight if isinstance(in_flight, Prediction) else Prediction(
        "lab06", IN_FLIGHT_QUESTION, in_flight, "receive(s)")
    value = declared.value
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        fail(f"in_flight must be a whole number of receives, got {value!r}.")
    if value < 2:
        fail(f"you declared {value} scatter-reduce receive(s) in flight: the contract asks that "
             f"piece j + 1 be on its way (its receive posted) while piece j is waited for and "
             f"added, so at that moment two receives are posted and not yet waited on. No ring "
             f"that keeps the contract has fewer; this number was not kept as your decision.")
    if value > segments:
        fail(f"you declared {value} scatter-reduce receives in flight with segments={segments}: "
             f"a step has only {segments} pieces, and the next step's pieces are the sums this "
             f"step is still adding, so they cannot be on their way yet. This number was not "
             f"kept as your decision.")
    first = kept_prediction("lab06", IN_FLIGHT_QUESTION)
    if first is not None and int(first.value) != int(value):
        fail(f"you declared {int(first.value)} receive(s) in flight first, and the check "
             f"compared that number with your ring; now you declare {int(value)}. A decision "
             f"that changes after each measurement until the check passes is a search, not a "
             f"decision: the check keeps your first number, {int(first.value)}, and holds your "
             f"ring to it.",
             fix=f"set in_flight back to {int(first.value)} and change the ring so that, at "
                 f"its busiest moment (just before a wait), it has {int(first.value)} "
                 f"receive(s) started and not yet waited on.")
    return declared


@recorded
def check_segmented_ring(fn, segments: int = 4, timeout: float | None = None,
                         world_sizes=WORLD_SIZES, in_flight=None) -> None:
    """Stretch: ``fn(tensor, op, segments=S)`` must give the sum / average in place, sending
    each scatter-reduce chunk as S segments: at least (N-1)·S messages of at most
    ceil(ceil(K/N)/S) elements per rank, and no built-in collective. (The all-gather may send
    whole chunks or segments.) In the scatter-reduce, piece j + 1 must be posted before piece j
    is waited on, and piece j added into the tensor before piece j + 1 is waited on (the
    tensor's contents at the two waits differ): post-all, wait-all, add-all is refused.

    ``in_flight``: the learner's design decision, declared before the ring is written (the
    :class:`~dpcourse.checks.Prediction` that ``predict(..., IN_FLIGHT_QUESTION, n)`` returned,
    or a plain number) — the most scatter-reduce receives their ring keeps posted and not yet
    waited on at once with ``segments`` pieces per chunk. It must be what the ring did
    (measured on every rank). The first number compared with a measurement is kept as the
    decision for this kernel: a different number afterwards is refused with its own sentence
    (trying numbers until one passes is a search, not a decision), and the ring must be made
    to keep the declared count instead."""
    __tracebackhide__ = True
    timeout = check_timeout(timeout, 30.0)
    if not callable(fn):
        fail(f"check_segmented_ring needs your function, got {type(fn).__name__}")
    declared = _declared_in_flight(in_flight, segments)
    _refuse_reference(fn)
    most = 0
    for n in world_sizes:
        for S in (segments, segments - 1):  # two segment counts: none may be hard-coded
            per_rank = _launch_ring(fn, n, timeout, _SEGMENT_CASES, {"segments": S})
            correct = _simulate_real(n, _SEGMENT_CASES)
            for i, (shape, _, op) in enumerate(_SEGMENT_CASES):
                k = int(np.prod(shape))
                chunk = -(-k // n)
                piece = -(-chunk // S)
                for r in range(n):
                    got = per_rank[r]["results"][i][0]
                    t = per_rank[r]["traffic"][i]
                    if t["builtins"]:
                        fail(f"the segmented ring called dist.{t['builtins'][0]}: build it from "
                             f"dist.isend / dist.irecv only.")
                    shared = _first_shared_buffer(t["events"])
                    if shared is not None:
                        fail(_shared_buffer_sentence(shared, r, n, S, k), fix=_SHARED_BUFFER_FIX)
                    if not np.allclose(got, correct[i][r], rtol=1e-6):
                        fail(f"wrong result on rank {r} of {n} for shape {shape}, op='{op}', "
                             f"segments={S}: the tensor must end as the "
                             f"{'average' if op == 'average' else 'sum'} of all ranks' tensors.",
                             fix="check that segment j of the chunk you receive is added to "
                                 "segment j of the same chunk.")
                    small = sum(1 for m in t["sizes"] if m <= piece)
                    if small < (n - 1) * S:
                        fail(f"rank {r} sent {small} message(s) of at most {piece} elements for "
                             f"a tensor of {k} on {n} ranks with segments={S}; the segmented "
                             f"scatter-reduce sends each chunk (about {chunk}) as {S} pieces, "
                             f"(N-1)·S = {(n - 1) * S} in all.",
                             fix="split the chunk with tensor_split(segments) and send the "
                                 "pieces one by one.")
                    late = _first_unpipelined(t["events"], n, S)
                    if late is not None:
                        j = late % S
                        sent, got = _posted_before_wait(t["events"], late)
                        missing = " and ".join(
                            w for w, done in (("send", sent > late + 1),
                                              ("receive", got > late + 1)) if not done)
                        fail(f"rank {r} waited for piece {j} of a scatter-reduce chunk before it "
                             f"had posted piece {j + 1}'s {missing} (N={n}, segments={S}): "
                             f"piece {j + 1} was not on its way while piece {j} was waited for "
                             f"and added, so that addition overlapped no transfer.",
                             fix="have piece j + 1's send and receive started before you wait "
                                 "for piece j.")
                    unadded = _first_added_late(t["events"], n, S)
                    if unadded is not None:
                        j = unadded % S
                        step_first = unadded - j
                        sent, got = _posted_before_wait(t["events"], step_first)
                        if got >= step_first + S and sent >= step_first + S:
                            how = (f"every piece of the step was posted before the first wait, "
                                   f"but the additions came after the waits, so none of them "
                                   f"overlapped a transfer")
                        else:
                            how = (f"piece {j + 1} was posted in time (it was on its way while "
                                   f"you waited for piece {j}), but piece {j} was added only "
                                   f"after piece {j + 1}'s wait, so that addition overlapped no "
                                   f"transfer")
                        fail(f"rank {r} waited for piece {j + 1} of a scatter-reduce chunk while "
                             f"piece {j} had arrived but was not yet added into the tensor (N={n},"
                             f" segments={S}): {how}.",
                             fix="add piece j into the tensor before you wait for piece j + 1.")
                    if S == segments:
                        most = max(most, _most_in_flight(t["events"], n, S))
                    allowed = {(n - 1) * (S + 1), 2 * (n - 1) * S}
                    if t["messages"] not in allowed:
                        fail(f"rank {r} sent {t['messages']} messages on {n} ranks with "
                             f"segments={S}; a ring sends (N-1)·S pieces in the scatter-reduce "
                             f"and N-1 chunks (or (N-1)·S pieces) in the all-gather: "
                             f"{' or '.join(map(str, sorted(allowed)))} in all. Does a phase "
                             f"run more or fewer than N-1 steps?")
    if declared is not None:
        keep(declared, most, close=int(declared.value) == int(most))
        if int(declared.value) != most:
            fail(f"you declared {int(declared.value)} scatter-reduce receive(s) in flight at "
                 f"once with segments={segments}, but at its busiest moment your ring had a "
                 f"different number posted and not yet waited on (the most on any rank, "
                 f"measured): your code and your design decision disagree, and each receive in "
                 f"flight needs a buffer of its own. {int(declared.value)} is now kept as your "
                 f"decision: the check holds your ring to it (the count is yours to work out "
                 f"from your code, and the check does not say it).",
                 fix=f"your ring kept {'more' if most > int(declared.value) else 'fewer'} "
                     f"than {int(declared.value)}. Read your scatter-reduce step with "
                     f"segments={segments}: just before each wait() on a receive, count the "
                     f"irecv your code has started and not yet waited on, the one about to be "
                     f"waited on included. The largest of those counts is what the check "
                     f"measured; move the point where your code starts the next pieces' "
                     f"receives until it is {int(declared.value)}, the number you decided on.")
    # The count in flight is the learner's to work out: said only once they declared it.
    counted = (f"up to {most} receive(s) in flight at once with segments={segments}, as "
               f"declared, so {most} receive buffer(s) of a piece each" if declared is not None
               else "declare in_flight to have your count of receives in flight compared")
    passed(f"segmented ring: right sums and averages on {' and '.join(map(str, world_sizes))} "
           f"ranks, each scatter-reduce chunk sent in {segments} (and {segments - 1}) segments, "
           f"piece j + 1 posted before piece j was waited on, and piece j added before piece "
           f"j + 1 was waited on; {counted}")
