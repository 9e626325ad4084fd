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


# --------------------------------------------------------------------------------------------
# Stretch: the top-k comm hook with error feedback
# --------------------------------------------------------------------------------------------
# Each hook below is one answer a learner could write. The right ones differ in how they talk
# (sync or async, all_gather or all_gather_into_tensor, int32 or int64 indices, one packed
# message) and in how they keep the residual; the wrong ones each make one mistake. To keep
# the suite fast, most run together in one launch per world size (run_hooks below) and go
# through the check's own diagnosis; check_topk_hook itself runs end to end on a few.


class TopKState:
    # the state class the lab gives the learner, as written there
    def __init__(self, fraction=0.05):
        self.fraction = fraction
        self.residuals = {}

    def k(self, numel):
        return max(1, int(self.fraction * numel))

    def residual_for(self, bucket):
        buf = bucket.buffer()
        r = self.residuals.get(bucket.index())
        if r is None or r.shape != buf.shape:
            r = self.residuals[bucket.index()] = torch.zeros_like(buf)
        return r


def _done(t):
    fut = torch.futures.Future()
    fut.set_result(t)
    return fut


def _gather(t):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t)
    return parts


def topk_variant(state, bucket, *, feedback=True, magnitude=True, clear=True,
                 select_corrected=True, add=True, divide=None, k_shift=0, dtype=None):
    grad = bucket.buffer()
    residual = state.residual_for(bucket)
    corrected = grad + residual if feedback else grad.clone()
    key = corrected if select_corrected else grad
    key = key.abs() if magnitude else key
    idx = key.topk(state.k(grad.numel()) + k_shift).indices
    values = corrected[idx]
    residual.copy_(corrected)
    if clear:
        residual[idx] = 0
    out = torch.zeros_like(grad, dtype=dtype)
    for i, v in zip(_gather(idx), _gather(values)):
        if add:
            out.index_add_(0, i, v.to(out.dtype))
        else:
            out[i] = v.to(out.dtype)
    world_size = dist.get_world_size()
    return _done(out / (world_size if divide is None else divide))


def right_sync(state, bucket):
    return topk_variant(state, bucket)


def right_async_chain(state, bucket):
    grad = bucket.buffer()
    residual = state.residual_for(bucket)
    corrected = grad + residual
    idx = corrected.abs().topk(state.k(grad.numel())).indices
    values = corrected[idx]
    residual[:] = corrected
    residual[idx] = 0
    n = dist.get_world_size()
    all_idx = torch.empty(n * idx.numel(), dtype=idx.dtype)
    all_values = torch.empty(n * values.numel(), dtype=values.dtype)
    w1 = dist.all_gather_into_tensor(all_idx, idx, async_op=True)
    w2 = dist.all_gather_into_tensor(all_values, values, async_op=True)

    def combine(_):
        w1.wait()
        return torch.zeros_like(grad).index_add_(0, all_idx, all_values).div_(n)

    return w2.get_future().then(combine)


def right_packed_int32(state, bucket):
    # one message: values and int32 indices side by side in float64 (exact below 2**53)
    grad = bucket.buffer()
    corrected = grad + state.residual_for(bucket)
    idx = torch.topk(corrected.abs(), state.k(grad.numel()), sorted=False).indices
    packed = torch.cat([corrected[idx].double(), idx.to(torch.int32).double()])
    state.residuals[bucket.index()] = corrected.index_fill(0, idx, 0.0)
    out = torch.zeros_like(grad)
    k = idx.numel()
    for p in _gather(packed):
        out.scatter_add_(0, p[k:].long(), p[:k].float())
    return _done(out / dist.get_world_size())


def right_in_place(state, bucket):
    # the averaged result written back into the bucket's own buffer
    grad = bucket.buffer()
    residual = state.residual_for(bucket)
    residual.add_(grad)
    idx = residual.abs().topk(state.k(grad.numel())).indices
    values = residual[idx].clone()
    residual[idx] = 0
    grad.zero_()
    for i, v in zip(_gather(idx), _gather(values)):
        grad.index_add_(0, i, v)
    grad.div_(dist.get_world_size())
    return _done(grad)


def right_threshold(state, bucket):
    # the k-th largest magnitude as a threshold, a mask instead of topk
    grad = bucket.buffer()
    corrected = grad + state.residual_for(bucket)
    mags = corrected.abs()
    k = state.k(grad.numel())
    threshold = mags.kthvalue(grad.numel() - k + 1).values
    idx = (mags >= threshold).nonzero().flatten()
    sent = torch.zeros_like(grad)
    sent[idx] = corrected[idx]
    state.residuals[bucket.index()] = corrected - sent
    out = torch.zeros_like(grad)
    for i, v in zip(_gather(idx), _gather(corrected[idx])):
        out.index_add_(0, i, v)
    return _done(out / dist.get_world_size())


RIGHT_HOOKS = [right_sync, right_async_chain, right_packed_int32, right_in_place,
               right_threshold]


def no_feedback(state, bucket):
    return topk_variant(state, bucket, feedback=False)


def by_value(state, bucket):
    return topk_variant(state, bucket, magnitude=False)


def residual_not_cleared(state, bucket):
    return topk_variant(state, bucket, clear=False)


def select_on_gradient(state, bucket):
    return topk_variant(state, bucket, select_corrected=False)


def overwrite(state, bucket):
    return topk_variant(state, bucket, add=False)


def no_average(state, bucket):
    return topk_variant(state, bucket, divide=1)


def divide_by_two(state, bucket):
    return topk_variant(state, bucket, divide=2)


def divide_twice(state, bucket):
    return topk_variant(state, bucket, divide=dist.get_world_size() ** 2)


def one_too_many(state, bucket):
    return topk_variant(state, bucket, k_shift=1)


def float64_result(state, bucket):
    return topk_variant(state, bucket, dtype=torch.float64)


def returns_tensor(state, bucket):
    return topk_variant(state, bucket).value()


def own_gradient(state, bucket):
    # compresses, but never talks to the other ranks
    return _done(bucket.buffer())


def dense_all_reduce(state, bucket):
    # zeros everywhere but the top k — and then all-reduces the whole dense tensor
    grad = bucket.buffer()
    corrected = grad + state.residual_for(bucket)
    idx = corrected.abs().topk(state.k(grad.numel())).indices
    sparse = torch.zeros_like(grad)
    sparse[idx] = corrected[idx]
    state.residuals[bucket.index()] = corrected - sparse
    dist.all_reduce(sparse)
    return _done(sparse / dist.get_world_size())


def future_of_list(state, bucket):
    grad = bucket.buffer()
    return dist.all_reduce(grad.div_(dist.get_world_size()), async_op=True).get_future()


def wrong_mix(state, bucket):
    # no error feedback AND summed: matches no single mistake; the general sentence answers
    return topk_variant(state, bucket, feedback=False, divide=1)


WRONG_HOOKS = [
    (no_feedback, "without\\*\\* error feedback"),
    (by_value, "largest values, not the k largest magnitudes"),
    (residual_not_cleared, "still holds the values that were sent"),
    (select_on_gradient, "top k of this step's gradient alone"),
    (overwrite, "overwrote the other"),
    (no_average, "summed the ranks' values without averaging"),
    (divide_by_two, "divided by 2, not by the world size"),
    (divide_twice, "divided by the world size twice"),
    (one_too_many, "k \\+ 1 entries"),
    (float64_result, "torch.float64, but the bucket is"),
    (returns_tensor, "returned a Tensor"),
    (own_gradient, "each returned its own gradient unchanged"),
    (dense_all_reduce, "the whole tensor"),
    (future_of_list, "delivered a list of 1"),
    (wrong_mix, "differs from top-k with error feedback"),
]


def run_hooks(rank, world_size, hooks):
    return [lab07._topk_worker(rank, world_size, h, TopKState, lab07.HOOK_FRACTION)
            for h in hooks]


@pytest.fixture(scope="module", params=lab07.HOOK_WORLD_SIZES)
def hook_results(request):
    from dpcourse import launch

    world_size = request.param
    hooks = RIGHT_HOOKS + [h for h, _ in WRONG_HOOKS]
    per_rank = launch.spawn(run_hooks, world_size, hooks, backend="gloo", timeout=60,
                            show_output=False)
    return world_size, {h.__name__: [r[i] for r in per_rank] for i, h in enumerate(hooks)}


def _diagnose(hook_results, hook):
    world_size, results = hook_results
    lab07._diagnose_hook(results[hook.__name__], world_size, TopKState(lab07.HOOK_FRACTION).k)


@pytest.mark.parametrize("hook", RIGHT_HOOKS)
def test_right_hooks_pass(hook_results, hook):
    _diagnose(hook_results, hook)


@pytest.mark.parametrize("hook, phrase", WRONG_HOOKS)
def test_wrong_hooks_are_named(hook_results, hook, phrase):
    world_size, _ = hook_results
    if hook is divide_by_two and world_size == 2:
        _diagnose(hook_results, hook)      # at 2 ranks dividing by 2 *is* right
        return
    with pytest.raises(LabCheckError, match=phrase):
        _diagnose(hook_results, hook)


def test_check_topk_hook_end_to_end(capsys):
    lab07.check_topk_hook(right_async_chain, TopKState)
    assert "✔ right_async_chain: top-k with error feedback" in capsys.readouterr().out
    with pytest.raises(LabCheckError, match="without\\*\\* error feedback"):
        lab07.check_topk_hook(no_feedback, TopKState, world_sizes=(3,))


def residual_without_reset(state, bucket):
    # its own dict, by bucket index only: DDP's rebuild after step 1 changes bucket 0's size
    grad = bucket.buffer()
    residual = state.residuals.setdefault(bucket.index(), torch.zeros_like(grad))
    corrected = grad + residual
    idx = corrected.abs().topk(state.k(grad.numel())).indices
    state.residuals[bucket.index()] = corrected.index_fill(0, idx, 0.0)
    out = torch.zeros_like(grad)
    for i, v in zip(_gather(idx), _gather(corrected[idx])):
        out.index_add_(0, i, v)
    return _done(out / dist.get_world_size())


def rank_dependent_k(state, bucket):
    # rank 1 sends one entry more: the gathers no longer match
    return topk_variant(state, bucket, k_shift=dist.get_rank())


def test_a_hook_that_raises_is_named_with_the_rebuild_hint():
    # whichever rank fails first is named
    with pytest.raises(LabCheckError, match="rank [0-9] raised in your hook: .*rebuilds its"):
        lab07.check_topk_hook(residual_without_reset, TopKState, world_sizes=(2,))


def test_mismatched_gathers_fail_fast_with_a_rank_named():
    t0 = time.monotonic()
    with pytest.raises(LabCheckError, match="rank .*(differ in size|deadlock)"):
        lab07.check_topk_hook(rank_dependent_k, TopKState, world_sizes=(2,), timeout=15)
    assert time.monotonic() - t0 < 25


def test_unfinished_hook_is_not_implemented_without_launching():
    def topk_hook(state, bucket):
        raise NotImplementedError("TODO")

    with pytest.raises(NotImplementedError, match="replace the TODO"):
        lab07.check_topk_hook(topk_hook, TopKState)


def test_a_peer_reporting_a_reset_connection_gets_the_size_hint(monkeypatch):
    # Which rank's failure arrives first is a race: when gloo aborts rank 0 over a size
    # mismatch, rank 1 may report "Connection reset by peer" first (seen in CI). Both must
    # lead the learner to the same mistake.
    from dpcourse import launch

    def reset_by_peer(*args, **kwargs):
        raise launch.RankFailedError(
            [(1, "RuntimeError: [gloo/transport/tcp/pair.cc:545] Read error "
                 "[127.0.0.1]:11648: Connection reset by peer.", "tb")], world_size=2)

    monkeypatch.setattr(launch, "spawn", reset_by_peer)
    with pytest.raises(LabCheckError, match="rank 1 .*differ in size"):
        lab07.check_topk_hook(rank_dependent_k, TopKState, world_sizes=(2,))
