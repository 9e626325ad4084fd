"""Lab 08's predict-then-measure parts: the peak of live gradient memory on a five-layer MLP
(``PEAK_WIDTHS``, buckets of ``PEAK_CAP`` bytes, fp32, ``PEAK_WORLD_SIZE`` ranks), weighed as
``check_zero_two`` weighs it (:mod:`dpcourse.checks._lab08_memory`).

``measure_peak`` and ``check_peak_prediction``: the learner's own ``ZeroTwo``, against the
learner's prediction, with where the peak of one bucket in flight comes from — a bucket's last
gradient arriving while the one before is still in flight, or a bucket just copied into its
buffer before its ``p.grad`` is let go, whichever is larger.

``measure_schedules`` and ``check_schedule_predictions``: the lab's design decision measured.
The check's own ZeRO-2 (:class:`_Schedule`) runs the same buckets in three orders —
``"wait-then-launch"`` (wait for bucket k − 1, then copy and launch bucket k: the lab's bound),
``"launch-then-wait"`` (copy and launch bucket k, then wait for k − 1) and ``"launch-all"``
(wait for every bucket in ``step()``) — and is weighed line by line as the learner's code is
(its code objects are in ``WEIGHED_AS_LEARNERS``), so that the learner's predictions of the
other two orders meet a measurement, and the feedback names the instant that decides: bucket
k copied while bucket k − 1 still flies.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from . import check_timeout, fail, require_answer, reveal, run_ranks
from ._lab08_bounds import _piece_numel
from ._lab08_diagnose import DEFAULT_TIMEOUT
from ._lab08_raised import _raised
from ._lab08_memory import (WEIGHED_AS_LEARNERS, _inner_tensors, _inputs, _live_gradients,
                            _Watched, prefer, weighing_lines)

PEAK_WIDTHS = (16, 64, 64, 64, 64, 8)    # five Linear layers, ReLU between them
PEAK_CAP = 4096                          # bytes: a bucket closes once it holds 4096 B or more
PEAK_WORLD_SIZE = 2
SCHEDULES = ("wait-then-launch", "launch-then-wait", "launch-all")


def _peak_mlp() -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for fan_in, fan_out in zip(PEAK_WIDTHS[:-1], PEAK_WIDTHS[1:]):
        layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def peak_buckets() -> list[int]:
    """The numbers in each bucket of the prediction's model, in launch order (DDP's rule:
    reverse registration order, a bucket closes once it reaches ``PEAK_CAP`` bytes)."""
    sizes, current = [], 0
    for p in reversed(list(_peak_mlp().parameters())):
        current += p.numel()
        if 4 * current >= PEAK_CAP:
            sizes.append(current)
            current = 0
    return sizes + ([current] if current else [])


def _padded() -> list[int]:
    """Each bucket's padded buffer, in numbers: world_size pieces of shard_bounds' length."""
    return [PEAK_WORLD_SIZE * _piece_numel(n, PEAK_WORLD_SIZE, 4) for n in peak_buckets()]


def schedule_peaks() -> dict:
    """{order: (bytes, bucket, moment)} — the peak of each order, from the bucket sizes: at
    bucket k's last arrival its gradients (b_k) are in p.grad; right after its copy they are
    also in its buffer (P_k), until p.grad is let go; what else is alive is the buffers still
    in flight."""
    b, P = peak_buckets(), _padded()
    before = [0] + P[:-1]                                    # the bucket launched just before
    earlier = [sum(P[:k]) for k in range(len(P))]            # every bucket launched before
    wait_first = max(max((4 * (b[k] + P[k]), k, "copy"), (4 * (b[k] + before[k]), k, "arrival"))
                     for k in range(len(b)))
    return {"wait-then-launch": wait_first,
            "launch-then-wait": max((4 * (b[k] + P[k] + before[k]), k, "copy")
                                    for k in range(len(b))),
            "launch-all": max((4 * (b[k] + P[k] + earlier[k]), k, "copy")
                              for k in range(len(b)))}


def expected_peak() -> tuple[int, int]:
    """(bytes, bucket) at the peak of one bucket in flight, waited for before the next bucket
    is copied: the larger of a bucket's last arrival beside the bucket before it, in flight,
    and a bucket just copied before its p.grad is let go."""
    peak, k, _ = schedule_peaks()["wait-then-launch"]
    return peak, k


class _Schedule:
    """The check's own ZeRO-2 with one bucket order, ``order`` (one of ``SCHEDULES``): the
    instrument of ``measure_schedules``. At a bucket's last arrival it copies the bucket into a
    padded buffer, lets go of its p.grad and launches it — after waiting for the bucket before
    (``wait-then-launch``), before it (``launch-then-wait``), or never before step()
    (``launch-all``)."""

    order = "wait-then-launch"

    def __init__(self, params, optimizer_cls, bucket_cap=128, **kwargs):
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        trainable = [p for p in params if p.requires_grad]
        self.buckets, current, size = [], [], 0
        for p in reversed(trainable):
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= bucket_cap:
                self.buckets.append(current)
                current, size = [], 0
        if current:
            self.buckets.append(current)
        self.bucket_of = {p: i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.layout, pieces, offset = [], [], 0
        for bucket in self.buckets:
            numel = sum(p.numel() for p in bucket)
            n = _piece_numel(numel, self.world_size, bucket[0].element_size())
            flat = F.pad(torch.cat([p.detach().reshape(-1) for p in bucket]),
                         (0, n * self.world_size - numel))
            pieces.append(flat[self.rank * n:(self.rank + 1) * n])
            self.layout.append((n, offset))
            offset += n
        self.shard = nn.Parameter(torch.cat(pieces))
        self.shard.grad = torch.zeros_like(self.shard)
        self.optimizer = optimizer_cls([self.shard], **kwargs)
        self.arrived = [0] * len(self.buckets)
        self.in_flight = []
        for p in trainable:
            p.register_post_accumulate_grad_hook(self._ready)

    def zero_grad(self):
        for bucket in self.buckets:
            for p in bucket:
                p.grad = None

    def _ready(self, p):
        i = self.bucket_of[p]
        self.arrived[i] += 1
        if self.arrived[i] < len(self.buckets[i]):
            return
        self.arrived[i] = 0
        if self.order == "wait-then-launch":
            self._finish(keep=0)
        n, offset = self.layout[i]
        numel = sum(q.numel() for q in self.buckets[i])
        buffer = self.shard.new_zeros(n * self.world_size)          # padded: zeros past numel
        torch.cat([q.grad.reshape(-1) for q in self.buckets[i]], out=buffer[:numel])
        for q in self.buckets[i]:
            q.grad = None
        out = self.shard.grad[offset:offset + n]
        work = dist.reduce_scatter_single(out, buffer, async_op=True)
        self.in_flight.append((work, buffer, out))
        if self.order == "launch-then-wait":
            self._finish(keep=1)

    def _finish(self, keep):
        while len(self.in_flight) > keep:
            work, buffer, out = self.in_flight.pop(0)
            work.wait()
            out /= self.world_size

    def step(self):
        self._finish(keep=0)
        self.optimizer.step()
        for bucket, (n, offset) in zip(self.buckets, self.layout):
            full = self.shard.new_empty(n * self.world_size)
            dist.all_gather_single(full, self.shard.detach()[offset:offset + n])
            start = 0
            for p in bucket:
                p.data.copy_(full[start:start + p.numel()].view_as(p))
                start += p.numel()


WEIGHED_AS_LEARNERS.update(f.__code__ for f in vars(_Schedule).values() if hasattr(f, "__code__"))


def _peak_worker(rank: int, world_size: int, cls, order: str | None = None) -> dict:
    """One rank: ``cls`` (or the check's own ZeRO-2 in ``order``) for 2 SGD steps of the
    prediction's model, weighing the gradient memory alive as ``check_zero_two`` does: at
    every gradient's arrival, before every line of the wrapper's own code during the backward,
    and at each reduce-scatter's launch and each wait()."""
    __tracebackhide__ = True
    from ..collectives import record_collectives

    if order is not None:
        cls = type(f"_Schedule_{order}", (_Schedule,), {"order": order})
    model = _peak_mlp()
    trainable = [p for p in model.parameters() if p.requires_grad]
    tracked: list = []
    state = {"learner": None, "skip": set(), "grad_ptr": None, "flying": {}}
    peak = {"bytes": 0, "where": {}, "moment": None}
    log: list = []
    launches: dict = {}

    def weigh(moment=("arrival",)):
        total, where = _live_gradients(trainable, tracked, state, inside=moment[0] != "arrival")
        if total > peak["bytes"] or total == peak["bytes"] and prefer(peak["moment"], moment):
            peak.update(bytes=total, where=where, moment=moment)

    def seen(p):                                       # the check's hook: runs before yours
        tracked.append(weakref.ref(p.grad))
        weigh()

    def launched(call):
        if call.op == "reduce_scatter" or call.function == "all_reduce":
            number = len(launches)
            inputs = _inputs(call)
            state["flying"].update(inputs)
            weigh(("launch", number))
            launches[call.index] = (number, inputs)

    def watched(call):
        number, inputs = launches.get(call.index, (None, {}))
        if number is not None and call.result is not None:
            return _Watched(call.result, number, log, weigh, state["flying"], inputs)
        for ptr in inputs:
            state["flying"].pop(ptr, None)
        return None

    for p in trainable:
        p.register_post_accumulate_grad_hook(seen)
    opt = cls(model.parameters(), torch.optim.SGD, bucket_cap=PEAK_CAP, lr=0.1)
    inner = getattr(opt, "optimizer", None)
    skip = {p.untyped_storage().data_ptr() for p in trainable}
    if inner is not None and hasattr(inner, "state"):
        skip |= {t.untyped_storage().data_ptr() for t in _inner_tensors(inner)}
    state.update(learner=opt, skip=skip)
    with record_collectives(before=launched, after=watched):
        for step in range(2):
            g = torch.Generator().manual_seed(200 + step)
            X = torch.randn(8 * world_size, PEAK_WIDTHS[0], generator=g)
            y = torch.randint(0, PEAK_WIDTHS[-1], (8 * world_size,), generator=g)
            X, y = X[rank * 8:(rank + 1) * 8], y[rank * 8:(rank + 1) * 8]
            opt.zero_grad()
            tracked.clear()
            shard_grad = getattr(getattr(opt, "shard", None), "grad", None)
            state["grad_ptr"] = shard_grad.untyped_storage().data_ptr() \
                if isinstance(shard_grad, torch.Tensor) else None
            loss = F.cross_entropy(model(X), y)
            with weighing_lines(weigh):
                loss.backward()
            opt.step()
    return {"peak": peak["bytes"], "where": peak["where"], "moment": peak["moment"]}


def _schedules_worker(rank: int, world_size: int) -> dict:
    return {order: _peak_worker(rank, world_size, None, order)["peak"] for order in SCHEDULES}


def measure_peak(cls, timeout: float | None = None) -> int:
    """The most gradient bytes your ``cls`` kept alive at once on the prediction's model
    (``PEAK_WIDTHS``, buckets of ``PEAK_CAP`` bytes, fp32, ``PEAK_WORLD_SIZE`` ranks), weighed
    as ``check_zero_two`` weighs them (at every gradient's arrival, and inside your code at
    each line of the backward, each reduce-scatter's launch and each wait()), the largest over
    the ranks."""
    __tracebackhide__ = True
    timeout = check_timeout(timeout, DEFAULT_TIMEOUT)
    require_answer(cls, getattr(cls, "__name__", "ZeroTwo"), "class")
    results = run_ranks(_peak_worker, PEAK_WORLD_SIZE, cls, timeout=timeout,
                        failed=lambda exc: _raised(exc.rank, exc.summary),
                        hang="every rank must make the same collectives, in the same order, "
                             "with tensors of the same size.")
    return max(r["peak"] for r in results)


def measure_schedules(timeout: float | None = None) -> dict:
    """{order: peak bytes} of the check's own ZeRO-2 in each of ``SCHEDULES`` on the
    prediction's model, weighed as ``measure_peak`` weighs your ZeroTwo."""
    __tracebackhide__ = True
    timeout = check_timeout(timeout, DEFAULT_TIMEOUT)
    results = run_ranks(_schedules_worker, PEAK_WORLD_SIZE, timeout=timeout,
                        failed=lambda exc: _raised(exc.rank, exc.summary),
                        hang="the check's own schedules hung: run the cell again.")
    return {order: max(r[order] for r in results) for order in SCHEDULES}


def _close(guess, measured) -> bool:
    value = guess.value if hasattr(guess, "value") else None
    return isinstance(value, (int, float)) and abs(value - measured) <= 0.05 * measured


def check_peak_prediction(guess, measured: int) -> None:
    """Compare the learner's predicted peak of live gradient bytes with ``measured``
    (``measure_peak``), and say where the peak comes from."""
    __tracebackhide__ = True
    b, P = peak_buckets(), _padded()
    total = 4 * sum(b)
    expected, _ = expected_peak()
    j = max(range(1, len(b)), key=lambda n: b[n] + P[n - 1])
    k = max(range(len(b)), key=lambda n: b[n] + P[n])
    arrival, copy = 4 * (b[j] + P[j - 1]), 4 * (b[k] + P[k])
    why = (f"The buckets hold {', '.join(map(str, b))} numbers of 4 B, launched in that order. "
           f"With one bucket in flight, waited for before the next is copied, two moments "
           f"compete: a bucket's last gradient arriving while the bucket before it is still in "
           f"flight — at most at bucket {j}: ({b[j]} + {P[j - 1]}) × 4 = {arrival} B — and a "
           f"bucket just copied into its buffer, before its p.grad is let go: the same "
           f"gradients twice — at most at bucket {k}: ({b[k]} + {P[k]}) × 4 = {copy} B. The "
           f"peak is the larger, {expected} B, {round(100 * expected / total)} % of the {total} "
           f"B of the gradients alone, which DDP, or a ZeRO-2 that reduce-scatters in step(), "
           f"holds at once before any buffer to send them (by default torch DDP's buckets are a "
           f"second copy) — two buckets, not two caps ({2 * PEAK_CAP} B). What is weighed is "
           f"the gradient storage alive between two lines of your code: a temporary made and "
           f"dropped inside one line is not seen — F.pad(torch.cat(...)) holds the unpadded "
           f"cat and its padded copy at once, one bucket more than the {expected} B; a zeroed "
           f"buffer filled by torch.cat(..., out=buffer[:numel]) holds no copy beside it.")
    if measured != expected:
        why += (f" Your ZeroTwo's peak, {measured} B, is not that of one bucket in flight "
                f"({expected} B): it keeps {'more' if measured > expected else 'less'} alive.")
    reveal(guess, measured, close=_close(guess, measured), explanation=why)


def check_schedule_predictions(wait_first, launch_first, launch_all, measured: dict) -> None:
    """Compare the learner's predicted peaks of the three orders (``SCHEDULES``, in that order)
    with ``measure_schedules``' ``measured``, and say which instant makes each."""
    __tracebackhide__ = True
    if not isinstance(measured, dict) or set(measured) != set(SCHEDULES):
        fail(f"the check needs what lab08.measure_schedules() returned, a dict with the keys "
             f"{', '.join(SCHEDULES)}; got {type(measured).__name__}.")
    b, P = peak_buckets(), _padded()
    total = 4 * sum(b)
    first = measured["wait-then-launch"]
    peak, k, moment = schedule_peaks()["wait-then-launch"]
    when = (f"right after bucket {k} is copied, before its p.grad is let go: ({b[k]} + {P[k]})"
            if moment == "copy" else
            f"when bucket {k} is full and bucket {k - 1} still in flight: ({b[k]} + {P[k - 1]})")
    why = (f"Waiting for bucket k − 1 before copying bucket k: at most two buckets are alive — "
           f"the peak, {peak} B, comes {when} × 4 B.")
    reveal(wait_first, first, close=_close(wait_first, first), explanation=why)
    peak, k, _ = schedule_peaks()["launch-then-wait"]
    why = (f"Launching bucket k before waiting for bucket k − 1 means copying bucket k while "
           f"bucket k − 1's buffer still flies: between the copy and p.grad = None, bucket k "
           f"exists twice beside it — at bucket {k}: ({b[k]} + {P[k]} + {P[k - 1]}) × 4 = "
           f"{peak} B, {measured['launch-then-wait'] - first} B (one more bucket) above waiting "
           f"first ({first} B), which lets go of bucket k − 1 before it copies bucket k. What "
           f"launching first buys is overlap: two reduce-scatters in flight for a moment, so "
           f"the backward never stops for bucket k − 1; waiting first stops it only when bucket "
           f"k − 1's reduce-scatter is still running once bucket k is full.")
    value = getattr(launch_first, "value", None)
    if isinstance(value, (int, float)) and abs(value - first) <= 0.05 * first:
        why += (f" You predicted waiting first's peak: the bytes do not just move from p.grad "
                f"into the buffer — for the instant between the copy and p.grad = None both "
                f"exist, and bucket k − 1 is still alive.")
    reveal(launch_first, measured["launch-then-wait"],
           close=_close(launch_first, measured["launch-then-wait"]), explanation=why)
    peak, k, _ = schedule_peaks()["launch-all"]
    why = (f"Waiting for nothing until step() keeps every launched bucket's buffer: at bucket "
           f"{k}'s copy, the buffers of the buckets before it ({' + '.join(map(str, P[:k]))}) "
           f"and bucket {k} twice ({b[k]} + {P[k]}), × 4 = {peak} B — more than the {total} "
           f"B of the gradients alone, before the buffers DDP adds to send them: unbounded "
           f"launches keep every gradient ZeRO-2 meant to drop, and the copy comes on top.")
    value = getattr(launch_all, "value", None)
    if isinstance(value, (int, float)) and abs(value - total) <= 0.05 * total:
        why += (" You predicted all the gradients: the buffers are the gradients, moved — but "
                "the last bucket is copied while its p.grad still exists.")
    reveal(launch_all, measured["launch-all"], close=_close(launch_all, measured["launch-all"]),
           explanation=why)
