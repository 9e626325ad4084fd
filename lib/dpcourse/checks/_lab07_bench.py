"""Lab 07 part 2's test bench, shared by its checks: the model the wrapper is run on (registered
in one order, run in another, with a frozen parameter), the spy that stands in for
``dist.all_reduce`` (it records each call and hands the reduced values over only when the handle
is waited on) and the storage census that tells a bucket's view from a copy. The checks are in
:mod:`dpcourse.checks.lab07`."""

from __future__ import annotations

import time

import torch
from torch import nn

DEFAULT_TIMEOUT = 30.0


# The check's model: registered in one order, run in another, with a frozen parameter.
# Registration: conv (3 -> w -> 2w), out (64 -> 10), hidden (64 -> 64), a frozen scale.
# Forward: conv -> hidden -> scale -> out, so the backward produces out's gradients first: in
# reverse registration order out comes *after* hidden, and at 0.002 MiB its bucket (bucket 1)
# is complete before bucket 0 (hidden) — buckets fill out of order.
CONFIGS = ((2, 0.002), (3, 0.004))   # (world size, bucket_cap_mb): 4 buckets, then 3
_STEPS = 3
_GLOBAL_BATCH = 24
# how each step starts: p.grad None (nothing yet), zeroed in place, set to None again
_ZERO_GRAD = (True, False, True)


class _CheckNet(nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(4),            # 8x8
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(4))    # 2x2
        self.out = nn.Linear(64, 10)          # registered before `hidden`, runs after it
        self.hidden = nn.Linear(8 * width, 64)
        self.scale = nn.Parameter(torch.full((64,), 0.5), requires_grad=False)   # frozen

    def forward(self, x):
        h = torch.relu(self.hidden(self.conv(x).flatten(1))) * self.scale
        return self.out(h)


def _check_net() -> nn.Module:
    torch.manual_seed(0)
    return _CheckNet()


class _Deferred:
    """What the spy returns for ``all_reduce(..., async_op=True)``: the real all-reduce runs on
    a copy, and its result is written into the learner's tensor when the handle is waited on
    (or its future completes). Until then the learner's tensor holds NaN, as a buffer a GPU
    collective is still writing holds no defined value."""

    def __init__(self, work, buf, target, rec, state):
        self._work, self._buf, self._target, self._rec = work, buf, target, rec
        self._state = state          # the check's current step, to notice stale handles
        self._delivered = False

    def _deliver(self):
        if not self._delivered:
            self._target.copy_(self._buf)
            self._delivered = True

    def wait(self, *args, **kwargs):
        if self._state["step"] != self._rec["step"]:
            self._state["stale_waits"].append((self._state["step"], self._rec["step"]))
        self._work.wait(*args, **kwargs)
        if self._rec["t_wait"] is None:
            self._rec["t_wait"] = time.perf_counter()
        self._deliver()
        return True

    def is_completed(self):
        return self._work.is_completed() and self._delivered

    def get_future(self):
        self._rec["future"] = True

        def delivered(fut):
            self._deliver()
            if self._rec["t_wait"] is None:
                self._rec["t_wait"] = time.perf_counter()
            return [self._target]

        return self._work.get_future().then(delivered)

    def __getattr__(self, name):
        return getattr(self._work, name)


def _deferring_spy(calls, state, where=False):
    """The ``before``/``after`` pair for ``record_collectives`` that both workers use: each
    all_reduce the learner launches is appended to ``calls`` (its step, size, whether async,
    when waited on; with ``where``, also when launched and which storage it reads), and an async
    one runs on a copy that a ``_Deferred`` delivers on wait(), while the learner's tensor holds
    NaN — so reading it before waiting gives wrong numbers, as on a GPU."""
    pending = {}                            # a recorded call's index -> (its record, tensors)

    def before(call):
        if call.function != "all_reduce":
            return
        tensor = call.args["tensor"]
        rec = {"step": state["step"], "numel": tensor.numel(), "async": call.async_op,
               "t_wait": None, "future": False}
        if where:
            rec.update(t_launch=time.perf_counter(), storage=_storage(tensor),
                       offset=tensor.storage_offset(), sent=tensor.detach().cpu().clone())
        calls.append(rec)
        if call.async_op:
            call.args["tensor"] = tensor.detach().clone()
        pending[call.index] = (rec, tensor, call.args["tensor"])

    def after(call):
        if call.index not in pending:
            return None
        rec, tensor, buf = pending.pop(call.index)
        if not call.async_op:
            rec["t_wait"] = time.perf_counter()
            return None
        tensor.detach().fill_(float("nan"))     # in flight: no defined value until wait()
        return _Deferred(call.result, buf, tensor, rec, state)

    return before, after


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _held_storages(obj, depth: int = 0, seen=None) -> set:
    """The storages of every tensor the learner's object keeps (attributes, lists, dicts)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 4:
        return set()
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return {_storage(obj)}
    items = []
    if isinstance(obj, dict):
        items = list(obj.keys()) + list(obj.values())
    elif isinstance(obj, (list, tuple, set)):
        items = list(obj)
    elif isinstance(obj, nn.Module):
        items = [v for k, v in vars(obj).items() if k not in ("_modules", "_parameters")]
    out = set()
    for x in items:
        out |= _held_storages(x, depth + 1, seen)
    return out


def _close(a, b) -> bool:
    return a is not None and b is not None and a.shape == b.shape and \
        torch.allclose(a, b, rtol=1e-4, atol=1e-7)


def _all_close(xs, ys) -> bool:
    return all(_close(x, y) for x, y in zip(xs, ys))
