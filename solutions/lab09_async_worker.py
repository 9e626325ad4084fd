# %% [markdown]
# # Lab 09 · The asynchronous worker's loop
#
# Lesson 09 built a parameter server and let its workers run without waiting for each other:
# each gradient then reaches the server after other workers' updates, computed on weights
# that are no longer the server's — it is **stale**. To study staleness without racing
# threads, the lesson uses a simulator in one process: a server with
#
# - `pull()` → a copy of the weights and their **version** (the number of updates so far);
# - `push(grad, version)` → apply a gradient computed on weights of that version (the server
#   records its staleness: its own version minus that one).
#
# You write the workers' side: `async_worker_loop(server, compute_gradient, batches, tau)`.
# For each batch, a worker pulls the weights and computes its gradient; a gradient reaches
# the server **τ pulls later** — once τ newer gradients are in flight behind it. When the
# batches run out, the gradients still in flight land, oldest first. Then gradient k is
# computed on weights of version max(0, k − τ) and applied as update k:
#
# w<sub>k+1</sub> = w<sub>k</sub> − lr · g(w<sub>k−τ</sub>)
#
# and with τ = 0 the loop is plain SGD.
#
# The check runs your loop for τ = 0, 3, 1 and 12 (more than its 10 batches) with a spy
# server and a spy `compute_gradient` that see which weights and which batch each gradient
# came from, and replays the reference. It names the classic mistakes: a gradient pushed one
# update too early, the ones in flight at the end forgotten, the newest pushed instead of
# the oldest, the weights pulled only once, the server's current version pushed instead of
# the gradient's.
#
# Stretch: the staleness-aware step of Zhang et al. (2016), lr / staleness.

# %% tags=["parameters"]
steps = 300       # the demonstration's budget of gradients
demo_lr = 0.3

# %%
import collections

import torch

from dpcourse import async_sgd
from dpcourse.checks import lab09

torch.set_num_threads(1)

# %% [markdown]
# ## 1. Pull, compute, push
#
# Keep the gradients in flight in a first-in, first-out queue
# (`collections.deque`: `append` on the right, `popleft` on the left), each with the
# version of the weights it was computed on. For each batch: pull, compute the gradient,
# put it in the queue; if more than `tau` gradients are now in flight, the oldest one
# arrives: push it with its version. After the last batch, push what is still in flight,
# oldest first.

# %%
def async_worker_loop(server, compute_gradient, batches, tau):
    """Every gradient computed on the weights pulled for its batch, and pushed τ pulls later."""
    ### BEGIN SOLUTION: a FIFO queue of (gradient, version); per batch: pull, compute, append, and push the oldest once more than tau are in flight; then push the rest in order
    in_flight = collections.deque()
    for batch in batches:
        w, version = server.pull()
        in_flight.append((compute_gradient(w, batch), version))
        if len(in_flight) > tau:
            server.push(*in_flight.popleft())
    while in_flight:
        server.push(*in_flight.popleft())
    ### END SOLUTION


# %%
lab09.check_async_worker(async_worker_loop)

# %% [markdown]
# Your loop drives the lesson's MLP now: the same batches, the same budget, τ = 0 and τ = 8.

# %%
problem = async_sgd.make_problem()
batches = async_sgd.batch_schedule(len(problem.x_train), 32, steps)
for tau in (0, 8):
    run = async_sgd.run_stale(problem, tau, demo_lr, batches, loop=async_worker_loop)
    print(f"τ = {tau}: test loss {run['loss']:.3f}, accuracy {run['acc']:.1%}, "
          f"largest staleness {max(run['staleness'])}")


# %% [markdown]
# ## Stretch (optional): the staleness-aware step
#
# A workshop can stop here. Lesson 09 found that stale gradients diverge at a step size
# that fresh ones tolerate. Zhang et al. (2016, "Staleness-aware async-SGD for distributed
# deep learning") scale each step by the gradient's staleness s: lr / s, and the full lr for
# a fresh gradient (s = 0) — that is, lr / max(1, s).
#
# Write `push` for a server that does it. It is `SimulatedServer` (from the lesson: `self.w`,
# `self.lr`, `self.version`, `self.staleness`) with one method changed: compute the staleness
# s (the server's version minus the gradient's), record it in `self.staleness`, take the step
# `self.w.add_(grad, alpha=-step)` with step = lr / max(1, s), and count the update in
# `self.version`. The check runs it under the reference loop for τ = 0, 2 and 5 and compares
# with the rules people get wrong: no scaling, lr / (s + 1), lr · s.

# %%
class StalenessAware(async_sgd.SimulatedServer):
    def push(self, grad, version):
        ### BEGIN SOLUTION: s = self.version - version; record it; step lr / max(1, s); self.version += 1
        staleness = self.version - version
        self.staleness.append(staleness)
        self.w.add_(grad, alpha=-self.lr / max(1, staleness))
        self.version += 1
        ### END SOLUTION


# %%
lab09.check_staleness_aware(StalenessAware)
