# %% [markdown]
# # Lab 11 · Tensor parallelism from scratch: Megatron-LM's MLP
#
# Lesson 11 split a model's *layers* across ranks. Now you split each *weight matrix*, as
# Megatron-LM does for a transformer's MLP `Y = GeLU(X A) B` (Shoeybi et al. 2019, §3): the
# first linear layer is **column-parallel** (rank r keeps a block of its output features and
# computes its block of the hidden activations, with no communication), the second is
# **row-parallel** (rank r multiplies its hidden block by its block of the weight's input
# features, and the ranks' partial products are summed). Two autograd operations carry all the
# communication:
#
# | operation | forward | backward |
# |---|---|---|
# | `f`: copy to the tensor-parallel region (before the column layer) | identity | all-reduce (sum) |
# | `g`: reduce from the tensor-parallel region (after the row layer) | all-reduce (sum) | identity |
#
# You write, in this order:
#
# 1. `block_of(size, rank, world_size)`: the features rank r keeps;
# 2. `CopyToTPRegion` (`f`) and `ReduceFromTPRegion` (`g`) as `torch.autograd.Function`s;
# 3. `ColumnParallel` and `RowParallel`, each built from a full `nn.Linear`;
# 4. `TPMLP`, the two layers around a GeLU, equal to the plain MLP on 2 and 3 ranks;
# 5. (stretch) one GPipe step of a pipeline stage, with its bubble measured.
#
# **How it is checked.** Each check runs your code on 2 and then 3 ranks (gloo, through
# `dpcourse.launch.spawn`, which ships your classes to the ranks: define them right here),
# records every collective your code makes, and compares outputs and gradients with the plain
# layer on one process. It names the classic mistakes: an all-reduce in the column layer's
# forward, none in its backward, the row layer's bias added on every rank, shards cut along the
# wrong dimension, blocks not offset by the rank, an average where a sum belongs, micro-batch
# gradients not accumulated.

# %% tags=["parameters"]
check_timeout = 30  # seconds before a hanging rank is stopped

# %%
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dpcourse.checks import lab11

torch.set_num_threads(1)

# %% [markdown]
# ## 1. Which features a rank keeps
#
# Rank r keeps the contiguous block `[start, stop)` of a dimension of `size` features: with
# `size // world_size` features per rank, `start = rank × per` and `stop = start + per`. When
# the world size does not divide the size (a hidden size of 16 on 3 ranks), either **refuse**
# it — raise a `ValueError` whose sentence names the size and the world size — or **handle**
# it with uneven blocks that still cover every feature once, in rank order (your choice; the
# check accepts both).

# %%
def block_of(size, rank, world_size):
    """(start, stop) of the block of ``size`` features that ``rank`` keeps."""
    ### BEGIN SOLUTION: a size the world size does not divide: refuse it (a sentence naming both) or handle it; otherwise rank's equal block
    if size % world_size != 0:
        raise ValueError(f"a hidden size of {size} does not split into {world_size} equal "
                         f"blocks: choose a size divisible by the number of ranks")
    per_rank = size // world_size
    return rank * per_rank, rank * per_rank + per_rank
    ### END SOLUTION


lab11.check_block_of(block_of)

# %% [markdown]
# ## 2. The two conjugate operations
#
# Write each as a `torch.autograd.Function`: a `forward(ctx, x)` and a `backward(ctx, grad)`,
# both static methods, used as `CopyToTPRegion.apply(x)`. Sum with `dist.all_reduce` (its
# default op), which works **in place**: all-reduce a copy of the tensor you were given
# (`.clone()`), not the tensor itself.
#
# - `f` sits before the column layer: every rank holds the **same** `x`, so the forward has
#   nothing to do. In the backward, each rank's block of the layer contributes only part of
#   dL/dx; the whole gradient is their **sum**.
# - `g` sits after the row layer: each rank holds a **partial** product; the output is their
#   **sum**. In the backward, the gradient of a sum reaches each term unchanged.

# %%
class CopyToTPRegion(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce (sum) backward."""

    @staticmethod
    def forward(ctx, x):
        ### BEGIN SOLUTION: every rank already holds the same x: give it back unchanged
        return x.clone()
        ### END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        ### BEGIN SOLUTION: sum a copy of the gradient over the ranks and return it
        summed = grad.clone()
        dist.all_reduce(summed, op=dist.ReduceOp.SUM)
        return summed
        ### END SOLUTION


class ReduceFromTPRegion(torch.autograd.Function):
    """Megatron's g: all-reduce (sum) forward, identity backward."""

    @staticmethod
    def forward(ctx, x):
        ### BEGIN SOLUTION: sum a copy of the partial results over the ranks and return it
        summed = x.clone()
        dist.all_reduce(summed, op=dist.ReduceOp.SUM)
        return summed
        ### END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        ### BEGIN SOLUTION: the gradient of a sum reaches each term as it is
        return grad
        ### END SOLUTION


lab11.check_conjugates(CopyToTPRegion, ReduceFromTPRegion, timeout=check_timeout)

# %% [markdown]
# ## 3. The column- and the row-parallel layer
#
# Both are built from a full `nn.Linear` and keep a block of its weight as a new
# `nn.Parameter` (`.detach()[...].clone()`, so it gets its own gradient). Remember torch's
# layout: `linear.weight` is **(out_features, in_features)**, and the layer computes
# `x @ weight.T + bias`.
#
# - `ColumnParallel` keeps the block of **output** features: rows of the weight, and the same
#   block of the bias. Its forward passes `x` through `f`, then computes its block of the
#   output — no communication in the forward.
# - `RowParallel` keeps the block of **input** features: columns of the weight. Its input is
#   this rank's block of the hidden features; it computes its partial product, sums the
#   partial products with `g`, and adds the bias **once**: the sum of N copies of the bias
#   would be N times the bias. Keep the whole bias on every rank and add it after `g`, or add
#   it before `g` on rank 0 only.

# %%
class ColumnParallel(nn.Module):
    def __init__(self, linear, rank, world_size):
        super().__init__()
        ### BEGIN SOLUTION: block_of(out_features); this rank's rows of the weight and its block of the bias, as new Parameters
        start, stop = block_of(linear.out_features, rank, world_size)
        self.weight = nn.Parameter(linear.weight.detach()[start:stop, :].clone())
        self.bias = nn.Parameter(linear.bias.detach()[start:stop].clone())
        ### END SOLUTION

    def forward(self, x):
        ### BEGIN SOLUTION: f, then this rank's block of the output features
        x = CopyToTPRegion.apply(x)
        return x @ self.weight.T + self.bias
        ### END SOLUTION


lab11.check_column_parallel(ColumnParallel, timeout=check_timeout)


# %%
class RowParallel(nn.Module):
    def __init__(self, linear, rank, world_size):
        super().__init__()
        ### BEGIN SOLUTION: block_of(in_features); this rank's columns of the weight; the whole bias
        start, stop = block_of(linear.in_features, rank, world_size)
        self.weight = nn.Parameter(linear.weight.detach()[:, start:stop].clone())
        self.bias = nn.Parameter(linear.bias.detach().clone())
        ### END SOLUTION

    def forward(self, hidden_block):
        ### BEGIN SOLUTION: the partial product, g to sum it over the ranks, then the bias once
        partial = hidden_block @ self.weight.T
        return ReduceFromTPRegion.apply(partial) + self.bias
        ### END SOLUTION


lab11.check_row_parallel(RowParallel, timeout=check_timeout)

# %% [markdown]
# ## 4. The tensor-parallel MLP
#
# `plain` is `nn.Sequential(nn.Linear(d, h), nn.GELU(), nn.Linear(h, d))`. Build the column
# layer from its first layer and the row layer from its last, with the GeLU between them: it
# acts on each hidden feature alone, so it runs on a block as well as on the whole. The check
# compares your MLP with `plain` on 2 and 3 ranks (output and dL/dx), counts one all-reduce in
# the forward and one in the backward, and then builds it with h = 16 on 3 ranks.

# %%
class TPMLP(nn.Module):
    def __init__(self, plain, rank, world_size):
        super().__init__()
        ### BEGIN SOLUTION: ColumnParallel from plain[0], plain[1] between, RowParallel from plain[2]
        self.column = ColumnParallel(plain[0], rank, world_size)
        self.gelu = plain[1]
        self.row = RowParallel(plain[2], rank, world_size)
        ### END SOLUTION

    def forward(self, x):
        ### BEGIN SOLUTION: column, GeLU, row
        return self.row(self.gelu(self.column(x)))
        ### END SOLUTION


lab11.check_tp_mlp(TPMLP, timeout=check_timeout)

# %% [markdown]
# ## Stretch (optional): one GPipe step, and its bubble
#
# A workshop can stop here. Lesson 11 cut a model into stages, one per rank; write the step of
# one stage under the GPipe schedule. `gpipe_step(stage, rank, world_size, m, inputs, targets,
# loss_fn, shape)`, with `m` micro-batches (`inputs` on the first stage, `targets` on the last,
# `None` elsewhere; `shape` is one micro-batch's activation between stages):
#
# - **forwards**, for each micro-batch i = 0 … m−1: stage 0 takes `inputs[i]`; every other
#   stage receives its input (`torch.empty(shape)`, `dist.recv(..., src=rank - 1)`) and makes
#   it require grad. Run `stage` on it; send the output to `rank + 1` — or, on the last stage,
#   compute `loss_fn(output, targets[i]) / m`. Keep each micro-batch's input and output for its
#   backward.
# - **backwards**, for each micro-batch: the last stage calls `backward()` on its loss; every
#   other stage receives the gradient of its output from `rank + 1` and calls
#   `output.backward(gradient)`. Each stage but the first sends the gradient of its input to
#   `rank - 1`. Do **not** zero the gradients between micro-batches: autograd adds each
#   backward into `.grad`, and that sum is the batch's gradient.
# - return `(loss, events)`: the batch's loss on the last stage (the sum of the divided
#   micro-batch losses; `None` elsewhere) and one `(kind, i, start, end)` per action, `kind`
#   `"F"` or `"B"`, the times from `time.perf_counter()` around the computation only (not the
#   waiting for messages).
#
# Then `bubble(events, stages)`: `events` holds every stage's actions as `(stage, kind, i,
# start, end)`; return the share of the step the stages were idle: 1 − (time spent computing,
# all stages together) / (stages × the step's span, from the earliest start to the latest end).
# The check runs your step on 2 and 3 stages with M = 4 and compares the gradients with the
# unsplit model's on the whole batch.

# %%
def gpipe_step(stage, rank, world_size, m, inputs, targets, loss_fn, shape):
    ### BEGIN SOLUTION: every forward, then every backward, as above; time the computations only
    kept, events, loss = [], [], None
    for i in range(m):
        if rank == 0:
            act = inputs[i]
        else:
            act = torch.empty(shape)
            dist.recv(act, src=rank - 1)
            act.requires_grad_()
        t0 = time.perf_counter()
        result = stage(act)
        if rank == world_size - 1:
            result = loss_fn(result, targets[i]) / m
            loss = result.item() if loss is None else loss + result.item()
        t1 = time.perf_counter()
        events.append(("F", i, t0, t1))
        if rank < world_size - 1:
            dist.send(result.detach(), dst=rank + 1)
        kept.append((act, result))
    for i, (act, result) in enumerate(kept):
        upstream = None
        if rank < world_size - 1:
            upstream = torch.empty(shape)
            dist.recv(upstream, src=rank + 1)
        t0 = time.perf_counter()
        result.backward(upstream)
        t1 = time.perf_counter()
        events.append(("B", i, t0, t1))
        if rank > 0:
            dist.send(act.grad, dst=rank - 1)
    return loss, events
    ### END SOLUTION


def bubble(events, stages):
    ### BEGIN SOLUTION: the idle share of the whole step, all stages together
    busy = sum(end - start for _, _, _, start, end in events)
    span = max(e[4] for e in events) - min(e[3] for e in events)
    return 1 - busy / (stages * span)
    ### END SOLUTION


lab11.check_gpipe(gpipe_step, bubble, timeout=check_timeout)

# %% [markdown]
# Now measure it. Each forward below sleeps 10 ms and each backward 20 ms beside the
# computation — a stand-in for an accelerator, which computes without taking one of this
# machine's CPU cores — and your `bubble` measures the step for M = 1, 2, 4, 8 on 2 stages.
# The formula (K−1)/(M+K−1) counts no time for messages; in your measurement, waiting for a
# message is idle time. Read how far apart the two columns are, and whether the gap grows or
# shrinks with M.

# %%
# NBVAL_IGNORE_OUTPUT
# measured times: they change from run to run and with the machine's load
lab11.measure_bubble(gpipe_step, bubble, stages=2, micro=(1, 2, 4, 8), timeout=check_timeout)
