# %% [markdown]
# # Lab 07 · Write your own bucketed, overlapped DDP
#
# Lesson 07 took DDP apart: hooks that launch an all-reduce the moment a gradient is ready,
# and buckets that group gradients into a few large messages. Its `BucketedDataParallel`
# launches a bucket as soon as it is full and copies gradients in and out. Now you build what
# DDP's reducer really does:
#
# 1. `assign_buckets(params, bucket_cap_mb)` — the buckets DDP's reducer's rule makes, for
#    parameters of several dtypes; before you write it, you predict how many it makes of seven of them;
# 2. `BucketedDDP`, a wrapper that keeps DDP's two promises: every gradient **is** a slice of
#    its bucket's flat buffer, and buckets go on the wire **strictly in bucket order**, each as
#    early as that order allows, while the backward is still running;
# 3. a prediction, then a measurement: when your wrapper sends the bucket that fills first.
#    You predict before you write part 2; the measurement runs your own wrapper.
#
# Each coding part holds one design decision the lesson did not make, said where it is asked:
# part 1, **what closes a bucket**; part 2, **what the hooks remember**; the stretch, **which
# collectives carry a compressed gradient**.
#
# The checks run your code on 2 and then 3 ranks (gloo, through `dpcourse.launch.spawn`:
# define everything right here in the notebook) against real `DistributedDataParallel`, and
# spy on every collective — how many, how large, which buffer, when it was launched and when
# it was waited on — against the moment each gradient arrived. When something is wrong, the
# check's sentence names the cause: read it, it is the teacher. Hints wait in folded cells.

# %% tags=["parameters"]
check_timeout = 30  # seconds before a hanging rank is stopped

# %%
import torch
import torch.distributed as dist
from torch import nn

from dpcourse.checks import lab07, predict

torch.set_num_threads(1)

# %% [markdown]
# ## 1. Buckets, by DDP's rule
#
# **The contract.** `assign_buckets(params, bucket_cap_mb)` takes a module's parameters in
# **registration order** (a list, all on one device; some may be frozen, `requires_grad=False`;
# they may be of **several dtypes**) and a cap in MiB (1 MiB = 2**20 bytes), measured against
# a bucket's **bytes**, not its elements; it returns a list of buckets, each a list of
# parameters, such that:
#
# - every parameter that requires a gradient is in exactly one bucket, and nothing else is;
# - the grouping is the one DDP's rule (a function of its C++ reducer) makes at
#   this cap when it walks the parameters you are given **reversed** — registration order
#   reversed, the order a model's gradients roughly arrive in. Real DDP, when it rebuilds its
#   buckets after the first backward (lesson 07 §3), walks the order the gradients *really*
#   arrived, which differs within a layer (a `Conv2d`'s weight arrives before its bias) and
#   can split the buckets differently where a cap falls between the two; the check grades the
#   reversed walk, not a recorded arrival. Write it yourself, do not call torch's or the
#   course library's. One cap applies to every bucket: the 1 MiB first bucket of lesson 07 §3
#   does not apply here;
# - a bucket is one flat buffer, so it holds **one dtype**; within it, the parameters are in
#   the order of that walk;
# - the buckets are in the order they become **complete** when the gradients arrive in that
#   order (a bucket is complete once every one of its gradients has arrived): bucket 0 is the
#   first that could go on the wire, so that a wrapper that sends the buckets in their order
#   (part 2) never holds a complete bucket back behind one that is still waiting. This order is
#   the lab's own rule, not torch's: with one dtype torch's rebuilt list is in this order too,
#   with several it is not always (the check says how, if your list is torch's).
#
# **Your design decision:** part 1's is **what closes a bucket**. The lesson gave you the
# walk's order and a cap in MiB, and stopped there; the contract says what must hold, not how.
# Three questions are yours:
#
# - when the cap is tested: once a parameter has joined the open bucket, or before it joins
#   (tested before, a parameter that would take the bucket past the cap closes it and starts
#   the next);
# - a parameter arrives whose dtype is not the open bucket's (it cannot join that buffer):
#   is that bucket closed there, or does it stay open beside a new one — and if it stays, does
#   it keep a size count of its own;
# - a bucket still open when the walk is over: when did it become complete, and so where in
#   the list does it go?
#
# Each choice gives different buckets of the check's three models of two and three dtypes;
# the check refuses the ones DDP's rule does not make and says what each costs.
#
# ### Predict first: how many buckets?
#
# Before you write any code: the seven parameters below (two dtypes) and a 1 MiB cap. **How
# many buckets does DDP's rule make of them?** The number follows from the decision you
# just made: write it in the cell, run it. Torch's own reducer function answers after part 1's
# check, beside your `assign_buckets`.

# %%
lab07.show_bucket_puzzle()

# %%
### BEGIN SOLUTION: your prediction (a number of buckets)
my_bucket_count = 3
### END SOLUTION
bucket_guess = predict("lab07", lab07.BUCKET_QUESTION, my_bucket_count, unit="bucket(s)")

# %% [markdown]
# <details><summary>▶ Hint 1 — a question</summary>
#
# What does one message cost: something per message, and something per byte? A parameter
# arrives that would take the open bucket past the cap: if the bucket closed before it joined,
# how large would its message be, and how many messages would the step send? A bfloat16
# gradient arrives while a float32 bucket holds 0.5 MiB and more float32 gradients are still to
# come: if that bucket closed now, how large would its message be? And when is a bucket
# complete — when the walk ends, or earlier?
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 2 — the idea</summary>
#
# The cap keeps messages few and large: a bucket below it is not yet worth its message. A
# choice that sends a message below the cap while gradients of its dtype are still to come pays
# a message's start-up cost (lesson 06's α) again for nothing; neither a parameter that would
# take the bucket past the cap nor one of another dtype passing by is a reason to. A bucket's
# place in the list is the moment its last gradient arrives — however it was closed, or if it
# never was.
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 3 — the shape of the code</summary>
#
# One pass over the parameters that require a gradient, in the order the backward produces
# them. At each: find the bucket it may join (or start one), add it, and let that bucket's size
# decide whether it closes. Give every bucket the moment it became complete; after the pass,
# the buckets still open need one too; then sort by it.
#
# </details>

# %%
def assign_buckets(params, bucket_cap_mb):
    """Group ``params`` (in registration order) into buckets by DDP's rule, bucket 0 the one
    the backward completes first."""
    ### BEGIN SOLUTION: assign_buckets: DDP's buckets for these parameters at this cap
    cap = bucket_cap_mb * 2**20
    trainable = list(reversed([p for p in params if p.requires_grad]))
    open_buckets = {}       # (dtype, device) -> [its open bucket, its bytes]
    complete = []           # (gradients arrived when it became complete, the bucket)
    for arrived, p in enumerate(trainable, start=1):
        key = (p.dtype, p.device)
        bucket = open_buckets.setdefault(key, [[], 0])
        bucket[0].append(p)
        bucket[1] += p.numel() * p.element_size()
        if bucket[1] >= cap:
            complete.append((arrived, bucket[0]))
            del open_buckets[key]
    position = {id(p): k for k, p in enumerate(trainable, start=1)}
    complete += [(position[id(b[-1])], b) for b, _ in open_buckets.values()]
    return [b for _, b in sorted(complete, key=lambda done: done[0])]
    ### END SOLUTION


# %%
lab07.check_assign_buckets(assign_buckets)

# %% [markdown]
# ### Measure: the buckets torch's reducer makes of the seven parameters
#
# Your prediction against torch's own reducer function, run now on the same seven parameters,
# and your `assign_buckets` beside it.

# %%
lab07.check_bucket_prediction(bucket_guess, assign_buckets)

# %% [markdown]
# ## 2. The wrapper, as DDP's reducer really runs it
#
# Lesson 07's `BucketedDataParallel` copies each gradient into its bucket, launches a bucket's
# all-reduce the moment the bucket is full, and copies the averages back after waiting. DDP's
# reducer keeps two promises that class does not, and your `BucketedDDP` keeps both.
#
# **The contract.** `BucketedDDP(module, bucket_cap_mb=25.0)` is an `nn.Module` whose forward
# is the module's (given), with `self.buckets` from your `assign_buckets` (given) and a method
# `finish_gradient_synchronization()`. A training step is the caller's usual `zero_grad`, then
# `loss.backward()`, then `finish_gradient_synchronization()`, then the optimizer's step. In
# every step, when `finish_gradient_synchronization()` returns:
#
# - every trainable `p.grad` holds the **average over the ranks** of that parameter's gradient
#   (to a relative 1e-4; where you divide is yours to decide), so the weights stay equal to
#   real DDP's on the same shards;
# - every trainable `p.grad` **is a view of its bucket** — a slice of one flat buffer per
#   bucket, shaped like `p` (DDP's `gradient_as_bucket_view=True`): the reduced buffer *is* the
#   average, nothing is copied back;
# - each bucket went on the wire as **one asynchronous all-reduce of its flat buffer**,
#   launched from the gradient hooks while the backward was still running; the i-th all-reduce
#   of every rank is **bucket i's**; and **each bucket went as soon as strict bucket order
#   let it** (no later than the backward had filled it and launched every bucket before it);
# - the wrapper is ready for the next step.
#
# If a trainable parameter got no gradient in this backward, its bucket never becomes
# complete: `finish_gradient_synchronization()` then **raises an error whose message names
# every such parameter** by its name in the module (as lesson 07 §6's class does), and every
# rank gets out of the step. After that error the wrapper need not be usable again.
#
# One backward per `finish_gradient_synchronization()`: gradient accumulation (a second
# backward before it) is outside the contract.
#
# **Your design decision:** part 2's is **what the hooks remember**. Between two hook calls,
# what must the wrapper keep so that the hook that has just run knows whether it may launch
# anything — and what? The check accepts every choice that keeps the contract; the lesson made
# none for you, and the hints below ask the questions without choosing for you.
#
# The check runs your wrapper for several steps on 2 and 3 ranks beside real DDP, on models
# chosen to meet the usual mistakes, and names the mistake it finds.

# %% [markdown]
# ### Predict first: when does the bucket that fills first go?
#
# Before you write the wrapper: below is the check's model at its first cap, with the buckets
# DDP's rule makes of its parameters walked reversed (your `assign_buckets` makes the same)
# and the order its forward uses the layers. Real DDP would not keep these: after its first
# backward it rebuilds its buckets in the order the gradients really arrived, which puts `out`
# in bucket 0, so there no bucket fills out of order. Your wrapper's buckets are fixed before
# any backward runs, as DDP's are when it never rebuilds (`find_unused_parameters=True`), so
# it must cope with the order below. One backward hands your hooks its 8 gradients one at a time. **After how many
# gradients have arrived will a wrapper that keeps this contract launch bucket 1's
# all-reduce?** Write your number in the cell and run it; the measurement, on your own
# `BucketedDDP`, comes after part 2's check.

# %%
lab07.show_prediction_model()

# %%
### BEGIN SOLUTION: your prediction (a number of gradients, 1 to 8)
my_guess = 4
### END SOLUTION
guess = predict("lab07", lab07.PREDICTION_QUESTION, my_guess, unit="gradient(s)")

# %% [markdown]
# <details><summary>▶ Hint 1 — a question</summary>
#
# Bucket 1 has just become complete, but bucket 0 is still waiting for a gradient. What must
# the hook do now — and which later event lets bucket 1 go? And when autograd hands the hook a
# gradient, how can the hook tell whether that tensor already lives in the bucket?
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 2 — the idea</summary>
#
# Every hook call must answer two questions: is this gradient's bucket complete now, and which
# buckets may go now? The second depends on what has gone already, not only on what has
# arrived. Keep what answers both with work that does not grow with the model, and put it back
# as it was when the step ends. When the answer is yes, launch, in bucket order, every bucket
# that may go, and stop at the first that may not.
#
# Is the gradient already its view? DDP asks `grad.is_alias_of(bucket_view)`: do the two share
# storage — true for ANY view of the bucket's buffer, so DDP relies on no one handing it another
# slice of that buffer; comparing where the two tensors start (`data_ptr()`) is a stricter
# test. If it is not, put its values into the view and make the view the gradient. The handles
# of the launched all-reduces are what the end of the step waits on. A bucket still awaiting
# gradients at the end of the step tells you which parameters never arrived: keep which ones
# did.
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 3 — the shape of the code</summary>
#
# `__init__`: per bucket a zero flat buffer of its total element count; for each of its
# parameters a view of its slice reshaped like it, and a post-accumulate gradient hook; then
# the state your answer to hint 2 needs, as it is before a backward. The hook: make `p.grad`
# its view; bring the state up to date; launch what may go now. The end of the step: wait on
# each handle you hold; then, if a bucket is not complete, raise with the names (from
# `named_parameters()`) of the parameters that did not arrive; otherwise put the state back as
# it was before the backward.
#
# </details>

# %%
class BucketedDDP(nn.Module):
    def __init__(self, module, bucket_cap_mb=25.0):
        super().__init__()
        self.module = module
        for p in module.parameters():
            dist.broadcast(p.data, src=0)
        self.buckets = assign_buckets(list(module.parameters()), bucket_cap_mb)
        ### BEGIN SOLUTION: the buckets' flat buffers, the gradients' views, the hooks' state
        self.buffers, self.view_of, self.bucket_of = [], {}, {}
        for i, bucket in enumerate(self.buckets):
            buffer = torch.zeros(sum(p.numel() for p in bucket), dtype=bucket[0].dtype,
                                 device=bucket[0].device)
            start = 0
            for p in bucket:
                self.view_of[p] = buffer[start:start + p.numel()].view_as(p)
                self.bucket_of[p] = i
                start += p.numel()
                p.register_post_accumulate_grad_hook(self._grad_ready)
            self.buffers.append(buffer)
        self.pending = [len(b) for b in self.buckets]
        self.next_bucket = 0
        self.works = []
        self.arrived = set()
        ### END SOLUTION

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _grad_ready(self, p):
        ### BEGIN SOLUTION: the hook: p's gradient in its bucket; launch what may go now
        view = self.view_of[p]
        if p.grad.data_ptr() != view.data_ptr():    # a fresh tensor from autograd
            view.copy_(p.grad)
            p.grad = view
        self.arrived.add(p)
        self.pending[self.bucket_of[p]] -= 1
        while self.next_bucket < len(self.buckets) and self.pending[self.next_bucket] == 0:
            buffer = self.buffers[self.next_bucket]
            buffer.div_(dist.get_world_size())
            self.works.append(dist.all_reduce(buffer, async_op=True))
            self.next_bucket += 1
        ### END SOLUTION

    def finish_gradient_synchronization(self):
        ### BEGIN SOLUTION: the end of the step: every average in place, ready for the next
        for work in self.works:     # launched by every rank: waited on even before an error
            work.wait()
        if any(self.pending):
            lost = [name for name, p in self.module.named_parameters()
                    if p in self.view_of and p not in self.arrived]
            raise RuntimeError(f"parameter(s) {lost} got no gradient in this backward, so "
                               f"their bucket was never complete and never all-reduced")
        self.works = []
        self.pending = [len(b) for b in self.buckets]
        self.next_bucket = 0
        self.arrived = set()
        ### END SOLUTION


# %%
lab07.check_bucketed_ddp(BucketedDDP, timeout=check_timeout)

# %% [markdown]
# ### Measure: when did your wrapper send bucket 1?
#
# Now the measurement of the prediction you wrote before part 2's code (2 ranks, one step,
# rank 0's count: a hook registered before yours counts the gradients, and every all-reduce
# notes the count when it is launched).

# %%
measured = lab07.measure_launches(BucketedDDP, timeout=check_timeout)
lab07.check_prediction(guess, measured)

# %% [markdown]
# ## Stretch (optional): your own communication hook — top-k with error feedback
#
# A workshop can stop here. Lesson 07 §5 plugged torch's hooks into DDP; now write one. DDP
# calls `hook(state, bucket)` once per bucket, in bucket order, where it would launch that
# bucket's all-reduce: once the bucket and every bucket before it are complete (lesson 07 §3):
# `bucket.buffer()` is the bucket's flat gradient (this rank's), `bucket.index()` its number.
# The hook returns a `torch.futures.Future` whose value is the **averaged** gradient, a tensor
# of the buffer's shape and dtype; DDP waits on it at the end of the backward and writes that
# value into the parameters' `.grad`.
#
# **The goal.** Each rank puts on the wire only the k entries of its gradient of largest
# magnitude (here 5 %, `state.k(numel)`) and where they are. What a rank does not send is not
# thrown away — *error feedback*: it is kept, per bucket, and counts toward what that rank
# chooses and sends at the bucket's next call, so every entry goes once it has grown large
# enough.
#
# **The contract**, per hook call:
#
# - the future's value is the same tensor on every rank: at every index, the sum over the
#   ranks of what each sent there, divided by the world size;
# - nothing of a rank's gradient is lost: after every call, what the rank has sent for this
#   bucket plus what it keeps for it (`state.residual_for(bucket)`, given) equals the sum of
#   the gradients the bucket handed it since that residual started from zeros — and what it
#   sends are the k entries of largest magnitude among everything it could send now;
# - what travels: each rank hands its collectives the k selected values in the gradient's
#   dtype and their k indices, nothing else: **at most 12 bytes per selected entry** (a
#   float32 value, an int64 index as `topk` gives it). A value widened to float64 (16 bytes)
#   carries nothing more and is refused as waste;
# - the hook **returns while its communication is still in flight**: the backward goes on
#   computing earlier layers as the entries travel, and DDP waits on the future only at the
#   end. A hook that waits for its collectives before returning stops the backward at every
#   bucket, and the overlap DDP's hooks exist for is gone.
#
# **Your design decision:** the stretch's is **which collectives carry it**. Which
# collective(s) carry the selected entries, given that each rank picked indices of its own; how
# the averaged tensor is put together from what arrives; and how the hook hands DDP a value
# that does not exist yet when it returns.
#
# `TopKState` (given) holds the fraction and one residual per bucket. DDP rebuilds its buckets
# after the first step (lesson 07 §6), so bucket 0 of the first step is not bucket 0 of the
# second: `residual_for` restarts from zeros a residual whose size no longer matches, and the
# check's replay does the same. The check runs your hook in real DDP on 2 and 3 ranks for 12
# steps, replays top-k with error feedback on the same buckets and compares every result,
# weighs what each rank sends, and watches whether the backward could go on while it did.

# %% [markdown]
# <details><summary>▶ Hint 1 — a question</summary>
#
# Rank 0 picked indices {3, 17}, rank 1 picked {17, 40}. An all-reduce sums tensors position by
# position: what would it need every rank to send? Which collective instead lets every rank
# learn both short lists — and what must happen at index 17? And which tensor is the one whose
# top k a rank sends: this call's gradient alone, or something more?
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 2 — the idea</summary>
#
# Per call: the *corrected* gradient is this call's gradient plus the bucket's residual; pick
# the k entries of largest |corrected|; the residual becomes `corrected` with those entries
# zeroed. Gather every rank's indices and its values (every rank sends the same k, so the sizes
# match on all ranks), then accumulate them into a zeroed tensor shaped like the buffer — add
# where two ranks chose the same index, never overwrite — and divide by the world size. Launch
# the gathers without waiting, and do the accumulating in a callback that runs once both have
# arrived; return the future that callback's result will complete.
#
# The tools, all in torch: a collective launched with `async_op=True` returns a work object
# whose `get_future()` completes when the data has arrived (the output tensors you passed then
# hold it); `torch.futures.collect_all(futures)` is a future that completes when all of them
# have, and its value is the list of those futures; `fut.then(fn)` returns a new future at
# once, and when `fut` completes it calls `fn` with **`fut` itself** (the completed future —
# its value is `fut.value()`): the new future's value is whatever `fn` returns. Lesson 07 §6
# tries them on toys, with `dist.all_gather`, in its fold "▶ Two tools for lab 07's stretch".
#
# </details>

# %% [markdown]
# <details><summary>▶ Hint 3 — the shape of the code</summary>
#
# The residual from the state; the corrected gradient; the top k of its absolute values (their
# indices) and the corrected values there; the residual set to the corrected gradient with
# those entries zeroed; two lists of empty tensors, one per rank, for the indices and for the
# values; two asynchronous gathers and their futures; a small function that builds the average
# from the two lists; the future that joins both gathers, chained on that function, returned.
#
# </details>

# %%
class TopKState:
    """What the hook keeps between steps: the fraction of entries to send, one residual per
    bucket."""

    def __init__(self, fraction=0.05):
        self.fraction = fraction
        self.residuals = {}

    def k(self, numel):
        return max(1, int(self.fraction * numel))

    def residual_for(self, bucket):
        buf = bucket.buffer()
        residual = self.residuals.get(bucket.index())
        if residual is None or residual.shape != buf.shape:   # new, or DDP rebuilt its buckets
            residual = self.residuals[bucket.index()] = torch.zeros_like(buf)
        return residual


def topk_hook(state, bucket):
    ### BEGIN SOLUTION: top-k with error feedback, its communication still in flight on return
    grad = bucket.buffer()
    residual = state.residual_for(bucket)
    corrected = grad + residual
    idx = corrected.abs().topk(state.k(grad.numel())).indices
    values = corrected[idx]
    residual.copy_(corrected)
    residual[idx] = 0
    world_size = dist.get_world_size()
    all_idx = [torch.empty_like(idx) for _ in range(world_size)]
    all_values = [torch.empty_like(values) for _ in range(world_size)]
    # asynchronous: the backward goes on while the gathers travel; DDP waits on the future
    got_idx = dist.all_gather(all_idx, idx, async_op=True).get_future()
    got_values = dist.all_gather(all_values, values, async_op=True).get_future()

    def average(_):
        out = torch.zeros_like(grad)
        for i, v in zip(all_idx, all_values):
            out.index_add_(0, i, v)
        return out / world_size

    return torch.futures.collect_all([got_idx, got_values]).then(average)
    ### END SOLUTION


# %%
lab07.check_topk_hook(topk_hook, TopKState, timeout=check_timeout)
