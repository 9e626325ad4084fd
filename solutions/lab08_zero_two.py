# %% [markdown]
# # Lab 08 · ZeRO-2, overlapped with the backward
#
# Lesson 08 built ZeRO stages 1–3. Its `Zero2` is short on purpose: it reduce-scatters every
# gradient in `step()`, after the backward, so every full gradient has existed at once by
# then and the rank's memory at its fullest — its **peak** — is ZeRO-1's, whatever it keeps at
# rest. Here you write ZeRO stage 2 the way it earns its memory: the gradients are grouped into
# **buckets** (lesson 07), and each bucket is reduce-scattered **during the backward**, as
# soon as its last gradient arrives, *asynchronously*, so that the communication overlaps the
# backward of the earlier layers; its full gradients are dropped at once. You write it in two
# parts:
#
# 1. `shard_bounds(numel, rank, world_size)` — which slice of a flat vector a rank owns;
# 2. `ZeroTwo`, a wrapper around any torch optimizer, used like lesson 08's stages:
#    `zero_grad()`, your backward, `step()`.
#
# The check runs your wrapper on 2 ranks with Adam and on 3 ranks with SGD + momentum, next
# to DDP with the full optimizer, for 3 steps, on a seven-layer MLP that has a **frozen**
# bias (`requires_grad=False`: it never gets a gradient) and a weight **tied** between two
# layers (one `Parameter` used twice: autograd sums both uses before its hook runs). From
# inside each rank it watches every gradient arrive, every reduce-scatter launched and every
# `wait()`, and it weighs the gradient memory alive at each arrival by *storage* — a view
# weighs the whole buffer it keeps alive. It names the mistakes: a shard that is a view of the
# whole padded vector, the reduce-scatters done in `step()` or all launched at the end of the
# backward, a blocking reduce-scatter, one never waited for, buffers kept too long, a frozen
# parameter bucketed or stepped, gradients summed instead of averaged.
#
# **Collective names.** `dist.reduce_scatter_single` and `dist.all_gather_single` are the
# names in torch 2.14, the version this course pins. Older torch calls them
# `dist.reduce_scatter_tensor` and `dist.all_gather_into_tensor`; torch 2.14 keeps those as
# deprecated aliases (they warn, then call the new ones), and the check accepts either.

# %% tags=["parameters"]
check_timeout = 30  # seconds before a hanging rank is stopped

# %%
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dpcourse.checks import lab08

torch.set_num_threads(1)

# %% [markdown]
# ## 1. Shard boundaries
#
# Flatten a bucket's gradients into one vector of `numel` numbers. `reduce_scatter_single`
# needs every rank's piece to be the **same size**, and the `world_size` pieces, in rank
# order, must cover all `numel` numbers; think of the vector as padded with zeros up to
# `world_size` pieces. Choose the smallest such piece size (what if `numel` is not a multiple
# of `world_size`?) and return the `[start, end)` of rank `rank`'s piece in the padded vector.
# The check tries sizes that divide and sizes that do not, and more ranks than numbers.

# %%
def shard_bounds(numel, rank, world_size):
    """[start, end) of rank ``rank``'s equal-size shard of a flat vector of ``numel`` numbers,
    padded up to a multiple of ``world_size``."""
    ### BEGIN SOLUTION: one piece size for every rank, the smallest that covers numel; then rank's [start, end)
    size = math.ceil(numel / world_size)
    return rank * size, (rank + 1) * size
    ### END SOLUTION


# %%
lab08.check_shard_bounds(shard_bounds)

# %% [markdown]
# ## 2. Buckets
#
# Given: the backward produces gradients roughly from the last layer to the first, so the
# buckets are filled in reverse registration order, and a bucket is closed once it holds
# `cap` bytes or more (DDP's rule, lesson 07).

# %%
def make_buckets(params, cap):
    """``params`` grouped in reverse order; a bucket closes once it reaches ``cap`` bytes."""
    buckets, current, size = [], [], 0
    for p in reversed(list(params)):
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= cap:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


# %% [markdown]
# ## 3. The wrapper
#
# **`__init__`.** Leave out the frozen parameters (`requires_grad=False`): they get no
# gradient, so a bucket waiting for one would never be sent. Group the others with
# `make_buckets(..., bucket_cap)`. Shard **each bucket** on its own: this rank owns
# `shard_bounds(numel_of_the_bucket, rank, world_size)` of the bucket's flat values, padded to
# `world_size` times the shard size. Keep the buckets in `self.buckets` (the given
# `zero_grad` reads it) and, per bucket, what `_grad_ready` and `step` will need (its shard
# size and where its slice starts in `self.shard`). `self.shard` is a copy of this rank's
# slices of the weights of all the buckets, one after the other, as an `nn.Parameter` that
# owns its memory (`torch.cat` copies; a slice of the padded vector is a *view* that keeps the
# whole vector alive); `self.shard.grad` a zero
# tensor of the same size, filled bucket by bucket during the backward; `self.optimizer` over
# `[self.shard]`, so the inner optimizer's state covers the shard alone. Then register
# `p.register_post_accumulate_grad_hook(self._grad_ready)` on every trainable parameter:
# autograd calls `self._grad_ready(p)` as soon as `p.grad` holds this backward's gradient.
#
# **`_grad_ready(p)`.** Count the bucket's arrivals; when its last gradient is in:
# 1. wait for the bucket still in flight, if any (`_finish`): one bucket in flight at a time
#    keeps at most two buckets of full gradients alive — the one in flight and the one
#    filling;
# 2. copy the bucket's gradients into one padded flat buffer and set their `p.grad = None`;
# 3. launch `work = dist.reduce_scatter_single(out, buffer, async_op=True)`, where `out` is
#    the bucket's slice of `self.shard.grad` (a slice of a 1-d tensor is contiguous: a view
#    will do as the output). `async_op=True` returns at once with a `Work`; the backward goes
#    on computing earlier layers while the bucket travels. Keep `(work, buffer, out)` until it
#    is waited for: the buffer must stay alive while the collective reads it.
#
# **`_finish()`.** If a bucket is in flight: `work.wait()`, divide its `out` by the world size
# (a reduce-scatter sums), and drop the tuple, and with it the buffer.
#
# **`step()`.** `_finish()` the last bucket, step the inner optimizer, then for every bucket
# `all_gather_single` its slices into a padded vector (allocate it on the shard's device,
# `device=self.shard.device`: the same code then runs on a GPU) and copy each parameter's
# numbers back into `p.data`.
#
# `zero_grad()` is given. (One thing this version gives up: a second backward before `step()`
# would overwrite the shard's gradient instead of adding to it, so gradient accumulation needs
# `+=` there.)

# %%
class ZeroTwo:
    def __init__(self, params, optimizer_cls, bucket_cap=128, **kwargs):
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        ### BEGIN SOLUTION: trainable parameters only; self.buckets; per bucket its shard size and offset in self.shard; self.shard (a copy of this rank's slices of the weights) and a zero self.shard.grad; the inner optimizer; a hook on every trainable parameter
        trainable = [p for p in params if p.requires_grad]    # frozen ones never get a gradient
        self.buckets = make_buckets(trainable, bucket_cap)
        self.bucket_of, self.layout, pieces, offset = {}, [], [], 0
        for i, bucket in enumerate(self.buckets):
            numel = sum(p.numel() for p in bucket)
            start, end = shard_bounds(numel, self.rank, self.world_size)
            size = end - start
            mine = torch.cat([p.detach().reshape(-1) for p in bucket])[start:end]
            pieces.append(F.pad(mine, (0, size - mine.numel())))   # past numel: zeros
            self.layout.append((size, offset))            # shard size, offset in self.shard
            offset += size
            for p in bucket:
                self.bucket_of[p] = i
        self.shard = torch.nn.Parameter(torch.cat(pieces))  # cat copies: no view kept
        self.shard.grad = torch.zeros_like(self.shard)
        self.optimizer = optimizer_cls([self.shard], **kwargs)
        self.arrived = [0] * len(self.buckets)
        self.in_flight = None                      # (work, buffer, out) of the bucket in flight
        for p in trainable:
            p.register_post_accumulate_grad_hook(self._grad_ready)
        ### END SOLUTION

    def zero_grad(self):
        for bucket in self.buckets:
            for p in bucket:
                p.grad = None

    def _grad_ready(self, p):
        ### BEGIN SOLUTION: count the bucket's arrivals; when it is full: finish the one in flight, pad its gradients into one buffer, drop them, launch an async reduce_scatter_single (torch >= 2.14; reduce_scatter_tensor before) into its slice of self.shard.grad, keep (work, buffer, out)
        i = self.bucket_of[p]
        self.arrived[i] += 1
        if self.arrived[i] < len(self.buckets[i]):
            return                                 # the bucket is not full yet
        self.arrived[i] = 0
        self._finish()                             # one bucket in flight at a time
        size, offset = self.layout[i]
        numel = sum(q.numel() for q in self.buckets[i])
        buffer = F.pad(torch.cat([q.grad.reshape(-1) for q in self.buckets[i]]),
                       (0, size * self.world_size - numel))
        for q in self.buckets[i]:
            q.grad = None                          # the full gradients are not needed again
        out = self.shard.grad[offset:offset + size]
        work = dist.reduce_scatter_single(out, buffer, async_op=True)
        self.in_flight = (work, buffer, out)
        ### END SOLUTION

    def _finish(self):
        ### BEGIN SOLUTION: if a bucket is in flight: wait, divide its slice by the world size, drop it
        if self.in_flight is not None:
            work, buffer, out = self.in_flight
            work.wait()
            out /= self.world_size                 # the sum over the ranks -> the mean
            self.in_flight = None                  # and with it the padded buffer
        ### END SOLUTION

    def step(self):
        ### BEGIN SOLUTION: finish the last bucket; step; per bucket all_gather_single (torch >= 2.14; all_gather_into_tensor before) its slices and copy them back into p.data
        self._finish()
        self.optimizer.step()
        for bucket, (size, offset) in zip(self.buckets, self.layout):
            full = torch.empty(size * self.world_size, dtype=self.shard.dtype,
                               device=self.shard.device)
            dist.all_gather_single(full, self.shard.detach()[offset:offset + size])
            start = 0
            for p in bucket:
                p.data.copy_(full[start:start + p.numel()].view_as(p))
                start += p.numel()
        ### END SOLUTION


# %%
lab08.check_zero_two(ZeroTwo, timeout=check_timeout)

# %% [markdown]
# What the check printed is the point of stage 2: the gradient bytes alive at once stayed at
# about two buckets, not the whole model's, and every reduce-scatter left during the backward.
# On a GPU with NCCL the asynchronous reduce-scatter runs on a communication stream beside the
# backward's kernels; on this CPU gloo runs it on a thread of its own. One collective per small
# bucket means many small messages (lesson 06's α per message): a larger `bucket_cap` sends
# fewer, larger messages at the price of a higher peak.
