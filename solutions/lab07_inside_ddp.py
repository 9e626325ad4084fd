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
