# %% [markdown]
# # Lab 03 · Averaging gradients by hand
#
# Write the two pieces of data parallelism that DDP hides:
#
# 1. `average_gradients(model)`: after `loss.backward()` on every rank, make every `p.grad` the
#    **mean over the ranks** — `dist.all_reduce` it (SUM), then divide by the world size, both
#    **in place** on `p.grad`;
# 2. `data_parallel_step(model, optimizer, X, y)`: one training step of a rank on its shard
#    `X, y`: zero the gradients, mean cross-entropy, backward, `average_gradients`, step.
#
# The checks run your functions on 2 ranks (gloo, through `dpcourse.launch.spawn`; they ship
# your functions to the ranks, so define them right here in the notebook) and compare with one
# process on the global batch. They recognise the classic mistakes — summing without dividing,
# dividing into a new tensor instead of `p.grad`, calling `all_reduce` on one rank only (a
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
    ### BEGIN SOLUTION: zero_grad, loss on the shard, backward, average_gradients(model), step
    optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(X), y)
    loss.backward()
    average_gradients(model)
    optimizer.step()
    return loss.item()
    ### END SOLUTION


lab03.check_data_parallel_step(data_parallel_step)
