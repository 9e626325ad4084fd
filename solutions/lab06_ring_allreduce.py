# %% [markdown]
# # Lab 06 — Build the ring: simulated, then real
#
# Lesson 06 showed a ring all-reduce step by step and a real one over `torch.distributed`. Now
# you write both:
#
# 1. `scatter_reduce(buffers)` and `all_gather(buffers)` — the two phases, in NumPy, on a list
#    of N arrays (one per simulated worker);
# 2. `ring_allreduce(tensor, op)` — the same on real processes with `dist.isend` / `dist.irecv`.
#
# After each, run the check cell: it prints one ✔ line, or one sentence naming the mistake.
# Chunks follow `ring.chunk_bounds(length, N)` (NumPy's `array_split` rule, the same as
# `torch.tensor_split`): lengths need not be divisible by N.

# %% tags=["parameters"]
check_timeout = 20  # seconds before a hanging ring is stopped

# %%
import numpy as np

from dpcourse import ring
from dpcourse.checks import lab06

# %% [markdown]
# ## 1. Scatter-reduce
#
# At step s (s = 0 .. N−2), worker i sends chunk (i − s) mod N to worker (i + 1) mod N, which
# **adds** it into its own copy of that chunk. All workers send at once, so take what is sent
# before anyone adds (here a worker never receives the chunk it sends in the same step, but
# copying first keeps the simulation honest). Afterwards worker i holds the full sum of chunk
# (i + 1) mod N.

# %%
def scatter_reduce(buffers):
    """Scatter-reduce in place over ``buffers``, a list of N equally long 1-D arrays."""
    n = len(buffers)
    bounds = ring.chunk_bounds(len(buffers[0]), n)
    for s in range(n - 1):
        ### BEGIN SOLUTION: send chunk (i - s) mod N from worker i to worker i+1, which adds it
        outgoing = [buffers[i][slice(*bounds[(i - s) % n])].copy() for i in range(n)]
        for i in range(n):
            c = (i - s) % n
            buffers[(i + 1) % n][slice(*bounds[c])] += outgoing[i]
        ### END SOLUTION

# %%
_ = lab06.check_scatter_reduce(scatter_reduce)

# %% [markdown]
# ## 2. All-gather
#
# At step s, worker i sends chunk (i + 1 − s) mod N — the one it finished most recently — to
# worker i + 1, which **overwrites** its copy. After N − 1 steps every worker has every sum.

# %%
def all_gather(buffers):
    """All-gather in place, after scatter_reduce."""
    n = len(buffers)
    bounds = ring.chunk_bounds(len(buffers[0]), n)
    for s in range(n - 1):
        ### BEGIN SOLUTION: send chunk (i + 1 - s) mod N from worker i to worker i+1, which copies it
        outgoing = [buffers[i][slice(*bounds[(i + 1 - s) % n])].copy() for i in range(n)]
        for i in range(n):
            c = (i + 1 - s) % n
            buffers[(i + 1) % n][slice(*bounds[c])] = outgoing[i]
        ### END SOLUTION

# %%
_ = lab06.check_all_gather(all_gather)

# %% [markdown]
# Together they are a ring all-reduce. Five workers, seven numbers each (7 is not divisible by 5):

# %%
buffers = [np.arange(7.0) * (w + 1) for w in range(5)]
expected = np.sum(buffers, axis=0)
scatter_reduce(buffers)
all_gather(buffers)
from dpcourse.checks import claim

claim("every worker holds the sum", all(np.array_equal(b, expected) for b in buffers))

# %% [markdown]
# ## 3. The real ring
#
# Same two phases, with real messages. Rank r sends to `right = (r + 1) % N` and receives from
# `left = (r - 1) % N`. In each step, **post the send and the receive together** with
# `dist.isend` / `dist.irecv` and only then `wait()` on both: if every rank first called a
# blocking `dist.send`, all would wait for a receive that nobody has posted.
#
# * scatter-reduce step s: send chunk (r − s) mod N, receive into a temporary buffer, then add
#   it to chunk (r − s − 1) mod N;
# * all-gather step s: send chunk (r + 1 − s) mod N, receive straight into chunk (r − s) mod N;
# * with `op="average"`, divide by N at the end.
#
# Work in place: `tensor.view(-1)` is a flat view of a contiguous tensor, and `tensor_split`
# gives views into it, so writing into a chunk writes into `tensor`.
#
# The check runs your ring on 3 ranks and then on 2, and watches what it sends: no built-in
# collective (`dist.all_reduce` would be cheating), and per rank 2(N − 1) messages of one chunk
# each.

# %%
def ring_allreduce(tensor, op="sum"):
    import torch
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    right, left = (rank + 1) % n, (rank - 1) % n
    flat = tensor.view(-1)
    chunks = flat.tensor_split(n)

    def exchange(send_chunk, recv_into):
        works = [dist.isend(send_chunk, right), dist.irecv(recv_into, left)]
        for w in works:
            w.wait()

    ### BEGIN SOLUTION: scatter-reduce (N-1 steps) then all-gather (N-1 steps) with exchange()
    for s in range(n - 1):
        recv_chunk = chunks[(rank - s - 1) % n]
        incoming = torch.empty_like(recv_chunk)
        exchange(chunks[(rank - s) % n], incoming)
        recv_chunk += incoming
    for s in range(n - 1):
        exchange(chunks[(rank + 1 - s) % n], chunks[(rank - s) % n])
    ### END SOLUTION
    if op == "average":
        ### BEGIN SOLUTION: divide by the number of ranks, in place
        flat /= n
        ### END SOLUTION
    return tensor

# %%
lab06.check_ring_allreduce(ring_allreduce, timeout=check_timeout)

# %% [markdown]
# ## 4. Why isend/irecv: the deadlock, made safe
#
# Here is the tempting version: each rank *sends* with the blocking `dist.send`, then receives.
# With gloo it hangs at every size (we measured from 1 element to 16 Mi elements): `dist.send`
# does not return until the neighbour has posted the matching receive, and every neighbour is
# itself stuck in its own send. The check runs it in separate processes, stops them after the
# timeout and tells you what happened — the notebook does not hang.

# %%
def blocking_ring(tensor, op="sum"):
    import torch
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    chunks = tensor.view(-1).tensor_split(n)
    for s in range(n - 1):
        incoming = torch.empty_like(chunks[(rank - s - 1) % n])
        dist.send(chunks[(rank - s) % n], (rank + 1) % n)  # everyone blocks here ...
        dist.recv(incoming, (rank - 1) % n)  # ... and nobody gets here
        chunks[(rank - s - 1) % n] += incoming
    return tensor


try:
    lab06.check_ring_allreduce(blocking_ring, world_size=3, timeout=10)
except lab06.LabCheckError as err:
    print(err)

# %% [markdown]
# ## Stretch (optional): the scatter-reduce in segments
#
# A workshop can stop here. In your ring, a rank receives a whole chunk, *then* adds it, *then*
# sends it on: the network waits for the addition and the addition waits for the network. Cut
# each chunk into `segments` pieces and pipeline them: post the transfer of piece j + 1 before
# adding piece j, so that the next piece travels while this one is added. NCCL does the same
# with its own "slices" (the idea behind the bandwidth term of lesson 06's cost model).
#
# Write `ring_allreduce_segmented(tensor, op="sum", segments=4)`: the segmented scatter-reduce,
# then the all-gather (whole chunks are fine there: nothing is added) and the average. The
# check runs it on 3 and 2 ranks with 4 and 3 segments and counts the messages: at least
# (N − 1) × segments pieces of about K / (N × segments) elements.

# %%
def ring_allreduce_segmented(tensor, op="sum", segments=4):
    import torch
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    right, left = (rank + 1) % n, (rank - 1) % n
    flat = tensor.view(-1)
    chunks = flat.tensor_split(n)
    ### BEGIN SOLUTION: per step: split the send and receive chunks into segments; post piece j+1 before adding piece j; then the all-gather and the average
    for s in range(n - 1):
        outgoing = chunks[(rank - s) % n].tensor_split(segments)
        target = chunks[(rank - s - 1) % n].tensor_split(segments)
        incoming = [torch.empty_like(t) for t in target]

        def post(j):
            return [dist.isend(outgoing[j], right), dist.irecv(incoming[j], left)]

        pending = post(0)
        for j in range(segments):
            following = post(j + 1) if j + 1 < segments else []
            for w in pending:
                w.wait()
            target[j].add_(incoming[j])  # piece j + 1 is on its way meanwhile
            pending = following
    for s in range(n - 1):
        works = [dist.isend(chunks[(rank + 1 - s) % n], right),
                 dist.irecv(chunks[(rank - s) % n], left)]
        for w in works:
            w.wait()
    if op == "average":
        flat /= n
    ### END SOLUTION
    return tensor


# %%
lab06.check_segmented_ring(ring_allreduce_segmented)

# %% [markdown]
# Does pipelining pay on this machine? The cell below times both rings on 2 ranks, 64 MiB of
# float32 each (best of 3), with 8 segments. On a 2-core laptop the "network" is a memory copy
# through the loopback, done by the same cores that add, so there may be little to overlap; on
# real links between machines the pipelined version hides the additions behind the transfers.

# %%
# NBVAL_IGNORE_OUTPUT
# Why: timings depend on the machine and its load.
import time

from dpcourse import launch


def time_rings(rank, world_size, rings, numel, repeats=3):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    x = torch.ones(numel)
    best = {}
    for name, (fn, kwargs) in rings.items():
        times = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            fn(x, "sum", **kwargs)
            times.append(time.perf_counter() - t0)
        best[name] = min(times)
    return best


rings = {"whole chunks": (ring_allreduce, {}),
         "8 segments": (ring_allreduce_segmented, {"segments": 8})}
timed = launch.spawn(time_rings, 2, rings, 16 * 2**20, backend="gloo", timeout=300,
                     show_output=False)[0]
whole, segmented = timed["whole chunks"], timed["8 segments"]
# Best of 3 on a shared machine moves by several per cent from run to run: call a difference
# only beyond 10 %.
speedup = whole / segmented
verdict = ("segmenting was faster" if speedup > 1.1 else
           "segmenting was slower" if speedup < 1 / 1.1 else "no clear difference (within 10 %)")
print(f"64 MiB on 2 ranks: whole chunks {whole * 1e3:.0f} ms, 8 segments {segmented * 1e3:.0f} ms "
      f"-> {verdict} here ({speedup:.2f}x)")
