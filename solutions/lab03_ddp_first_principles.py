# %% [markdown]
# # Lab 03 · Averaging gradients by hand
#
# **Goal.** Every rank ends each step with the same weights as one process that took the step on
# the whole global batch — without DDP, with the collectives of lesson 03 only. You write:
#
# 1. `average_gradients(model)`: the gradients of all ranks combined into their mean, also
#    when the ranks did not use the same parameters (which the lesson does not show);
# 2. how many collective calls that makes in one step — **predicted first**, then measured;
# 3. `data_parallel_step(model, optimizer, X, y)`: one training step of a rank on its shard,
#    for any optimizer, returning the loss of the whole global batch;
# 4. `average_gradients_weighted(model, n_local)`: the same goal when the shards have
#    **different sizes**, which the lesson does not show — a design decision of yours;
# 5. (stretch) `average_gradients_flat(model)`: the mean with one collective for the whole model.
#
# Each part states the contract its check holds you to: the signature, what the function
# returns, and what must be true afterwards. How you get there is yours. The checks run your
# functions on 2 and then 3 ranks (gloo, through `dpcourse.launch.spawn`; they ship your
# functions to the ranks, so define them right here in the notebook) and compare with one
# process on the global batch; when something is wrong, the check's sentence names the cause.
# Stuck? Each part has up to three folded hints: a question, then the idea, then the shape of
# the code. If a check reports that a crowded server may simply be slow, give it more time where
# it says, e.g. `lab03.check_average_gradients(average_gradients, timeout=120)`.

# %%
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dpcourse.checks import lab03, predict

torch.set_num_threads(1)

# %% [markdown]
# ## 1. Average the gradients
#
# `average_gradients(model)` is called **on every rank**, right after that rank's
# `loss.backward()` on its own data, with the process group already started. The ranks need
# not have used the same parameters: the check's model, `lab03.part1_model()`, sends a rank's
# batch through some of its parameters and not others, depending on the rank (as a
# mixture-of-experts layer sends each token to one expert) — which ones is for you to find out,
# from `help(lab03.part1_model)` or from the check. Contract:
#
# - afterwards, on every rank, every parameter that **requires a gradient** and got one on at
#   least one rank holds in `p.grad` the gradient of the **mean of the ranks' losses** (each
#   rank's loss being the mean over its own equal shard) — the same values on every rank, in
#   the parameter's shape;
# - a parameter that requires a gradient but got none on **any** rank keeps `p.grad` `None` on
#   every rank — as one process on the global batch leaves it, and as DDP does when told to
#   expect unused parameters (`find_unused_parameters=True`; with its defaults DDP fails at
#   the next step instead: lesson 10, bug 9); a
#   parameter that requires no gradient (`requires_grad=False`, frozen) keeps `None` too;
# - any tensor you hand to a collective lives on the gradients' device (the check runs on the
#   CPU with gloo, which accepts CPU tensors; NCCL on GPUs accepts only CUDA tensors);
# - it works for any number of ranks, and returns `None`.
#
# **Your design decision:** lesson 03's ranks all used every parameter; these do not. What
# your function does about a parameter without a gradient on this rank is yours to decide —
# and to defend against the contract.

# %% [markdown]
# <details><summary>▶ Hint 1 — a question</summary>
#
# Which collective of lesson 03 leaves the same combination of every rank's tensor on every
# rank? How does it know which rank's tensor goes with which — by a name, or by the order of
# the calls? And can rank 0 tell, from what it holds, whether rank 1 used `never`?
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 2 — the idea</summary>
#
# A sum-reduction pairs the ranks' calls by their order only. If rank 0 skips `head_b` and
# rank 1 skips `head_a`, rank 0's call on `head_a` meets rank 1's call on `head_b`. On a rank
# that did not use a parameter, its gradient counts as zero (`p.grad` is None there), and that
# zero still counts in the mean over the ranks, whose size the process group knows. Whether a parameter got a gradient on
# *some* rank is knowledge spread over the ranks, like the gradients themselves: a reduction
# can gather it too, before any gradient is sent.
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 3 — the shape of the code</summary>
#
# One small tensor on the gradients' device, one entry per parameter that requires a gradient
# (the same list on every rank): does this rank hold a gradient for it? One collective on it.
# Then loop over those parameters: where no rank had one, leave it; where this rank has none,
# zeros of the parameter's shape; then one collective on `p.grad`, in place, and one division
# of `p.grad` by the number of ranks, all of them, those without a gradient included.
#
# </details>

# %%
def average_gradients(model):
    """Make every p.grad the mean of that gradient over all ranks; returns None."""
    ### BEGIN SOLUTION: every p.grad the mean of that gradient over all the ranks
    world_size = dist.get_world_size()
    params = [p for p in model.parameters() if p.requires_grad]
    got = torch.tensor([float(p.grad is not None) for p in params], device=params[0].device)
    dist.all_reduce(got)   # how many ranks hold a gradient for each parameter
    for p, ranks_with_grad in zip(params, got.tolist()):
        if ranks_with_grad == 0:
            continue   # no rank used it: None, as one process on the global batch leaves it
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        p.grad /= world_size
    ### END SOLUTION


# on a crowded server: lab03.check_average_gradients(average_gradients, timeout=120)
lab03.check_average_gradients(average_gradients)

# %% [markdown]
# ## 2. Predict, then measure: collective calls in one step
#
# Every collective call pays a fixed start-up cost, called α (what a call costs even when it
# carries almost nothing: launching it, and each message's latency; lesson 06 measures it), on
# top of its bytes, so the **number** of calls a step makes matters as much as what they carry.
# The measurement runs your `average_gradients` once, on 2 ranks, on part 1's model — its
# parameters are listed below — right after each rank's backward: rank 0's batch went through
# `head_a`, rank 1's through `head_b`, no rank's through `never`. **Before you run the
# measurement**, predict: how many collective calls (`all_reduce` or any other) does that
# **one** call of *your* `average_gradients` make **on rank 0**? Write a whole number.

# %%
for name, p in lab03.part1_model().named_parameters():
    print(f"{name:22s} shape {str(tuple(p.shape)):15s} requires_grad={p.requires_grad}")

# %% [markdown]
# <details><summary>▶ Hint 1 — a question</summary>
#
# What does your function hand to each collective call: a layer, a parameter tensor, or a single
# number? Which of the parameters listed get a call on rank 0 — the head rank 0's batch never
# went through, `never`, `frozen`? Does anything else cross between the ranks? And how many
# calls does rank 1 make?
#
# </details>

# %%
### BEGIN SOLUTION: my_guess = your prediction (a whole number)
my_guess = 13
### END SOLUTION
guess = predict("lab03", "collective calls in one average_gradients", my_guess, unit="calls")

# %%
measured = lab03.count_all_reduces(average_gradients)   # once on 2 ranks; every collective
lab03.check_prediction(guess, measured)

# %% [markdown]
# ## 3. A data-parallel step without DDP
#
# `data_parallel_step(model, optimizer, X, y)` is one training step of **one rank**: every rank
# calls it at the same time with the same model and optimizer settings and its own equal shard
# `X, y` of the global batch. Contract:
#
# - the loss that is differentiated is the mean cross-entropy of the model's outputs on the
#   rank's own shard;
# - it returns **the mean loss over the whole global batch, before the update, as a Python
#   `float`** — the same number on every rank, the one a training log would print;
# - afterwards every rank's weights equal those of one process that took the same step with
#   the same optimizer on the whole global batch — step after step, for as many steps as it is
#   called, **whatever `torch.optim` optimizer it is given** (the check tries more than one).
#
# **Your design decision:** the lesson's worker never needed the global batch's loss. Decide
# what crosses between the ranks for it, so that the number every rank returns is the global
# one and the gradients stay exactly what part 1 averages.

# %% [markdown]
# <details><summary>▶ Hint 1 — a question</summary>
#
# In an ordinary single-process step, between which two lines does the gradient become final?
# What must the ranks agree on at that point — the loss, the weights, or something else? And
# the loss to return: which rank knows it?
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 2 — the idea</summary>
#
# Each rank's backward gives the gradient of its own shard's mean loss. The mean of those
# gradients over equal shards is the gradient of the global batch's mean loss; once every rank
# holds it, every rank hands the same gradient to the same optimizer state and applies the same
# update, whatever that optimizer computes from it. The global loss is the mean of the shards'
# losses too, but it is a number to report: a copy outside the autograd graph can cross the
# ranks without touching what the backward computes.
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 3 — the shape of the code</summary>
#
# The four lines of lesson 01's step (clear the gradients, loss, backward, optimizer step), with
# one call to part 1's function where the gradients must agree; then a detached copy of the
# loss, one collective on it, a division by the number of ranks, and a Python number out.
#
# </details>

# %%
def data_parallel_step(model, optimizer, X, y):
    """One step on this rank's shard (X, y); returns the global batch's loss as a float."""
    ### BEGIN SOLUTION: one data-parallel training step on this rank's shard
    optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(X), y)
    loss.backward()
    average_gradients(model)
    optimizer.step()
    global_loss = loss.detach().clone()
    dist.all_reduce(global_loss)
    return global_loss.item() / dist.get_world_size()
    ### END SOLUTION


lab03.check_data_parallel_step(data_parallel_step)

# %% [markdown]
# ## 4. Unequal shards
#
# Shards are not always equal: the last batch of an epoch without `drop_last`, or data split by
# file. Here rank *r* holds `n_local` samples (3, 5 and 8 on ranks 0, 1, 2) and has run
# `backward()` on the **mean** loss over its own `n_local` samples. Write
# `average_gradients_weighted(model, n_local)`. Contract:
#
# - `n_local` is this rank's number of samples; no rank is told the other ranks' counts;
# - the check runs it on `SmallCNN(width=4)`, and then on part 1's model, whose ranks did not
#   all use the same parameters;
# - afterwards, on every rank, every parameter that requires a gradient and got one on at
#   least one rank holds in `p.grad` the gradient of the **mean loss over every sample of every
#   rank, each sample counted once** — what one process would compute on the concatenated
#   batch; the rest is as in part 1 (a frozen parameter keeps `None`, and so does one that no
#   rank used);
# - it works for any number of ranks and any positive counts, and returns `None`;
# - any tensor you hand to a collective lives on the gradients' device (the check runs on the
#   CPU with gloo, which accepts CPU tensors; NCCL on GPUs accepts only CUDA tensors).
#
# **Your design decision:** the lesson only averaged equal shards. Decide what each rank must
# contribute to the collectives so that every rank can form that global mean — for a
# parameter its samples went through, for one they did not, and for one no rank's did.

# %% [markdown]
# <details><summary>▶ Hint 1 — a question</summary>
#
# With 3 samples on rank 0 and 5 on rank 1, how much does one of rank 0's samples weigh in the
# global mean loss, and how much does it weigh in rank 0's own mean? What would rank 0 need to
# know to turn one into the other? And for a head rank 0's samples never went through: do
# those 3 samples belong to the mean the contract names?
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 2 — the idea</summary>
#
# A rank's gradient is a mean over its own samples; scaled by its count it becomes a sum over
# them, and sums over disjoint samples add up across ranks. The global mean is that total sum
# over the total number of samples — a number that no single rank has until the ranks share
# their counts.
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 3 — the shape of the code</summary>
#
# First, every rank learns the total count (a collective on a one-element tensor, or one more
# entry in part 1's exchange). Then for each parameter that requires a gradient, with part 1's
# decisions for a missing one: scale this rank's gradient by its own count, sum it across the
# ranks, and divide by the total — with the result left in the gradient.
#
# </details>

# %%
def average_gradients_weighted(model, n_local):
    """Make every p.grad the gradient of the mean loss over all ranks' samples; returns None."""
    ### BEGIN SOLUTION: every p.grad the gradient of the mean loss over all ranks' samples
    params = [p for p in model.parameters() if p.requires_grad]
    shared = torch.tensor([float(n_local)] + [float(p.grad is not None) for p in params],
                          device=params[0].device)
    dist.all_reduce(shared)   # [total count, then how many ranks hold each gradient]
    total = shared[0]
    for p, ranks_with_grad in zip(params, shared[1:].tolist()):
        if ranks_with_grad == 0:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        p.grad *= n_local
        dist.all_reduce(p.grad)
        p.grad /= total
    ### END SOLUTION


lab03.check_average_gradients_weighted(average_gradients_weighted)

# %% [markdown]
# ## Stretch (optional): one collective for the whole model
#
# A workshop can stop here. Part 2 measured how many calls `average_gradients` makes; for a real
# network that number is in the hundreds, and each call pays the start-up cost α again. DDP
# pays it once per *bucket*: a group of gradients, about 25 MiB by default, all-reduced in one
# call (lesson 03 shows them after this lab; lesson 07 times them); the extreme is a single
# bucket. Write `average_gradients_flat(model)`. Contract:
#
# - afterwards every `p.grad` holds what part 1's contract asks for, in its parameter's shape —
#   and the check runs part 1's model too, whose even and odd ranks used different heads;
# - it makes **exactly one** collective call per call — one `dist.all_reduce`, and no other
#   collective — whatever the number of parameters (the check counts your calls on 2 and 3
#   ranks); returns `None`.
#
# **Before you write it, predict:** on part 1's model, the gradients of the parameters that
# some rank used (SmallCNN's, `head_a`'s and `head_b`'s) weigh a number of bytes in float32.
# Will the one call of your `average_gradients_flat` hand over `"fewer"` bytes than they weigh,
# `"the same"`, or `"more"`?

# %%
### BEGIN SOLUTION: my_bytes_guess = your prediction: "fewer", "the same" or "more"
my_bytes_guess = "more"
### END SOLUTION
bytes_guess = predict("lab03", "bytes of the flat version's call, against the used gradients'",
                      my_bytes_guess, choices=lab03.BYTES_CHOICES)

# %% [markdown]
# <details><summary>▶ Hint 1 — a question</summary>
#
# A collective takes one tensor. How can one tensor carry every gradient of the model, and how
# will each parameter find its own part again afterwards? And on part 1's model, where rank 0
# has no `head_b.grad` and rank 1 no `head_a.grad`: which gradient sits at a given offset of
# rank 0's buffer, and which at the same offset of rank 1's? With one call only, when does a
# rank learn that no rank used `never`?
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 2 — the idea</summary>
#
# Lay every gradient end to end in one 1-D buffer; the reduction is element-wise, so reducing
# the buffer reduces every gradient at once — element k of every rank's buffer is summed with
# element k of the others', so every rank must lay out the same parameters in the same order.
# Whatever else the ranks must add up — part 1's exchange — can ride in the same buffer, since
# the sum does not care what an element means. Joining tensors makes a copy, so the averaged
# values must travel back into the gradients, each slice in its parameter's shape.
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 3 — the shape of the code</summary>
#
# For every parameter that requires a gradient, its flattened gradient (zeros where this rank
# has none), and after them one entry per parameter saying whether this rank had it; one
# collective and one division on the buffer; then walk the parameters with a running offset:
# where some rank had the gradient, copy the slice back into it (as a new p.grad where this
# rank had none); where none did, leave p.grad None.
#
# </details>

# %%
def average_gradients_flat(model):
    """Like average_gradients, with a single all_reduce for the whole model; returns None."""
    ### BEGIN SOLUTION: the mean of every gradient, with one collective call for the whole model
    params = [p for p in model.parameters() if p.requires_grad]
    dev = params[0].device
    pieces = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
    had = torch.tensor([float(p.grad is not None) for p in params], device=dev)
    flat = torch.cat(pieces + [had])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    used = flat[-len(params):].tolist()   # > 0 where some rank had the gradient
    offset = 0
    for p, share in zip(params, used):
        mean = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
        if share == 0:
            continue
        if p.grad is None:
            p.grad = mean.clone()
        else:
            p.grad.copy_(mean)
    ### END SOLUTION


# %%
lab03.check_average_gradients_flat(average_gradients_flat)

# %%
flat_measured = lab03.count_all_reduces(average_gradients_flat)   # once on 2 ranks, as part 2
lab03.check_bytes_prediction(bytes_guess, flat_measured, measured)
