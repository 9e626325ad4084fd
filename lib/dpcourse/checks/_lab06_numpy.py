"""Lab 06, parts 1 and 2: the ring's two phases in NumPy, and the paper question before them.

The layout is a parameter the lesson never shows: ``owner[i]`` is the chunk worker i must end
the reduce-scatter holding complete (any permutation of the chunks, as a sharded optimizer
might ask for; ``None`` means ``owner[i] = i``). Lesson 06's formula, (i + 1 - t) mod N, is
one layout among them, and no shifted copy of it is right for a layout that is not a rotation:
the learner must follow a chunk to the worker it ends on. At step t worker i sends chunk
``owner[(i - t) mod N]`` (it ends N - 1 - t hops past worker i + 1, on worker i - t).

:func:`check_worker0_sends` judges the paper answer (N = 4, owner = [2, 0, 3, 1]) by where each
chunk would end; :func:`check_scatter_reduce` and :func:`check_all_gather` run the learner's
phases on a few worker counts, lengths (uneven ones too) and layouts, and recognise each
plausible mistake by simulating it (:func:`_scatter_reduce` and :func:`_all_gather` take the
mistake as arguments) and matching the learner's numbers: the layout ignored (every worker
finishing chunk i, or lesson 06's layout), arithmetic on owner's chunk index ((owner[i] - t)
mod N, right only for rotations), owner read the other way round (as the worker of a chunk), an
index off by one, a wrong number of steps, a chunk rule other than ``ring.chunk_bounds``, an
all-gather that adds or writes nowhere. A shifted index into owner (owner[(i + 1 - t) mod N]) is
lesson 06's formula on the identity layout, so it is judged on the paper's layout first
(:func:`_off_by_one_owner`). A reduce-scatter whose owner chunks are right but whose other chunks
are not the partial sums a ring leaves (np.sum into each owner's chunk) is named as no ring
(:func:`_refuse_shortcut_sums`). An all-gather's result says nothing of how it got there, so a
right one runs again on tracked arrays (:func:`_refuse_not_a_ring`; the tracking is
:mod:`._lab06_tracked`): a chunk copied from a worker that is not the left neighbour (the
owner's chunk straight to everyone), more than one chunk in one write, and chunks passed on in
another order than the ring's steps are each named. The same two simulators give part 3's expected results (:mod:`._lab06_ring`, in
lesson 06's layout).
"""

from __future__ import annotations

import inspect
import itertools

import numpy as np

from dpcourse.checks import LabCheckError, fail, passed, recorded
from dpcourse.ring import chunk_bounds

from ._lab06_tracked import _chunk_of, _transfers

# (workers, length, owner): even and uneven lengths, L < N; the identity layout (owner None,
# called with buffers alone), a layout that is not a rotation, lesson 06's (a rotation)
_CASES = [(3, 9, None), (4, 10, (2, 0, 3, 1)), (5, 7, (1, 2, 3, 4, 0)), (5, 8, (3, 0, 4, 1, 2)),
          (3, 2, (0, 2, 1))]


def _inputs(n: int, length: int, seed: int = 6) -> list[np.ndarray]:
    # Distinct integers (as float64): sums are exact, so every mistake gives different numbers.
    rng = np.random.default_rng(seed + 31 * n + length)
    return [rng.integers(1, 1000, length).astype(np.float64) * (w + 1) for w in range(n)]


# --- layouts, the reference and its plausible mistakes -----------------------------------------


def _owner(n: int, owner) -> tuple:
    """``owner`` as a tuple: None is the lab's default layout (worker i finishes chunk i),
    "lesson" lesson 06's (worker i finishes chunk (i + 1) mod N)."""
    if owner is None:
        return tuple(range(n))
    if isinstance(owner, str) and owner == "lesson":
        return tuple((w + 1) % n for w in range(n))
    return tuple(int(c) for c in owner)


def _sender(owner: tuple, how: str = "owner"):
    """``chunk(i, t, d)``: the chunk worker i sends at step t (1-based) when the learner's rule
    is ``how`` and its index is shifted by d: "owner" is the right rule, owner[(i - t) mod N]
    (d shifts the worker looked up); "rotated" does arithmetic on owner's chunk index,
    (owner[i] - t) mod N, right only when owner is a rotation; "inverse" reads owner the other
    way round, as the worker that finishes each chunk."""
    n = len(owner)
    if how == "rotated":
        return lambda i, t, d: (owner[i % n] - t + d) % n
    if how == "inverse":
        inverse = [owner.index(c) for c in range(n)]
        return lambda i, t, d: inverse[(i - t + d) % n]
    return lambda i, t, d: owner[(i - t + d) % n]


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


def _scatter_reduce(buffers, send_shift=0, recv_shift=0, steps=None, bounds=chunk_bounds,
                    owner=None, how="owner"):
    n = len(buffers)
    chunk = _sender(_owner(n, owner), how)
    b = bounds(len(buffers[0]), n)
    for t in range(1, (n - 1 if steps is None else steps) + 1):
        out = [buffers[i][slice(*b[chunk(i, t, send_shift)])].copy() for i in range(n)]
        for i in range(n):
            target = buffers[(i + 1) % n][slice(*b[chunk(i, t, send_shift + recv_shift)])]
            if target.shape == out[i].shape:
                target += out[i]
            else:  # sizes differ for uneven chunks: the mistake would crash; mark it garbage
                target[...] = np.nan
    return buffers


def _all_gather(buffers, send_shift=0, recv_shift=0, steps=None, add=False,
                bounds=chunk_bounds, owner=None, how="owner"):
    # At all-gather step s = 1 .. N-1 worker i passes on the chunk it completed most recently:
    # its own, owner[i], at s = 1, then the one that arrived the step before.
    n = len(buffers)
    chunk = _sender(_owner(n, owner), how)
    b = bounds(len(buffers[0]), n)
    for s in range(1, (n - 1 if steps is None else steps) + 1):
        out = [buffers[i][slice(*b[chunk(i, s - 1, send_shift)])].copy() for i in range(n)]
        for i in range(n):
            target = buffers[(i + 1) % n][slice(*b[chunk(i, s - 1, send_shift + recv_shift)])]
            if target.shape != out[i].shape:
                target[...] = np.nan
            elif add:
                target += out[i]
            else:
                target[...] = out[i]
    return buffers


def reference_scatter_reduce(buffers, owner=None):
    """Reduce-scatter in place: afterwards worker i holds the full sum of chunk owner[i]."""
    return _scatter_reduce(buffers, owner=owner)


def reference_all_gather(buffers, owner=None):
    """All-gather in place, after :func:`reference_scatter_reduce` with the same ``owner``:
    every worker gets every sum."""
    return _all_gather(buffers, owner=owner)


_CHUNK_RULE_FIX = ("cut the chunks with ring.chunk_bounds(length, N) and index them by its "
                   "(start, stop) pairs.")
_FOLLOW = ("follow one chunk: the chunk worker i sends at step t is added by worker i + 1 and "
           "passed on N - 1 - t more times, so the worker it ends on is fixed by i and t alone; "
           "owner says which chunk that worker must end with, and that is the chunk to send.")
_SR_RULE = ("the chunk a worker adds into must be the chunk its left neighbour sent in that "
            "step, and " + _FOLLOW)
_AG_RULE = ("in each step a worker must pass on the chunk it completed most recently (at the "
            "first step its own, owner[i]), and its right neighbour must overwrite that same "
            "chunk.")


def _takes_owner(fn) -> bool:
    try:
        inspect.signature(fn).bind([], ())
    except (TypeError, ValueError):
        return False
    return True


def _run_learner(fn, buffers, owner, what):
    __tracebackhide__ = True
    try:
        if owner is None:
            out = fn(buffers, list(range(len(buffers)))) if _takes_owner(fn) else fn(buffers)
        elif _takes_owner(fn):
            out = fn(buffers, list(owner))
        else:
            fail(f"your {what} takes only buffers: the contract's second parameter, owner, says "
                 f"which chunk each worker must finish (the check passes owner={list(owner)} "
                 f"for N={len(buffers)}).", fix=f"define it as def {what}(buffers, owner=None).")
    except NotImplementedError:
        raise  # an unsolved TODO: let the lab stop right there, with the TODO's own message
    except LabCheckError:
        raise
    except Exception as exc:  # noqa: BLE001 - the learner's code; name the error in one line
        fail(f"your {what} raised {type(exc).__name__}: {exc}")
    if isinstance(out, (list, tuple)) and len(out) == len(buffers):
        buffers = [np.asarray(o) for o in out]  # returning new arrays is fine too
    return buffers


def _same(a_list, b_list) -> bool:
    return all(a.shape == b.shape and np.array_equal(a, b) for a, b in zip(a_list, b_list))


def _case(n: int, owner) -> str:
    return f"N={n}" if owner is None else f"N={n}, owner={list(owner)}"


def _misread_layout(got, phase, start, owner, what: str) -> None:
    """Name the mistake if ``got`` is ``phase`` run from ``start`` with the layout ignored or
    misread: every worker i finishing chunk i, lesson 06's layout, arithmetic on owner's chunk
    index, or owner read the other way round."""
    __tracebackhide__ = True
    n = len(start)
    layout = _owner(n, owner)
    lesson = _owner(n, "lesson")
    done = "finish" if phase is _scatter_reduce else "start the all-gather from"
    if layout != lesson and _same(got, phase([a.copy() for a in start], owner="lesson")):
        fail(f"{what} makes worker i {done} chunk (i + 1) mod N ({_case(n, owner)}): that is "
             f"lesson 06's layout, (i + 1 - t) mod N, copied, not the one owner names, so the "
             f"finished sums sit on the wrong workers.", fix=_FOLLOW)
    if owner is not None and layout != tuple(range(n)) and _same(
            got, phase([a.copy() for a in start], owner=None)):
        fail(f"{what} makes worker i {done} chunk i whatever owner says ({_case(n, owner)}): "
             f"that is the layout of owner = {list(range(n))}, so the finished sums sit on the "
             f"wrong workers.", fix="read owner inside the loop; " + _FOLLOW)
    for how in ("rotated", "inverse"):
        if owner is None or not _same(got, phase([a.copy() for a in start], owner=owner,
                                                 how=how)):
            continue
        if how == "rotated":
            fail(f"{what} finds the chunk by arithmetic on owner's chunk index, (owner[i] - t) "
                 f"mod N ({_case(n, owner)}): that follows a chunk only when owner is a "
                 f"rotation (owner[i + 1] = owner[i] + 1, as in lesson 06's layout); this "
                 f"owner is not, so chunks end on workers owner did not give them to.",
                 fix="a chunk index minus t names no chunk's journey; " + _FOLLOW)
        fail(f"{what} reads owner the other way round ({_case(n, owner)}): your ring finishes "
             f"chunk c on worker owner[c], but owner[i] is the chunk that worker i must finish "
             f"(a chunk index, looked up by a worker).",
             fix="look owner up by a worker, never by a chunk; " + _FOLLOW)


def _wrong_steps_or_chunk(got, phase, start, owner, what: str, chunk_rule: str) -> None:
    """Name the mistake if ``got`` is the reference ``phase`` run from ``start`` with a wrong
    number of steps, or with the sent or received chunk's worker index off by one or two."""
    __tracebackhide__ = True
    n = len(start)
    for steps in (n, n - 2, 1):
        if steps != n - 1 and steps >= 0 and _same(
                got, phase([a.copy() for a in start], steps=steps, owner=owner)):
            fail(f"{what} ran {steps} steps for N={n} workers; it takes exactly N-1 = {n - 1}: "
                 f"each step moves every chunk one hop, and N-1 hops carry a chunk past every "
                 f"worker once.", fix="loop over range(N - 1) steps, N being len(buffers).")
    for ds, dr in itertools.product((-1, 0, 1, 2), (-1, 0, 1)):
        if (ds, dr) != (0, 0) and _same(got, phase([a.copy() for a in start], ds, dr,
                                                   owner=owner)):
            def places(d: int, same: str, base: str) -> str:
                return same if d == 0 else (
                    f"the one meant for the worker {abs(d)} place{'s' if abs(d) > 1 else ''} "
                    f"{'further round the ring' if d > 0 else 'back'} from {base}")

            fail(_off_by_one_sentence(what, n, owner, ds, dr), fix=chunk_rule)


# --- what moved where (the tracked arrays: dpcourse.checks._lab06_tracked) -------------------


def _refuse_not_a_ring(fn, start, owner, total, what: str) -> None:
    """The all-gather's contract beyond its result: N - 1 steps in which every worker sends one
    chunk to its right neighbour, the one it completed most recently. The learner's phase runs
    again on tracked arrays (:class:`_Tracked`), which note every write into a worker's array
    and the worker its value was read from; a value copied straight from a worker that is not
    the left neighbour (every owner's chunk copied to every worker), a write of more than one
    chunk at once, and chunks passed on in another order than the ring's steps are each named
    by their cause. A run whose writes cannot be read (values put in place by means the
    tracking does not see) is not judged."""
    __tracebackhide__ = True
    n = len(start)
    length = len(start[0])
    if length < n:
        return
    watched = _transfers(fn, start, owner, _takes_owner(fn))
    if watched is None:
        return
    log, roots = watched
    if not all(np.array_equal(r, t) for r, t in zip(roots, [total] * n)):
        return
    layout = _owner(n, owner)
    bounds = chunk_bounds(length, n)
    sent: list[list[int]] = [[] for _ in range(n)]
    for dw, a, b, src in log.writes:
        chunk = _chunk_of(bounds, a, b)
        if src is None and chunk is not None:
            continue  # a chunk from no one worker's array: a value the tracking cannot follow
        if src is None:
            covered = [c for c, (lo, hi) in enumerate(bounds) if a < hi and lo < b]
            fail(f"{what} wrote elements {a}..{b - 1} of worker {dw}'s array in one write, "
                 f"values taken from no single worker ({_case(n, owner)}): that is chunks "
                 f"{covered} at once, gathered from everywhere, and a ring step carries one "
                 f"chunk per worker, from its left neighbour.",
                 fix="pass one chunk of ring.chunk_bounds per worker per step, from worker i "
                     "to worker (i + 1) mod N.")
        sw = src[0]
        if sw != (dw - 1) % n:
            hops = (dw - sw) % n
            named = f"chunk {chunk}" if chunk is not None else f"elements {a}..{b - 1}"
            fail(f"{what} is not a ring ({_case(n, owner)}): worker {dw} got {named} straight "
                 f"from worker {sw}, {hops} places to its left, not from its left neighbour "
                 f"{(dw - 1) % n}. In a ring a worker receives only what its left neighbour "
                 f"sends, one chunk per step, so a chunk reaches the worker {hops} places on "
                 f"after {hops} steps, passed on by every worker between; a copy from the "
                 f"owner to everyone is the naive gather, whose owner sends N - 1 chunks "
                 f"while the others send none.",
                 fix="run N - 1 steps; in each, every worker i passes one chunk to worker "
                     "(i + 1) mod N only: the finished chunk it received most recently (its "
                     "own, owner[i], at the first step).")
        if chunk is None:
            covered = [c for c, (lo, hi) in enumerate(bounds) if a < hi and lo < b]
            fail(f"{what} moved elements {a}..{b - 1} from worker {sw} to worker {dw} in one "
                 f"write ({_case(n, owner)}): that is chunks {covered} at once, and a ring "
                 f"step carries one chunk per worker.",
                 fix="pass one chunk of ring.chunk_bounds per worker per step.")
        if not sent[sw] or sent[sw][-1] != chunk:
            sent[sw].append(chunk)
    for i in range(n):
        want = [layout[(i - s) % n] for s in range(n - 1)]
        if sent[i] and sent[i] != want:
            fail(f"{what} passes chunks neighbour to neighbour, but not in the ring's N - 1 "
                 f"steps ({_case(n, owner)}): worker {i} sent chunks {sent[i]} in that order, "
                 f"the ring's steps give {want}. In step s every worker passes on the chunk it "
                 f"completed most recently (its own, chunk {layout[i]}, at the first step, then "
                 f"the one that arrived in step s - 1), so each step moves N chunks at once; "
                 f"one chunk carried all round the ring before the next keeps the other "
                 f"workers idle.",
                 fix="organise the loop by steps: in each of the N - 1 steps every worker "
                     "passes on one chunk, the one that arrived in the step before.")


def _index_text(d: int) -> str:
    return "owner[(i - t) mod N]" if d == 0 else (
        f"owner[(i {'+' if d > 0 else '-'} {abs(d)} - t) mod N]")


def _off_by_one_sentence(what: str, n: int, owner, ds: int, dr: int) -> str:
    """The cause of a result that is the ring's with the index into owner shifted: ``ds`` for
    the chunk sent, ``ds + dr`` for the chunk the neighbour adds into (or overwrites)."""
    adds = "adds it into" if what == "scatter_reduce" else "writes it over"
    sent = _index_text(ds)
    if dr:
        return (f"off-by-one index into owner in {what} ({_case(n, owner)}): your result is "
                f"what the ring gives when worker i sends chunk {sent} at step t but its "
                f"neighbour {adds} chunk {_index_text(ds + dr)}: the chunk received is not the "
                f"chunk sent, so two chunks' values mix.")
    if what != "scatter_reduce":
        return (f"off-by-one index into owner in {what} ({_case(n, owner)}): your result is "
                f"what the ring gives when worker i passes on chunk {sent} at step t (t = N, "
                f"..., 2N - 2, numbered on from the reduce-scatter): that is not the chunk it "
                f"completed most recently, so what it passes on is a partial sum, or a chunk "
                f"its neighbour already has.")
    sign = "+" if ds > 0 else "-"
    return (f"off-by-one index into owner in {what} ({_case(n, owner)}): your result is what "
            f"the ring gives when worker i sends chunk {sent} at step t, the chunk owner gives "
            f"to worker (i {sign} {abs(ds)} - t) mod N. But a chunk that worker i sends at step "
            f"t ends on worker (i - t) mod N, N - 1 - t hops past worker i + 1, whichever chunk "
            f"it is: {abs(ds)} place(s) {'before' if ds > 0 else 'after'} the worker owner "
            f"gives it to, so every finished sum sits on the wrong worker.")


def _off_by_one_owner(fn, phase, what: str) -> None:
    """A shifted index into owner looks like lesson 06's layout on the identity layout
    ((i + 1 - t) mod N is owner[(i + 1 - t) mod N] there): judge it on the paper's layout,
    which is not a rotation, before a layout is blamed."""
    __tracebackhide__ = True
    n, length, owner = 4, 10, PAPER_OWNER
    inputs = _inputs(n, length)
    start = inputs if phase is _scatter_reduce else _scatter_reduce(
        [a.copy() for a in inputs], owner=owner)
    try:
        got = _run_learner(fn, [a.copy() for a in start], owner, what)
    except LabCheckError:
        return
    for ds, dr in itertools.product((-1, 1, 2), (-1, 0, 1)):
        if _same(got, phase([a.copy() for a in start], ds, dr, owner=owner)):
            fail(_off_by_one_sentence(what, n, owner, ds, dr),
                 fix=_SR_RULE if phase is _scatter_reduce else _AG_RULE)


def _refuse_shortcut_sums(got, want, inputs, owner) -> None:
    """Every worker holds the full sum of its chunk owner[i], but its other chunks are not what
    N - 1 ring steps leave there: the sums were computed some other way (np.sum over all the
    workers' chunks, say). Name it with one chunk the ring would have left partly summed."""
    __tracebackhide__ = True
    n, length = len(inputs), len(inputs[0])
    layout = _owner(n, owner)
    bounds = chunk_bounds(length, n)
    total = np.sum(inputs, axis=0)
    if not all(np.array_equal(got[w][slice(*bounds[c])], total[slice(*bounds[c])])
               for w, c in enumerate(layout)):
        return
    # which workers' values the ring leaves in each chunk: run it on worker w = 2 ** w
    marks = _scatter_reduce([np.full(length, float(2 ** w)) for w in range(n)], owner=owner)
    for w in range(n):
        for c, (lo, hi) in enumerate(bounds):
            if hi > lo and not np.array_equal(got[w][lo:hi], want[w][lo:hi]):
                mask = int(marks[w][lo])
                who = [v for v in range(n) if mask >> v & 1]
                if np.array_equal(got[w][lo:hi], inputs[w][lo:hi]):
                    yours = "its own values, untouched"
                elif np.array_equal(got[w][lo:hi], total[lo:hi]):
                    yours = "the full sum"
                else:
                    yours = f"{got[w][lo:hi][:3].tolist()}..."
                fail(f"scatter_reduce leaves every worker i the full sum of chunk owner[i] "
                     f"({_case(n, owner)}, length {length}), but not by a ring: after N - 1 "
                     f"ring steps worker {w}'s chunk {c} holds the sum of workers {who} (a "
                     f"chunk passing through on its way to worker {layout.index(c)}), and "
                     f"yours holds {yours}. In a ring each worker receives one chunk per step "
                     f"from its left neighbour and adds it, so every chunk is summed one "
                     f"worker at a time along the ring; summing all the workers' copies at "
                     f"once is a gather to one place, not a ring.",
                     fix="run N - 1 steps; in each, every worker sends one chunk to its right "
                         "neighbour, which adds it into its own copy of that chunk. " + _FOLLOW)


# The paper question before part 1: worker 0's chunks at steps 1, 2 and 3 on a 4-ring whose
# layout is not a rotation, so that no copy of lesson 06's formula answers it.
PAPER_N, PAPER_OWNER = 4, (2, 0, 3, 1)


@recorded
def check_worker0_sends(sends) -> None:
    """Before part 1's code, on paper: for N = 4 and owner = [2, 0, 3, 1] (worker i ends the
    reduce-scatter with the full sum of chunk owner[i]), the chunks worker 0 sends at steps 1,
    2 and 3, as a list of three chunk indices. The only answer is [1, 3, 0]: the chunk worker 0
    sends at step t is added by worker 1 and passed on 3 - t more times, so it ends on worker
    (-t) mod 4 — workers 3, 2 and 1, whose chunks owner says are 1, 3 and 0. A wrong answer is
    answered with where its chunks would end (and, for the plausible rules, which rule it
    follows); the way to follow a chunk only on the second meeting."""
    __tracebackhide__ = True
    n, owner = PAPER_N, PAPER_OWNER
    if sends is None or sends is Ellipsis:
        raise NotImplementedError("write worker0_sends, the chunks worker 0 sends at steps 1, 2 "
                                  "and 3 for N = 4, owner = [2, 0, 3, 1], first")
    if (not isinstance(sends, (list, tuple)) or len(sends) != n - 1 or any(
            isinstance(c, bool) or not isinstance(c, (int, np.integer)) for c in sends)):
        fail(f"worker0_sends must be a list of {n - 1} chunk indices, the chunk worker 0 sends "
             f"at steps 1, 2 and 3 (N = {n}: N - 1 steps), e.g. [0, 0, 0]; got {sends!r}.")
    if any(not 0 <= int(c) < n for c in sends):
        fail(f"worker0_sends holds {list(map(int, sends))}: with N = {n} the chunks are "
             f"numbered 0, 1, 2 and 3.")
    sends = [int(c) for c in sends]
    right = [owner[(0 - t) % n] for t in range(1, n)]
    if sends == right:
        ends = ", ".join(f"chunk {c} on worker {(0 - t) % n}" for t, c in enumerate(sends, 1))
        passed(f"worker 0 sends chunks {sends[0]}, {sends[1]} and {sends[2]} at steps 1, 2 and "
               f"3: each ends complete on the worker owner gives it to ({ends}); part 1 asks "
               f"the same of every worker, for every N and every owner")
        return
    inverse = [owner.index(c) for c in range(n)]
    rules = {
        "lesson": ([(0 + 1 - t) % n for t in range(1, n)],
                   " These are lesson 06's chunks, (i + 1 - t) mod N: its layout, not this "
                   "owner's."),
        "identity": ([(0 - t) % n for t in range(1, n)],
                     f" These are the chunks of the layout owner = {list(range(n))}, worker i "
                     f"finishing chunk i, not of this owner."),
        "rotated": ([(owner[0] - t) % n for t in range(1, n)],
                    " These are (owner[0] - t) mod N: arithmetic on a chunk index, which follows "
                    "a chunk only when owner is a rotation, and [2, 0, 3, 1] is not."),
        "inverse": ([inverse[(0 - t) % n] for t in range(1, n)],
                    " These read owner the other way round, as the worker that finishes each "
                    "chunk: owner[i] is the chunk worker i finishes."),
    }
    which = next((text for chosen, text in rules.values() if chosen == sends), "")
    wrong = [(t, c) for t, c in enumerate(sends, 1) if c != right[t - 1]]
    def hops(t: int) -> str:
        left = n - 1 - t
        return (f"{left} more hop{'' if left == 1 else 's'} after worker 1" if left else
                f"step {t} is the last")

    where = "; ".join(
        f"chunk {c}, sent at step {t}, would collect its last contribution on worker "
        f"{(0 - t) % n} ({hops(t)}), but owner has chunk {c} finished by worker {inverse[c]}"
        for t, c in wrong)
    fail(f"with worker0_sends = {sends}: {where}.{which}",
         fix="follow each chunk worker 0 sends: at step t it reaches worker 1, which adds its "
             "part and passes it on; after N - 1 - t more hops it stops. Which worker is that, "
             "and which chunk does owner give that worker?")


def _refuse_other_chunk_rules(got, reference, start, owner, name) -> None:
    """Uneven lengths only: refuse a result that is the reference pass run with one of the other
    plausible ways to cut a buffer into N chunks (``_OTHER_CHUNK_RULES``)."""
    __tracebackhide__ = True
    n, length = len(start), len(start[0])
    if length % n == 0:
        return
    for rule in _OTHER_CHUNK_RULES:
        if _same(got, reference([a.copy() for a in start], bounds=rule, owner=owner)):
            fail(_chunk_rule_sentence(name, n, length, rule), fix=_CHUNK_RULE_FIX)


@recorded
def check_scatter_reduce(fn) -> None:
    """``fn(buffers, owner=None)``: N 1-D float arrays, changed in place; after it worker i must
    hold the full sum of chunk owner[i] (chunks as in ``ring.chunk_bounds``; owner None means
    owner[i] = i, and a function that takes no owner is called without one there)."""
    __tracebackhide__ = True
    for n, length, owner in _CASES:
        inputs = _inputs(n, length)
        got = _run_learner(fn, [a.copy() for a in inputs], owner, "scatter_reduce")
        want = _scatter_reduce([a.copy() for a in inputs], owner=owner)
        if _same(got, want):
            continue
        if _same(got, inputs):
            fail(f"scatter_reduce left the buffers unchanged ({_case(n, owner)}): nothing a "
                 f"worker received reached its own array (a copy or a rebound name does not "
                 f"change it).",
                 fix="in every step, add the chunk received from the left neighbour into the "
                     "worker's own copy of that chunk, in place.")
        _off_by_one_owner(fn, _scatter_reduce, "scatter_reduce")
        _misread_layout(got, _scatter_reduce, inputs, owner, "scatter_reduce")
        _refuse_other_chunk_rules(got, _scatter_reduce, inputs, owner, "scatter_reduce")
        _wrong_steps_or_chunk(got, _scatter_reduce, inputs, owner, "scatter_reduce", _SR_RULE)
        _refuse_shortcut_sums(got, want, inputs, owner)
        layout = _owner(n, owner)
        bad = [w for w in range(n) if not np.array_equal(got[w], want[w])]
        fail(f"scatter_reduce gives wrong numbers on worker(s) {bad} for {_case(n, owner)}, "
             f"length {length}: after it worker i must hold the full sum of chunk owner[i] "
             f"(here worker {bad[0]}: chunk {layout[bad[0]]}).", fix=_SR_RULE)
    passed("scatter_reduce: every worker i ends with the full sum of chunk owner[i], for N = "
           "3, 4 and 5, uneven lengths, and layouts that are and are not rotations")


@recorded
def check_all_gather(fn) -> None:
    """``fn(buffers, owner=None)``: run on the state the reference reduce-scatter leaves for the
    same ``owner``; afterwards every worker must hold the whole sum."""
    __tracebackhide__ = True
    for n, length, owner in _CASES:
        inputs = _inputs(n, length)
        reduced = _scatter_reduce([a.copy() for a in inputs], owner=owner)
        total = np.sum(inputs, axis=0)
        got = _run_learner(fn, [a.copy() for a in reduced], owner, "all_gather")
        if all(np.array_equal(g, total) for g in got):
            _refuse_not_a_ring(fn, reduced, owner, total, "all_gather")
            continue
        if _same(got, reduced):
            fail(f"all_gather left every worker's array as the reduce-scatter left it "
                 f"({_case(n, owner)}): nothing a worker received was written into its own "
                 f"array (a copy or a rebound name does not change it), so each still holds "
                 f"only one finished chunk.",
                 fix="in every step, write the chunk that arrives into the receiving worker's "
                     "own array, through a slice of it (buffers[j][a:b] = ...), not into a "
                     "copy or a new name.")
        if _same(got, _all_gather([a.copy() for a in reduced], add=True, owner=owner)):
            fail("all_gather adds the incoming chunk to the worker's own: the chunk that arrives "
                 "is already the complete sum, so adding it counts values twice.",
                 fix="overwrite the worker's copy of the chunk with the one that arrives.")
        _off_by_one_owner(fn, _all_gather, "all_gather")
        _misread_layout(got, _all_gather, reduced, owner, "all_gather")
        _refuse_other_chunk_rules(got, _all_gather, reduced, owner, "all_gather")
        _wrong_steps_or_chunk(got, _all_gather, reduced, owner, "all_gather", _AG_RULE)
        bad = [w for w in range(n) if not np.array_equal(got[w], total)]
        fail(f"all_gather leaves wrong numbers on worker(s) {bad} for {_case(n, owner)}, length "
             f"{length}: afterwards every worker must hold the whole sum.", fix=_AG_RULE)
    passed("all_gather: every worker ends with the whole sum, for N = 3, 4 and 5, uneven "
           "lengths, and layouts that are and are not rotations")
