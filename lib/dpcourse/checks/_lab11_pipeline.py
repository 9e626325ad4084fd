"""Lab 11's stretch, read: how ``check_gpipe`` and ``measure_bubble`` tell one wrong GPipe
step (or bubble) from another — the cases they run (stages, micro-batches, the "device time"
of each forward) and the diagnosis that turns what each stage reported into the one sentence
that names its mistake.

Kept apart from :mod:`dpcourse.checks._lab11_diagnose` and ``_lab11_layer_diagnosis``, which
read the tensor-parallel parts: a pipeline stage's mistakes (order, accumulation, timing what is
not computation) are another idea. :mod:`dpcourse.checks.lab11` runs the stages and calls these.
"""

from __future__ import annotations

import torch

from . import fail
from ._lab11_diagnose import _close, _error

_STAGES = (2, 3)


_M = 4


_WIDTH, _BATCH = 8, 8


_CHECK_DELAY_S = 0.015   # "device time" of a forward in check_gpipe (a backward: twice)


_CLOCK_SLACK_S = 1e-4    # perf_counter is one clock for every process of the machine


_BELOW_IDEAL = 0.05      # how far a measured bubble may dip below (K−1)/(M+K−1) (uneven stages)


def _mse(out, target):
    return ((out - target) ** 2).mean()


def _micro_grads(world_size: int, m: int) -> tuple:
    """The reference gradients (whole batch), and each micro-batch's own loss's gradients."""
    from .. import pipeline_parallel as pp

    model = pp.make_mlp(_WIDTH, world_size, seed=12)
    gen = torch.Generator().manual_seed(13)
    x, y = torch.randn(_BATCH, _WIDTH, generator=gen), torch.randn(_BATCH, _WIDTH, generator=gen)
    loss, ref = pp.reference_step(model, x, y, _mse)
    each = [pp.reference_step(model, xm, ym, _mse)[1] for xm, ym in zip(x.chunk(m), y.chunk(m))]
    return loss, ref, each


def _pending(outs: list) -> None:
    """A stage that returns with a non-blocking send (or receive) never waited on: its message
    may not have left (or arrived) yet — the neighbour waits for it after this process has gone
    on, which shows as a deadlock (the worker settles them, so the check can name the cause)."""
    __tracebackhide__ = True
    for rank, o in enumerate(outs):
        sends, recvs = o["pending"]["send"], o["pending"]["recv"]
        if sends:
            fail(f"stage {rank} returned from gpipe_step with {sends} non-blocking send(s) still "
                 f"pending (an isend whose handle was never waited on): until its wait() returns, the "
                 f"message may not have left, and a process that goes on or ends leaves its neighbour "
                 f"waiting.", fix="wait on every send's handle before gpipe_step returns.")
        if recvs:
            fail(f"stage {rank} returned from gpipe_step with {recvs} non-blocking receive(s) "
                 f"never waited on (an irecv whose handle was never waited on): until its wait() "
                 f"returns, the tensor may not hold the message yet.",
                 fix="wait on a receive's handle before using what it receives.")


def _computation_only(outs: list, k: int, m: int) -> None:
    """A stage cannot start computing micro-batch i before its neighbour has finished computing
    what it sends (its activation forward, its gradient backward): an event that starts earlier
    timed the wait for the message (or the neighbour's timed its send)."""
    __tracebackhide__ = True
    at = {(s, kind, i): (a, b) for s, o in enumerate(outs) for kind, i, a, b in o["events"]}
    t0 = min(a for a, _ in at.values())
    for kind, neighbour, what in (("F", -1, "forward"), ("B", +1, "backward")):
        for s in range(k):
            if not 0 <= s + neighbour < k:
                continue
            for i in range(m):
                start, ready = at[(s, kind, i)][0], at[(s + neighbour, kind, i)][1]
                if start < ready - _CLOCK_SLACK_S:
                    needs = "activation" if kind == "F" else "gradient"
                    fail(f"stage {s}'s {what} of micro-batch {i} starts at "
                         f"{1e3 * (start - t0):.1f} ms, {1e3 * (ready - start):.1f} ms before "
                         f"stage {s + neighbour} finished computing the {needs} it needs "
                         f"({1e3 * (ready - t0):.1f} ms): the events time waiting for (or "
                         f"sending) a message, not only the computation.",
                         fix="take each start after the recv returns and each end before the send.")


def _check_bubble_fn(bubble_fn) -> None:
    __tracebackhide__ = True
    from .. import pipeline_parallel as pp

    cases = [pp.simulate_timeline(2, 4, "gpipe", 1.0, 2.0),
             pp.simulate_timeline(3, 2, "gpipe", 1.0, 3.0)]
    # a measured-looking one: stage 1's forwards are slow, and there are gaps
    slow = [(s, k, i, a * 1.3 + 0.1 * s, b * 1.3 + 0.1 * s + (0.4 if s == 1 else 0.0))
            for s, k, i, a, b in pp.simulate_timeline(2, 3, "gpipe", 1.0, 2.0)]
    cases.append(slow)
    for events in cases:
        k = len({e[0] for e in events})
        m = sum(1 for e in events if e[0] == 0 and e[1] == "F")
        want = pp.measured_bubble(events)
        try:
            got = float(bubble_fn(events, k))
        except Exception as exc:
            fail(f"bubble(events, {k}) raised {_error(exc)}.")
        if abs(got - want) <= 1e-9:
            continue
        if abs(got - pp.ideal_bubble(k, m)) <= 1e-9:
            fail(f"bubble() returns (K−1)/(M+K−1) = {got:.3f} whatever the timeline; this timeline "
                 f"idles {want:.3f} of the time.",
                 fix="measure it: 1 − (time spent computing, all stages) / (stages × the step's span).")
        busy = sum(e[4] - e[3] for e in events)
        span = max(e[4] for e in events) - min(e[3] for e in events)
        if abs(got - busy / (k * span)) <= 1e-9:
            fail(f"bubble() returns the busy share {got:.3f}, where the bubble is the idle share "
                 f"({want:.3f}).", fix="1 − the busy share.")
        own = sum(1 - sum(e[4] - e[3] for e in events if e[0] == s)
                  / (max(e[4] for e in events if e[0] == s)
                     - min(e[3] for e in events if e[0] == s)) for s in range(k)) / k
        if abs(got - own) <= 1e-9:
            fail(f"bubble() measures each stage against its own first and last action, but a stage "
                 f"idles from the step's start until its first input arrives, and after its last "
                 f"backward until the step ends: {got:.3f} where the idle share is {want:.3f}.",
                 fix="use the step's span (earliest start to latest end over all stages).")
        fail(f"bubble() gives {got:.4f} on a timeline whose idle share is {want:.4f}.",
             fix="1 − (time spent computing, summed over stages) / (stages × the step's span).")


def _gpipe_failed(exc) -> None:
    __tracebackhide__ = True
    if "NoneType" in exc.summary or "None" in exc.summary and "grad" in exc.summary:
        fail(f"stage {exc.rank} raised {exc.summary!r}: the tensor it received has no gradient "
             f"after the backward, so there is nothing to send back.",
             fix="call requires_grad_() on it after recv, so that the backward computes the gradient "
                 "to send back.")
    fail(f"stage {exc.rank} raised: {exc.summary}.")


def _diagnose_gpipe(outs: list, k: int, m: int) -> None:
    __tracebackhide__ = True
    loss, ref, each = _micro_grads(k, m)
    last = outs[-1]
    for rank, o in enumerate(outs):
        kinds = [e[0] for e in o["events"]]
        if sorted(kinds) != ["B"] * m + ["F"] * m or len(o["events"]) != 2 * m:
            fail(f"stage {rank} reported {len(o['events'])} events ({kinds}): one ('F', i, "
                 f"start, end) and one ('B', i, start, end) per micro-batch.")
        if kinds != ["F"] * m + ["B"] * m:
            fail(f"stage {rank} ran {kinds}: GPipe runs every forward first, then every "
                 f"backward (interleaving them is 1F1B — a fine schedule, but not this one).")
        if any(s > e for _, _, s, e in o["events"]):
            fail(f"stage {rank}'s events end before they start: (kind, micro-batch, start, end).")
        timed = sorted(o["events"], key=lambda ev: ev[2])
        if any(b[2] < a[3] for a, b in zip(timed, timed[1:])):
            fail(f"stage {rank}'s events overlap, but a stage computes one action at a time.",
                 fix="take start right before each computation and end right after it.")
    grads = [g for o in outs for g in o["grads"]]
    if any(g is None for g in grads):
        fail("a stage's parameters have no gradient after the step: a backward did not run "
             "through them.", fix="run the backward of every micro-batch (the last stage from its "
             "loss, the others from the gradient they receive).")
    if all(_close(g, r) for g, r in zip(grads, ref)):
        if last["loss"] is None or abs(last["loss"] - loss) > 1e-5 * max(1.0, abs(loss)):
            fail(f"the last stage returned loss {last['loss']}, but the batch's loss is "
                 f"{loss:.6f}.", fix="return the sum of the micro-batches' losses, each divided by M.")
        return
    if all(_close(g, m * r) for g, r in zip(grads, ref)):
        fail(f"the gradients are {m} times too large: the {m} micro-batches' losses were "
             f"summed, but the batch's loss is their mean.",
             fix=f"divide each micro-batch's loss by M = {m}.")
    for scale in (1.0 / m, 1.0):
        for i in (m - 1, 0):
            if all(_close(g, scale * r) for g, r in zip(grads, each[i])):
                fail(f"only micro-batch {i}'s gradient is left: the gradients were not "
                     f"accumulated over the micro-batches.",
                     fix="do not zero them (or replace .grad) between micro-batches; autograd adds each "
                         "backward into .grad.")
    fail("the stages' gradients differ from the unsplit model's on the whole batch: each "
         "micro-batch's loss divided by M, every backward adding into .grad.")
