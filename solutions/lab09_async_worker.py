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
# The behaviour to reach is the one above; the design is yours. Before you code, write down
# the sequence of server calls your loop must make for τ = 2 and five batches (which pulls,
# which pushes, each push with which version), and for τ = 0. Then two questions decide the
# loop: between computing a gradient and pushing it, what must the loop remember about it?
# And in which order do the remembered gradients leave? (`collections` is imported, if a
# container from it fits your answer.)

# %%
def async_worker_loop(server, compute_gradient, batches, tau):
    """Every gradient computed on the weights pulled for its batch, and pushed τ pulls later."""
    ### BEGIN SOLUTION: make the server calls of your trace: every gradient pushed once, τ pulls after its own pull, with the version of the weights it was computed on
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
# deep learning") scale each step by the gradient's staleness s: a gradient s updates stale
# takes the step lr / s; a fresh one (s = 0) takes the full lr.
#
# Write `push` for a server that does it: a `SimulatedServer` (its source is in lesson 09)
# with only the size of the step changed. Everything else its `push` does — what it records,
# what it counts — must still happen. The check runs it under the reference loop for τ = 0, 2
# and 5 and names the scaling rules people get wrong.

# %%
class StalenessAware(async_sgd.SimulatedServer):
    def push(self, grad, version):
        ### BEGIN SOLUTION: the staleness-aware step, and everything SimulatedServer.push does besides
        staleness = self.version - version
        self.staleness.append(staleness)
        self.w.add_(grad, alpha=-self.lr / max(1, staleness))
        self.version += 1
        ### END SOLUTION


# %%
lab09.check_staleness_aware(StalenessAware)
