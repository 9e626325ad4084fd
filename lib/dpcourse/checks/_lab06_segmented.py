"""Lab 06's stretch: a ring whose reduce-scatter sends each chunk in segments, pipelined.

:func:`check_segmented_ring` runs it on 3 and 2 ranks with two segment counts (both counts in one
launch per number of ranks, :func:`._lab06_spawn._run_real_cases` taking each case's keyword
arguments) and judges it by
the order of its posts and waits (recorded by :mod:`._lab06_spawn`): piece j + 1 must be on its
way while piece j is waited for and added (:func:`_first_unpipelined`), and piece j added before
piece j + 1 is waited on (:func:`_first_added_late`); one receive buffer shared by receives in
flight is named by its cause (a race). The design decision, how many receives the ring keeps in
flight, is declared before the ring is written and held: the first number compared with a
measurement is kept, another one refused (:func:`_declared_in_flight`).
"""

from __future__ import annotations

import numpy as np

from dpcourse.checks import Prediction, check_timeout, fail, keep, kept_prediction, passed, recorded
from dpcourse.checks._lab06_ring import WORLD_SIZES, _simulate_real
from dpcourse.checks._lab06_spawn import _first_shared_buffer, _launch_ring, _refuse_reference

# --- stretch: the reduce-scatter in segments -------------------------------------------------

_SEGMENT_CASES = [((48,), "float64", "sum"), ((50,), "float64", "sum"),
                  ((4, 13), "float32", "average")]


def _first_unpipelined(events, n: int, segments: int):
    """The index of the first reduce-scatter receive that was waited on before the next piece's
    send and receive were both posted (None if every piece but a step's last had its successor
    in flight). Receives and sends are numbered in the order they were posted; the first
    (N-1)·S receives are the reduce-scatter's pieces. A receive never waited on (polled, or
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
    """The index of the first reduce-scatter piece j that was not yet added into the tensor when
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
    """The most reduce-scatter receives posted and not yet waited on at one moment: how many
    receive buffers the ring needed at once (the stretch's design decision)."""
    open_now = most = 0
    for kind, op, index, _ in events:
        if op == "recv" and index < (n - 1) * segments:
            open_now += 1 if kind == "post" else -1 if kind == "wait" else 0
            most = max(most, open_now)
    return most


def _receive_name(index: int, n: int, segments: int) -> str:
    if index < (n - 1) * segments:
        return f"piece {index % segments} of reduce-scatter step {index // segments + 1}"
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


IN_FLIGHT_QUESTION = "reduce-scatter receives in flight at most, segments=4"


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
        fail(f"you declared {value} reduce-scatter receive(s) in flight: the contract asks that "
             f"a step's next piece be in flight (its receive posted, not yet waited on) while "
             f"the current piece is added, and the current piece's own receive is in flight "
             f"until you wait for it, so just before that wait two receives are in flight. No ring "
             f"that keeps the contract has fewer; this number was not kept as your decision.")
    if value > segments:
        fail(f"you declared {value} reduce-scatter receives in flight with segments={segments}: "
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
    each reduce-scatter chunk as S segments: at least (N-1)·S messages of at most
    ceil(ceil(K/N)/S) elements per rank, and no built-in collective. (The all-gather may send
    whole chunks or segments.) In the reduce-scatter, piece j + 1 must be posted before piece j
    is waited on, and piece j added into the tensor before piece j + 1 is waited on (the
    tensor's contents at the two waits differ): post-all, wait-all, add-all is refused.

    ``in_flight``: the learner's design decision, declared before the ring is written (the
    :class:`~dpcourse.checks.Prediction` that ``predict(..., IN_FLIGHT_QUESTION, n)`` returned,
    or a plain number) — the most reduce-scatter receives their ring keeps posted and not yet
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
    counts = (segments, segments - 1)  # two segment counts: none may be hard-coded
    for n in world_sizes:
        # Both counts in one launch (one process group): every case with S pieces, then every
        # case with S - 1; judged in that order.
        per_rank = _launch_ring(fn, n, timeout, _SEGMENT_CASES * len(counts),
                                [{"segments": S} for S in counts for _ in _SEGMENT_CASES])
        correct = _simulate_real(n, _SEGMENT_CASES)
        for launched, S in enumerate(counts):
            for i, (shape, _, op) in enumerate(_SEGMENT_CASES):
                k = int(np.prod(shape))
                chunk = -(-k // n)
                piece = -(-chunk // S)
                for r in range(n):
                    got = per_rank[r]["results"][launched * len(_SEGMENT_CASES) + i][0]
                    t = per_rank[r]["traffic"][launched * len(_SEGMENT_CASES) + i]
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
                             f"reduce-scatter sends each chunk (about {chunk}) as {S} pieces, "
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
                        fail(f"rank {r} waited for piece {j} of a reduce-scatter chunk before it "
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
                        fail(f"rank {r} waited for piece {j + 1} of a reduce-scatter chunk while "
                             f"piece {j} had arrived but was not yet added into the tensor (N={n},"
                             f" segments={S}): {how}.",
                             fix="add piece j into the tensor before you wait for piece j + 1.")
                    if S == segments:
                        most = max(most, _most_in_flight(t["events"], n, S))
                    allowed = {(n - 1) * (S + 1), 2 * (n - 1) * S}
                    if t["messages"] not in allowed:
                        fail(f"rank {r} sent {t['messages']} messages on {n} ranks with "
                             f"segments={S}; a ring sends (N-1)·S pieces in the reduce-scatter "
                             f"and N-1 chunks (or (N-1)·S pieces) in the all-gather: "
                             f"{' or '.join(map(str, sorted(allowed)))} in all. Does a phase "
                             f"run more or fewer than N-1 steps?")
    if declared is not None:
        keep(declared, most, close=int(declared.value) == int(most))
        if int(declared.value) != most:
            fail(f"you declared {int(declared.value)} reduce-scatter receive(s) in flight at "
                 f"once with segments={segments}, but at its busiest moment your ring had a "
                 f"different number posted and not yet waited on (the most on any rank, "
                 f"measured): your code and your design decision disagree, and each receive in "
                 f"flight needs a buffer of its own. {int(declared.value)} is now kept as your "
                 f"decision: the check holds your ring to it (the count is yours to work out "
                 f"from your code, and the check does not say it).",
                 fix=f"your ring kept {'more' if most > int(declared.value) else 'fewer'} "
                     f"than {int(declared.value)}. Read your reduce-scatter step with "
                     f"segments={segments}: just before each wait() on a receive, count the "
                     f"irecv your code has started and not yet waited on, the one about to be "
                     f"waited on included. The largest of those counts is what the check "
                     f"measured; move the point where your code starts the next pieces' "
                     f"receives until it is {int(declared.value)}, the number you decided on.")
    # The count in flight is the learner's to work out: said only once they declared it.
    counted = (f"at its busiest moment (just before a wait) each rank had up to {most} "
               f"reduce-scatter receive(s) in flight with segments={segments}, posted and not "
               f"yet waited on, as declared: {most} piece(s) on their way at once, each writing "
               f"into a buffer of its own" if declared is not None
               else "declare in_flight to have your count of receives in flight compared")
    passed(f"segmented ring: right sums and averages on {' and '.join(map(str, world_sizes))} "
           f"ranks, each reduce-scatter chunk sent in {segments} (and {segments - 1}) segments, "
           f"piece j + 1 posted before piece j was waited on, and piece j added before piece "
           f"j + 1 was waited on; {counted}")
