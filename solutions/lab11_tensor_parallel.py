# %% [markdown]
# # Lab 11 · Tensor parallelism from scratch: Megatron-LM's MLP
#
# Lesson 11 §2 showed how Megatron-LM cuts a transformer's MLP `Y = GeLU(X A) B` (Shoeybi
# et al. 2019, §3) over t ranks, with the shapes and the pictures; here you write the layers.
# The two definitions you build on:
#
# - the first linear layer is **column-parallel**: rank r keeps a block of A's columns and
#   computes its block of the hidden activations from the whole X;
# - the second is **row-parallel**: rank r keeps a block of B's rows, multiplies its block of
#   the hidden activations by it, and every rank ends with the layer's output Y.
#
# (A and B in the paper's `X·A` convention; which dimension of a torch weight that is, part 3
# asks.)
#
# All the MLP's communication sits in two autograd operations: `f`, wrapped around the column
# layer's input, and `g`, wrapped around the row layer's output. Deciding what they do is the
# lab. **The goal.** On t ranks, your `TPMLP` gives every rank the plain MLP's output; after one
# backward, the gradient of the input is the plain MLP's, and every rank's weight and bias
# gradients are the matching blocks of the plain MLP's; and after a few SGD steps, each rank
# stepping only its own parameters, it still gives the plain MLP's output (trained the same
# way) — each rank holding only its block of each weight, and the ranks making no collective
# that the plain MLP's arithmetic does not need (the checks count them, pass by pass, and in
# part 5 weigh them in bytes).
#
# The parts, each with the question it asks you to decide:
#
# 1. `block_of(size, rank, world_size)`, the features rank r keeps — and what it does with a
#    size the world size does not divide (parts 4 and 5 hold your layers to it);
# 2. `CopyToTPRegion` (`f`) and `ReduceFromTPRegion` (`g`) as `torch.autograd.Function`s:
#    which pass of each communicates, with which collective — and which collectives once the
#    activations around the MLP are cut along the tokens (a diagnosis, no code);
# 3. `ColumnParallel` and `RowParallel`, each built from a full `nn.Linear`: which dimension
#    of torch's `nn.Linear.weight` (and of a Keras `Dense` kernel) each cuts, and where the row
#    layer's bias goes, on which ranks;
# 4. `TPMLP`, the two layers around a GeLU, after a prediction of how many numbers one rank's
#    parameters hold;
# 5. the same MLP with a layer norm between the two layers, an arrangement the lesson did not
#    show — the lab's main design decision: the **cheapest** exchange that keeps it exact, and
#    what that exchange does in the backward (after a prediction of its bytes);
# 6. a prediction: how many all-reduces a step of two stacked `TPMLP`s makes — then counted.
#
# Then a stretch, optional: one GPipe step of a pipeline stage, with its bubble measured.
#
# **How it is checked.** Each check runs your code on 2 and then 3 ranks (gloo, through
# `dpcourse.launch.spawn`, which ships your classes to the ranks: define them right here),
# records every collective your code makes, and compares outputs and gradients (of the input,
# and of every weight and bias shard) with the plain layer on one process — then takes two
# SGD steps of each rank's own parameters and compares again with the plain layer trained the
# same way. A wrong answer stops
# with one sentence naming its mistake: when you are stuck, run the check and read it first;
# the folded hints come after. A prediction counts once: written again after its measurement
# has been shown in this kernel, it is compared but not recorded — your first one stands.

# %% tags=["parameters"]
check_timeout = 30  # seconds before a hanging rank is stopped

# %%
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dpcourse.checks import lab11, predict

torch.set_num_threads(1)

# %% [markdown]
# ## 1. Which features a rank keeps
#
# `block_of(size, rank, world_size)` returns `(start, stop)`, two ints: rank r keeps features
# `start … stop − 1` of a dimension of `size` features. Afterwards the ranks' blocks, taken in
# rank order, are contiguous, do not overlap and cover every feature exactly once; when the
# world size divides the size, every block has the same length.
#
# When the world size does not divide the size (a hidden size of 16 on 3 ranks), the choice is
# yours: refuse it (a `ValueError` whose sentence names the size and the world size) or give
# blocks of unequal length that keep the contract above. Parts 4 and 5 build your layers with
# h = 16 on 3 ranks and hold them to what `block_of` says: the same refusal on every rank
# before any collective, or the plain MLP's values with the blocks it gives.

# %% [markdown]
# <details><summary>▶ Hint 1 — a question</summary>
#
# With 12 features on 3 ranks, write down by hand the three ranges. What do rank 1's start and
# rank 0's stop have in common? With 16 on 3, how many ranks can have the same length?
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 2 — the shape of the code</summary>
#
# Your decision for the remainder first (an `if` that raises, or a length per rank that
# depends on the remainder), then start from the rank and stop from start, as in a Python
# slice; return the pair.
#
# </details>

# %%
def block_of(size, rank, world_size):
    """(start, stop) of the block of ``size`` features that ``rank`` keeps."""
    ### BEGIN SOLUTION: rank's block, and what happens when world_size does not divide size
    if size % world_size != 0:
        raise ValueError(f"a hidden size of {size} does not split into {world_size} equal "
                         f"blocks: choose a size divisible by the number of ranks")
    per_rank = size // world_size
    return rank * per_rank, rank * per_rank + per_rank
    ### END SOLUTION


# %%
lab11.check_block_of(block_of)

# %% [markdown]
# ## 2. The two conjugate operations
#
# Write each as a `torch.autograd.Function`: a `forward(ctx, x)` and a `backward(ctx, grad)`,
# both static methods, used as `CopyToTPRegion.apply(x)`. `forward` returns a tensor of x's
# shape; `backward` receives the gradient of that output and returns the gradient of x.
# `dist.all_reduce(t)` sums `t` over the ranks and writes the sum into `t` itself (it returns
# nothing useful); whether you hand it the tensor you were given or a copy is yours to judge
# (the check accepts both).
#
# - `f` wraps the column layer's input: its forward takes `x` and its output goes into the
#   column layer's matrix product.
# - `g` wraps the row layer's output: its forward takes this rank's matrix product of the row
#   layer and returns what the layer outputs.
#
# What must hold afterwards: the column layer's input gets the gradient the plain layer would
# give it, and the row layer's output is the plain layer's, on every rank.
#
# **Your diagnosis first.** Before you write a method, decide in
# which pass each operation must talk to the other ranks: set `f_communicates_in` and
# `g_communicates_in` each to `"forward"`, `"backward"`, `"both"` or `"neither"`.
# `lab11.check_diagnosis` judges them as a pair: a wrong pair comes back with what it would
# make of the MLP's tensors, and you find which of those the plain MLP does not compute (a
# different pair sent after that, without a new reason, is named as the search it is). The
# check of your code then refuses code that communicates anywhere else than you declared.

# %% [markdown]
# <details><summary>▶ Hint 1 — a question</summary>
#
# Take the four tensors at the two operations' edges: X (what `f` receives in the forward),
# dL/dX (what `f` receives in the backward), Y_r (this rank's matrix product, which `g`
# receives in the forward) and dL/dY (what `g` receives in the backward). For each, right
# where the operation receives it and before any collective: does every rank hold the same,
# whole tensor — or does each hold only a part, which the ranks must add up to get the plain
# MLP's value?
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 2 — let the check test your reasoning</summary>
#
# Write your answers to Hint 1 down for the check: `held = {"X": ..., "dL/dX": ..., "Y": ...,
# "dL/dY": ...}`, each `"whole"` (the same on every rank) or `"partial"` (a part the ranks
# must sum), and call `lab11.check_diagnosis(f_communicates_in, g_communicates_in, held)`. It
# then first tells you where your passes disagree with your own answers, and, when they agree
# but are wrong, asks which of your answers does not hold.
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 3 — the idea, and the shape of the code</summary>
#
# ∂L/∂X = Σ_r ∂L/∂Z_r · A_rᵀ (Z_r = X A_r): each rank computes one term, so the sum needs the
# ranks together — on the backward pass; the forward of `f` has nothing to add, since X is
# already the same everywhere. `g` is the mirror image: the forward needs the sum of the
# partial products; the gradient of a sum reaches each term as it is, and everything after
# `g` runs identically on every rank, so each rank already holds it. In the code, then, two of
# the four methods return what they were given (a fresh tensor or a view of it), and two sum
# over the ranks before returning; each collective runs on every rank, unconditionally.
#
# </details>

# %%
### BEGIN SOLUTION: f_communicates_in, g_communicates_in
f_communicates_in = "backward"
g_communicates_in = "forward"
### END SOLUTION
lab11.check_diagnosis(f_communicates_in, g_communicates_in)

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
        ### BEGIN SOLUTION: dL/dx from this rank's gradient of f's output
        summed = grad.clone()
        dist.all_reduce(summed, op=dist.ReduceOp.SUM)
        return summed
        ### END SOLUTION


class ReduceFromTPRegion(torch.autograd.Function):
    """Megatron's g: wraps the row-parallel layer's output."""

    @staticmethod
    def forward(ctx, x):
        ### BEGIN SOLUTION: the layer's output from this rank's matrix product
        summed = x.clone()
        dist.all_reduce(summed, op=dist.ReduceOp.SUM)
        return summed
        ### END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        ### BEGIN SOLUTION: the gradient of this rank's matrix product from dL/dY
        return grad
        ### END SOLUTION


lab11.check_conjugates(CopyToTPRegion, ReduceFromTPRegion, f_communicates_in,
                       g_communicates_in, timeout=check_timeout)

# %% [markdown]
# **A second diagnosis: the same MLP with sequence parallelism** (no code). Outside the MLP —
# the layer norms, the dropouts — a transformer keeps the tokens × d activations whole on
# every tensor-parallel rank, which wastes memory. Korthikanti et al. (2022) cut them along the
# tokens instead: X, s tokens × d features, now **enters** the MLP on rank r as its share of
# the tokens (with t dividing s: rows r·s/t … (r+1)·s/t − 1 of X, all d features), and the
# MLP's output must **leave** it the same way, each rank keeping Y for its own tokens only.
# The weights, their cuts and the two matmuls stay as before; `f` and `g` keep their places.
# What each pass of them must make is yours to work out again. `sp_collectives` is a dict with the keys
# `"f forward"`, `"f backward"`, `"g forward"` and `"g backward"`, each one of
# `lab11.SP_VALUES`: `"nothing"`, `"all-reduce"`, `"all-gather"` (every rank gets every rank's
# tensor, stacked in rank order) or `"reduce-scatter"` (the ranks' tensors summed, and rank r
# keeps only the r-th block of rows of the sum). A wrong set comes back whole, with what
# each of your four would make of its tensor; a changed set after that is named as a search.

# %% [markdown]
# <details><summary>▶ Hint 1 — a question</summary>
#
# For each of the four tensors, ask two things: what does this rank hold of it (all the tokens
# or only its own; whole, or a part the ranks must sum)? And what does the operation on the
# other side of f or g need of it?
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 2 — the idea</summary>
#
# Going into the column layer, a rank has its own tokens and needs everyone's; coming out of
# the row layer, it has a part of every token's sum and needs the whole sum of its own tokens
# only. Each backward turns its forward's change around: a gradient of a tensor that was
# gathered is a sum to take back to each rank's share, and a gradient of one rank's share of a
# sum is needed by every rank's partial product.
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 3 — the shape of the answer</summary>
#
# Two different collectives, each used twice; no "nothing" and no "all-reduce". Each
# operation's backward uses the one of the two that its forward does not.
#
# </details>

# %%
for value in lab11.SP_VALUES:
    print(repr(value))
### BEGIN SOLUTION: sp_collectives, a dict of four answers
sp_collectives = {"f forward": "all-gather", "f backward": "reduce-scatter",
                  "g forward": "reduce-scatter", "g backward": "all-gather"}
### END SOLUTION
lab11.check_sequence_parallel(sp_collectives)

# %% [markdown]
# ## 3. The column- and the row-parallel layer
#
# Both take `(linear, rank, world_size)`, a full `nn.Linear` the same on every rank, and keep
# what the rank needs of it as **new** `nn.Parameter`s (the full layer is not kept), each
# holding only this rank's block of the weight (`block_of` says which features).
#
# - `ColumnParallel(linear, rank, world_size)(x)`, with x the whole input (the same on every
#   rank), returns this rank's block of the full layer's output features, bias included.
# - `RowParallel(linear, rank, world_size)(hidden_block)`, with this rank's block of the
#   hidden features, returns the full layer's output, bias included, the same on every rank.
#
# After a backward, the gradient of each layer's input and of every parameter equals the
# matching block of the full layer's. And the layers train like the full layer: after a few
# SGD steps, each rank stepping only its own parameters, every rank's output still equals
# the full layer's trained the same way. Where `f` and `g` go is yours to find.
#
# **Decide before you code:** which dimension of `linear.weight` (0 or 1) each layer cuts.
# Your decision rests on how `nn.Linear` lays out its weight, so write that down too:
# `weight_shape` is the shape you expect `nn.Linear(6, 12).weight` to have. The check
# compares it with the weight torch builds, then your dimensions with that layout; the layer
# checks below refuse code that cuts another dimension than the one you declared.
#
# Then the same two layers in another framework's layout, which this course does not show
# cut: Keras's `Dense(units)` keeps its weight as a `kernel`. How Keras lays it out is for you
# to find — build one on 6 input features and print its kernel's shape, or read `Dense.build`
# and `Dense.call` in the installed `keras/src/layers/core/dense.py`. `dense_dims` is the pair
# `(column, row)`: the dimension of the column layer's kernel and of the row layer's kernel
# that each would cut, were they Keras `Dense` layers.
#
# **Your design decision:** the row layer's bias. The lesson left it open: keep it whole or
# in blocks, on every rank or on one, and add it before `g` or after it. More than one choice
# satisfies the contract — and some choices that give the right output and the right
# gradients after one backward do not (the check trains your layer to find them). Pick one;
# before you write `RowParallel` you predict what one rank's bias gets as its gradient with
# your choice.

# %% [markdown]
# <details><summary>▶ Hint 1 — a question</summary>
#
# Which torch dimension of the first layer's weight indexes its output features — and so its
# hidden features? Which dimension of the second layer's weight does the hidden block
# multiply? And if every rank added the whole row bias to its partial product, what would the
# sum hold?
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 2 — the idea</summary>
#
# Both layers cut the hidden dimension and keep the model's width whole, whatever the
# framework's layout: find, in each layout, which dimension runs over the hidden features. A column block of
# output features comes with the same block of the first bias. The row layer's partial
# products are summed, so anything added to each of them before the sum is added t times;
# after the sum, every rank holds the same output and may add the whole bias itself.
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 3 — the shape of the code</summary>
#
# In each `__init__`: the block's bounds from the right size, then a slice along one
# dimension, copied into a new parameter. In each `forward`: `f` on the way in (column) or `g`
# on the way out (row), around one matrix product, and the bias where your decision puts it.
#
# </details>

# %%
### BEGIN SOLUTION: weight_shape, column_weight_dim, row_weight_dim and dense_dims
weight_shape = (12, 6)     # nn.Linear(6, 12).weight: (out_features, in_features)
column_weight_dim = 0
row_weight_dim = 1
dense_dims = (1, 0)        # a Keras kernel is (in, out): the hidden features sit the other way
### END SOLUTION
lab11.check_split_decision(column_weight_dim, row_weight_dim, weight_shape, dense_dims)

# %%
class ColumnParallel(nn.Module):
    def __init__(self, linear, rank, world_size):
        super().__init__()
        ### BEGIN SOLUTION: this rank's block of the weight, and what it needs of the bias
        start, stop = block_of(linear.out_features, rank, world_size)
        self.weight = nn.Parameter(linear.weight.detach()[start:stop, :].clone())
        self.bias = nn.Parameter(linear.bias.detach()[start:stop].clone())
        ### END SOLUTION

    def forward(self, x):
        ### BEGIN SOLUTION: this rank's block of the output features, with f where its gradient is needed
        x = CopyToTPRegion.apply(x)
        return x @ self.weight.T + self.bias
        ### END SOLUTION


lab11.check_column_parallel(ColumnParallel, column_weight_dim, timeout=check_timeout)


# %% [markdown]
# **Predict first.** With your row-bias decision, on 3 ranks: after one backward, what does
# the row bias that **rank 1** holds get as its gradient? dL/db is the full layer's bias
# gradient after the same backward. Pick one of `lab11.BIAS_GRAD_CHOICES`; the row layer's
# check measures it once your layer passes, and says why.

# %%
for choice in lab11.BIAS_GRAD_CHOICES:
    print(repr(choice))
### BEGIN SOLUTION: your prediction (one of the choices, as a string)
my_bias_grad = "the whole of dL/db"      # b₂ whole on every rank, added after g
### END SOLUTION
bias_guess = predict("lab11", "the gradient of rank 1's row bias (3 ranks)", my_bias_grad,
                     choices=lab11.BIAS_GRAD_CHOICES)


# %%
class RowParallel(nn.Module):
    def __init__(self, linear, rank, world_size):
        super().__init__()
        ### BEGIN SOLUTION: this rank's block of the weight, and what it needs of the bias
        start, stop = block_of(linear.in_features, rank, world_size)
        self.weight = nn.Parameter(linear.weight.detach()[:, start:stop].clone())
        self.bias = nn.Parameter(linear.bias.detach().clone())
        ### END SOLUTION

    def forward(self, hidden_block):
        ### BEGIN SOLUTION: the full layer's output, bias included, the same on every rank
        partial = hidden_block @ self.weight.T
        return ReduceFromTPRegion.apply(partial) + self.bias
        ### END SOLUTION


lab11.check_row_parallel(RowParallel, row_weight_dim, timeout=check_timeout,
                         bias_prediction=bias_guess)

# %% [markdown]
# ## 4. The tensor-parallel MLP, and what one rank holds
#
# `TPMLP(plain, rank, world_size)`, with `plain = nn.Sequential(nn.Linear(d, h), nn.GELU(),
# nn.Linear(h, d))` the same on every rank: `TPMLP(...)(x)` equals `plain(x)` on every rank,
# and after a backward dL/dx and each rank's parameter gradients are `plain`'s (the matching
# blocks), its only collectives those of your `f` and `g`; after a few SGD steps it still
# equals `plain` trained the same way. The check compares on
# 2 and 3 ranks, counts the collectives of each pass, and then builds it with h = 16 on 3
# ranks, where what your `block_of` does with a remainder shows.
#
# Tensor parallelism is there to cut each rank's memory. **Before** you write `TPMLP`,
# predict how much: with d = 6 and h = 12, the plain MLP's parameters hold 162 numbers. How
# many numbers do the parameters of `TPMLP(plain, 1, 3)` — rank 1 of 3 — hold, with *your*
# layers (`sum(p.numel() for p in mlp.parameters())`)? Work it out from the shapes your
# layers keep and from your row-bias decision, not by running it; the cell after `TPMLP`'s
# check counts it and explains the count.

# %%
### BEGIN SOLUTION: your prediction (a number)
my_count = 58
### END SOLUTION
held_guess = predict("lab11", "numbers in the parameters of rank 1 of 3 (d = 6, h = 12)",
                     my_count, unit="numbers")

# %% [markdown]
# <details><summary>▶ Hint 1 — a question</summary>
#
# The GeLU sits between the two layers. Does it need the other ranks' hidden features to
# compute its output on this rank's block?
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 2 — the idea</summary>
#
# GeLU acts on each feature alone, so it runs on a block as well as on the whole: the column
# layer's block of hidden features goes through it and straight into the row layer.
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 3 — the shape of the code</summary>
#
# Three attributes built from the three entries of `plain` (yours, yours, and the activation
# as it is); the forward chains them in the plain MLP's order.
#
# </details>

# %%
class TPMLP(nn.Module):
    def __init__(self, plain, rank, world_size):
        super().__init__()
        ### BEGIN SOLUTION: the two parallel layers and the activation, built from plain
        self.column = ColumnParallel(plain[0], rank, world_size)
        self.gelu = plain[1]
        self.row = RowParallel(plain[2], rank, world_size)
        ### END SOLUTION

    def forward(self, x):
        ### BEGIN SOLUTION: the MLP's output, equal to plain(x)
        return self.row(self.gelu(self.column(x)))
        ### END SOLUTION


lab11.check_tp_mlp(TPMLP, timeout=check_timeout)

# %%
held = lab11.count_parameters(TPMLP)
lab11.check_parameters_prediction(held_guess, held, TPMLP)

# %% [markdown]
# ## 5. A layer norm between the two layers: the cheapest exact exchange
#
# NormFormer (Shleifer et al. 2021) adds a layer norm on the MLP's hidden activations, between
# the GeLU and the second layer:
# `plain = nn.Sequential(nn.Linear(d, h), nn.GELU(), nn.LayerNorm(h, elementwise_affine=False),
# nn.Linear(h, d))`. Lesson 11 cut the MLP without it.
#
# `NormedTPMLP(plain, rank, world_size)`, built from your `ColumnParallel` and `RowParallel`
# (on `plain[0]` and `plain[3]`). What must hold afterwards:
#
# - **exact values**: `NormedTPMLP(...)(x)` equals `plain(x)` on every rank; after a backward,
#   dL/dx and each rank's gradients of its blocks of both weights are `plain`'s; after two SGD
#   steps of each rank's own parameters (biases included) the output is still `plain`'s,
#   trained the same way; each rank holds only its blocks of the two weights; the output is
#   also torch's LayerNorm's (within 1e-3, what float32 allows there) when the hidden
#   activations have a large mean next to their spread (the check shifts the first layer's
#   bias by 1000);
# - **a byte bound**: besides `f`'s and `g`'s all-reduces, what the ranks exchange for the norm
#   sends, per rank and per pass, no more bytes than the cheapest exchange that keeps the
#   values exact. Bytes are counted as the bandwidth-optimal ring sends them: an all-reduce of
#   n bytes costs each rank 2(t − 1)/t · n; a reduce-scatter of n bytes, or an all-gather whose
#   result is n bytes, (t − 1)/t · n;
# - **an uneven hidden size** (h = 16 on 3 ranks): you may rely on your `block_of` — the same
#   refusal on every rank before any collective, or the exact values with its blocks.
#
# The check runs it on 2 and 3 ranks (h = 12, 5 rows of x), then with h = 16 on 3 ranks,
# records every collective of each pass with its size, and names each design it refuses by
# what its numbers or its bytes show.
#
# **Your design decision:** what the ranks exchange for the norm, and what that exchange does
# in the backward — and how few bytes it can be. Write it as `torch.autograd.Function`s of
# your own beside `f` and `g` (any of `dist.all_reduce`, `dist.all_gather`,
# `dist.reduce_scatter`; `dist.get_rank()` and `dist.get_world_size()` work inside them).

# %% [markdown]
# **Predict, before you write it.** On 2 ranks, with 5 rows of x and h = 12 in float32: how
# many bytes must one rank send, at the fewest, for the norm's exchange in one forward (counted
# as above)? The check measures your exchange once it passes and explains the number.

# %%
### BEGIN SOLUTION: your prediction (a number of bytes)
my_norm_bytes = 40         # 5 rows × 2 float32 numbers = 40 B, all-reduced: 2(2 − 1)/2 × 40
### END SOLUTION
norm_bytes_guess = predict("lab11", "fewest bytes one rank sends for the norm in a forward "
                           "(2 ranks, 5 rows, h = 12, float32)", my_norm_bytes, unit="bytes")

# %% [markdown]
# <details><summary>▶ Hint 1 — a question</summary>
#
# To compute rank r's block of the norm's output, what does rank r need from the other ranks'
# features — the features themselves, or something smaller computed from them? And in the
# backward: does rank s's block of the norm's output depend on rank r's features, and where is
# that part of the gradient computed?
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 2 — the idea</summary>
#
# The mean and the variance of a row are made of sums over its features, and a sum over all h
# features is the sum of the ranks' sums over their blocks. Every rank's block of the output
# then depends on every rank's sums, so the gradient of rank r's sums has a part on every
# rank: the parts must be added up. Which sums? Picture a row whose features are all near
# 1000 with a spread of 1, in float32 (about 7 significant digits): which sums still carry
# the spread?
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 3 — the shape of the code</summary>
#
# One Function around a small tensor of this rank's per-row sums (rows × one or two
# numbers): its forward and its backward both sum over the ranks. Used twice if a second sum
# needs the first's total (deviations from the row's mean), or once on sums taken from a value
# every rank shares. Then the norm written out from the totals on this rank's block of hidden
# features, and the result into the row layer.
#
# </details>

# %%
### BEGIN SOLUTION: the autograd Function(s) for the norm's communication
class SumOverRanks(torch.autograd.Function):
    """A per-row sum over every rank's hidden features. Every rank's block of the norm's output
    uses the totals, so the gradient of this rank's sums is the sum of every rank's gradient
    of the totals: an all-reduce in both passes."""

    @staticmethod
    def forward(ctx, sums):
        total = sums.clone()
        dist.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx, grad):
        total = grad.clone()
        dist.all_reduce(total)
        return total
### END SOLUTION


class NormedTPMLP(nn.Module):
    def __init__(self, plain, rank, world_size):
        super().__init__()
        ### BEGIN SOLUTION: the two parallel layers, the activation and the norm, from plain
        self.column = ColumnParallel(plain[0], rank, world_size)
        self.gelu, self.eps = plain[1], plain[2].eps
        self.row = RowParallel(plain[3], rank, world_size)
        self.h = plain[0].out_features
        ### END SOLUTION

    def forward(self, x):
        ### BEGIN SOLUTION: plain(x) on every rank, the norm's communication where it belongs
        a = self.gelu(self.column(x))
        # two passes: E[a²] − E[a]² would cancel when the mean is large next to the spread
        mean = SumOverRanks.apply(a.sum(-1, keepdim=True)) / self.h
        centred = a - mean
        var = SumOverRanks.apply(centred.square().sum(-1, keepdim=True)) / self.h
        return self.row(centred * torch.rsqrt(var + self.eps))
        ### END SOLUTION


# %% [markdown]
# **Predict, before you run the check.** Megatron-LM has an all-gather of the hidden blocks
# ready-made: `gather_from_tensor_model_parallel_region`, whose backward keeps this rank's
# block of the gradient and communicates nothing. A `NormedTPMLP` that gathers the hidden
# blocks with it, normalises the whole row and feeds this rank's block of the result to the
# row layer: what would differ from the plain MLP? Pick one of `lab11.NORM_CHOICES`; once
# your `NormedTPMLP` passes, the check measures that arrangement.

# %%
for choice in lab11.NORM_CHOICES:
    print(repr(choice))
### BEGIN SOLUTION: your prediction (one of the choices, as a string)
my_norm_guess = "dL/dx and the first layer's gradients"
### END SOLUTION
norm_guess = predict("lab11", "what Megatron's gather (backward: keep this rank's block) "
                     "breaks here", my_norm_guess, choices=lab11.NORM_CHOICES)

# %%
lab11.check_normed_mlp(NormedTPMLP, timeout=check_timeout, prediction=norm_guess,
                       bytes_prediction=norm_bytes_guess)

# %% [markdown]
# ## 6. Predict, then count
#
# A real model stacks many MLPs. Take two of your `TPMLP`s in an `nn.Sequential` (`model`),
# give it a batch `x = torch.randn(5, 6)` of inputs, and run one forward and one backward of
# the loss `model(x).square().mean()`. How many all-reduces does each rank make in that step,
# forward and backward together? And how many when `x` requires a gradient
# (`x.requires_grad_()`)? Write both numbers below
# **before** you run the cell after them, which counts both on 2 ranks and explains the
# counts.

# %% [markdown]
# <details><summary>▶ Hint 1 — a question</summary>
#
# When does autograd call a `Function`'s `backward` at all? Think of what it needs the result
# for.
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 2 — the idea</summary>
#
# A backward computes the gradients of a Function's inputs; when none of its inputs requires
# a gradient, autograd records no backward for it. Where does each MLP's input come from?
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 3 — the shape of the code</summary>
#
# Count per MLP and per pass: one sum in each forward, and in the backward one for each `f`
# whose input requires a gradient. Add them up.
#
# </details>

# %%
### BEGIN SOLUTION: your predictions (two numbers)
my_guess = 3         # x is data: it needs no gradient
my_guess_grad = 4    # x requires a gradient
### END SOLUTION
guess = predict("lab11", "all-reduces in one step of two stacked TPMLPs, x data", my_guess,
                unit="all-reduces")
guess_grad = predict("lab11", "all-reduces in one step of two stacked TPMLPs, x requires "
                     "grad", my_guess_grad, unit="all-reduces")

# %%
measured = lab11.count_all_reduces(TPMLP, timeout=check_timeout)
lab11.check_prediction(guess, measured, guess_grad)

# %% [markdown]
# ## Stretch (optional): one GPipe step, and its bubble
#
# A workshop can stop here. Lesson 11 §3 cut a model into stages: stage r (an index) runs on
# rank r, and `module` is its part of the model (an `nn.Module`). Write
# `gpipe_step(module, rank, world_size, m, inputs, targets, loss_fn, shape)`: one GPipe step
# (Huang et al. 2019) of this stage with `m` micro-batches, on GPipe's schedule as lesson 11 §3
# drew it. What it is given, and what must hold when it returns:
#
# - `inputs` (stage 0 only) and `targets` (the last stage only) are lists of m tensors; the
#   other stages get `None`. `shape` is one micro-batch's activation between two stages (and
#   so of its gradient). The stages talk only through `torch.distributed`'s point-to-point
#   calls, and nothing this step sent is still in flight when `gpipe_step` returns.
# - Every parameter's `.grad`, on every stage, equals the unsplit model's gradient of the
#   batch's loss: the mean over the m micro-batches of `loss_fn` (the parameters start with no
#   gradient).
# - It returns `(loss, events)`: `loss` is a Python float on the last stage, the batch's loss,
#   and `None` on the others; `events` has one `(kind, i, start, end)` per forward (`"F"`) and
#   backward (`"B"`) of micro-batch i, `start` and `end` from `time.perf_counter()` (one
#   clock for all the machine's processes), covering this stage's **computation only** (on
#   the last stage, the loss may be timed inside its forward or left out).
#
# Then `bubble(events, stages)`: `events` holds every stage's actions as `(stage, kind, i,
# start, end)`, `stages` is their number; it returns the bubble, the share of the stages' time
# during the step (from its earliest start to its latest end, over all stages) in which they
# were not computing.
#
# The check runs your step on 2 and 3 stages with M = 4, each forward lasting a few
# milliseconds longer than its computation alone (a sleep; each backward's, twice as long),
# compares the gradients with the unsplit model's on the whole batch, and names a schedule
# that is not GPipe's.

# %% [markdown]
# <details><summary>▶ Hint 1 — a question</summary>
#
# In GPipe's schedule, when does a stage start its first backward? A middle stage's backward
# of micro-batch i needs two things: which, and where does each come from? And what does
# autograd do to `.grad` when `backward` runs a second time?
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 2 — the idea</summary>
#
# Every forward first, then every backward. Activations go to rank + 1, their gradients back
# to rank − 1. Keep each micro-batch's input and output from its forward: the backward starts
# from the output (with the gradient the next stage sends, or from the loss on the last stage)
# and ends with the gradient of the input, which the previous stage needs — so a received
# input must be a leaf that asks for a gradient. `.grad` adds up across backwards, which is how
# the m micro-batches' gradients become the batch's, once each loss is scaled to the batch
# mean. A non-blocking send must be waited for before the step returns.
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 3 — the shape of the code</summary>
#
# Two loops over the micro-batches. The first: get the input (from `inputs` or a receive),
# time the module (and the loss on the last stage), pass the result on, keep the pair. The
# second: get the output's gradient (a receive, or none on the last stage), time the
# backward, pass the input's gradient back. For the bubble: the summed durations, the span,
# and the number of stages.
#
# </details>

# %%
def gpipe_step(module, rank, world_size, m, inputs, targets, loss_fn, shape):
    ### BEGIN SOLUTION: one GPipe step of this stage, returning (loss, events)
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
# The formula (K−1)/(M+K−1), with K the number of stages (`world_size`, 2 here), counts no
# time for messages; in your measurement, waiting for a message is idle time. One run is
# noisy, so read what it can show: does the measured bubble fall as M grows, as the formula's
# does?

# %%
# NBVAL_IGNORE_OUTPUT
# measured times: they change from run to run and with the machine's load
lab11.measure_bubble(gpipe_step, bubble, stages=2, micro=(1, 2, 4, 8), timeout=check_timeout)
