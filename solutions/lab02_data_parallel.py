# %% [markdown]
# # Lab 02 · DataParallel's step by hand
#
# Lesson 02 took `nn.DataParallel` apart. Now you write its step yourself, on simulated devices:
#
# 1. `scatter(X, n_devices)`: split the batch along dim 0 into contiguous chunks, one per device,
#    as the real `nn.DataParallel` does — which means: no device gets more than `ceil(B/N)`
#    samples, none gets an empty chunk, and when the batch runs out before the devices do (6
#    samples on 4 devices, 2 on 3) it returns fewer chunks and the step uses fewer devices,
#    rather than raising;
# 2. `gather(outputs)`: put the replicas' outputs back together into one batch;
# 3. `dp_forward_backward(model, X, y, n_devices)`: scatter, make plain copies of the model
#    (`copy.deepcopy`), run each copy on its chunk (`dp.parallel_apply` gives you the threads),
#    gather, compute the mean cross-entropy on the whole batch, backward — and then **put the
#    gradients where the optimizer will find them**: on the original model's parameters. The
#    copies are plain copies, so nothing links their gradients to the original; think about how
#    each copy's gradient relates to the gradient of the whole batch's mean loss.
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
    """A list of at most n_devices contiguous, non-empty chunks of X along dim 0, in order."""
    ### BEGIN SOLUTION: split X along dim 0 into contiguous chunks, at most n_devices, none empty
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
    ### BEGIN SOLUTION: scatter X, one deepcopy of the model per chunk, parallel_apply, gather, loss, backward, then the gradients onto model
    chunks = scatter(X, n_devices)
    replicas = [copy.deepcopy(model) for _ in chunks]  # fewer chunks than devices: fewer copies
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

# %% [markdown]
# ## Stretch (optional): the copies in real threads
#
# A workshop can stop here. `dp.parallel_apply` ran your copies for you; now write it.
# `threaded_apply(replicas, inputs)` must run `replicas[i](inputs[i])` in one thread per
# replica, **all at the same time**, and return the outputs in replica order. Three details
# make it right, and the check tries each:
#
# * threads finish in any order — store each output at its replica's index;
# * grad mode is *per thread* in torch: a new thread starts with autograd on even if the caller
#   is inside `torch.no_grad()`, so read `torch.is_grad_enabled()` in the caller and set it in
#   each thread with `torch.set_grad_enabled(...)`;
# * an exception in a thread does not reach the caller by itself: keep it and raise it after
#   `join`.
#
# The check uses stand-in replicas that sleep (as a torch kernel does, they release the GIL),
# the slowest first, so it can tell the order the threads finished in from replica order.

# %%
import threading


def threaded_apply(replicas, inputs):
    ### BEGIN SOLUTION: one thread per replica, started together, joined; results in replica order; caller's grad mode; re-raise errors
    grad_enabled = torch.is_grad_enabled()
    results = [None] * len(replicas)
    errors = [None] * len(replicas)

    def work(i):
        try:
            with torch.set_grad_enabled(grad_enabled):
                results[i] = replicas[i](inputs[i])
        except Exception as exc:
            errors[i] = exc

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(replicas))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for exc in errors:
        if exc is not None:
            raise exc
    return results
    ### END SOLUTION


# %%
try:
    lab02.check_threaded_apply(threaded_apply)
except NotImplementedError:
    print("Stretch skipped: threaded_apply is not written yet (the cell below will say so too).")

# %% [markdown]
# How much do real threads buy for the lesson's CNN? Only the time spent inside torch kernels
# can overlap (they release the GIL); the Python between them takes turns. The cell below times
# four copies run one after another against your threads, with one torch thread per operation
# so that the threads, not torch's own pool, share the cores.

# %%
# NBVAL_IGNORE_OUTPUT
# Why: timings depend on the machine and its load.
import os
import time

torch.manual_seed(0)
net = models.SmallCNN(width=16)
copies = [copy.deepcopy(net) for _ in range(4)]
chunks = list(torch.chunk(torch.randn(256, 3, 32, 32), 4))


def best_of(fn, repeats=5):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


try:
    with torch.no_grad():
        one_by_one = best_of(lambda: [c(x) for c, x in zip(copies, chunks)])
        threaded = best_of(lambda: threaded_apply(copies, chunks))
    print(f"4 copies one after another: {one_by_one * 1e3:.1f} ms; in threads: "
          f"{threaded * 1e3:.1f} ms ({one_by_one / threaded:.2f}x, on {os.cpu_count()} cores)")
except NotImplementedError:
    print("Stretch skipped: write threaded_apply above to time it.")
