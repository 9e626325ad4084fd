"""Lab 06, part 3: the learner's real ring, ``ring_allreduce(tensor, op)``, over blocking
``dist.send`` / ``dist.recv``; and the prediction after it (the most bytes one rank sends).

:func:`check_ring_allreduce` runs it on 3, 2 and then 4 gloo ranks (:mod:`._lab06_spawn`),
compares every rank's tensor with the sum / average, refuses built-in collectives and
non-blocking calls, counts 2(N-1) messages of about K/N elements, and judges the order of each
step's calls (:mod:`._lab06_order`). A wrong result is matched against simulated mistakes
(:func:`_simulate_real`): the tensor left unchanged, the sum where the average is asked, a
fixed divisor, another chunk rule, a missing all-gather, a chunk index off by one.
"""

from __future__ import annotations

import itertools

import numpy as np

from dpcourse.checks import check_timeout, fail, passed, recorded
from dpcourse.checks._lab06_numpy import _OTHER_CHUNK_RULES, _all_gather, _chunk_rule_sentence, _scatter_reduce, _CHUNK_RULE_FIX
from dpcourse.checks._lab06_order import (DRY_SIZES, _recorded_orders, _refuse_growing_steps,
                                          _refuse_serialised_steps, _rounds, _slowest_step)
from dpcourse.checks._lab06_spawn import _REAL_CASES, _launch_ring, _real_input, _refuse_reference
from dpcourse.ring import chunk_bounds

def _simulate_real(n, cases, sr=(0, 0), ag=(0, 0), gather=True, average=True, divisor=None,
                   bounds=chunk_bounds):
    """What a ring with these chunk-index shifts would leave on each rank, per case (averages
    divided by ``divisor`` instead of N if given; chunks cut by ``bounds``)."""
    out = []
    for shape, _, op in cases:
        bufs = [_real_input(r, shape).ravel() for r in range(n)]
        _scatter_reduce(bufs, *sr, bounds=bounds, owner="lesson")
        if gather:
            _all_gather(bufs, *ag, bounds=bounds, owner="lesson")
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
    timed: dict = {}  # N -> (the whole ring's transfer times, (its slowest step, that step's))
    dry = None
    for n in sizes:
        seen = _check_ring_once(fn, n, timeout, DRY_SIZES if n == sizes[-1] and n >= 4 else ())
        if seen["recorded"] is not None:
            units, _ = _rounds(seen["recorded"])
            if units is not None:
                timed[n] = (units, _slowest_step(seen["recorded"]))
        dry = seen["dry"] if seen["dry"] is not None else dry
    per_step = {n: units / (2 * (n - 1)) for n, (units, _) in timed.items()}
    modelled = _refuse_growing_steps(dry, per_step) if dry is not None else {}
    for n in modelled:
        timed[n] = (_rounds(dry[n])[0], _slowest_step(dry[n]))
    passed(f"ring_allreduce, built from blocking dist.send/dist.recv only, finished without "
           f"deadlock and equals the sum (and the average) on {', '.join(map(str, sizes))} "
           f"ranks for lengths 12, 10, 20, 2 and 11; for every length of at least N, each rank "
           f"sent exactly 2(N-1) messages and at most 2(N-1) chunks' worth of elements (with "
           f"length 2 < N only the results were compared: empty chunks may be skipped)."
           + _timing_sentence(timed, modelled))


def _timing_sentence(timed: dict, modelled: dict) -> str:
    """What the ✔ line says of the order of the ring's calls: the whole ring's time in transfer
    times (:func:`_rounds`, when its last transfer ends), that time divided by its 2(N-1) steps
    (the average per step, which part 3's contract is about), and the slowest single step
    (:func:`_slowest_step`), so that neither number is mistaken for the other."""
    if not timed:
        return ""
    ran = [n for n in timed if n not in modelled]
    total = ", ".join(f"{timed[n][0]} on {n} ranks" for n in ran)
    if modelled:
        shown = [f"{timed[n][0]} on {n}" for n in modelled]
        total += (" (and, modelled from the order of its calls on more ranks than this machine "
                  "runs, " + ", ".join(shown[:-1]) + " and " * (len(shown) > 1) + shown[-1]
                  + ")")
    mean = ", ".join(f"{timed[n][0] / (2 * (n - 1)):.1f}" for n in timed)
    slow = ", ".join(f"{timed[n][1][1]}" if timed[n][1] else "?" for n in timed)
    return (f" Timed from the order of its calls (each transfer one time unit, a send going out "
            f"only once its receiver is in dist.recv): from start until its last transfer "
            f"ended, the whole ring took {total} transfer times; divided by its 2(N-1) steps, "
            f"that is {mean} per step on average (N in the same order), and its slowest single "
            f"step took {slow}. The average is what the ring pays: ranks do not wait for one "
            f"another between steps, so a slow step is overlapped by the steps after it."
            + _growing_slowest_sentence(timed))


def _growing_slowest_sentence(timed: dict) -> str:
    """Said only when the slowest single step grows with N (from the smallest N >= 4 timed to
    the largest, by more than one transfer time), as "the first half of the ranks send first"
    makes it (3 on 4 ranks, 9 on 16): why that order still keeps part 3's contract, which
    judges the average, and what the growing step is."""
    sizes = [n for n in timed if n >= 4 and timed[n][1]]
    if len(sizes) < 2:
        return ""
    small, large = min(sizes), max(sizes)
    (step, slowest_large), slowest_small = timed[large][1], timed[small][1][1]
    if slowest_large <= slowest_small + 1:
        return ""
    return (f" Your slowest step grows with N ({slowest_small} transfer times on {small} ranks, "
            f"{slowest_large} on {large}, its step {step}): there a run of neighbouring ranks "
            f"that make the same first call wait for one another in a chain. The contract judges "
            f"the average, which stays bounded, because that chain is paid once and the steps "
            f"after it overlap it; an order with no long run of ranks making the same first "
            f"call keeps even its slowest step from growing.")


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
                         f"N-1 steps of reduce-scatter, then N-1 of all-gather.",
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
                fail("missing all-gather: the tensors hold what the reduce-scatter leaves, each "
                     "rank only its one finished chunk.",
                     fix="add N-1 steps that pass the finished chunks around the ring.")
    for sr in shifts:
        for ag in shifts:
            if (sr, ag) != ((0, 0), (0, 0)) and _matches(
                    results, _simulate_real(world_size, cases, sr, ag)):
                phase = "reduce-scatter" if sr != (0, 0) else "all-gather"
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


class BytesSent(list):
    """The bytes each rank sent (a list of ints), with ``chunks``: per rank, the chunk indices
    (of ``chunk_bounds``) of the messages it sent, in order, or None for a rank that sent
    something other than a view of one whole chunk of its tensor (a copy, a piece)."""

    chunks: list = []


def measure_bytes_sent(fn, world_size: int = 4, numel: int = 10,
                       timeout: float | None = None) -> BytesSent:
    """Run the learner's ``fn(tensor, op="sum")`` on ``world_size`` gloo ranks with a float32
    tensor of ``numel`` elements and return the bytes each rank sent (point-to-point only),
    with the chunks each rank sent where they can be told (:class:`BytesSent`)."""
    __tracebackhide__ = True
    timeout = check_timeout(timeout, 20.0)
    if not callable(fn):
        fail(f"measure_bytes_sent needs your ring_allreduce function, got {type(fn).__name__}")
    _refuse_reference(fn)
    per_rank = _launch_ring(fn, world_size, timeout, [((numel,), "float32", "sum")])
    starts = {(lo, hi - lo): c for c, (lo, hi) in enumerate(chunk_bounds(numel, world_size))}
    out = BytesSent(int(per_rank[r]["traffic"][0]["elements"]) * 4 for r in range(world_size))
    out.chunks = []
    for r in range(world_size):
        spans = per_rank[r]["traffic"][0].get("spans", [])
        chunks = [starts.get(tuple(sp)) if sp is not None else None for sp in spans]
        out.chunks.append(None if None in chunks else chunks)
    return out


def _skipped(chunks, n: int):
    """The chunk a rank did not send in each phase, (reduce-scatter, all-gather), from the
    chunks it sent in order (N - 1 per phase, none twice in a phase); None if not that shape."""
    if chunks is None or len(chunks) != 2 * (n - 1):
        return None
    phases = (chunks[:n - 1], chunks[n - 1:])
    if any(len(set(p)) != n - 1 for p in phases):
        return None
    return tuple((set(range(n)) - set(p)).pop() for p in phases)


def check_prediction(guess, measured, world_size: int = 4, numel: int = 10) -> None:
    """Compare the learner's prediction of the most bytes any one rank sends (N = 4, K = 10
    float32: chunks of 3, 3, 2, 2 elements) with :func:`measure_bytes_sent`'s per-rank bytes, and
    say why the number is what it is (never raises for a wrong prediction).

    A rank sends every chunk but one in each phase: not, in the reduce-scatter, the chunk it
    finishes (its last contribution arrives; there is nothing to pass on), and not, in the
    all-gather, the chunk it receives last (its right neighbour finished it). Which two those
    are depends on the layout, so the feedback reads the chunks each of the learner's ranks
    sent (``measured.chunks``), names the two it skipped and computes its bytes from them:
    2K minus the two skipped chunks (lesson 06's layout on N = 4, K = 10: 56, 60, 64, 60;
    owner = [0, 2, 1, 3]: 60 on every rank). 2(N-1)K/N is only the average over ranks. Where
    the chunks cannot be told (a ring that sends copies), the bytes are read back the same way
    from the measurement."""
    from dpcourse.checks import reveal

    n, k = world_size, numel
    sizes = [hi - lo for lo, hi in chunk_bounds(k, n)]
    average = 2 * (n - 1) * k / n * 4
    worst = max(measured)
    close = abs(float(guess.value) - worst) < 0.5
    ring_total = sum(measured) == round(average * n)
    explanation = (
        f"A rank sends every chunk but one in each phase: in the reduce-scatter not the chunk it "
        f"finishes (nothing is left to pass on), in the all-gather not the one it receives last "
        f"(its right neighbour finished it). So it sends 2K minus those two chunks, and which "
        f"two they are is set by the layout: with chunks of "
        f"{', '.join(map(str, sizes))} elements (chunk 0 first), ")
    chunks = getattr(measured, "chunks", None) or [None] * n
    skips = [_skipped(c, n) for c in chunks]
    if all(s is not None for s in skips):
        per_rank = [(2 * k - sizes[a] - sizes[b]) * 4 for a, b in skips]
        explanation += "in your ring's layout " + "; ".join(
            f"rank {r} skips chunks {a} and {b} ({sizes[a]} + {sizes[b]} elements), so sends "
            f"2K − {sizes[a] + sizes[b]} = {2 * k - sizes[a] - sizes[b]} float32, "
            f"{per_rank[r]} bytes" for r, (a, b) in enumerate(skips)) + "."
        agrees = per_rank == list(measured)
    else:
        explanation += (f"your ranks left out {', '.join(str(2 * k - b // 4) for b in measured)}"
                        f" elements (rank 0 first): the two chunks each skipped (which ones is "
                        f"not known here: your ring did not send views of its tensor's chunks).")
        agrees = True
    mosts = sorted({max((2 * k - sizes[o[r]] - sizes[o[(r + 1) % n]]) * 4 for r in range(n))
                    for o in itertools.permutations(range(n))}) if n <= 7 else [worst]
    explanation += (f" Your ring's ranks sent {', '.join(map(str, measured))} bytes, "
                    f"{worst} at most; 2(N−1)K/N × 4 = {average:g} bytes is only the average "
                    f"over the ranks, exact when N divides K"
                    + (f", and over all layouts the most one rank sends is "
                       f"{' or '.join(map(str, mosts))} bytes." if len(mosts) > 1 else "."))
    if not ring_total or not agrees:
        explanation += (f" That is not {round(average * n)} bytes in all, two chunks skipped per "
                        f"rank: does your ring send exactly one chunk per step, every chunk of "
                        f"ring.chunk_bounds's size?")
    reveal(guess, worst, close=close, explanation=explanation)
