# %% [markdown]
# # Lab 06 — Build the ring: simulated, then real
#
# Lesson 06 ran a ring all-reduce step by step and a real one over `torch.distributed`. Now you
# build both, from their contracts:
#
# 1. `scatter_reduce(buffers, owner)` and `all_gather(buffers, owner)` — the two phases, in
#    NumPy, on a list of N arrays (one per simulated worker), for a finishing layout that is a
#    parameter: worker i must end the reduce-scatter holding the full sum of **chunk
#    owner[i]**;
# 2. `ring_allreduce(tensor, op)` — the same on real processes, with blocking point-to-point
#    messages whose order you decide.
#
# After each, run the check cell: it prints one ✔ line, or one sentence naming the mistake.
# Chunks are those of `ring.chunk_bounds(length, N)` (NumPy's `array_split` rule, the same as
# `torch.tensor_split`): lengths need not be divisible by N.

# %% tags=["parameters"]
check_timeout = 20  # seconds before a hanging ring is stopped

# %%
import numpy as np

from dpcourse import ring
from dpcourse.checks import lab06, predict

# %% [markdown]
# ## 1. Reduce-scatter
#
# The contract of `scatter_reduce(buffers, owner=None)`:
#
# * `buffers` is a list of N equally long 1-D float arrays, one per worker; change them in place;
# * `owner` is a list of N chunk indices holding each chunk once: `owner[i]` is the chunk worker
#   i must finish (a sharded optimizer, lesson 08, may want shard c finished on a given
#   worker). `None` means `owner[i] = i`;
# * it runs N − 1 steps; in every step **each** worker sends exactly one chunk to its right
#   neighbour, worker (i + 1) mod N, which adds it into its own copy of that same chunk; all
#   workers send at once: what a worker sends in a step is what it held when the step began.
#   That needs no copy: in a ring no worker sends, in a step, the chunk it receives into in that
#   step, so adding into a neighbour's chunk never changes what that neighbour sends. (A copy
#   would matter only if a worker sent and received the same chunk in one step, and then the
#   indices are what is wrong.);
# * afterwards worker i holds the full sum (over all workers) of **chunk owner[i]**; its other
#   chunks hold what the N − 1 steps left there (sums on their way to another worker), so they
#   show that the steps ran.
#
# Lesson 06's simulator finishes one layout, chunk (i + 1) mod N on worker i; the check also
# passes layouts that no shifted copy of its formula finishes. First, on paper, for N = 4
# (workers and chunks 0 … 3, steps 1, 2 and 3) and `owner = [2, 0, 3, 1]`: which chunk does
# worker 0 send at step 1, at step 2 and at step 3? Write them as `worker0_sends = [chunk at
# step 1, chunk at step 2, chunk at step 3]`; the check says where your chunks would end.

# %%
### BEGIN SOLUTION: worker 0's chunks at steps 1, 2 and 3, for N = 4 and owner = [2, 0, 3, 1]
worker0_sends = [1, 3, 0]
### END SOLUTION
lab06.check_worker0_sends(worker0_sends)

# %% [markdown]
# <details><summary>▶ Hint 1 — a question</summary>
#
# The chunk worker 0 sends at step 1 reaches worker 1, which adds its part. Where is that sum
# after step 2, and after step 3, the last? Which chunk must the worker it stops at hold?
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 2 — the idea</summary>
#
# A chunk being summed travels one hop to the right per step, collecting one contribution per
# hop, and stops after step N − 1. So the worker a chunk ends on is fixed by who sends it and at
# which step — and `owner` says which chunk that worker needs. A formula on chunk numbers
# alone can only be right for layouts where neighbouring workers finish neighbouring chunks.
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 3 — the shape of the code</summary>
#
# Per step, one loop over the workers: work out the worker that the chunk worker i sends at
# step t will end on (an expression in i and t, mod N), look up that worker's chunk in
# `owner`, and add that chunk into the right neighbour's slice of the same chunk. Your
# expression must give worker 0 the three chunks you worked out on paper.
#
# </details>

# %%
def scatter_reduce(buffers, owner=None):
    """Reduce-scatter in place over ``buffers``, a list of N equally long 1-D arrays:
    afterwards worker i holds the full sum of chunk owner[i] (owner None: chunk i)."""
    n = len(buffers)
    owner = list(range(n)) if owner is None else list(owner)
    bounds = ring.chunk_bounds(len(buffers[0]), n)
    for t in range(1, n):  # steps t = 1 .. N-1, numbered as in lesson 06
        ### BEGIN SOLUTION: one reduce-scatter step
        for i in range(n):  # no copy: worker i + 1 does not send chunk c in this step
            c = owner[(i - t) % n]  # it ends on worker i - t: N - 1 - t hops past worker i + 1
            buffers[(i + 1) % n][slice(*bounds[c])] += buffers[i][slice(*bounds[c])]
        ### END SOLUTION

# %%
_ = lab06.check_scatter_reduce(scatter_reduce)

# %% [markdown]
# ## 2. All-gather
#
# The contract of `all_gather(buffers, owner=None)`: it starts from what your `scatter_reduce`
# leaves for the same `owner` (worker i holds the complete chunk owner[i]), runs N − 1 steps in
# which each worker sends one chunk to its right neighbour, which **overwrites** its copy of
# that chunk, and afterwards every worker holds the whole sum.

# %% [markdown]
# <details><summary>▶ Hint 1 — a question</summary>
#
# At the all-gather's first step (t = N: lesson 06 numbers the steps on through both phases),
# which chunk is the only one worker i can usefully pass on? And at step N + 1, which complete
# chunk has just arrived that its right neighbour still lacks?
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 2 — the idea</summary>
#
# Each worker passes on the complete chunk it got most recently (its own at step N), so every
# complete chunk travels once around the ring, N − 1 hops.
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 3 — the shape of the code</summary>
#
# The same step as the reduce-scatter (one write per worker, and no copy, for part 1's
# reason: no worker sends, in a step, the chunk it receives into), a lookup in `owner` that
# gives worker i its own finished chunk at step N, and an assignment where the reduce-scatter
# added.
#
# </details>

# %%
def all_gather(buffers, owner=None):
    """All-gather in place, after scatter_reduce with the same owner: every worker ends with
    the whole sum."""
    n = len(buffers)
    owner = list(range(n)) if owner is None else list(owner)
    bounds = ring.chunk_bounds(len(buffers[0]), n)
    for t in range(n, 2 * n - 1):  # steps t = N .. 2(N-1), numbered on as in lesson 06
        ### BEGIN SOLUTION: one all-gather step
        for i in range(n):  # no copy, as in the reduce-scatter
            c = owner[(i - t) % n]  # at t = N: owner[i], worker i's own finished chunk
            buffers[(i + 1) % n][slice(*bounds[c])] = buffers[i][slice(*bounds[c])]
        ### END SOLUTION

# %%
_ = lab06.check_all_gather(all_gather)

# %% [markdown]
# Together they are a ring all-reduce, whatever the layout. Five workers, seven numbers each
# (7 is not divisible by 5), worker i finishing chunk owner[i] in between:

# %%
from dpcourse.checks import claim

owner = [4, 2, 0, 3, 1]
buffers = [np.arange(7.0) * (w + 1) for w in range(5)]
expected = np.sum(buffers, axis=0)
bounds = ring.chunk_bounds(7, 5)
scatter_reduce(buffers, owner)
claim("after the reduce-scatter, worker i holds the full sum of chunk owner[i]",
      all(np.array_equal(buffers[i][slice(*bounds[c])], expected[slice(*bounds[c])])
          for i, c in enumerate(owner)))
all_gather(buffers, owner)
claim("after the all-gather, every worker holds the sum",
      all(np.array_equal(b, expected) for b in buffers))

# %% [markdown]
# ## 3. The real ring
#
# The contract of `ring_allreduce(tensor, op="sum")`, called on every rank of a gloo group with
# tensors of one shape and dtype (contiguous, float32 or float64: the check passes no other):
#
# * afterwards `tensor` itself (not a copy) holds the element-wise sum over all ranks, or with
#   `op="average"` that sum divided by the number of ranks; return `tensor`;
# * it uses the blocking `dist.send` and `dist.recv` only: no built-in collective, and no
#   `isend`/`irecv`/`batch_isend_irecv` (those are for the stretch);
# * it is a ring: each rank talks to its right neighbour `(rank + 1) % N` (sends) and left
#   neighbour `(rank - 1) % N` (receives), in 2(N − 1) steps of one chunk each;
# * any N ≥ 2, any number of elements (chunks may be uneven, or empty when there are fewer
#   elements than ranks). With at least N elements no chunk is empty, and every rank sends
#   exactly 2(N − 1) messages; with fewer, a step whose chunk is empty may skip its send and its
#   receive (both neighbours alike) or send the empty chunk.
#
# The chunk layout is yours: only the final tensor is compared.
#
# **Your design decision:** the order of each step's two calls. `dist.send` and `dist.recv` both
# block until the other side is ready, so some orders leave every rank waiting for another that
# waits too, and others finish but make a step's transfers wait for one another around the
# ring. Decide, from the rank (and N if you need it), which ranks send first in a step and
# which receive first, so that no step can stall, for every N ≥ 2, and so that the ring's time
# per step does not grow with N: it must stay under a bound that does not depend on N (the
# naive all-reduce's grows like N). Count time in *transfer times*: the ring's time is when
# its last transfer ends, and its time per step is that divided by its 2(N − 1) steps, an
# average (a rank that has finished a step goes on to the next without waiting for the
# others, so steps overlap, and one slow step can be hidden by the steps after it). A rank
# makes its two calls one after the other, so no order takes less than 2 per step on average.
#
# The check runs your ring on 3, 2 and then 4 ranks, watches what it sends and the order of
# its calls, and names a deadlock if one happens. It then counts the transfer times your whole
# ring takes (each transfer one unit, a send going out once its receiver is in `dist.recv`) and
# divides them by its steps, showing its slowest single step beside that average: on 3, 2 and 4
# ranks from the calls your ranks made, and on 5, 7, 8 and 16 ranks from the order your code
# makes its calls there (run with stand-ins that send nothing).
#
# First, two predictions, once you have decided your order and before you write the ring.
# Your order, whatever it is, meets odd rings too. How many transfer times per step, on
# average, will it take on N = 3 ranks, and on N = 5? Write them as `my_step_times = {3: ...,
# 5: ...}` (decimals welcome). The check models your order after your ring passes and says
# where the time went.

# %%
### BEGIN SOLUTION: your predictions: your order's transfer times per step on N = 3 and N = 5
my_step_times = {3: 3.0, 5: 2.5}
### END SOLUTION
step_guesses = {n: predict("lab06", lab06.STEP_QUESTION.format(n=n), my_step_times[n],
                           unit="transfer times") for n in (3, 5)}

# %% [markdown]
# And one more. Once your ring works, the cell after the check will run it on N = 4 ranks
# with a float32 tensor of K = 10 elements (40 bytes; 10 is not divisible by 4, so the chunks
# hold 3, 3, 2 and 2 elements) and count the bytes each rank sends. Before you write the ring:
# how many bytes does the rank that sends the most send?

# %%
### BEGIN SOLUTION: your prediction: the most bytes one rank sends (N = 4, K = 10 float32)
my_guess = 64
### END SOLUTION
guess = predict("lab06", "most bytes one rank sends for N = 4, K = 10 float32", my_guess,
                unit="bytes")

# %% [markdown]
# <details><summary>▶ Hint 1 — a question</summary>
#
# In your NumPy version, what did a worker receive in each step, and what did it do with it
# before the next step could send it on? Which of those steps need a buffer that is not part
# of the tensor?
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 2 — the idea</summary>
#
# Flatten the tensor once and cut it into N chunks that are views of it, so that whatever lands
# in a chunk lands in `tensor`. A rank plays one worker of your simulation: the same indices with
# the rank as i. What it receives in the reduce-scatter must be added, so it needs a place to
# land first; what it receives in the all-gather may land where it belongs. (Any layout will
# do here: only the final tensor is compared; `owner[i] = i` is the simplest.) A rank stuck in
# `send` waits for its right neighbour, one stuck in `recv` for its left: when can such waits
# close a circle, and when do they line up in a long chain? And if only a few ranks sent first,
# how many transfers could be under way at once on 16 ranks?
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 3 — the shape of the code</summary>
#
# A small helper that, for one step, makes this rank's send and receive in the order your rule
# gives this rank; a loop of N − 1 reduce-scatter steps (helper, then an in-place add); a loop of
# N − 1 all-gather steps (helper only); then the in-place division for the average.
#
# </details>

# %%
def ring_allreduce(tensor, op="sum"):
    """All-reduce ``tensor`` in place over the default group with a ring; return ``tensor``."""
    import torch
    import torch.distributed as dist

    ### BEGIN SOLUTION: ring_allreduce's body: the two phases over point-to-point messages
    n, rank = dist.get_world_size(), dist.get_rank()
    right, left = (rank + 1) % n, (rank - 1) % n
    flat = tensor.view(-1)
    chunks = flat.tensor_split(n)

    def exchange(send_chunk, recv_into):
        # Even ranks send first, odd ranks receive first. Rank 1 always exists and is odd, so
        # some rank receives first in every step: the chain of blocked sends ends there (on
        # N = 3, rank 2's send to rank 0 waits only until rank 0's own send to rank 1 is taken).
        if rank % 2:
            dist.recv(recv_into, left)
            dist.send(send_chunk, right)
        else:
            dist.send(send_chunk, right)
            dist.recv(recv_into, left)

    for t in range(1, n):  # steps numbered as in lesson 06: t = 1 .. 2(N-1)
        recv_chunk = chunks[(rank - t) % n]
        incoming = torch.empty_like(recv_chunk)
        exchange(chunks[(rank + 1 - t) % n], incoming)
        recv_chunk += incoming
    for t in range(n, 2 * n - 1):
        exchange(chunks[(rank + 1 - t) % n], chunks[(rank - t) % n])
    if op == "average":
        flat /= n
    ### END SOLUTION
    return tensor

# %%
lab06.check_ring_allreduce(ring_allreduce, timeout=check_timeout)

# %% [markdown]
# Your predictions of the time per step on 3 and 5 ranks, next to the model run on the order
# your code makes its calls in, and where the time went:

# %%
lab06.check_step_prediction(step_guesses, ring_allreduce)

# %% [markdown]
# Now the measurement for your prediction: your ring on 4 ranks, K = 10 float32, the bytes each
# rank sends; the most of them is compared with your prediction.

# %%
measured = lab06.measure_bytes_sent(ring_allreduce, world_size=4, numel=10,
                                    timeout=check_timeout)
lab06.check_prediction(guess, measured)

# %% [markdown]
# ## 4. The deadlock, made safe
#
# Here is the order with no decision in it: every rank *sends* with the blocking `dist.send`,
# then receives (one exchange of the whole tensor is enough to show it). With gloo it hangs at
# every size: gloo's TCP `Pair::send` (`gloo/transport/tcp/pair.cc` in
# github.com/facebookincubator/gloo at cc44198) sends the data only if the peer has posted its
# receive, and otherwise queues the send in `localPendingSend_` until it has, however small the
# message. So `dist.send` does not return until the neighbour has posted the matching receive,
# and every neighbour is itself stuck in its own send. `lab06.demo_ring` runs it in separate processes, stops them after the timeout and tells
# you what happened — the notebook does not hang. Compare its sentence with why your own order
# cannot do this on 3 ranks.

# %%
def blocking_ring(tensor, op="sum"):
    import torch
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    incoming = torch.empty_like(tensor)
    dist.send(tensor, (rank + 1) % n)  # everyone blocks here ...
    dist.recv(incoming, (rank - 1) % n)  # ... and nobody gets here
    return tensor


try:
    lab06.demo_ring(blocking_ring, world_size=3, timeout=10)
except lab06.LabCheckError as err:
    print(err)

# %% [markdown]
# ## Stretch (optional): the reduce-scatter in segments
#
# A workshop can stop here. In your ring, a rank receives a whole chunk, *then* adds it, *then*
# sends it on: the network waits for the addition and the addition waits for the network. NCCL
# and gloo cut each chunk into segments (lesson 06's word; this lab calls one a *piece*) and
# pipeline them. Write
# `ring_allreduce_segmented(tensor, op="sum", segments=4)`, with the contract of your
# `ring_allreduce`, non-blocking `dist.isend`/`dist.irecv` allowed, and this goal: **the
# reduce-scatter's additions hide behind its transfers.** What must hold:
#
# * in the reduce-scatter, each chunk travels as `segments` pieces (cut as `tensor_split` cuts);
# * overlap: whenever a piece of a step is being added into the tensor, the step's next piece
#   (if there is one) is in flight, its send and its receive both started and not yet waited
#   on, so that the network works while the rank adds;
# * bounded memory: every receive in flight writes into a buffer of its own, one piece long,
#   that nothing else writes into or reads from until that receive has been waited on;
# * the all-gather may send whole chunks or pieces (nothing is added there).
#
# Receives posted from one neighbour are matched with its sends in the order both sides posted
# them (the docstring of `dist.batch_isend_irecv` in `torch/distributed/distributed_c10d.py`
# says so for a batch; with gloo it holds for separate `isend`/`irecv` too, whatever the order
# of the waits: the lab's tests measure it), so a later piece's receive may be posted before
# an earlier piece has arrived.
#
# **Your design decision:** how far ahead of the addition your ring runs. Every receive in
# flight holds a buffer of its own; more of them ask more memory of every rank. Decide,
# **before you write the ring**, how many reduce-scatter receives it will keep in flight at
# most with `segments=4` (a receive is in flight from the moment it is posted until its wait
# returns, so the one you are about to wait on counts too), and be ready to say what a larger
# or a smaller number would buy or cost. Then write the ring so that it keeps that many. The check measures the count on every
# rank and compares it with your decision; the first number it compares is kept as your
# decision for this Jupyter kernel (session), and another number afterwards is refused (trying
# numbers until one passes is a search, not a decision): if the two disagree, it is the ring
# you change.
#
# The check runs it on 3 and 2 ranks with 4 and 3 segments, compares the results, counts the
# messages, and watches your ring's posts, waits and additions: an order that leaves an
# addition with nothing in flight is named by what it did.

# %%
### BEGIN SOLUTION: your decision: reduce-scatter receives in flight at most (segments=4)
in_flight = 2
### END SOLUTION
decision = predict("lab06", lab06.IN_FLIGHT_QUESTION, in_flight, unit="receive(s)")

# %% [markdown]
# <details><summary>▶ Hint 1 — a question</summary>
#
# When you wait for piece j and then add it, what is on its way at that moment? What must
# already have happened for piece j + 1 to be on its way then — and what must not have
# happened yet?
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 2 — the idea</summary>
#
# A transfer overlaps an addition only if it was started before the addition began and is
# waited on after it ended. So piece j + 1's send and receive must be posted before you wait
# for piece j, and piece j must be added before you wait for piece j + 1. At the moment you
# wait for piece j, which later pieces have you already started? Anything from "just the next
# one" to "all of the step's" meets the goal; they differ in the buffers they hold.
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 3 — the shape of the code</summary>
#
# Per reduce-scatter step: the pieces of the chunk sent, the pieces of the chunk added into, a
# receive buffer per piece, a helper that starts piece j's send and receive and returns the two
# works, and a loop over j that starts the later pieces your decision allows, then waits for
# piece j, then adds it.
#
# </details>

# %%
def ring_allreduce_segmented(tensor, op="sum", segments=4):
    import torch
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    right, left = (rank + 1) % n, (rank - 1) % n
    flat = tensor.view(-1)
    chunks = flat.tensor_split(n)
    ### BEGIN SOLUTION: ring_allreduce_segmented's body: a pipelined reduce-scatter, then the rest
    for t in range(1, n):  # steps numbered as in lesson 06: t = 1 .. 2(N-1)
        outgoing = chunks[(rank + 1 - t) % n].tensor_split(segments)
        target = chunks[(rank - t) % n].tensor_split(segments)
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
    for t in range(n, 2 * n - 1):
        works = [dist.isend(chunks[(rank + 1 - t) % n], right),
                 dist.irecv(chunks[(rank - t) % n], left)]
        for w in works:
            w.wait()
    if op == "average":
        flat /= n
    ### END SOLUTION
    return tensor


# %%
lab06.check_segmented_ring(ring_allreduce_segmented, in_flight=decision)

# %% [markdown]
# Does pipelining pay on this machine? Your segmented ring differs from your part 3 ring in two
# ways at once: its sends and receives are non-blocking, so both directions of a step move
# together, and its chunks are pipelined in pieces. The cell below separates them by timing
# three rings on 2 ranks, 64 MiB of float32 each (best of 3, the rings taking turns in every
# round): your blocking ring, your segmented ring with `segments=1` (non-blocking, but each
# chunk arrives whole before it is added: nothing to pipeline) and with 8 segments. On a
# 2-core laptop the "network" is a memory copy through the loopback, done by the same cores
# that add, so there may be little to overlap; on real links between machines the pipelined
# version hides the additions behind the transfers.

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
    times = {name: [] for name in rings}
    for _ in range(repeats):  # the rings take turns, so a burst of load hits all of them
        for name, (fn, kwargs) in rings.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn(x, "sum", **kwargs)
            times[name].append(time.perf_counter() - t0)
    return {name: min(t) for name, t in times.items()}


rings = {"blocking": (ring_allreduce, {}),
         "segments=1": (ring_allreduce_segmented, {"segments": 1}),
         "8 segments": (ring_allreduce_segmented, {"segments": 8})}
timed = launch.spawn(time_rings, 2, rings, 16 * 2**20, backend="gloo", timeout=300,
                     show_output=False)[0]
blocking, one, eight = timed["blocking"], timed["segments=1"], timed["8 segments"]


def compare(before, after):
    # Best of 3 on a shared machine moves by several per cent from run to run: call a
    # difference only beyond 10 %.
    ratio = before / after
    verdict = ("faster" if ratio > 1.1 else "slower" if ratio < 1 / 1.1 else
               "no clear difference (within 10 %)")
    return ratio, verdict


both_ways, v_both = compare(blocking, one)
pipelined, v_pipe = compare(one, eight)
print(f"64 MiB on 2 ranks: blocking ring {blocking * 1e3:.0f} ms, segmented ring with "
      f"segments=1 {one * 1e3:.0f} ms, with 8 segments {eight * 1e3:.0f} ms")
print(f"non-blocking, both directions at once (segments=1 vs blocking): {v_both} "
      f"({both_ways:.2f}x)")
print(f"pipelining the additions (8 segments vs segments=1): {v_pipe} ({pipelined:.2f}x)")
total = blocking / eight
if total > 1.1:
    source = ("moving both directions at once" if both_ways >= pipelined else
              "pipelining the additions")
    print(f"-> of the {total:.2f}x over the blocking ring, the larger part came from {source}")
else:
    print(f"-> no clear gain over the blocking ring here ({total:.2f}x)")
