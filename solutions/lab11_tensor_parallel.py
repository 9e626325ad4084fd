# %% [markdown]
# # Lab 11 · Tensor parallelism from scratch: Megatron-LM's MLP
#
# Lesson 11 §2 showed how Megatron-LM cuts a transformer's MLP `Y = GeLU(X A) B` (Shoeybi
# et al. 2019, §3) over t ranks, with the shapes and the pictures; here you write the layers.
# The two definitions you build on:
#
# - the first linear layer is **column-parallel**: rank r keeps a block of its *output*
#   features (A's columns) and computes its block of the hidden activations from the whole X;
# - the second is **row-parallel**: rank r multiplies its block of the hidden features by its
#   block of the weight's *input* features (B's rows), and the ranks' partial products add up
#   to Y.
#
# All the communication sits in two autograd operations: `f`, wrapped around the column
# layer's input, and `g`, wrapped around the row layer's output. Deciding what they do is the
# lab:
#
# 1. Which pass of `f` communicates — forward, backward, or both — and with which collective?
#    Which pass of `g`?
# 2. Which dimension of torch's `nn.Linear.weight` does each layer cut?
# 3. Where is the row layer's bias added, and on which ranks?
#
# Hint for 1: write down ∂L/∂X for the column layer. Every rank holds all of X but only its
# block A_r; X reaches the hidden features through every block, so ∂L/∂X is a sum over the
# ranks of terms `∂L/∂Z_r · A_rᵀ` (Z_r = X A_r), and each rank can compute only its own term.
# Then write dL/dY_r for the sum Y = Σ_r Y_r at `g`, and ask which ranks already hold it.
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
# records every collective your code makes, and compares outputs and gradients (of the input,
# and of every weight and bias shard) with the plain layer on one process. A wrong answer stops
# with one sentence naming its mistake.

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
# - `f` sits before the column layer, whose input `x` is the **same** on every rank.
# - `g` sits after the row layer, where each rank holds a **partial** product.
#
# For each, decide from the questions above what its forward returns and what its backward
# returns, and which of the four methods calls a collective.

# %%
class CopyToTPRegion(torch.autograd.Function):
    """Megatron's f: wraps the column-parallel layer's input."""

    @staticmethod
    def forward(ctx, x):
        ### BEGIN SOLUTION: what x must become on its way into the column layer
        return x.clone()
        ### END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        ### BEGIN SOLUTION: dL/dx from this rank's dL/d(output of f) — see the hint on ∂L/∂X
        summed = grad.clone()
        dist.all_reduce(summed, op=dist.ReduceOp.SUM)
        return summed
        ### END SOLUTION


class ReduceFromTPRegion(torch.autograd.Function):
    """Megatron's g: wraps the row-parallel layer's output."""

    @staticmethod
    def forward(ctx, x):
        ### BEGIN SOLUTION: the layer's output from this rank's partial product
        summed = x.clone()
        dist.all_reduce(summed, op=dist.ReduceOp.SUM)
        return summed
        ### END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        ### BEGIN SOLUTION: the gradient of this rank's partial product from dL/dY
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
# - `ColumnParallel` keeps this rank's block of the **output** features; its forward returns
#   this rank's block of the layer's output.
# - `RowParallel` takes this rank's block of the hidden features (the column layer's output
#   after the GeLU) and keeps the matching block of the **input** features; its forward
#   returns the whole layer's output, the same on every rank.
#
# Decide which dimension of `linear.weight` holds each block, what happens to each layer's
# bias (sliced or whole; added before `g`, after it, on which ranks — the output must hold it
# exactly once), and where `f` and `g` go.

# %%
class ColumnParallel(nn.Module):
    def __init__(self, linear, rank, world_size):
        super().__init__()
        ### BEGIN SOLUTION: this rank's block of the weight (which dimension?) and what it needs of the bias, as new nn.Parameters
        start, stop = block_of(linear.out_features, rank, world_size)
        self.weight = nn.Parameter(linear.weight.detach()[start:stop, :].clone())
        self.bias = nn.Parameter(linear.bias.detach()[start:stop].clone())
        ### END SOLUTION

    def forward(self, x):
        ### BEGIN SOLUTION: this rank's block of the output features, with f where its gradient is needed
        x = CopyToTPRegion.apply(x)
        return x @ self.weight.T + self.bias
        ### END SOLUTION


lab11.check_column_parallel(ColumnParallel, timeout=check_timeout)


# %%
class RowParallel(nn.Module):
    def __init__(self, linear, rank, world_size):
        super().__init__()
        ### BEGIN SOLUTION: this rank's block of the weight (which dimension?) and what it needs of the bias, as new nn.Parameters
        start, stop = block_of(linear.in_features, rank, world_size)
        self.weight = nn.Parameter(linear.weight.detach()[:, start:stop].clone())
        self.bias = nn.Parameter(linear.bias.detach().clone())
        ### END SOLUTION

    def forward(self, hidden_block):
        ### BEGIN SOLUTION: the whole layer's output on every rank, through g, the bias counted once
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
# compares your MLP with `plain` on 2 and 3 ranks (output, dL/dx, and each rank's weight and
# bias gradients against the matching slice of `plain`'s), counts the collectives of each
# pass, and then builds it with h = 16 on 3 ranks.

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
# A workshop can stop here. Lesson 11 §3 cut a model into stages: stage r (an index) runs on
# rank r, and `module` is its part of the model (an `nn.Module`). Write one GPipe step of a
# stage: `gpipe_step(module, rank, world_size, m, inputs, targets, loss_fn, shape)`, with `m`
# micro-batches (`inputs`, a list of m tensors, on stage 0; `targets` on the last stage;
# `None` elsewhere; `shape` is one micro-batch's activation between stages). Send and receive
# with the blocking `dist.send` and `dist.recv` (with `dist.isend` instead, keep every request
# and `wait()` on it before returning):
#
# - **forwards**, for each micro-batch i = 0 … m−1: stage 0 takes `inputs[i]`; every other
#   stage receives its input (`torch.empty(shape)`, `dist.recv(..., src=rank - 1)`) and makes
#   it require grad. Run `module` on it; send the output to `rank + 1` — or, on the last stage,
#   compute `loss_fn(output, targets[i]) / m`. Keep each micro-batch's input and output for its
#   backward.
# - **backwards**, for each micro-batch: the last stage calls `backward()` on its loss; every
#   other stage receives the gradient of its output from `rank + 1` and calls
#   `output.backward(gradient)`. Each stage but the first sends the gradient of its input to
#   `rank - 1`. Do **not** zero the gradients between micro-batches: autograd adds each
#   backward into `.grad`, and that sum is the batch's gradient.
# - return `(loss, events)`: `loss` is a Python float on the last stage, the batch's loss (the
#   sum of the divided micro-batch losses' `.item()`), and `None` on the other stages;
#   `events` has one `(kind, i, start, end)` per action, `kind` `"F"` or `"B"`, the times from
#   `time.perf_counter()` around the computation only (not the waiting for messages).
#
# Then `bubble(events, stages)`: `stages` is the number of stages, and `events` holds every
# stage's actions as `(stage, kind, i, start, end)`, `stage` its index; return the share of
# the step the stages were idle: 1 − (time spent computing, all stages together) / (stages ×
# the step's span, from the earliest start to the latest end).
# The check runs your step on 2 and 3 stages with M = 4 and compares the gradients with the
# unsplit model's on the whole batch.

# %%
def gpipe_step(module, rank, world_size, m, inputs, targets, loss_fn, shape):
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
        result = module(act)
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
