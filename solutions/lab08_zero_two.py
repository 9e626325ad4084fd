# %% [markdown]
# # Lab 08 · ZeRO-2, overlapped with the backward
#
# Lesson 08's `Zero2` reduce-scatters every gradient in `step()`, after the backward: by then
# every full gradient has existed at once, so the rank's memory at its fullest — its **peak** —
# is ZeRO-1's, whatever it keeps at rest. Here you write ZeRO stage 2 that lowers the peak:
# the gradients leave the rank **during** the backward, in **buckets** (lesson 07), while the
# backward goes on computing the earlier layers. Two pieces:
#
# 1. `shard_bounds(numel, rank, world_size)` — which slice of a flat vector a rank owns;
# 2. `ZeroTwo`, a wrapper around any torch optimizer, used like lesson 08's stages:
#    `zero_grad()`, your `loss.backward()`, `step()`;
#
# then you predict the peak of live gradient memory of your wrapper on a small model, and
# measure it.
#
# The check runs your wrapper for 3 steps on 2 ranks with Adam and on 3 ranks with SGD +
# momentum, next to DDP with the full optimizer, on a seven-layer MLP with a **frozen** bias
# (`requires_grad=False`) and a weight **tied** between two layers (one `Parameter` used
# twice). From inside each rank it watches every gradient arrive, every collective you launch
# and every `wait()`; at each arrival, and inside your hook at each launch and each `wait()`,
# it weighs the gradient memory alive — by *storage*: a view weighs the whole buffer it keeps
# alive, and a tensor held only by a local variable of your hook weighs too. Its sentence
# names what went wrong: read it.
#
# **Collective names.** `dist.reduce_scatter_single` and `dist.all_gather_single` are the
# names in torch 2.14, the version this course pins. Older torch calls them
# `dist.reduce_scatter_tensor` and `dist.all_gather_into_tensor`; torch 2.14 keeps those as
# deprecated aliases (they warn, then call the new ones), and the check accepts either. Both
# take `async_op=True` and then return a `Work` at once, whose `wait()` blocks until it is done.
# The cell after the imports prints their parameters, read from torch itself: the **output
# comes first**.

# %% tags=["parameters"]
check_timeout = 30  # seconds before a hanging rank is stopped

# %%
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dpcourse.checks import lab08

torch.set_num_threads(1)

# %%
import inspect

for collective in (dist.reduce_scatter_single, dist.all_gather_single):
    print(f"dist.{collective.__name__}({', '.join(inspect.signature(collective).parameters)})")

# %% [markdown]
# ## 1. Shard boundaries
#
# A bucket's gradients, flattened, are one vector of `numel` numbers, which your wrapper will
# reduce-scatter and, once stepped, all-gather with the two collectives above — each rank's
# piece in rank order, over the vector padded with zeros at its end if the collectives need
# it. `shard_bounds(numel, rank, world_size)` returns two integers, `(start, end)`, end
# exclusive: rank `rank`'s piece of that padded vector. What must hold: both collectives can
# move these pieces, every one of the `numel` numbers belongs to a rank, and no rank's piece
# carries padding the collectives do not force on it (every collective sends it). The check
# tries sizes that divide, sizes that do not, and more ranks than numbers.

# %% [markdown]
# **▶ Hint 1 — a question** (click the folded cell below)

# %% [markdown] jupyter={"source_hidden": true}
# What does `reduce_scatter_single` require of its input's length, given its output's, and
# what does that say about the pieces of different ranks? With `numel = 53` on 2 ranks, how
# long must each piece then be so that no number is left without an owner? And with 3 numbers
# on 4 ranks?

# %% [markdown]
# **▶ Hint 2 — the idea** (click the folded cell below)

# %% [markdown] jupyter={"source_hidden": true}
# Divide and round **up**: the pieces are equal, and only the last one(s) run into the zero
# padding. Every rank uses the same length; where a piece starts follows from the rank.

# %% [markdown]
# **▶ Hint 3 — the shape of the code** (click the folded cell below)

# %% [markdown] jupyter={"source_hidden": true}
# Two lines: one piece length computed from `numel` and `world_size` alone, then the start and
# end of piece number `rank`.

# %%
def shard_bounds(numel, rank, world_size):
    """[start, end) of rank ``rank``'s equal-size shard of a flat vector of ``numel`` numbers,
    padded up to a multiple of ``world_size``."""
    ### BEGIN SOLUTION: this rank's [start, end) in the padded vector
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
# `cap` **bytes** or more (DDP's rule, lesson 07; bytes, not MB or MiB).

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
# **What you are given.** `ZeroTwo(params, optimizer_cls, bucket_cap=128, **kwargs)`:
# - `params` is what `model.parameters()` returns: a **generator**, so it can be iterated
#   once; it yields every parameter once, frozen ones (`requires_grad=False`) included; a
#   tied weight is one `Parameter`, yielded once: its gradient sums both uses, and its
#   post-accumulate-grad hook runs once per backward, when that sum is complete;
# - `optimizer_cls(tensors, **kwargs)` builds the inner torch optimizer (`kwargs` are its
#   hyper-parameters: `lr`, `momentum`, ...);
# - `bucket_cap` is in bytes;
# - every rank built the same model from the same seed, so the weights start equal on every
#   rank: `ZeroTwo` need not broadcast them (it may).
#
# **What must hold** — the contract the check holds you to:
# 1. after every `step()`, every rank's parameters equal those of DDP with the full
#    optimizer on the same global batch (to float rounding), and a frozen parameter never
#    moves;
# 2. `self.shard` is an `nn.Parameter` holding this rank's slice (`shard_bounds` of the
#    bucket's padded flat vector) of every bucket, one bucket after the other, owning its
#    memory; `self.shard.grad` has its size; `self.optimizer` is the inner optimizer over
#    `[self.shard]` alone, so its state covers the shard and nothing more; `self.buckets` is
#    the list of buckets (`make_buckets(..., bucket_cap)` of the trainable parameters: the
#    given `zero_grad` reads it);
# 3. when the inner optimizer steps, `self.shard.grad` holds, on every rank, the **average**
#    over the ranks of this step's gradient for that rank's slices;
# 4. each bucket's gradients leave the rank **during** the backward, as soon as the bucket
#    is full, without the backward waiting for the network;
# 5. no more than about **two buckets** of gradient are alive at once on a rank — in `p.grad`,
#    in buffers, or anywhere your object keeps them — and between steps nothing but
#    `self.shard.grad`. Exactly, the check allows 2 × (`bucket_cap` / 4 + the largest
#    trainable parameter's `numel` + `world_size`) fp32 numbers: a bucket closes at the
#    parameter that takes it to the cap, so it can hold up to one parameter more than the cap,
#    plus its padding;
# 6. every tensor you make — the shard, its gradient, the buffers — has the parameters'
#    device and dtype (on a GPU with NCCL, a buffer left on the CPU cannot be sent).
#
# Outside the contract: gradient accumulation (two backwards before one `step()`) and a
# trainable parameter that gets no gradient in some step; every step here is one backward
# in which every trainable parameter gets its gradient.
#
# A hook that runs as soon as `p.grad` holds this backward's gradient:
# `p.register_post_accumulate_grad_hook(fn)` (lesson 08, §4) calls `fn(p)`. The skeleton's
# `_grad_ready` and `_finish` are one way to split the work; the check calls only the
# constructor, `zero_grad()` and `step()`.
#
# **Your design decision:** what to keep in flight, and when to wait for it. The backward
# must not stop for the network, yet no more than about two buckets of gradient may be alive
# at once: decide how many reduce-scatters may be outstanding, at which moment you wait for
# one, and what you must keep alive until you do.

# %% [markdown]
# **▶ Hint 1 — a question** (click the folded cell below)

# %% [markdown] jupyter={"source_hidden": true}
# When the last gradient of bucket k arrives, which gradients are alive on the rank: those of
# bucket k, and which others? What does a collective that is still running need you to keep,
# and when is it safe to let go of it? Where does its result have to land for contract 3?

# %% [markdown]
# **▶ Hint 2 — the idea** (click the folded cell below)

# %% [markdown] jupyter={"source_hidden": true}
# Keep one bucket in flight: when a bucket is full, first wait for the bucket launched before
# it and forget its buffer, then flatten the full one into a padded buffer, drop its `p.grad`s
# and launch it asynchronously, writing straight into its own slice of `self.shard.grad`. A
# reduce-scatter sums: turn the sum into the mean once it has arrived. `step()` must wait for
# the last bucket before the inner optimizer runs, and every rank then needs every updated
# slice.

# %% [markdown]
# **▶ Hint 3 — the shape of the code** (click the folded cell below)

# %% [markdown] jupyter={"source_hidden": true}
# In `__init__`: the trainable parameters as a list; the buckets; a dictionary from parameter
# to bucket index and an arrival counter per bucket; per bucket its shard size and its offset
# in the shard; the shard built from copies of this rank's slices, its zero gradient, the
# inner optimizer; one hook per trainable parameter. In the hook: count, and on the last
# arrival finish the previous bucket, build the padded buffer, forget the `p.grad`s, launch,
# remember (work, buffer, output). `_finish`: wait, divide, forget. `step`: finish, step the
# inner optimizer, then per bucket all-gather its slices into a padded vector and copy each
# parameter's numbers back into it.

# %%
class ZeroTwo:
    def __init__(self, params, optimizer_cls, bucket_cap=128, **kwargs):
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        ### BEGIN SOLUTION: the wrapper's state: buckets, this rank's shard and its gradient, the optimizer
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
        ### BEGIN SOLUTION: what happens when p's gradient arrives
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
        ### BEGIN SOLUTION: what you launched and have not waited for yet, finished
        if self.in_flight is not None:
            work, buffer, out = self.in_flight
            work.wait()
            out /= self.world_size                 # the sum over the ranks -> the mean
            self.in_flight = None                  # and with it the padded buffer
        ### END SOLUTION

    def step(self):
        ### BEGIN SOLUTION: every rank's parameters hold the stepped weights
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
# ## 4. Predict, then measure: the peak
#
# Now the point of stage 2 in one number. The model below is five `Linear` layers of widths
# 16 → 64 → 64 → 64 → 64 → 8 (each with a bias), fp32, on 2 ranks, with `bucket_cap = 4096`
# bytes and your `ZeroTwo` as it is. Before you measure: what is the **peak of live gradient
# memory** on a rank, in bytes — the most gradient bytes alive at once (in `p.grad`, in your
# buffers, anywhere your object keeps them; `self.shard.grad` aside)? It is weighed as the
# check weighed it: at every gradient's arrival, once that gradient is in `p.grad` and
# **before** your hook runs on it, and inside your hook at each reduce-scatter's launch and
# each `wait()` (whatever your hook has made by then counts, local variables included).
# Write a number of bytes (not MB), then run the measurement.

# %% [markdown]
# **▶ Hint 1 — a question** (click the folded cell below)

# %% [markdown] jupyter={"source_hidden": true}
# Which buckets does `make_buckets` build for this model at 4096 bytes? Count each layer's
# weight and bias, starting from the last layer. At which arrival is the most alive?

# %% [markdown]
# **▶ Hint 2 — the idea** (click the folded cell below)

# %% [markdown] jupyter={"source_hidden": true}
# Look at the moments just after a bucket's last gradient arrives, before your hook lets go of
# anything: all of that bucket is still in `p.grad`, plus whatever your wrapper still keeps of
# the buckets launched before it, plus whatever your hook builds before it waits or frees. The
# first bucket has no predecessor.

# %% [markdown]
# **▶ Hint 3 — the shape of the code** (click the folded cell below)

# %% [markdown] jupyter={"source_hidden": true}
# List the buckets' sizes in numbers, in launch order (a buffer is padded, a `p.grad` is
# not); at each bucket's last arrival, and at each `wait()` and launch in your hook, add up
# what is alive then (that bucket's `p.grad`s, the buffers your wrapper still holds, any
# buffer your hook has already filled); take the largest; 4 bytes per number.

# %%
from dpcourse.checks import predict

### BEGIN SOLUTION: your prediction: the peak of live gradient bytes (a number)
# bucket 1's gradients, all in p.grad, while bucket 0's padded buffer is still in flight: my
# hook waits for bucket 0 and lets go of it before it builds bucket 1's buffer
my_peak = 4 * (4160 + 4680)
### END SOLUTION
guess = predict("lab08", "peak of live gradient bytes of your ZeroTwo", my_peak, unit="B")

# %%
measured = lab08.measure_peak(ZeroTwo, timeout=check_timeout)
lab08.check_peak_prediction(guess, measured)

# %% [markdown]
# The check's explanation says where the peak came from: that is what stage 2 earns over a
# ZeRO-2 that reduce-scatters in `step()`. On a GPU with NCCL the asynchronous reduce-scatter
# runs on a communication stream beside the backward's kernels; on this CPU gloo runs it on a
# thread of its own. One collective per small bucket means many small messages (lesson 06's
# α per message): a larger `bucket_cap` sends fewer, larger messages at the price of a higher
# peak — and how much higher depends on where the cap falls across the layers.
