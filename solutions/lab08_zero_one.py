# %% [markdown]
# # Lab 08 · Write ZeRO stage 1
#
# Lesson 08 counted where a data-parallel rank's memory goes: with Adam, the optimizer's state
# (momentum and variance, plus fp32 master weights in mixed precision) is most of it, and
# every rank keeps an identical copy. ZeRO stage 1 keeps each rank's copy of that state for
# **its own shard** of the parameters only. You write it in two parts:
#
# 1. `shard_bounds(numel, rank, world_size)` — which slice of the flattened parameters a rank
#    owns;
# 2. `ZeroOne`, a wrapper around any torch optimizer: it keeps a flat copy of this rank's
#    shard, gives the inner optimizer only that, and in `step()` averages the gradients,
#    steps the shard and all-gathers the parameters so that every rank holds the whole model.
#
# The checks run your wrapper on 2 ranks with Adam and on 3 ranks with SGD + momentum — the
# parameter count (53) does not divide by either — next to DDP with the full optimizer, for 3
# steps, and weigh each rank's optimizer state. They name the classic mistakes: stepping the
# whole model on every rank (no memory saved), forgetting the all-gather (the ranks drift
# apart), an off-by-one shard boundary, summing the gradients instead of averaging them.
#
# Stretch: ZeRO stage 2 done right — each gradient reduce-scattered *during* the backward, from
# a hook, and dropped at once, so that the full gradients never all exist together; the check
# counts the gradient numbers alive at once.

# %% tags=["parameters"]
check_timeout = 30  # seconds before a hanging rank is stopped

# %%
import math

import torch
import torch.distributed as dist

from dpcourse.checks import lab08

torch.set_num_threads(1)

# %% [markdown]
# ## 1. Shard boundaries
#
# Flatten all parameters into one vector of `numel` numbers. `all_gather_single` needs
# every rank's piece to be the **same size**, so give every rank `ceil(numel / world_size)`
# numbers and think of the vector as padded with zeros up to `world_size` times that. Return
# the `[start, end)` of rank `rank`'s shard in the padded vector (the last shard may run past
# `numel` into the padding; a rank can even own nothing but padding when there are more ranks
# than numbers).

# %%
def shard_bounds(numel, rank, world_size):
    """[start, end) of rank ``rank``'s equal-size shard of a flat vector of ``numel`` numbers,
    padded up to a multiple of ``world_size``."""
    ### BEGIN SOLUTION: shard size = ceil(numel / world_size); rank r owns [r * size, (r + 1) * size)
    size = math.ceil(numel / world_size)
    return rank * size, (rank + 1) * size
    ### END SOLUTION


# %%
lab08.check_shard_bounds(shard_bounds)

# %% [markdown]
# ## 2. The wrapper
#
# `__init__` (the first lines are given): keep `self.shard`, this rank's slice of the
# flattened, padded parameters, as an `nn.Parameter` of its own: a copy (`.clone()`), not a
# view, which would keep the whole padded vector alive. Then make
# `self.optimizer = optimizer_cls([self.shard], **kwargs)`: the inner optimizer creates its
# state (Adam's `exp_avg`, `exp_avg_sq`) for the shard alone.
#
# `step()`: flatten the parameters' gradients into one vector and pad it like the
# parameters. Each rank needs the **average** gradient of its own slice only, so
# `dist.reduce_scatter_single(out, flat)` is enough — half an all-reduce (lesson 06's ring
# does it first): rank r receives the sum over the ranks of slice r; divide by the world size.
# Give that to `self.shard.grad`, step the inner optimizer, then
# `dist.all_gather_single(full, self.shard.detach())` brings every rank's new slice into a
# full padded vector; copy each parameter's part back into `p.data`. (An all-reduce followed by
# slicing gives the same weights, and the check accepts it, but it sends half as much again.)
#
# `zero_grad()` is given.

# %%
class ZeroOne:
    def __init__(self, params, optimizer_cls, **kwargs):
        self.params = [p for p in params if p.requires_grad]
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.numel = sum(p.numel() for p in self.params)
        ### BEGIN SOLUTION: this rank's bounds; the flat parameters padded with zeros; self.shard = an nn.Parameter holding a copy of this rank's slice; the inner optimizer over [self.shard]
        self.start, self.end = shard_bounds(self.numel, self.rank, self.world_size)
        self.padded = (self.end - self.start) * self.world_size
        flat = torch.zeros(self.padded)              # the flat parameters, then zeros
        flat[:self.numel] = torch.cat([p.detach().reshape(-1) for p in self.params])
        self.shard = torch.nn.Parameter(flat[self.start:self.end].clone())
        self.optimizer = optimizer_cls([self.shard], **kwargs)
        ### END SOLUTION

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def step(self):
        ### BEGIN SOLUTION: flat padded grads; reduce_scatter_single into this rank's slice, divide; step; all_gather_single the shards; copy back into p.data
        grads = torch.cat([p.grad.reshape(-1) for p in self.params])
        grads = torch.nn.functional.pad(grads, (0, self.padded - self.numel))
        mine = torch.empty(self.end - self.start, dtype=grads.dtype)
        dist.reduce_scatter_single(mine, grads)      # the sum over the ranks, my slice only
        self.shard.grad = mine / self.world_size
        self.optimizer.step()
        full = torch.empty(self.padded, dtype=self.shard.dtype)
        dist.all_gather_single(full, self.shard.detach())
        offset = 0
        for p in self.params:
            p.data.copy_(full[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        ### END SOLUTION


# %%
lab08.check_zero_one(ZeroOne, timeout=check_timeout)


# %% [markdown]
# ## Stretch (optional): ZeRO stage 2, reduce-scattering during the backward
#
# A workshop can stop here. `ZeroOne` shards the optimizer state, but every rank still holds
# the full gradient of every parameter, from the moment the backward produces it until
# `step()` reduce-scatters it. ZeRO stage 2 shards the gradients too: a rank keeps only the
# averaged gradient of its own slice. What that buys is a lower **peak**. Reduce-scatter the
# gradients in `step()`, as lesson 08's short `Zero2` does, and the full gradients have all
# existed at once by the end of the backward: the rank's memory at its fullest is ZeRO-1's,
# whatever it holds at rest. DeepSpeed's stage 2 reduces the gradients bucket by bucket
# *during* the backward, from hooks, like lesson 07's DDP, and frees each bucket's full
# gradients as soon as they are reduced, so at most a bucket of them is alive at a time
# (lesson 08's `Zero3` does the same per layer, its weights sharded as well).
#
# Write `ZeroTwo`, used like `ZeroOne`, with one group per parameter (FSDP2, too, shards each
# parameter on its own):
#
# - `__init__` (the first lines are given): shard **each parameter** on its own — this rank
#   owns `shard_bounds(p.numel(), rank, world_size)` of that parameter's flat values, padded
#   to `world_size` times the shard size. `self.shard` is this rank's slices of all the
#   parameters, one after the other in registration order (an `nn.Parameter` again);
#   `self.shard.grad` a zero tensor of the same size, filled slice by slice during the
#   backward; `self.optimizer` over `[self.shard]`. Then register
#   `p.register_post_accumulate_grad_hook(self._grad_ready)` on every parameter: autograd
#   calls `self._grad_ready(p)` as soon as `p.grad` holds this backward's gradient, the last
#   layer's first.
# - `_grad_ready(p)`: pad `p.grad`, flattened, to `world_size` times its shard size;
#   `dist.reduce_scatter_single` it straight into this parameter's place in `self.shard.grad`
#   (a slice of a 1-d tensor is contiguous, so a view will do as the output), divide by the
#   world size, and set `p.grad = None`: the full gradient is gone before the next one is
#   computed.
# - `step()`: the shard's gradient is ready: step the inner optimizer, then for every
#   parameter `all_gather_single` its slices into a padded vector and copy the first
#   `p.numel()` numbers into `p.data`.
#
# The check runs your class like `ZeroOne`'s, against DDP, on 2 and 3 ranks. A hook of its
# own, registered on every parameter before yours, counts the gradient numbers alive each time
# a gradient arrives (holding only weak references, it keeps none alive). If all 53 were ever
# alive at once — `ZeroOne` does exactly that — it says you kept all full gradients until
# `step()`. One collective per parameter means many small messages; DeepSpeed fills buckets
# (its `reduce_bucket_size`) as lesson 07's `assign_buckets` does, trading a larger peak for
# fewer messages, and the check accepts any grouping that never holds every gradient at once.
# (One thing this version gives up: a second backward before `step()` would overwrite the
# shard's gradient instead of adding to it, so gradient accumulation needs `+=` there.)

# %%
class ZeroTwo:
    def __init__(self, params, optimizer_cls, **kwargs):
        self.params = [p for p in params if p.requires_grad]
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        ### BEGIN SOLUTION: per parameter: shard_bounds(p.numel(), ...) and where its slice sits in self.shard; self.shard and a zero self.shard.grad; the inner optimizer; a post-accumulate-grad hook on every parameter
        self.where = {}               # parameter -> (its shard size, its offset in self.shard)
        pieces, offset = [], 0
        for p in self.params:
            start, end = shard_bounds(p.numel(), self.rank, self.world_size)
            size = end - start
            flat = torch.zeros(size * self.world_size)  # p's values, padded with zeros
            flat[:p.numel()] = p.detach().reshape(-1)
            pieces.append(flat[start:end])
            self.where[p] = (size, offset)
            offset += size
        self.shard = torch.nn.Parameter(torch.cat(pieces))     # cat copies: no views kept
        self.shard.grad = torch.zeros_like(self.shard)
        self.optimizer = optimizer_cls([self.shard], **kwargs)
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._grad_ready)
        ### END SOLUTION

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def _grad_ready(self, p):
        ### BEGIN SOLUTION: pad the flat p.grad; reduce_scatter_single into this parameter's slice of self.shard.grad; divide; p.grad = None
        size, offset = self.where[p]
        flat = torch.nn.functional.pad(p.grad.reshape(-1), (0, size * self.world_size - p.numel()))
        mine = self.shard.grad[offset:offset + size]
        dist.reduce_scatter_single(mine, flat)       # my slice of the sum, in place
        mine /= self.world_size
        p.grad = None                                # the full gradient is not needed again
        ### END SOLUTION

    def step(self):
        ### BEGIN SOLUTION: step the shard; for every parameter all_gather_single its slices and copy them into p.data
        self.optimizer.step()
        for p in self.params:
            size, offset = self.where[p]
            full = torch.empty(size * self.world_size, dtype=self.shard.dtype)
            dist.all_gather_single(full, self.shard.detach()[offset:offset + size])
            p.data.copy_(full[:p.numel()].view_as(p))
        ### END SOLUTION


# %%
lab08.check_zero_two(ZeroTwo, timeout=check_timeout)
