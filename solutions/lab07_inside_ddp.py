# %% [markdown]
# # Lab 07 · Write your own bucketed, overlapped DDP
#
# Lesson 07 took DDP apart: hooks that launch an all-reduce the moment a gradient is ready,
# and buckets that group gradients into a few large messages. Its `BucketedDataParallel`
# launches a bucket as soon as it is full and copies gradients in and out. Now you build what
# DDP's reducer really does:
#
# 1. `assign_buckets(params, bucket_cap_mb)` — group the parameters into buckets, in the order
#    the backward produces their gradients, closing a bucket once it has reached the cap;
# 2. `BucketedDDP`, a wrapper with one flat buffer per bucket whose slices **are** the
#    gradients (`p.grad` is a view into the bucket: no copy in, no copy out), and which
#    launches each bucket's **asynchronous** all-reduce from the hook **strictly in bucket
#    order**, as DDP's reducer does, even when buckets fill out of order.
#
# The checks run your wrapper on 2 and then 3 ranks (gloo, through `dpcourse.launch.spawn`:
# define everything right here in the notebook) on a model that has a frozen parameter and
# whose buckets fill out of order, against real `DistributedDataParallel`. They spy on the
# collectives — how many, how large, which buffer, when each was launched and when waited on —
# and compare every launch with the moment each gradient arrived. They name the mistakes:
# buckets filled in forward order or closed before the cap, a hook on a frozen parameter, one
# all-reduce per parameter, buckets launched out of order, launched late (only at the end of
# the backward), waited on inside the hook, not waited on, an all-reduce of a temporary,
# gradients that are not views of the bucket, `add_` where `copy_` belongs, views that
# overlap, a wrong division.

# %% tags=["parameters"]
check_timeout = 30  # seconds before a hanging rank is stopped

# %%
import torch
import torch.distributed as dist
from torch import nn

from dpcourse.checks import lab07

torch.set_num_threads(1)

# %% [markdown]
# ## 1. Buckets, by DDP's rule
#
# The backward computes gradients from the last layer to the first, so walk the parameters in
# **reverse** registration order. Add each parameter to the open bucket, and close the bucket
# once its size has **reached** `bucket_cap_mb` MiB (1 MiB = 2**20 bytes; a parameter's size is
# `p.numel() * p.element_size()`): that is the rule of DDP's reducer
# (`compute_bucket_assignment_by_size`), so a bucket may end above the cap by its last
# parameter, and a parameter larger than the cap closes the bucket it joins. Return a list of
# buckets, each a list of parameters. (All the parameters the check gives you share one dtype
# and device; DDP fills one set of buckets per dtype and device.)

# %%
def assign_buckets(params, bucket_cap_mb):
    """Group ``params`` (in registration order) into buckets by DDP's rule, filled in reverse
    order."""
    ### BEGIN SOLUTION: walk reversed(params); add the parameter, then close the bucket once it has reached the cap
    cap = bucket_cap_mb * 2**20
    buckets, size = [[]], 0
    for p in reversed(list(params)):
        buckets[-1].append(p)
        size += p.numel() * p.element_size()
        if size >= cap:
            buckets.append([])
            size = 0
    return [b for b in buckets if b]
    ### END SOLUTION


# %%
lab07.check_assign_buckets(assign_buckets)

# %% [markdown]
# ## 2. The wrapper, as DDP's reducer really runs it
#
# Lesson 07's `BucketedDataParallel` copies each gradient into its bucket, launches a bucket's
# all-reduce the moment the bucket is full, and copies the averages back after waiting. DDP's
# reducer differs in two ways, and your wrapper does both:
#
# - **Buckets are launched strictly in bucket order.** The reducer keeps `next_bucket_`: when a
#   bucket becomes ready it launches it only if it is the next one, and then every following
#   bucket that is already ready. Buckets can fill out of order — here the model registers its
#   output layer *before* its hidden layer but runs it after, so the output layer's bucket is
#   complete first. A rank that launched buckets as they filled would then issue its
#   all-reduces in an order that depends on its backward; with the same order on every rank,
#   the i-th all-reduce of each rank is always the same bucket, and they match.
# - **Gradients are views into the bucket** (`gradient_as_bucket_view=True`): each `p.grad` is
#   its slice of the bucket's flat buffer, shaped like `p`, so autograd accumulates straight
#   into the bucket (no copy in) and the all-reduced buffer *is* the averaged gradient (no copy
#   back). When `p.grad` is not the view — the first backward, or after
#   `optimizer.zero_grad(set_to_none=True)` autograd hands in a fresh tensor — the hook copies
#   it into the view (`copy_`, not `add_`) and sets `p.grad = view`, as the reducer does.
#
# `__init__` (the first lines are given): one flat buffer per bucket (`torch.zeros` of the
# bucket's total `numel`), each trainable parameter's view into it (`buffer[offset:offset +
# p.numel()].view_as(p)`), and `p.register_post_accumulate_grad_hook(self._grad_ready)` on each
# parameter in a bucket — the model has a **frozen** parameter (`requires_grad=False`), which
# gets no gradient, so no view and no hook.
#
# `_grad_ready(p)`: make sure `p.grad` is its view — it already is when it starts at the same
# memory address as its view (`p.grad.data_ptr() == view.data_ptr()`; the reducer asks
# `grad.is_alias_of(bucket_view)`); otherwise copy it in and make the view `p.grad`. Then
# count the bucket down, and when it is complete, launch every bucket that is now launchable **in order**: divide its buffer by the
# world size and `dist.all_reduce(buffer, async_op=True)`; keep the handle. Do not wait here.
#
# `finish_gradient_synchronization()`: wait on every handle (nothing to copy back), then reset
# what you counted, ready for the next backward.
#
# The check runs 3 steps (the first with no `p.grad`, the second after
# `zero_grad(set_to_none=False)`, which zeroes the gradients in place, the third after
# `zero_grad(set_to_none=True)`, the default) on 2 and 3 ranks and names what it sees.

# %%
class BucketedDDP(nn.Module):
    def __init__(self, module, bucket_cap_mb=25.0):
        super().__init__()
        self.module = module
        for p in module.parameters():
            dist.broadcast(p.data, src=0)
        self.buckets = assign_buckets([p for p in module.parameters() if p.requires_grad],
                                      bucket_cap_mb)
        ### BEGIN SOLUTION: a flat buffer per bucket, each parameter's view into it and its bucket, counts, the next bucket to launch, a hook on each bucketed parameter
        self.buffers, self.view_of, self.bucket_of = [], {}, {}
        for i, bucket in enumerate(self.buckets):
            buffer = torch.zeros(sum(p.numel() for p in bucket), dtype=bucket[0].dtype,
                                 device=bucket[0].device)
            start = 0
            for p in bucket:
                self.view_of[p] = buffer[start:start + p.numel()].view_as(p)
                self.bucket_of[p] = i
                start += p.numel()
                p.register_post_accumulate_grad_hook(self._grad_ready)
            self.buffers.append(buffer)
        self.pending = [len(b) for b in self.buckets]
        self.next_bucket = 0
        self.works = []
        ### END SOLUTION

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _grad_ready(self, p):
        ### BEGIN SOLUTION: p.grad becomes its view (copy_ a fresh gradient in); count down; launch every ready bucket from next_bucket on, in order
        view = self.view_of[p]
        if p.grad.data_ptr() != view.data_ptr():    # a fresh tensor from autograd
            view.copy_(p.grad)
            p.grad = view
        self.pending[self.bucket_of[p]] -= 1
        while self.next_bucket < len(self.buckets) and self.pending[self.next_bucket] == 0:
            buffer = self.buffers[self.next_bucket]
            buffer.div_(dist.get_world_size())
            self.works.append(dist.all_reduce(buffer, async_op=True))
            self.next_bucket += 1
        ### END SOLUTION

    def finish_gradient_synchronization(self):
        ### BEGIN SOLUTION: wait on every handle; nothing to copy back; reset the counts, the next bucket and the handles
        for work in self.works:
            work.wait()
        self.works = []
        self.pending = [len(b) for b in self.buckets]
        self.next_bucket = 0
        ### END SOLUTION


# %%
lab07.check_bucketed_ddp(BucketedDDP, timeout=check_timeout)

# %% [markdown]
# ## Stretch (optional): your own communication hook — top-k with error feedback
#
# A workshop can stop here. Lesson 07 §5 plugged torch's hooks into DDP; now write one. DDP
# calls `hook(state, bucket)` once per bucket, as soon as the bucket's gradients are ready:
# `bucket.buffer()` is the bucket's flat gradient, `bucket.index()` its number. The hook
# returns a `torch.futures.Future` whose value is the **averaged** gradient, a tensor shaped
# like the buffer; DDP waits on it and writes it into the parameters' `.grad`.
#
# Top-k compression sends only the k entries of largest magnitude (here 5 %) and their
# indices. What is not sent is not thrown away: it stays in a **residual** and is added to the
# next step's gradient — *error feedback* — so every entry is sent eventually, once it has
# grown large enough. Without it the small entries are never sent at all. Per rank:
#
# 1. `corrected = gradient + residual` (the residual from `state.residual_for(bucket)`);
# 2. the indices of the `state.k(numel)` largest `|corrected|` and their values;
# 3. the residual becomes `corrected` with the sent entries set to zero;
# 4. the ranks picked *different* indices, so an all-reduce does not fit: all-gather every
#    rank's indices and values, add them into a zero tensor, divide by the world size.
#
# Launch the gathers with `async_op=True` and return a future chained on them
# (`work.get_future()`, `torch.futures.collect_all([...]).then(fn)`): a blocking
# `all_gather` followed by an already-finished future would stop the backward at every
# bucket, and the overlap DDP's hooks exist for would be gone.
#
# Why a given `residual_for`: DDP rebuilds its buckets after the first step (lesson 07 §6), so
# bucket 0 of the first step is not bucket 0 of the second; a residual whose size no longer
# matches starts again from zeros. The check runs your hook in real DDP on 2 and 3 ranks for
# 12 steps, replays top-k with error feedback on the same buckets and compares every result,
# and weighs what each rank sends (k values and k indices, not the whole tensor).

# %%
class TopKState:
    """What the hook keeps between steps: the fraction of entries to send, one residual per
    bucket."""

    def __init__(self, fraction=0.05):
        self.fraction = fraction
        self.residuals = {}

    def k(self, numel):
        return max(1, int(self.fraction * numel))

    def residual_for(self, bucket):
        buf = bucket.buffer()
        residual = self.residuals.get(bucket.index())
        if residual is None or residual.shape != buf.shape:   # new, or DDP rebuilt its buckets
            residual = self.residuals[bucket.index()] = torch.zeros_like(buf)
        return residual


def topk_hook(state, bucket):
    ### BEGIN SOLUTION: corrected = grad + residual; top-k by magnitude; residual keeps the rest; all_gather indices and values asynchronously; chain their futures into the average
    grad = bucket.buffer()
    residual = state.residual_for(bucket)
    corrected = grad + residual
    idx = corrected.abs().topk(state.k(grad.numel())).indices
    values = corrected[idx]
    residual.copy_(corrected)
    residual[idx] = 0
    world_size = dist.get_world_size()
    all_idx = [torch.empty_like(idx) for _ in range(world_size)]
    all_values = [torch.empty_like(values) for _ in range(world_size)]
    # asynchronous: the backward goes on while the gathers travel; DDP waits on the future
    got_idx = dist.all_gather(all_idx, idx, async_op=True).get_future()
    got_values = dist.all_gather(all_values, values, async_op=True).get_future()

    def average(_):
        out = torch.zeros_like(grad)
        for i, v in zip(all_idx, all_values):
            out.index_add_(0, i, v)
        return out / world_size

    return torch.futures.collect_all([got_idx, got_values]).then(average)
    ### END SOLUTION


# %%
lab07.check_topk_hook(topk_hook, TopKState, timeout=check_timeout)
