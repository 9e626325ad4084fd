"""Lab 11's stretch, run: a GPipe step over 2 and 3 stages whose forwards take a fixed "device
time", with the point-to-point messages tracked, and the bubble measured over several numbers
of micro-batches. What a wrong step or bubble did is read by
:mod:`dpcourse.checks._lab11_pipeline`; re-exported by :mod:`dpcourse.checks.lab11`."""

from __future__ import annotations

import time

import torch
from torch import nn

from . import check_timeout, fail, passed, recorded, refuse_reference, run_ranks
from ._lab11_common import DEFAULT_TIMEOUT, _HANG, _OWN, _todo
from ._lab11_pipeline import (_BATCH, _BELOW_IDEAL, _CHECK_DELAY_S, _M, _STAGES, _WIDTH,
                              _check_bubble_fn, _computation_only, _diagnose_gpipe, _gpipe_failed,
                              _mse, _pending)


class _DeviceTime(torch.autograd.Function):
    """Sleep ``s`` in the forward and 2·s in the backward: a stand-in for an accelerator."""

    @staticmethod
    def forward(ctx, x, s):
        ctx.s = s
        time.sleep(s)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(2 * ctx.s)
        return grad, None


class _Timed(nn.Module):
    def __init__(self, inner: nn.Module, s: float):
        super().__init__()
        self.inner, self.s = inner, s

    def forward(self, x):
        return _DeviceTime.apply(self.inner(x), self.s)


class _Handle:
    """A point-to-point request as the learner's code sees it, noting whether it was settled:
    waited on, or seen complete through ``is_completed()``."""

    def __init__(self, work, kind: str):
        self._work, self.kind, self.settled = work, kind, False

    def wait(self, *args, **kwargs):
        self.settled = True
        return self._work.wait(*args, **kwargs)

    def is_completed(self):
        done = self._work.is_completed()
        self.settled = self.settled or bool(done)
        return done

    def __getattr__(self, name):
        return getattr(self._work, name)


class _TrackP2P:
    """Within the block, every send and receive of a process group (``dist.send``/``recv``,
    ``isend``/``irecv`` and ``batch_isend_irecv`` all go through ``ProcessGroup.send``/``recv``)
    hands back a :class:`_Handle`; the blocking calls wait on theirs at once."""

    def __enter__(self):
        from torch._C._distributed_c10d import ProcessGroup

        self.handles, self._pg = [], ProcessGroup
        self._orig = {name: getattr(ProcessGroup, name) for name in ("send", "recv")}

        def wrap(name):
            orig = self._orig[name]

            def call(group, *args, **kwargs):
                handle = _Handle(orig(group, *args, **kwargs), name)
                self.handles.append(handle)
                return handle
            return call

        for name in self._orig:
            setattr(ProcessGroup, name, wrap(name))
        return self

    def __exit__(self, *exc):
        for name, orig in self._orig.items():
            setattr(self._pg, name, orig)
        return False

    def pending(self) -> dict:
        """How many sends and receives were never settled; waits on them, so that the
        neighbours get their messages and the run ends (the check then names the mistake)."""
        left = [h for h in self.handles if not h.settled]
        for h in left:
            h._work.wait()
        return {kind: sum(h.kind == kind for h in left) for kind in ("send", "recv")}


def _gpipe_worker(rank: int, world_size: int, step_fn, m: int, delay_s: float) -> dict:
    import torch.distributed as dist

    from .. import pipeline_parallel as pp

    torch.set_num_threads(1)
    stage = pp.split_stages(pp.make_mlp(_WIDTH, world_size, seed=12), world_size)[rank]
    module = _Timed(stage, delay_s) if delay_s else stage
    gen = torch.Generator().manual_seed(13)
    x, y = torch.randn(_BATCH, _WIDTH, generator=gen), torch.randn(_BATCH, _WIDTH, generator=gen)
    inputs = list(x.chunk(m)) if rank == 0 else None
    targets = list(y.chunk(m)) if rank == world_size - 1 else None
    stage.zero_grad(set_to_none=True)
    dist.barrier()
    # a rank that raises is not caught here: the launch stops every rank at once (its neighbour
    # would wait for its message forever) and _gpipe_failed names the mistake
    with _TrackP2P() as p2p:
        loss, events = step_fn(module, rank, world_size, m, inputs, targets, _mse,
                               (_BATCH // m, _WIDTH))
        pending = p2p.pending()
    return {"pending": pending, "loss": None if loss is None else float(loss),
            "events": [(str(k), int(i), float(s), float(e)) for k, i, s, e in events],
            "grads": [None if p.grad is None else p.grad.clone() for p in stage.parameters()]}


@recorded
def check_gpipe(step_fn, bubble_fn, stages=_STAGES, timeout: float | None = None) -> None:
    """Stretch: ``step_fn(module, rank, world_size, m, inputs, targets, loss_fn, shape)`` runs one
    GPipe step of this rank's stage (``module``, its part of the model) over send/recv and
    returns ``(loss, events)``; on 2 and 3 stages with 4 micro-batches its gradients must equal
    the unsplit model's on the whole batch, and its events must time the computation only (a
    stage's forward of micro-batch i starts after the previous stage's ended, its backward after
    the next stage's: each forward sleeps ``_CHECK_DELAY_S`` and each backward twice that, so a
    timer around a ``recv`` shows). ``bubble_fn(events, stages)`` must give the measured idle
    share of a timeline ``[(stage, kind, micro-batch, start, end)]``."""
    __tracebackhide__ = True
    from .. import pipeline_parallel as pp

    refuse_reference(step_fn, "gpipe_step", pp.run_stage, why=_OWN)
    refuse_reference(bubble_fn, "bubble", pp.measured_bubble, pp.ideal_bubble, why=_OWN)
    _todo(step_fn, bubble_fn)
    timeout = check_timeout(timeout, DEFAULT_TIMEOUT)
    _check_bubble_fn(bubble_fn)
    for k in stages:
        outs = run_ranks(_gpipe_worker, k, step_fn, _M, _CHECK_DELAY_S, timeout=timeout,
                         failed=_gpipe_failed,
                         hang="a stage waits for a message that never comes: every send needs "
                              "its recv on the neighbour, in the same order (forwards go to "
                              "rank + 1, gradients back to rank - 1).")
        _pending(outs)
        _diagnose_gpipe(outs, k, _M)
        _computation_only(outs, k, _M)
    passed(f"GPipe stage: gradients accumulated over {_M} micro-batches equal the unsplit "
           f"model's on {' and '.join(map(str, stages))} stages, events timing the computation "
           f"only; bubble measured as the idle share of the timeline")


def measure_bubble(step_fn, bubble_fn, stages: int = 2, micro=(1, 2, 4, 8),
                   delay_s: float = 0.01, timeout: float | None = None) -> None:
    """Run the learner's GPipe stage with each number of micro-batches in ``micro`` (each
    forward sleeps ``delay_s`` and each backward twice it, as an accelerator would compute
    without taking a CPU core), and print the bubble their ``bubble_fn`` measures beside
    (K−1)/(M+K−1), one row per M."""
    __tracebackhide__ = True
    from .. import pipeline_parallel as pp

    timeout = check_timeout(timeout, DEFAULT_TIMEOUT)
    rows = []
    for m in micro:
        outs = run_ranks(_gpipe_worker, stages, step_fn, m, delay_s, timeout=timeout,
                         failed=_gpipe_failed, hang=_HANG)
        _pending(outs)
        _computation_only(outs, stages, m)
        events = [(rank, k, i, s, e) for rank, o in enumerate(outs) for k, i, s, e in o["events"]]
        rows.append((m, float(bubble_fn(events, stages)), pp.ideal_bubble(stages, m)))
    print(f"{'M':>3}  {'measured':>8}  {'(K-1)/(M+K-1)':>13}")
    for m, got, ideal in rows:
        print(f"{m:>3}  {got:>8.3f}  {ideal:>13.3f}")
    for m, got, ideal in rows:
        if got < ideal - _BELOW_IDEAL:
            fail(f"the measured bubble at M = {m} is {got:.3f}, below (K−1)/(M+K−1) = "
                 f"{ideal:.3f}, which no GPipe step with equal stages can beat (each stage idles while "
                 f"the pipeline fills and drains): your events count time that is not computation as "
                 f"busy.", fix="time the computation only.")
    above = sum(got >= ideal - _BELOW_IDEAL for _, got, ideal in rows)
    first, last = rows[0], rows[-1]
    print(f"measured ≥ formula (to {_BELOW_IDEAL}) in {above} of {len(rows)} rows; the measured "
          f"bubble went from {first[1]:.2f} at M = {first[0]} to {last[1]:.2f} at M = {last[0]}")
