"""lab07's checks: assign_buckets (in process) and the bucketed wrapper (2 and 3 gloo ranks).

Every wrong answer must fail with the sentence that names its mistake; every right variant
(another closing rule, MB for MiB, dividing after the wait, gradients as views of the bucket,
a tensor hook instead of a post-accumulate hook, futures, torch's flatten helpers) must pass.
"""

import sys
import time

import cloudpickle
import pytest
import torch
import torch.distributed as dist
from torch import nn

from dpcourse import overlap
from dpcourse.checks import LabCheckError, lab07

cloudpickle.register_pickle_by_value(sys.modules[__name__])

# --------------------------------------------------------------------------------------------
# assign_buckets
# --------------------------------------------------------------------------------------------


def _nbytes(p):
    return p.numel() * p.element_size()


def ddp_rule(params, cap_mb):
    # close a bucket once it has reached the cap (what DDP's reducer does): also right
    buckets, current, size = [], [], 0
    for p in reversed(params):
        current.append(p)
        size += _nbytes(p)
        if size >= cap_mb * 2**20:
            buckets.append(current)
            current, size = [], 0
    return buckets + ([current] if current else [])


def megabytes(params, cap_mb):
    # 1 MB = 10**6 bytes instead of 2**20: close enough, and right on the check's cases
    out = [[]]
    for p in params[::-1]:
        if out[-1] and sum(map(_nbytes, out[-1])) + _nbytes(p) > cap_mb * 1e6:
            out.append([])
        out[-1].append(p)
    return out


def by_indices(params, cap_mb):
    order = list(range(len(params)))[::-1]
    groups, start = [], 0
    while start < len(order):
        end, size = start, 0
        while end < len(order) and (end == start or size + _nbytes(params[order[end]])
                                    <= cap_mb * 2**20):
            size += _nbytes(params[order[end]])
            end += 1
        groups.append([params[i] for i in order[start:end]])
        start = end
    return groups


@pytest.mark.parametrize("fn", [overlap.assign_buckets, ddp_rule, megabytes, by_indices])
def test_right_assign_buckets_pass(fn, capsys):
    lab07.check_assign_buckets(fn)
    assert capsys.readouterr().out.count("✔") == 1


def forward_order(params, cap_mb):
    return overlap.assign_buckets(list(reversed(params)), cap_mb)


def one_per_parameter(params, cap_mb):
    return [[p] for p in reversed(params)]


def all_in_one(params, cap_mb):
    return [list(reversed(params))]


def elements_as_bytes(params, cap_mb):
    out, cur, size = [], [], 0
    for p in reversed(params):
        if cur and size + p.numel() > cap_mb * 2**20:
            out.append(cur)
            cur, size = [], 0
        cur.append(p)
        size += p.numel()
    return out + [cur]


def four_bytes_each(params, cap_mb):
    out, cur, size = [], [], 0
    for p in reversed(params):
        if cur and size + 4 * p.numel() > cap_mb * 2**20:
            out.append(cur)
            cur, size = [], 0
        cur.append(p)
        size += 4 * p.numel()
    return out + [cur]


def drops_the_last(params, cap_mb):
    buckets = overlap.assign_buckets(params, cap_mb)
    buckets[-1] = buckets[-1][:-1] or buckets[-1]
    return [b for b in buckets if b] if len(params) > 1 else buckets


def repeats_one(params, cap_mb):
    buckets = overlap.assign_buckets(params, cap_mb)
    buckets[0].append(buckets[-1][-1])
    return buckets


def names_not_params(params, cap_mb):
    return [[str(p.shape) for p in b] for b in overlap.assign_buckets(params, cap_mb)]


def sorted_by_size(params, cap_mb):
    return overlap.assign_buckets(sorted(params, key=lambda p: p.numel()), cap_mb)


def never_closes_small(params, cap_mb):
    # checks the cap only after adding, and only against the previous parameter's size
    out, cur, size = [], [], 0
    for p in reversed(params):
        cur.append(p)
        size += _nbytes(p)
        if size > 2 * cap_mb * 2**20:
            out.append(cur)
            cur, size = [], 0
    return out + ([cur] if cur else [])


@pytest.mark.parametrize("fn, phrase", [
    (forward_order, "forward \\(registration\\) order"),
    (one_per_parameter, "every parameter has a bucket of its own"),
    (all_in_one, "more than the cap .* already before its last one"),
    (elements_as_bytes, "counted elements \\(p.numel\\(\\)\\) as bytes"),
    (four_bytes_each, "assumed 4 bytes per element"),
    (drops_the_last, "are in no bucket"),
    (repeats_one, "in more than one bucket"),
    (names_not_params, "not one of the parameters given"),
    (sorted_by_size, "not in reverse registration order"),
    (never_closes_small, "more than the cap"),
])
def test_wrong_assign_buckets_are_named(fn, phrase):
    with pytest.raises(LabCheckError, match=phrase):
        lab07.check_assign_buckets(fn)


def todo_buckets(params, cap_mb):
    raise NotImplementedError("TODO")


def test_unfinished_assign_buckets_is_not_implemented():
    with pytest.raises(NotImplementedError, match="replace the TODO"):
        lab07.check_assign_buckets(todo_buckets)


# --------------------------------------------------------------------------------------------
# The wrapper
# --------------------------------------------------------------------------------------------


class Good(nn.Module):
    """The solution's wrapper, written once here; the wrong answers change one method."""

    def __init__(self, module, bucket_cap_mb=25.0):
        super().__init__()
        self.module = module
        for p in module.parameters():
            dist.broadcast(p.data, src=0)
        self.buckets = self.assign([p for p in module.parameters() if p.requires_grad],
                                   bucket_cap_mb)
        self.flat = [torch.zeros(sum(p.numel() for p in b)) for b in self.buckets]
        self.where = {}
        for i, bucket in enumerate(self.buckets):
            offset = 0
            for p in bucket:
                self.where[p] = (i, offset)
                offset += p.numel()
                self.register(p)
        self.missing = [len(b) for b in self.buckets]
        self.handles = []

    def assign(self, params, cap_mb):
        return overlap.assign_buckets(params, cap_mb)

    def register(self, p):
        p.register_post_accumulate_grad_hook(self._grad_ready)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def copy_in(self, p, grad):
        i, offset = self.where[p]
        self.flat[i][offset:offset + p.numel()].copy_(grad.reshape(-1))
        self.missing[i] -= 1
        return i

    def launch(self, i):
        self.flat[i].div_(dist.get_world_size())
        self.handles.append((i, dist.all_reduce(self.flat[i], async_op=True)))

    def _grad_ready(self, p):
        i = self.copy_in(p, p.grad)
        if self.missing[i] == 0:
            self.launch(i)

    def copy_back(self, i):
        for p in self.buckets[i]:
            _, offset = self.where[p]
            p.grad.copy_(self.flat[i][offset:offset + p.numel()].view_as(p.grad))

    def finish_gradient_synchronization(self):
        for i, work in self.handles:
            work.wait()
            self.copy_back(i)
        self.handles = []
        self.missing = [len(b) for b in self.buckets]


# --- right variants ---


class DivideAfterWait(Good):
    def launch(self, i):
        self.handles.append((i, dist.all_reduce(self.flat[i], async_op=True)))

    def finish_gradient_synchronization(self):
        for i, work in self.handles:
            work.wait()
            self.flat[i] /= dist.get_world_size()
            self.copy_back(i)
        self.handles = []
        self.missing = [len(b) for b in self.buckets]


class GradientsAsViews(Good):
    # like DDP's gradient_as_bucket_view: p.grad becomes a view of the bucket, nothing to copy back
    def _grad_ready(self, p):
        i, offset = self.where[p]
        view = self.flat[i][offset:offset + p.numel()].view_as(p)
        view.copy_(p.grad)
        p.grad = view
        self.missing[i] -= 1
        if self.missing[i] == 0:
            self.launch(i)

    def finish_gradient_synchronization(self):
        for _, work in self.handles:
            work.wait()
        self.handles = []
        self.missing = [len(b) for b in self.buckets]


class TensorHook(Good):
    # a hook on the gradient itself (before accumulation): with fresh grads every step, the
    # gradient handed to the hook is what p.grad will hold
    def register(self, p):
        p.register_hook(lambda grad, p=p: self._on_grad(p, grad))

    def _on_grad(self, p, grad):
        i = self.copy_in(p, grad)
        if self.missing[i] == 0:
            self.launch(i)
        return grad


class FuturesAndFlattenHelpers(Good):
    def launch(self, i):
        self.flat[i].div_(dist.get_world_size())
        fut = dist.all_reduce(self.flat[i], async_op=True).get_future()
        self.handles.append((i, fut))

    def finish_gradient_synchronization(self):
        from torch._utils import _unflatten_dense_tensors

        for i, fut in self.handles:
            fut.wait()
            grads = [p.grad for p in self.buckets[i]]
            for g, avg in zip(grads, _unflatten_dense_tensors(self.flat[i], grads)):
                g.copy_(avg)
        self.handles = []
        self.missing = [len(b) for b in self.buckets]


class AverageOp(Good):
    # ReduceOp.AVG (gloo has it in this torch): no division needed
    def launch(self, i):
        self.handles.append((i, dist.all_reduce(self.flat[i], op=dist.ReduceOp.AVG,
                                                async_op=True)))


@pytest.mark.parametrize("cls", [Good, DivideAfterWait, GradientsAsViews, TensorHook,
                                 FuturesAndFlattenHelpers, AverageOp])
def test_right_wrappers_pass(cls, capsys):
    lab07.check_bucketed_ddp(cls)
    out = capsys.readouterr().out
    assert out.count("✔") == 1 and "2 ranks" in out and "3 ranks" in out


# --- wrong answers ---


class BlockingInHook(Good):
    def launch(self, i):
        self.flat[i].div_(dist.get_world_size())
        dist.all_reduce(self.flat[i])
        self.handles.append((i, None))

    def finish_gradient_synchronization(self):
        for i, _ in self.handles:
            self.copy_back(i)
        self.handles = []
        self.missing = [len(b) for b in self.buckets]


class WaitInHook(Good):
    def launch(self, i):
        super().launch(i)
        self.handles[-1][1].wait()


class NoDivision(Good):
    def launch(self, i):
        self.handles.append((i, dist.all_reduce(self.flat[i], async_op=True)))


class DivideByTwo(Good):
    def launch(self, i):
        self.flat[i].div_(2)
        self.handles.append((i, dist.all_reduce(self.flat[i], async_op=True)))


class NoWait(Good):
    def finish_gradient_synchronization(self):
        for i, _ in self.handles:
            self.copy_back(i)
        self.handles = []
        self.missing = [len(b) for b in self.buckets]


class WrongParameter(Good):
    def copy_back(self, i):
        bucket = self.buckets[i]
        for p, q in zip(bucket, [bucket[-1]] + bucket[:-1]):   # shifted by one
            _, offset = self.where[q]
            if q.numel() == p.numel():
                p.grad.copy_(self.flat[i][offset:offset + q.numel()].view_as(p.grad))
            else:
                _, own = self.where[p]
                p.grad.copy_(self.flat[i][own:own + p.numel()].view_as(p.grad))


class WrongOffsets(Good):
    def copy_back(self, i):
        offset = 0
        for p in reversed(self.buckets[i]):     # offsets counted in the other order
            p.grad.copy_(self.flat[i][offset:offset + p.numel()].view_as(p.grad))
            offset += p.numel()


class LaunchInFinish(Good):
    def _grad_ready(self, p):
        self.copy_in(p, p.grad)

    def finish_gradient_synchronization(self):
        for i in range(len(self.buckets)):
            self.launch(i)
        super().finish_gradient_synchronization()


class PerParameter(Good):
    def _grad_ready(self, p):
        p.grad /= dist.get_world_size()
        self.handles.append((None, dist.all_reduce(p.grad, async_op=True)))

    def finish_gradient_synchronization(self):
        for _, work in self.handles:
            work.wait()
        self.handles = []


class NoReset(Good):
    def finish_gradient_synchronization(self):
        for i, work in self.handles:
            work.wait()
            self.copy_back(i)
        self.handles = []


class HandlesNeverCleared(Good):
    def finish_gradient_synchronization(self):
        for i, work in self.handles:
            work.wait()
            self.copy_back(i)
        self.missing = [len(b) for b in self.buckets]


class ForwardBuckets(Good):
    def assign(self, params, cap_mb):
        return forward_order(params, cap_mb)


class NoBucketsAttribute(Good):
    def __init__(self, module, bucket_cap_mb=25.0):
        super().__init__(module, bucket_cap_mb)
        self.groups = self.buckets
        del self.buckets

    def copy_back(self, i):
        for p in self.groups[i]:
            _, offset = self.where[p]
            p.grad.copy_(self.flat[i][offset:offset + p.numel()].view_as(p.grad))

    def finish_gradient_synchronization(self):
        for i, work in self.handles:
            work.wait()
            self.copy_back(i)
        self.handles = []
        self.missing = [len(b) for b in self.groups]


class CopyOnlyFirst(Good):
    def copy_in(self, p, grad):
        i, offset = self.where[p]
        self.flat[i][offset:offset + p.numel()].copy_(grad.reshape(-1))
        self.missing[i] -= 1
        return i

    def copy_back(self, i):
        pass


@pytest.mark.parametrize("cls, phrase", [
    (BlockingInHook, "blocking all_reduce"),
    (WaitInHook, "waited on each all-reduce inside the hook"),
    (NoDivision, "sum over the ranks, 2 times the mean"),
    (DivideByTwo, "not by a fixed 2"),
    (NoWait, "had not been waited on.*a race"),
    (WrongParameter, "copied back into the wrong parameter"),
    (WrongOffsets, "elsewhere in the bucket's buffer|wrong parameter"),
    (LaunchInFinish, "launched after the backward had finished"),
    (PerParameter, "one per parameter"),
    (NoReset, "no all-reduce was launched in step 2.*reset"),
    (ForwardBuckets, "self.buckets is wrong .* forward"),
    (HandlesNeverCleared, "in step 2.*waited again on 3 handle\\(s\\) from step 1"),
    (NoBucketsAttribute, "no self.buckets"),
    (CopyOnlyFirst, "still holds this rank's own gradient"),
])
def test_wrong_wrappers_are_named(cls, phrase):
    with pytest.raises(LabCheckError, match=phrase):
        lab07.check_bucketed_ddp(cls)


class Todo(Good):
    def finish_gradient_synchronization(self):
        raise NotImplementedError("TODO: wait")


def test_unfinished_wrapper_is_not_implemented_without_launching():
    t0 = time.monotonic()
    with pytest.raises(NotImplementedError, match="replace the TODOs"):
        lab07.check_bucketed_ddp(Todo)
    assert time.monotonic() - t0 < 2


def test_an_instance_instead_of_the_class_is_named():
    with pytest.raises(LabCheckError, match="your class itself"):
        lab07.check_bucketed_ddp(object())
