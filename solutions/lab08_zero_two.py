# %% [markdown]
# # Lab 08 · ZeRO-2, overlapped with the backward
#
# Lesson 08's `Zero2` reduce-scatters every gradient in `step()`, after the backward: by then
# every full gradient has existed at once, so the rank's memory at its fullest — its **peak** —
# is ZeRO-1's, whatever it keeps at rest. Here you write ZeRO stage 2 that lowers the peak:
# the gradients leave the rank **during** the backward, in **buckets** (lesson 07), while the
# backward goes on computing the earlier layers. Two pieces:
#
# 1. `shard_bounds(numel, rank, world_size, element_size)` — which slice of a flat vector a
#    rank owns;
# 2. `ZeroTwo`, a wrapper around any torch optimizer, used like lesson 08's stages:
#    `zero_grad()`, your `loss.backward()`, `step()`;
#
# then you predict the peak of live gradient memory of your wrapper on a small model, and
# measure it (part 4), and you predict and measure what other orders of launching and waiting
# would cost (part 5).
#
# **Where the decisions are.** Two are yours: in **part 1**, how long a rank's piece is once
# every piece must start on 16 bytes (the lesson's stages cut ⌈numel/N⌉ numbers per rank,
# FSDP2 ⌈size of dim 0 / N⌉ rows, and neither aligns its pieces); in **part 3**, what to keep
# in flight and when to wait for it (the lesson shows only torch's choice, folded).
#
# The check runs your wrapper for 3 steps on 2 ranks with Adam and on 3 ranks with SGD +
# momentum, next to DDP with the full optimizer, on a seven-layer MLP with a **frozen** bias
# (`requires_grad=False`), a weight **tied** between two layers (one `Parameter` used twice)
# and a learnable scalar **gain** on its input. From inside each rank it watches every
# gradient arrive, every collective you launch and every `wait()`; at each arrival, and during
# the backward before every line of your own code that runs (your hook and what it calls), it
# weighs the gradient memory alive — by *storage*: a view weighs the whole buffer it keeps
# alive, and a tensor held only by a local variable of your hook weighs too. Its sentence
# names what went wrong: read it.
#
# **Collective names.** `dist.reduce_scatter_single` and `dist.all_gather_single` are the
# names in torch 2.14, the version this course pins. Older torch calls them
# `dist.reduce_scatter_tensor` and `dist.all_gather_into_tensor`; torch 2.14 keeps those as
# deprecated aliases (they warn, then call the new ones), and the check accepts either. Both
# take `async_op=True` and then return a `Work` at once, whose `wait()` blocks until it is done.
# The cell after the imports prints their parameters, read from torch itself: the **output
# comes first**.

# %% tags=["parameters"]
check_timeout = 30  # seconds before a hanging rank is stopped

# %%
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dpcourse.checks import lab08

torch.set_num_threads(1)

# %%
import inspect

for collective in (dist.reduce_scatter_single, dist.all_gather_single):
    print(f"dist.{collective.__name__}({', '.join(inspect.signature(collective).parameters)})")

# %% [markdown]
# ## 1. Shard boundaries
#
# A bucket's gradients, flattened, are one vector of `numel` numbers of `element_size` bytes
# each, which your wrapper will reduce-scatter and, once stepped, all-gather with the two
# collectives above — each rank's piece in rank order, over the vector padded with zeros at
# its end. `shard_bounds(numel, rank, world_size, element_size)` returns two integers,
# `(start, end)`, end exclusive: rank `rank`'s piece of that padded vector. What must hold:
#
# - both collectives can move these pieces, and every one of the `numel` numbers belongs to a
#   rank;
# - every piece starts on a **16-byte boundary** of the vector. Torch's allocator aligns where
#   a tensor starts, but a piece inside a buffer starts where you cut it, and code that moves
#   16 bytes at a time (vectorised copies) wants its start aligned. This lab asks it of the
#   rank pieces themselves, which FSDP does not: FSDP1 (with `use_orig_params=True`) pads so
#   that each *parameter* starts on 16 bytes (`torch/distributed/fsdp/_flat_param.py`,
#   `_get_aligned_numel`: "This alignment constraint comes from TorchInductor"), then pads
#   the flat parameter only to a multiple of the world size; FSDP2 pads each parameter's dim
#   0 to a multiple of the world size (`_fully_shard/_fsdp_param.py`,
#   `padded_sharded_param_size`). In `self.shard` (part 3) the buckets' pieces follow one
#   another, so where each one starts depends on the lengths of those before it;
# - no piece carries padding that these rules do not force on it: every collective sends it,
#   in every step.
#
# The check tries sizes that divide and sizes that do not, more ranks than numbers, and
# numbers of 1, 2, 4 and 8 bytes.
#
# **Your decision in this part:** how long a piece is — what you round, and to what — so that
# all three hold at once.

# %% [markdown]
# <details><summary>▶ Hint 1 — a question</summary>
#
# What does `reduce_scatter_single` require of its input's length, given its output's, and
# what does that say about the pieces of different ranks? With 53 fp32 numbers on 3 ranks, how
# long must each piece be so that no number is left without an owner — and at which byte does
# rank 1's piece then start? What if you pad the whole vector to a multiple of 16 bytes first?
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 2 — the idea</summary>
#
# Every piece has the same length, and piece r starts at r times that length: so it is the
# **length** that must be a whole number of 16-byte units — the smallest such length whose
# `world_size` pieces still cover `numel`. Only the last piece(s) run into the zero padding.
# 16 bytes are not the same count of numbers for every `element_size`.
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 3 — the shape of the code</summary>
#
# Three lines: how many numbers make 16 bytes; one piece length from `numel`, `world_size`
# and that count (round up, in whole units); then the start and end of piece number `rank`.
#
# </details>

# %%
def shard_bounds(numel, rank, world_size, element_size):
    """[start, end) of rank ``rank``'s piece of a flat vector of ``numel`` numbers of
    ``element_size`` bytes, padded with zeros at its end."""
    ### BEGIN SOLUTION: this rank's [start, end) in the padded vector
    unit = 16 // element_size                      # numbers in 16 bytes
    size = math.ceil(numel / (world_size * unit)) * unit
    return rank * size, (rank + 1) * size
    ### END SOLUTION


# %%
lab08.check_shard_bounds(shard_bounds)

# %% [markdown]
# ## 2. Buckets
#
# Given: the buckets are made in reverse registration order — roughly the order in which the
# backward produces gradients, from the last layer to the first — and a bucket is closed once
# it holds `cap` **bytes** or more (DDP's rule, lesson 07; bytes, not MB or MiB).

# %%
def make_buckets(params, cap):
    """``params`` grouped in reverse order; a bucket closes once it reaches ``cap`` bytes."""
    buckets, current, size = [], [], 0
    for p in reversed(list(params)):
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= cap:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


# %% [markdown]
# ## 3. The wrapper
#
# **What you are given.** `ZeroTwo(params, optimizer_cls, bucket_cap=128, **kwargs)`:
# - `params` is what `model.parameters()` returns: a **generator**, so it can be iterated
#   once; it yields every parameter once, frozen ones (`requires_grad=False`) included; a
#   tied weight is one `Parameter`, yielded once: its gradient sums both uses, and its
#   post-accumulate-grad hook runs once per backward, when that sum is complete;
# - what you may rely on in a backward: every trainable parameter's hook runs exactly once,
#   after its gradient is complete. Not the order in which the hooks run — not even among the
#   parameters of one bucket;
# - `optimizer_cls(tensors, **kwargs)` builds the inner torch optimizer (`kwargs` are its
#   hyper-parameters: `lr`, `momentum`, ...);
# - `bucket_cap` is in bytes;
# - every rank built the same model from the same seed, so the weights start equal on every
#   rank: `ZeroTwo` need not broadcast them (it may).
#
# **What must hold** — the contract the check holds you to:
# 1. after every `step()`, every rank's parameters equal those of DDP with the full
#    optimizer on the same global batch (to float rounding), and a frozen parameter never
#    moves;
# 2. `self.shard` is an `nn.Parameter` holding this rank's slice (`shard_bounds` of the
#    bucket's padded flat vector, so every slice starts on 16 bytes) of every bucket, one
#    bucket after the other, owning its memory; `self.shard.grad` has its size;
#    `self.optimizer` is the inner optimizer over `[self.shard]` alone, so its state covers
#    the shard and nothing more; `self.buckets` is the list of buckets
#    (`make_buckets(..., bucket_cap)` of the trainable parameters: the given `zero_grad`
#    reads it);
# 3. when the inner optimizer steps, `self.shard.grad` holds, on every rank, the **average**
#    over the ranks of this step's gradient for that rank's slices;
# 4. each bucket's gradients leave the rank **during** the backward, as soon as the bucket
#    is full, and the backward never waits for the bucket it has just launched (waiting for
#    an older one is allowed: contract 5 decides whether you must);
# 5. the gradient alive at once on a rank — in `p.grad`, in buffers, or anywhere your object
#    keeps them — never exceeds 2 × (`bucket_cap` / 4 + the largest trainable parameter's
#    `numel` + 4 × `world_size`) fp32 numbers (one bucket can hold up to `bucket_cap` / 4 plus
#    the parameter that takes it past the cap, plus padding: the allowance is two of those).
#    A tensor counts wherever it is kept alive: a collective's input from its launch until its
#    `wait()` returns (the `Work` holds it), and after that only if you still hold it. It is
#    weighed before every line of your code in the backward, so a moment between two of your
#    lines counts as much as a launch or a `wait()` (a temporary made and dropped inside one
#    line is not seen: the weighing is between lines). What was launched in the backward may
#    stay in flight until `step()` waits for it; **between steps** — from the moment `step()`
#    returns until the next backward — nothing but `self.shard.grad`;
# 6. every tensor you make — the shard, its gradient, the buffers — has the parameters'
#    device and dtype (on a GPU with NCCL, a buffer left on the CPU cannot be sent).
#
# Outside the contract: gradient accumulation (two backwards before one `step()`) and a
# trainable parameter that gets no gradient in some step; every step here is one backward
# in which every trainable parameter gets its gradient.
#
# A hook that runs as soon as `p.grad` holds this backward's gradient:
# `p.register_post_accumulate_grad_hook(fn)` (lesson 07, §2) calls `fn(p)`. The skeleton's
# `_grad_ready` and `_finish` are one way to split the work; the check calls only the
# constructor, `zero_grad()` and `step()`.
#
# **Your design decision:** what to keep in flight, and when to wait for it — contracts 4
# and 5 together.

# %% [markdown]
# <details><summary>▶ Hint 1 — a question</summary>
#
# When the last gradient of bucket k arrives, which gradients are alive on the rank: those of
# bucket k, and which others? What does a collective that is still running need you to keep,
# and when is it safe to let go of it? Where does its result have to land for contract 3?
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 2 — the idea</summary>
#
# Keep one bucket in flight: when a bucket is full, first wait for the bucket launched before
# it and forget its buffer, then flatten the full one into a padded buffer, drop its `p.grad`s
# and launch it asynchronously, writing straight into its own slice of `self.shard.grad`. A
# reduce-scatter sums (its default `op`): turn the sum into the mean once it has arrived — or
# ask it for the mean, `op=dist.ReduceOp.AVG`, which gloo takes in torch 2.14 (the check
# accepts either). `step()` must wait for
# the last bucket before the inner optimizer runs, and every rank then needs every updated
# slice.
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 3 — the shape of the code</summary>
#
# In `__init__`: the trainable parameters as a list; the buckets; a dictionary from parameter
# to bucket index and an arrival counter per bucket (a bucket is full when its count reaches
# its length, whichever parameter came last); per bucket its shard size and its offset
# in the shard; the shard built from copies of this rank's slices, its zero gradient, the
# inner optimizer; one hook per trainable parameter. In the hook: count, and on the last
# arrival finish the previous bucket, build the padded buffer, forget the `p.grad`s, launch,
# remember (work, buffer, output). `_finish`: wait, divide, forget. `step`: finish, step the
# inner optimizer, then per bucket all-gather its slices into a padded vector and copy each
# parameter's numbers back into it.
#
# </details>

# %%
class ZeroTwo:
    def __init__(self, params, optimizer_cls, bucket_cap=128, **kwargs):
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        ### BEGIN SOLUTION: the wrapper's state: buckets, this rank's shard and its gradient, the optimizer
        trainable = [p for p in params if p.requires_grad]    # frozen ones never get a gradient
        self.buckets = make_buckets(trainable, bucket_cap)
        self.bucket_of, self.layout, pieces, offset = {}, [], [], 0
        for i, bucket in enumerate(self.buckets):
            numel = sum(p.numel() for p in bucket)
            start, end = shard_bounds(numel, self.rank, self.world_size,
                                      bucket[0].element_size())
            size = end - start
            mine = torch.cat([p.detach().reshape(-1) for p in bucket])[start:end]
            pieces.append(F.pad(mine, (0, size - mine.numel())))   # past numel: zeros
            self.layout.append((size, offset))            # shard size, offset in self.shard
            offset += size
            for p in bucket:
                self.bucket_of[p] = i
        self.shard = torch.nn.Parameter(torch.cat(pieces))  # cat copies: no view kept
        self.shard.grad = torch.zeros_like(self.shard)
        self.optimizer = optimizer_cls([self.shard], **kwargs)
        self.arrived = [0] * len(self.buckets)
        self.in_flight = None                      # (work, buffer, out) of the bucket in flight
        for p in trainable:
            p.register_post_accumulate_grad_hook(self._grad_ready)
        ### END SOLUTION

    def zero_grad(self):
        for bucket in self.buckets:
            for p in bucket:
                p.grad = None

    def _grad_ready(self, p):
        ### BEGIN SOLUTION: what happens when p's gradient arrives
        i = self.bucket_of[p]
        self.arrived[i] += 1
        if self.arrived[i] < len(self.buckets[i]):
            return                                 # the bucket is not full yet
        self.arrived[i] = 0
        self._finish()                             # one bucket in flight at a time
        size, offset = self.layout[i]
        numel = sum(q.numel() for q in self.buckets[i])
        buffer = self.shard.new_zeros(size * self.world_size)   # padded: zeros past numel
        torch.cat([q.grad.reshape(-1) for q in self.buckets[i]], out=buffer[:numel])  # no copy beside it
        for q in self.buckets[i]:
            q.grad = None                          # the full gradients are not needed again
        out = self.shard.grad[offset:offset + size]
        work = dist.reduce_scatter_single(out, buffer, async_op=True)
        self.in_flight = (work, buffer, out)
        ### END SOLUTION

    def _finish(self):
        ### BEGIN SOLUTION: what you launched and have not waited for yet, finished
        if self.in_flight is not None:
            work, buffer, out = self.in_flight
            work.wait()
            out /= self.world_size                 # the sum over the ranks -> the mean
            self.in_flight = None                  # and with it the padded buffer
        ### END SOLUTION

    def step(self):
        ### BEGIN SOLUTION: every rank's parameters hold the stepped weights
        self._finish()
        self.optimizer.step()
        for bucket, (size, offset) in zip(self.buckets, self.layout):
            full = torch.empty(size * self.world_size, dtype=self.shard.dtype,
                               device=self.shard.device)
            dist.all_gather_single(full, self.shard.detach()[offset:offset + size])
            start = 0
            for p in bucket:
                p.data.copy_(full[start:start + p.numel()].view_as(p))
                start += p.numel()
        ### END SOLUTION


# %%
lab08.check_zero_two(ZeroTwo, timeout=check_timeout)

# %% [markdown]
# ## 4. Predict, then measure: the peak
#
# Now the point of stage 2 in one number. The model below is five `Linear` layers of widths
# 16 → 64 → 64 → 64 → 64 → 8 (each with a bias), fp32, on 2 ranks, with `bucket_cap = 4096`
# bytes and your `ZeroTwo` as it is. Before you measure: what is the **peak of live gradient
# memory** on a rank, in bytes — the most gradient bytes alive at once (in `p.grad`, in your
# buffers, anywhere your object keeps them; `self.shard.grad` aside)? It is weighed as the
# check weighed it: at every gradient's arrival, once that gradient is in `p.grad` and
# **before** your hook runs on it; during the backward, before every line of your code that
# runs; and at each reduce-scatter's launch and each `wait()` (whatever your code has made by
# then counts, local variables included). Write a number of bytes (not MB), then run the
# measurement.

# %% [markdown]
# <details><summary>▶ Hint 1 — a question</summary>
#
# Which buckets does `make_buckets` build for this model at 4096 bytes? Count each layer's
# weight and bias, starting from the last layer. Is the most alive at an arrival, or at some
# line of your hook?
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 2 — the idea</summary>
#
# Walk through your hook line by line at a bucket's last arrival: all of that bucket is in
# `p.grad`; what does your wrapper still keep of the bucket launched before it, and when does
# it let go? Once your hook has built the new buffer, what is alive until the next line frees
# `p.grad`? The first bucket has no predecessor — but it is not the smallest.
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 3 — the shape of the code</summary>
#
# List the buckets' sizes in numbers, in launch order (a buffer is padded, a `p.grad` is
# not); for each bucket, add up what is alive at its last arrival and after each line of your
# hook (that bucket's `p.grad`s, the buffers your wrapper still holds, any buffer your hook
# has already filled); take the largest; 4 bytes per number.
#
# </details>

# %%
from dpcourse.checks import predict

### BEGIN SOLUTION: your prediction: the peak of live gradient bytes (a number)
# buckets of 4680, 4160, 4160, 1088 numbers. My hook waits for the bucket before and lets go
# of it, then copies the new one: right after the copy of bucket 0 (nothing in flight yet) its
# gradients are in p.grad and in the buffer, 4680 + 4680 — more than bucket 1's arrival
# beside bucket 0 in flight, 4160 + 4680
my_peak = 4 * (4680 + 4680)
### END SOLUTION
guess = predict("lab08", "peak of live gradient bytes of your ZeroTwo", my_peak, unit="B")

# %%
measured = lab08.measure_peak(ZeroTwo, timeout=check_timeout)
lab08.check_peak_prediction(guess, measured)

# %% [markdown]
# ## 5. Predict, then measure: the order of launching and waiting
#
# Part 3's decision, measured. The check's own ZeRO-2 copies each full bucket into a padded
# buffer and lets go of its `p.grad` right after the copy; what it keeps in flight follows one
# of three intents:
#
# - **wait-then-launch**: never more than one reduce-scatter in flight — the one before is
#   waited for before a full bucket is copied;
# - **launch-then-wait**: a full bucket leaves at once; the one before it is waited for just
#   after;
# - **launch-all**: nothing is waited for until `step()`.
#
# The check's own ZeRO-2 runs each order on part 4's model (the same buckets, 2 ranks) and is
# weighed exactly as your `ZeroTwo` was. Before you measure: the peak of live gradient bytes
# of each order?

# %% [markdown]
# <details><summary>▶ Hint 1 — a question</summary>
#
# In each order, which buffers are still alive at the line right after a bucket is copied,
# before its `p.grad` is let go? Is that more, or less, than at the moment its last gradient
# arrived?
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 2 — the idea</summary>
#
# Letting go of `p.grad` right after the copy does not make the copy free: for one line the
# bucket is alive twice. What else is alive then is whatever was launched and not yet waited
# for — none, one or every earlier bucket, depending on the order.
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 3 — the shape of the code</summary>
#
# Per order and per bucket k: (bucket k) + (its buffer) + (the buffers still in flight at its
# copy); take the largest over k; 4 bytes per number.
#
# </details>

# %%
### BEGIN SOLUTION: your predictions: each order's peak of live gradient bytes (numbers)
# wait-then-launch: part 4's, bucket 0 twice right after its copy
wait_first = 4 * (4680 + 4680)
# launch-then-wait: bucket 1 twice right after its copy, bucket 0 still in flight
launch_first = 4 * (4160 + 4160 + 4680)
# launch-all: bucket 2 twice right after its copy, buckets 0 and 1 still in flight
launch_all = 4 * (4160 + 4160 + 4680 + 4160)
### END SOLUTION
guesses = [predict("lab08", f"peak of live gradient bytes, {order}", value, unit="B")
           for order, value in zip(lab08.SCHEDULES, (wait_first, launch_first, launch_all))]

# %%
peaks = lab08.measure_schedules(timeout=check_timeout)
lab08.check_schedule_predictions(*guesses, peaks)

# %% [markdown]
# The explanations say which instant makes each peak. On a GPU with NCCL the asynchronous
# reduce-scatter runs on a communication stream beside the backward's kernels; on this CPU
# gloo runs it on a thread of its own. One collective per small bucket means many small
# messages (lesson 06's α per message): a larger `bucket_cap` sends fewer, larger messages at
# the price of a higher peak — and how much higher depends on where the cap falls across the
# layers. The copy that doubles a bucket for an instant is what DDP's `gradient_as_bucket_view`
# removes (`torch/nn/parallel/distributed.py`, its docstring: "This can reduce peak memory
# usage"): the gradients are views into the bucket, so there is nothing to copy.
