# %% [markdown]
# # Lab 09 · The asynchronous worker's loop
#
# Lesson 09 built a parameter server and let its workers run without waiting for each other:
# each gradient then reaches the server after other workers' updates, computed on weights
# that are no longer the server's — it is **stale**. To study staleness without racing
# threads, the lesson uses a simulator in one process: a server with
#
# - `pull()` → `(w, version)`: a copy of the weights and their **version** (the number of
#   updates applied so far);
# - `push(grad, version)` → applies a gradient computed on weights of that version (the server
#   records its staleness: its own version minus that one).
#
# You write the workers' side, `async_worker_loop(server, compute_gradient, batches, tau)`,
# where `compute_gradient(w, batch)` returns the gradient (a tensor shaped like `w`) of the
# loss on `batch` at the weights `w`. Its contract, for batches 0, 1, …, K − 1:
#
# - one pull per batch, and the batch's gradient computed on the weights that pull returned;
# - every gradient pushed exactly once, with the version its pull returned, and the batches
#   run out before the loop returns with nothing left unpushed;
# - gradient k is computed on the weights of version max(0, k − τ) and applied as update k:
#
#   w<sub>k+1</sub> = w<sub>k</sub> − lr · g(w<sub>k−τ</sub>),
#
#   so with τ = 0 the loop is plain SGD.
#
# First you write down, by hand, what the server sees; then the loop that makes it see that.
#
# Stretch: the staleness-aware step of Zhang et al. (2016), lr / staleness.

# %% tags=["parameters"]
steps = 300       # the demonstration's budget of gradients
demo_lr = 0.3

# %%
import collections

import torch

from dpcourse import async_sgd
from dpcourse.checks import lab09, predict

torch.set_num_threads(1)

# %% [markdown]
# ## 1. The trace: what the server sees for τ = 2
#
# One worker, τ = 2, five batches (0 … 4). Write the sequence of server calls a loop keeping
# the contract makes, as a list: `("pull", v)` for a pull that returns version v, and
# `("push", k, v)` for pushing the gradient of batch k with version v. Work it out from the
# equation: which version must gradient k's weights have, so when can its pull happen, and
# when must it land to be update k?

# %% [markdown]
# **▶ Hint 1 — a question** (click the folded cell below)

# %% [markdown] jupyter={"source_hidden": true}
# Gradient 2 must be computed on version max(0, 2 − 2) = 0. How many pushes may have happened
# before batch 2's pull, then? And gradient 0 is update 0: can it land before that pull?

# %% [markdown]
# **▶ Hint 2 — the idea**

# %% [markdown] jupyter={"source_hidden": true}
# The versions the pulls return are fixed by the equation (0, 0, 0, 1, 2 for batches 0 … 4),
# and a version only moves when a push lands. So the pushes fall between the pulls: none before
# batch 2's pull, one between each later pair, and the rest after the last pull.

# %% [markdown]
# **▶ Hint 3 — the shape of the answer**

# %% [markdown] jupyter={"source_hidden": true}
# Ten calls: five pulls and five pushes. Write the pulls with their versions first, leaving gaps,
# then place each push where the version has to move; each push carries the version of its own
# batch's pull.

# %%
### BEGIN SOLUTION: your trace for τ = 2 and five batches: a list of server calls
my_trace = [("pull", 0), ("pull", 0), ("pull", 0), ("push", 0, 0),
            ("pull", 1), ("push", 1, 0),
            ("pull", 2), ("push", 2, 0),
            ("push", 3, 1), ("push", 4, 2)]
### END SOLUTION
lab09.check_trace(my_trace)

# %% [markdown]
# ## 2. The loop
#
# Now the loop that makes those calls for any τ and any number of batches (τ may exceed the
# number of batches). The check runs it for several τ with a spy server and a spy
# `compute_gradient` that see which weights and which batch each gradient came from, once
# beside another worker that pushes too, and replays the reference.
#
# **Your design decision:** between computing a gradient and pushing it, what must your loop
# keep about it, and in what kind of container? Your trace says when each one leaves.

# %% [markdown]
# **▶ Hint 1 — a question** (click the folded cell below)

# %% [markdown] jupyter={"source_hidden": true}
# In your trace, look at the call just after each pull from batch 2 on. Which gradient leaves,
# and how long ago was it computed? After the last pull, in which order do the rest leave?

# %% [markdown]
# **▶ Hint 2 — the idea**

# %% [markdown] jupyter={"source_hidden": true}
# The gradients waiting to land form a line: each new one joins at the back, and the one that
# lands is always the one that has waited longest, as soon as more than τ are waiting. A push
# needs two things a gradient was born with.

# %% [markdown]
# **▶ Hint 3 — the shape of the code**

# %% [markdown] jupyter={"source_hidden": true}
# A container of (gradient, version) pairs that is cheap to take from the front; one loop over
# the batches (pull, compute, add to the back, maybe push from the front); one loop afterwards
# that empties it from the front.

# %%
def async_worker_loop(server, compute_gradient, batches, tau):
    """Drive ``server`` for ``batches`` so that gradient k, computed on version max(0, k - tau),
    is applied as update k; return nothing."""
    ### BEGIN SOLUTION: the worker's loop that makes the server calls of your trace, for any τ
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
# ## 3. Predict, then measure
#
# Your loop drives the lesson's MLP next: the same batches, the same budget of 300 updates,
# the same step size 0.3 (chosen for fresh gradients), with τ = 0 and then τ = 8. Before it
# runs: will τ = 8 end with a test loss **lower**, **about the same** (within 5 %) or
# **higher** than τ = 0?

# %% [markdown]
# **▶ Hint 1 — a question** (click the folded cell below)

# %% [markdown] jupyter={"source_hidden": true}
# A gradient 8 updates old points downhill from where the weights were 8 updates ago. How far
# can 8 steps of size 0.3 move the weights, and what does lesson 09 §2 say about the step size
# a stale gradient can bear?

# %%
### BEGIN SOLUTION: your prediction: "lower", "about the same" or "higher"
my_prediction = "higher"
### END SOLUTION
guess = predict("lab09", "test loss with τ = 8 against τ = 0", my_prediction,
                choices=lab09.OUTCOMES)

# %%
problem = async_sgd.make_problem()
batches = async_sgd.batch_schedule(len(problem.x_train), 32, steps)
runs = {}
for tau in (0, 8):
    runs[tau] = async_sgd.run_stale(problem, tau, demo_lr, batches, loop=async_worker_loop)
    print(f"τ = {tau}: test loss {runs[tau]['loss']:.3f}, accuracy {runs[tau]['acc']:.1%}, "
          f"largest staleness {max(runs[tau]['staleness'])}")
lab09.check_prediction(guess, runs[0]["loss"], runs[8]["loss"], tau=8)


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

# %% [markdown]
# **▶ Hint 1 — a question** (click the folded cell below)

# %% [markdown] jupyter={"source_hidden": true}
# Read `SimulatedServer.push` in lesson 09: which of its lines decide the size of the step, and
# which keep the server's books? What is the staleness of a fresh gradient, and what happens if
# you divide by it?

# %% [markdown]
# **▶ Hint 2 — the idea**

# %% [markdown] jupyter={"source_hidden": true}
# Keep every line of the parent's push; change only the factor in front of the gradient, so
# that a staleness of 0 or 1 gives the full lr and a staleness of s > 1 gives lr / s.

# %% [markdown]
# **▶ Hint 3 — the shape of the code**

# %% [markdown] jupyter={"source_hidden": true}
# Four statements, in the parent's order: the staleness computed from the two versions, recorded,
# the in-place step with the scaled lr, the version moved on.

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
