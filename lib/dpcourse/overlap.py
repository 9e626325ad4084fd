"""Inside DDP: gradient averaging that overlaps the backward, in three steps (lesson 07, lab07).

Lesson 03 averaged the gradients *after* the backward, one all-reduce per parameter. DDP is
faster because it does two more things, and this module adds them one at a time, each class a
small change of the one before:

1. :class:`AfterBackward` — lesson 03: after ``loss.backward()``, all-reduce every gradient, one
   call per parameter, while nothing else runs.
2. :class:`PerParameterHooks` — a hook on every parameter launches an *asynchronous* all-reduce
   of its gradient the moment autograd has accumulated it, so communication runs while the
   backward goes on computing earlier layers; ``finish_gradient_synchronization()`` waits for
   the handles before the optimizer step.
3. :class:`BucketedDataParallel` — the same hooks, but gradients are grouped into **buckets** of
   about ``bucket_cap_mb`` (in reverse registration order, the order the backward produces
   them): one flat buffer and one all-reduce per bucket, launched when its last gradient
   arrives. Fewer, larger messages pay the per-message latency (lesson 06's alpha) less often.

All three share the interface the training loop uses::

    model = BucketedDataParallel(SmallCNN(), bucket_cap_mb=25)   # inside a rank
    loss_fn(model(X), y).backward()
    model.finish_gradient_synchronization()                      # before optimizer.step()
    optimizer.step()

and count their collectives (``collectives``) and record a timeline (``events``), which the
lesson draws. :func:`predict_step` is lesson 07's model of how much overlap can hide, and
:func:`powersgd_elements` predicts how many numbers PowerSGD sends.

The runs that test them — each way beside real DDP, timed, and DDP's communication hooks
counted — are in :mod:`dpcourse.overlap_experiments`.
"""

from __future__ import annotations

import functools
import math
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "AfterBackward",
    "PerParameterHooks",
    "BucketedDataParallel",
    "assign_buckets",
    "torch_buckets",
    "bucket_nbytes",
    "predict_step",
    "powersgd_elements",
]

MiB = 1024 * 1024  # DDP's bucket_cap_mb is in MiB too (bucket_cap_mb * 1024 * 1024 bytes)


# --------------------------------------------------------------------------------------------
# Step 1: all-reduce after the backward (lesson 03)
# --------------------------------------------------------------------------------------------


class AfterBackward(nn.Module):
    """Lesson 03's averaging as a wrapper: nothing happens during the backward; afterwards one
    blocking all-reduce per parameter.

    Shown in lesson 07, §1.
    """

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        for p in module.parameters():       # start from rank 0's weights, as DDP does
            dist.broadcast(p.data, src=0)
        self.collectives = 0                # all-reduce calls so far
        self.events = []                    # (what, which, time): the lesson's timeline

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        world_size = dist.get_world_size()
        for i, p in enumerate(self.module.parameters()):
            if p.grad is None:
                continue
            self.events.append(("launch", i, time.perf_counter()))
            dist.all_reduce(p.grad)         # blocks until every rank has sent its part
            p.grad /= world_size
            self.events.append(("done", i, time.perf_counter()))
            self.collectives += 1


# --------------------------------------------------------------------------------------------
# Step 2: one asynchronous all-reduce per parameter, launched from a hook
# --------------------------------------------------------------------------------------------


class PerParameterHooks(nn.Module):
    """As soon as autograd has accumulated a parameter's gradient, its hook divides it by the
    world size and launches ``all_reduce(..., async_op=True)``, which returns at once with a
    handle; the backward carries on with earlier layers while the gradient is on the wire.

    ``overlap=False`` is the control experiment: the same asynchronous all-reduces of the same
    tensors, but all launched only once the backward has returned (from
    ``finish_gradient_synchronization``), so that overlap is the only difference.

    Shown in lesson 07, §2.
    """

    def __init__(self, module: nn.Module, overlap: bool = True):
        super().__init__()
        self.module = module
        self.overlap = overlap
        self._later = []                    # overlap=False: the launches held back
        for p in module.parameters():
            dist.broadcast(p.data, src=0)
        self.collectives = 0
        self.events = []
        self._handles = []                  # the in-flight all-reduces of this backward
        for i, p in enumerate(module.parameters()):
            if p.requires_grad:
                # runs after p.grad has been written (accumulated) for this backward
                p.register_post_accumulate_grad_hook(functools.partial(self._grad_ready, i))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _grad_ready(self, i, p):
        p.grad /= dist.get_world_size()     # sum of (g / N) over the ranks = the mean
        if self.overlap:
            self._launch(i, p.grad)
        else:
            self._later.append((i, p.grad))

    def _launch(self, i, grad):
        self.events.append(("launch", i, time.perf_counter()))
        work = dist.all_reduce(grad, async_op=True)
        self._handles.append(work)
        self.collectives += 1

    def finish_gradient_synchronization(self):
        for i, grad in self._later:         # overlap=False: launch them all only now
            self._launch(i, grad)
        self._later.clear()
        for work in self._handles:          # the optimizer must not read a half-reduced grad
            work.wait()
        self.events.append(("done", None, time.perf_counter()))
        self._handles.clear()


# --------------------------------------------------------------------------------------------
# Step 3: buckets — one flat buffer and one all-reduce per group of gradients
# --------------------------------------------------------------------------------------------


def bucket_nbytes(params) -> int:
    """The bytes of ``params`` in one flat buffer: what a bucket of them sends per all-reduce.

    Shown in lesson 07, §3.
    """
    return sum(p.numel() * p.element_size() for p in params)


def cap_steps_kib(params, lo_kib: float, hi_kib: float) -> list[float]:
    """Every cap in KiB, within [lo_kib, hi_kib], at which :func:`assign_buckets`'s count of
    buckets for ``params`` can change: the sums of the bytes of each run of neighbours in the
    walk's order (``params`` reversed). A figure plots the count at these caps only.

    Shown in lesson 07, §3.
    """
    sizes = [bucket_nbytes([p]) / 1024 for p in reversed(list(params))]
    edges = {sum(sizes[i:j]) for i in range(len(sizes)) for j in range(i + 1, len(sizes) + 1)}
    return sorted(e for e in edges if lo_kib <= e <= hi_kib)


def assign_buckets(params, bucket_cap_mb: float,
                   first_bucket_mb: float | None = None) -> list[list[nn.Parameter]]:
    """Group ``params`` into buckets by DDP's rule, in *reverse* order.

    The backward produces gradients roughly from the last layer to the first, so the reverse of
    registration order is the order the buckets fill up in; the first bucket can then be sent
    while the backward is still busy with the early layers. The rule is the one of DDP's
    reducer (``compute_bucket_assignment_by_size``): a parameter is added to the open bucket of
    its dtype and device, and the bucket is closed once it has **reached** the cap (so a bucket
    can end above the cap by its last parameter, and a parameter larger than the cap closes the
    bucket it joins, whatever that bucket held before it). Each
    (dtype, device) pair fills buckets of its own. The caps are a list walked per pair:
    ``first_bucket_mb`` for the first bucket when given (DDP uses 1 MiB when ``bucket_cap_mb``
    is left at its default), then ``bucket_cap_mb`` for every later one. Buckets still open at
    the end are added last, in the order their pairs first appeared.

    These are the buckets DDP's reducer makes when it *rebuilds* them from the order the
    gradients arrived (after the first backward), when ``params`` reversed is that order: for a
    model of ``Linear`` layers run in registration order (each bias's gradient arrives before
    its weight's). A convolution's weight gradient arrives before its bias's, so there DDP's
    rebuilt buckets list the two the other way round (and can split them differently when a
    cap falls between them). They are not the buckets DDP makes at construction
    with ``find_unused_parameters=True``: those walk the parameters in registration order and
    then reverse the list of buckets (lesson 07, §3, compares the two).

    Shown in lesson 07, §3.
    """
    caps = [bucket_cap_mb] if first_bucket_mb is None else [first_bucket_mb, bucket_cap_mb]
    for c in caps:
        if not c > 0:
            raise ValueError(f"bucket_cap_mb must be a positive number of MiB, got {c!r}")
    limits = [c * MiB for c in caps]
    buckets = []
    open_ = {}                          # (dtype, device) -> [params, bytes, index into limits]
    for p in reversed(list(params)):
        b = open_.setdefault((p.dtype, p.device), [[], 0, 0])
        b[0].append(p)
        b[1] += p.numel() * p.element_size()
        if b[1] >= limits[b[2]]:        # reached the cap: close it, move to the next cap
            buckets.append(b[0])
            b[:] = [[], 0, min(b[2] + 1, len(limits) - 1)]
    buckets += [b[0] for b in open_.values() if b[0]]
    return buckets


def torch_buckets(params, caps_mb) -> list[list[int]]:
    """The buckets DDP's reducer itself makes of ``reversed(params)``, as lists of indices into
    ``params``: torch's C++ assignment, called through the name torch exposes it by, with the
    limits ``caps_mb`` in MiB (the first for the first bucket, the last for every later one;
    ``math.inf`` for no cap). Lesson 07 checks ``assign_buckets`` against it; lab 07's check
    refuses it as an answer.

    Shown in lesson 07, §3.
    """
    n = len(params)
    limits = [sys.maxsize if c == math.inf else int(c * MiB) for c in caps_mb]
    got, _ = dist._compute_bucket_assignment_by_size(
        list(reversed(params)), limits, [False] * n, list(range(n - 1, -1, -1)))
    return [list(b) for b in got]


class BucketedDataParallel(nn.Module):
    """Gradients are copied into their bucket's flat buffer as they arrive; when a bucket's
    last gradient has arrived, the whole buffer is all-reduced asynchronously in one call.
    ``finish_gradient_synchronization()`` waits for every bucket and copies the averaged
    values back into each ``p.grad``. (DDP's reducer does two things more, which lab07 asks
    of you: it launches buckets strictly in bucket order, and it can make each ``p.grad`` a
    view into its bucket.) ``overlap=False`` is the control experiment: the same buckets and
    asynchronous all-reduces, all launched only after the backward has returned.
    ``copy_seconds[i]`` adds up, per bucket, the time spent putting gradients into the bucket
    and dividing it (in the hooks) and copying the averages back (after the wait): lesson 07's
    overlap model takes its copy costs from these, measured inside the ranks during the run.

    Shown in lesson 07, §3.
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25.0, overlap: bool = True):
        super().__init__()
        self.module = module
        self.overlap = overlap
        for p in module.parameters():
            dist.broadcast(p.data, src=0)
        self.collectives = 0
        self.events = []
        params = [p for p in module.parameters() if p.requires_grad]
        self.buckets = assign_buckets(params, bucket_cap_mb)
        self._flat = [torch.zeros(sum(p.numel() for p in b), dtype=b[0].dtype,
                                  device=b[0].device) for b in self.buckets]
        self._where = {}                    # parameter -> (bucket index, offset in its buffer)
        for i, bucket in enumerate(self.buckets):
            offset = 0
            for p in bucket:
                self._where[p] = (i, offset)
                offset += p.numel()
                p.register_post_accumulate_grad_hook(self._grad_ready)
        self._missing = [len(b) for b in self.buckets]   # gradients each bucket still awaits
        self._handles = {}                  # bucket index -> its in-flight all-reduce
        self.copy_seconds = [[0.0, 0.0] for _ in self.buckets]   # [in and divide, back]

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _grad_ready(self, p):
        i, offset = self._where[p]
        if self._missing[i] == 0:           # its bucket is complete: a second backward
            name = next(n for n, q in self.module.named_parameters() if q is p)
            raise RuntimeError(
                f"{name} got a second gradient before finish_gradient_synchronization(): its "
                f"bucket was already complete (and sent), so call "
                f"finish_gradient_synchronization() after every backward.")
        t = time.perf_counter()
        self._flat[i][offset:offset + p.numel()].copy_(p.grad.reshape(-1))
        self.copy_seconds[i][0] += time.perf_counter() - t
        self._missing[i] -= 1
        if self._missing[i] == 0 and self.overlap:   # the bucket is full: send it
            self._launch(i)

    def _launch(self, i):
        t = time.perf_counter()
        self._flat[i].div_(dist.get_world_size())
        self.copy_seconds[i][0] += time.perf_counter() - t
        self.events.append(("launch", i, time.perf_counter()))
        work = dist.all_reduce(self._flat[i], async_op=True)
        work.get_future().then(
            lambda _, i=i: self.events.append(("done", i, time.perf_counter())))
        self._handles[i] = work
        self.collectives += 1

    def finish_gradient_synchronization(self):
        unfinished = [i for i, m in enumerate(self._missing) if m]
        if unfinished:
            names = {p: n for n, p in self.module.named_parameters()}
            lost = [names[p] for i in unfinished for p in self.buckets[i] if p.grad is None]
            raise RuntimeError(
                f"bucket(s) {unfinished} never filled: parameter(s) {lost[:5]} got no gradient in "
                f"this backward, so their bucket was never sent. Every parameter must take part "
                f"in the loss; DDP handles unused ones with find_unused_parameters=True, or with "
                f"static_graph=True when the same parameters are unused in every iteration.")
        if not self.overlap:                # the control: launch every bucket only now
            for i in range(len(self.buckets)):
                self._launch(i)
        for i, work in sorted(self._handles.items()):
            work.wait()                     # the buffer now holds the mean over the ranks
            t = time.perf_counter()
            for p in self.buckets[i]:
                _, offset = self._where[p]
                p.grad.copy_(self._flat[i][offset:offset + p.numel()].view_as(p.grad))
            self.copy_seconds[i][1] += time.perf_counter() - t
        self._handles.clear()
        self._missing = [len(b) for b in self.buckets]


# --------------------------------------------------------------------------------------------
# The overlap model: what one step should take, with and without overlap
# --------------------------------------------------------------------------------------------


def predict_step(ready_ms, bucket_sizes, comm_ms, forward_ms: float, backward_ms: float,
                 opt_ms: float, overlap: bool = True, copy_in_ms=None, copy_back_ms=None) -> dict:
    """Lesson 07's overlap model of one training step, in ms.

    ``ready_ms``: when each gradient was ready (ms after the backward began, measured without
    communication), in the order they arrive; ``bucket_sizes``: each bucket's (number of
    gradients, bytes), in launch order, buckets taking the gradients in arrival order;
    ``comm_ms(nbytes)``: the time of one all-reduce (lesson 06's α-β model). One all-reduce
    runs at a time: bucket k starts when its last gradient is ready (``overlap``) or when the
    backward ends (not), and not before bucket k-1 has finished; the bucket that holds the last
    gradient is complete only when the backward ends, so it starts then in both cases (with a
    single bucket, overlap and its control do the same work; in the runs the last bucket is
    launched from its hook inside backward() in one, after backward() returns in the other).
    The step is then

        forward + max(backward, end of the last all-reduce) + optimizer step,

    which is forward + backward + the last bucket's ring cost 2(N-1)α + 2(N-1)/N·Kβ +
    optimizer step whenever the early buckets, each started at its ready time, have finished
    by the end of the backward and the last bucket is ready only when it ends. Optionally
    ``copy_in_ms``, the work the hooks do on the compute thread to put a bucket's gradients
    into its buffer (it delays the rest of the backward), and ``copy_back_ms``, the copy back
    after the wait: each a function of a bucket's bytes, or a list with one time per bucket
    (as measured in a run).

    Shown in lesson 07, §4.
    """
    ready = sorted(ready_ms)
    if sum(n for n, _ in bucket_sizes) != len(ready):
        raise ValueError(f"the buckets hold {sum(n for n, _ in bucket_sizes)} gradients but "
                         f"{len(ready)} ready times were given")
    def per_bucket(cost):
        if cost is None:
            return [0.0] * len(bucket_sizes)
        if callable(cost):
            return [cost(nbytes) for _, nbytes in bucket_sizes]
        if len(cost) != len(bucket_sizes):
            raise ValueError(f"{len(cost)} copy times given for {len(bucket_sizes)} buckets")
        return list(cost)

    copy_in, copy_back = per_bucket(copy_in_ms), per_bucket(copy_back_ms)
    backward_end = backward_ms + sum(copy_in)   # the hooks' copies lengthen the backward
    free, seen, comm, spans, copied = 0.0, 0, 0.0, [], 0.0
    for k, (n, nbytes) in enumerate(bucket_sizes):
        seen += n
        copied += copy_in[k]
        last = seen == len(ready)           # holds the last gradient: ready when backward ends
        start = max(ready[seen - 1] + copied if overlap and not last else backward_end, free)
        cost = comm_ms(nbytes)
        free = start + cost
        comm += cost
        spans.append((start, free))
    sync_end = max(backward_end, free) + sum(copy_back)
    return {"step_ms": forward_ms + sync_end + opt_ms, "comm_ms": comm,
            "exposed_comm_ms": max(backward_end, free) - backward_end, "spans": spans}


# --------------------------------------------------------------------------------------------
# What PowerSGD sends (counted by dpcourse.collectives.record_collectives in comm_hook_worker)
# --------------------------------------------------------------------------------------------


def powersgd_elements(shapes, rank: int, min_compression_rate: float = 2.0) -> dict:
    """How many numbers PowerSGD all-reduces per step, from the parameter shapes alone.

    Each gradient is seen as a matrix n × m (n = its first dimension, m = the rest). It is
    compressed to P (n × r) and Q (m × r), r = min(n, m, rank), when that is worth it:
    (n + m) r · min_compression_rate < n m; otherwise (biases, tiny layers) it is all-reduced
    whole, with the other uncompressed ones in one flat buffer. Returns the counts per part.

    Shown in lesson 07, §5.
    """
    p_total = q_total = whole = 0
    for shape in shapes:
        n = shape[0] if len(shape) else 1
        m = math.prod(shape[1:]) if len(shape) > 1 else 1
        r = min(n, m, rank)
        if (n + m) * r * min_compression_rate < n * m:
            p_total += n * r
            q_total += m * r
        else:
            whole += n * m
    return {"P": p_total, "Q": q_total, "uncompressed": whole,
            "total": p_total + q_total + whole,
            "dense": sum(math.prod(s) if len(s) else 1 for s in shapes)}
