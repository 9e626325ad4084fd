# %% [markdown]
# # Lab 07 · Write your own bucketed, overlapped DDP
#
# Lesson 07 took DDP apart: hooks that launch an all-reduce the moment a gradient is ready,
# and buckets that group gradients into a few large messages. Now you build it:
#
# 1. `assign_buckets(params, bucket_cap_mb)` — group the parameters into buckets, in the order
#    the backward produces their gradients;
# 2. `BucketedDDP`, a wrapper with one flat buffer per bucket: a hook copies each gradient in as
#    it arrives and launches an **asynchronous** all-reduce when its bucket is full;
#    `finish_gradient_synchronization()` waits for the handles and copies the averages back.
#
# The checks run your wrapper on 2 and then 3 ranks (gloo, through `dpcourse.launch.spawn`:
# define everything right here in the notebook), against real `DistributedDataParallel`. They
# spy on the collectives: how many, how large, when each was launched and when waited on. They
# name the classic mistakes: buckets filled in forward order, one all-reduce per parameter
# instead of per bucket, waiting on each handle inside the hook (no overlap), launching
# everything only after the backward, forgetting to divide by the world size, stepping before
# the all-reduces have finished (a race), copying a slice back into the wrong parameter.

# %% tags=["parameters"]
check_timeout = 30  # seconds before a hanging rank is stopped

# %%
import torch
import torch.distributed as dist
from torch import nn

from dpcourse.checks import lab07

torch.set_num_threads(1)

# %% [markdown]
# ## 1. Buckets
#
# The backward computes gradients from the last layer to the first, so walk the parameters in
# **reverse** registration order and fill a bucket until the next parameter would take it over
# `bucket_cap_mb` MiB (1 MiB = 2**20 bytes; a parameter's size is `p.numel() *
# p.element_size()`); then start a new one. A parameter larger than the cap gets a bucket of
# its own. Return a list of buckets, each a list of parameters.

# %%
def assign_buckets(params, bucket_cap_mb):
    """Group ``params`` (in registration order) into buckets of at most ``bucket_cap_mb`` MiB,
    filled in reverse order."""
    ### BEGIN SOLUTION: walk reversed(params); close the bucket when the next one would exceed the cap
    cap = bucket_cap_mb * 2**20
    buckets, current, size = [], [], 0
    for p in reversed(list(params)):
        nbytes = p.numel() * p.element_size()
        if current and size + nbytes > cap:
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets
    ### END SOLUTION


# %%
lab07.check_assign_buckets(assign_buckets)

# %% [markdown]
# ## 2. The wrapper
#
# `__init__` (the first lines are given): make each rank start from rank 0's weights, assign
# the buckets, then set up what the hooks need — one flat buffer per bucket (`torch.zeros` of
# the bucket's total `numel`), where each parameter's gradient lives in its buffer (bucket
# index and offset), how many gradients each bucket still awaits — and register
# `p.register_post_accumulate_grad_hook(self._grad_ready)` on every parameter. The hook is
# called with the parameter once `p.grad` holds this backward's gradient.
#
# `_grad_ready(p)`: copy `p.grad` into its slice of the bucket's buffer. When the bucket's last
# gradient has arrived, divide the buffer by the world size and launch
# `dist.all_reduce(buffer, async_op=True)`; keep the handle it returns. Do **not** wait here.
#
# `finish_gradient_synchronization()` (called after `loss.backward()`, before
# `optimizer.step()`): wait on every handle, copy each parameter's slice back into `p.grad`
# (`.view_as(p.grad)`), and reset what you counted, ready for the next backward.

# %%
class BucketedDDP(nn.Module):
    def __init__(self, module, bucket_cap_mb=25.0):
        super().__init__()
        self.module = module
        for p in module.parameters():
            dist.broadcast(p.data, src=0)
        self.buckets = assign_buckets([p for p in module.parameters() if p.requires_grad],
                                      bucket_cap_mb)
        ### BEGIN SOLUTION: flat buffers, where each parameter lives, counts, handles, a hook on each parameter
        self.flat = [torch.zeros(sum(p.numel() for p in b), dtype=b[0].dtype, device=b[0].device)
                     for b in self.buckets]
        self.where = {}
        for i, bucket in enumerate(self.buckets):
            offset = 0
            for p in bucket:
                self.where[p] = (i, offset)
                offset += p.numel()
                p.register_post_accumulate_grad_hook(self._grad_ready)
        self.missing = [len(b) for b in self.buckets]
        self.handles = []
        ### END SOLUTION

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _grad_ready(self, p):
        ### BEGIN SOLUTION: copy p.grad into its slice; if the bucket is complete, divide it and launch an async all_reduce
        i, offset = self.where[p]
        self.flat[i][offset:offset + p.numel()].copy_(p.grad.reshape(-1))
        self.missing[i] -= 1
        if self.missing[i] == 0:
            self.flat[i].div_(dist.get_world_size())
            self.handles.append((i, dist.all_reduce(self.flat[i], async_op=True)))
        ### END SOLUTION

    def finish_gradient_synchronization(self):
        ### BEGIN SOLUTION: wait on every handle, copy each slice back into p.grad, reset the counts and handles
        for i, work in self.handles:
            work.wait()
            for p in self.buckets[i]:
                _, offset = self.where[p]
                p.grad.copy_(self.flat[i][offset:offset + p.numel()].view_as(p.grad))
        self.handles = []
        self.missing = [len(b) for b in self.buckets]
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
    ### BEGIN SOLUTION: corrected = grad + residual; top-k by magnitude; residual keeps the rest; all_gather indices and values; add, divide, return a Future
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
    dist.all_gather(all_idx, idx)
    dist.all_gather(all_values, values)
    out = torch.zeros_like(grad)
    for i, v in zip(all_idx, all_values):
        out.index_add_(0, i, v)
    fut = torch.futures.Future()
    fut.set_result(out / world_size)
    return fut
    ### END SOLUTION


# %%
lab07.check_topk_hook(topk_hook, TopKState, timeout=check_timeout)
