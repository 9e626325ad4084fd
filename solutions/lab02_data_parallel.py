# %% [markdown]
# # Lab 02 · DataParallel's step by hand
#
# Lesson 02 took `nn.DataParallel` apart. Now you write its step yourself, on simulated devices:
#
# 1. `scatter(X, n_devices)`: split the batch along dim 0 into `n_devices` contiguous chunks;
# 2. `gather(outputs)`: put the replicas' outputs back together into one batch;
# 3. `dp_forward_backward(model, X, y, n_devices)`: scatter, make plain copies of the model
#    (`copy.deepcopy`), run each copy on its chunk (`dp.parallel_apply` gives you the threads),
#    gather, compute the mean cross-entropy on the whole batch, backward — and then **put the
#    gradients where the optimizer will find them**: on the original model's parameters.
#
# Each part has a check cell right after it that names your mistake, if there is one.

# %%
import copy

import torch
import torch.nn.functional as F

from dpcourse import dp
from dpcourse.checks import lab02

torch.set_num_threads(1)


# %%
def scatter(X, n_devices):
    """A list of n_devices contiguous chunks of X along dim 0 (device 0 gets the first)."""
    ### BEGIN SOLUTION: split X along dim 0 into n_devices contiguous chunks (torch.chunk)
    if X.shape[0] < n_devices:
        raise ValueError(f"a batch of {X.shape[0]} cannot be split over {n_devices} devices")
    return list(torch.chunk(X, n_devices, dim=0))
    ### END SOLUTION


lab02.check_scatter(scatter)


# %%
def gather(outputs):
    """One tensor: the outputs of the devices, in device order, as one batch."""
    ### BEGIN SOLUTION: concatenate along the batch dimension
    return torch.cat(outputs, dim=0)
    ### END SOLUTION


lab02.check_gather(gather)


# %%
def dp_forward_backward(model, X, y, n_devices):
    """One DataParallel forward/backward with plain copies; returns the loss as a float.

    Afterwards every parameter p of `model` must hold in p.grad the gradient of the mean loss on
    the whole batch.
    """
    ### BEGIN SOLUTION: scatter X, deepcopy the model per device, parallel_apply, gather, loss, backward, sum the copies' grads onto model
    chunks = scatter(X, n_devices)
    replicas = [copy.deepcopy(model) for _ in range(n_devices)]
    outputs = dp.parallel_apply(replicas, chunks)
    loss = F.cross_entropy(gather(outputs), y)
    loss.backward()
    # One mean loss over the gathered batch: each copy's gradient is its chunk's share already,
    # so the full gradient is their sum (not their mean).
    for p, *copies in zip(model.parameters(), *(r.parameters() for r in replicas)):
        p.grad = sum(c.grad for c in copies)
    return loss.item()
    ### END SOLUTION


lab02.check_dp_forward_backward(dp_forward_backward)

# %% [markdown]
# ## Use it
# Your step trains a model just like the plain loop: a few SGD steps on a fixed batch bring the
# loss down. (`copy.deepcopy` copies the model every step — the "replicate every step" cost of
# lesson 02.)

# %%
from dpcourse import models

torch.manual_seed(0)
model = models.SmallCNN(width=8)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
X = torch.randn(16, 3, 32, 32)
y = torch.randint(0, 10, (16,))
losses = []
for _ in range(5):
    opt.zero_grad(set_to_none=True)
    losses.append(dp_forward_backward(model, X, y, 4))
    opt.step()
from dpcourse.checks import claim

claim("your DataParallel step trains: the loss fell", losses[-1] < losses[0], losses=losses)
