# %% [markdown]
# # Lab 03 · Averaging gradients by hand
#
# Write three pieces of data parallelism that DDP hides:
#
# 1. `average_gradients(model)`: after `loss.backward()` on every rank, make every `p.grad` the
#    **mean over the ranks** — `dist.all_reduce` it (SUM), then divide by the world size, both
#    **in place** on `p.grad`;
# 2. `data_parallel_step(model, optimizer, X, y)`: one training step of a rank on its shard
#    `X, y`: zero the gradients, mean cross-entropy, backward, `average_gradients`, step;
# 3. `average_gradients_weighted(model, n_local)`: the same averaging when the ranks' shards
#    have **different sizes** — something the lesson does not show; see its cell below.
#
# The checks run your functions on 2 and then 3 ranks (gloo, through `dpcourse.launch.spawn`;
# they ship your functions to the ranks, so define them right here in the notebook) and compare
# with one process on the global batch. They recognise the classic mistakes — summing without
# dividing, dividing by a fixed 2 instead of the world size, dividing into a new tensor instead
# of `p.grad`, calling `all_reduce` on one rank only (a
# deadlock: the check stops it after 20 s), averaging the loss instead of the gradients — and
# tell you which one you made.

# %%
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dpcourse.checks import lab03

torch.set_num_threads(1)


# %%
def average_gradients(model):
    """Make every p.grad the mean of that gradient over all ranks (in place)."""
    ### BEGIN SOLUTION: all_reduce each p.grad with SUM, then divide it in place by the world size
    world_size = dist.get_world_size()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad /= world_size
    ### END SOLUTION


lab03.check_average_gradients(average_gradients)


# %%
def data_parallel_step(model, optimizer, X, y):
    """One step on this rank's shard (X, y); returns the rank's loss as a float."""
    ### BEGIN SOLUTION: zero_grad, loss on the shard, backward, average_gradients(model), step, return loss.item()
    optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(X), y)
    loss.backward()
    average_gradients(model)
    optimizer.step()
    return loss.item()
    ### END SOLUTION


lab03.check_data_parallel_step(data_parallel_step)

# %% [markdown]
# ## Unequal shards
#
# Shards are not always equal: the last batch of an epoch without `drop_last`, or data split by
# file. Here rank *r* holds `n_local` samples (3, 5 and 8 on ranks 0, 1, 2) and has run
# `backward()` on the **mean** loss over its own `n_local` samples. Make every `p.grad`, on
# every rank, the gradient of the mean loss over **all** the ranks' samples together — the step
# one process would take on the concatenated batch. Why is `average_gradients` wrong here, and
# what does no rank know yet? The check tells apart the plain mean, a missing or wrong divisor,
# and a divisor only one rank knows.

# %%
def average_gradients_weighted(model, n_local):
    """Make every p.grad the gradient of the mean loss over all ranks' samples (in place)."""
    ### BEGIN SOLUTION: a rank's gradient is a mean over n_local samples; the global mean counts every sample once, and the total count must be all-reduced too
    total = torch.tensor([float(n_local)], device=next(model.parameters()).device)
    dist.all_reduce(total)
    for p in model.parameters():
        if p.grad is not None:
            p.grad *= n_local
            dist.all_reduce(p.grad)
            p.grad /= total
    ### END SOLUTION


lab03.check_average_gradients_weighted(average_gradients_weighted)

# %% [markdown]
# ## Stretch (optional): one all_reduce for the whole model
#
# A workshop can stop here. Your `average_gradients` makes one collective call per parameter
# tensor — 10 for this small CNN, hundreds for a real network — and every call pays the fixed
# start-up cost α of lesson 06's cost model. Fewer, bigger messages pay it once. DDP's answer is
# *buckets* of about 25 MiB (lesson 03; lesson 07 times them); the extreme is a single bucket.
#
# Write `average_gradients_flat(model)`: concatenate every gradient, flattened, into one 1-D
# tensor; `all_reduce` it **once**; divide; and copy each slice back into its `p.grad` in the
# parameter's shape. The check counts your `dist.all_reduce` calls on 2 and 3 ranks.

# %%
def average_gradients_flat(model):
    """Like average_gradients, with a single all_reduce on one flat buffer."""
    ### BEGIN SOLUTION: torch.cat the flattened grads, one all_reduce, divide, copy each slice back into p.grad
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
    ### END SOLUTION


# %%
lab03.check_average_gradients_flat(average_gradients_flat)
