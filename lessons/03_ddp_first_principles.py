# %% [markdown]
# # 03 · Distributed data parallel from first principles
#
# **Prerequisites:** lessons 01 and 02 (the training step; why DataParallel is slow).
#
# **You will be able to:**
# - start ranks from a notebook and say what each of the four collectives leaves on every rank;
# - write a DDP training worker: process group, `DistributedDataParallel`, sharded data, the loop;
# - prove that averaging gradients by hand, DDP, and one process on the global batch agree;
# - explain DDP's buckets — why the first iteration has one, and how later ones overlap the
#   backward — from a timeline you record yourself;
# - shard data with `DistributedSampler` and say what forgetting `set_epoch` does.
#
# **Time:** about 30 minutes to read and run.
#
# **Lab:** [lab03_ddp_first_principles](../labs/lab03_ddp_first_principles.ipynb) — write
# `average_gradients` and a DDP-free data-parallel step.
#
# DataParallel ran N threads in one process. DDP runs **N processes**, one per device, each with
# its own copy of the model and its own share of every batch. They agree on the weights because,
# after every backward, they **average their gradients** with a collective operation. In this
# lesson we:
#
# 1. start processes (ranks) from the notebook and try the four collectives;
# 2. train with DDP and prove: DDP == one process on the global batch, and the weights stay
#    equal on every rank for many steps; then (after lab 03) the same by hand;
# 3. look inside DDP: the initial broadcast, the gradient buckets, the all-reduce during backward;
# 4. shard the data with `DistributedSampler`, and see what forgetting `set_epoch` does.
#
# Every multi-process cell goes through `dpcourse.launch.spawn`, with the backend that
# `dpcourse.devices` picks: gloo with 2 ranks on the CPU here; nccl with one GPU per rank on a
# multi-GPU machine. Nothing below changes between the two.

# %% tags=["parameters"]
world_size = None    # None: from the hardware profile (2 on the cpu profile)
steps = 10           # steps of the "many steps" comparison
global_batch = 32
width = 8            # SmallCNN width
lr = 0.05
seed = 0

# %%
import os

import torch
import torch.distributed as dist

from dpcourse import ddp, devices, launch, viz
from dpcourse.checks import claim

torch.set_num_threads(1)  # the reference run below shares the 2 cores with the ranks
profile = devices.choose_profile(world_size=world_size)
world_size = profile.world_size
backend = devices.backend_for(world_size)
ddp.validate_world_size(world_size, backend)

# %%
# NBVAL_IGNORE_OUTPUT
# (why: the profile depends on this machine's GPUs.)
print(profile.describe())
print(f"this lesson: {world_size} ranks over {backend}")

# %% [markdown]
# ## Processes, ranks, rendezvous
# Each process is a **rank** `0 … world_size−1`. To talk, they first meet at a **rendezvous**:
# here a TCP store at `MASTER_ADDR:MASTER_PORT` that rank 0 hosts; `init_process_group(backend)`
# reads the address, `RANK` and `WORLD_SIZE` from the environment. The **backend** moves the
# bytes: **gloo** (CPU tensors, any machine) or **nccl** (GPU tensors, one GPU per rank, much
# faster). `spawn` sets the variables, starts the ranks, initialises the group, and hands back
# what each rank returns. A worker is any function `f(rank, world_size, ...)` — even one defined
# in a cell like this:

# %%
def hello(rank, world_size):
    return {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "env": {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR")},
    }


answers = launch.spawn(hello, world_size, backend=backend)
for a in answers:
    print(a["rank"], a["world_size"], a["env"])
claim("the results come back in rank order, one per rank",
      [a["rank"] for a in answers] == list(range(world_size)))
claim("every rank uses the profile's backend", all(a["backend"] == backend for a in answers))

# %% [markdown]
# ## The four collectives
# A **collective** is called by *every* rank; it returns when all have taken part.
#
# | collective | every rank gives | every rank gets |
# |---|---|---|
# | `broadcast(t, src=0)` | its `t` | rank 0's `t` |
# | `all_reduce(t, SUM)` | its `t` | the sum of all `t` (in place) |
# | `all_gather(parts, t)` | its `t` | the list of everyone's `t` |
# | `reduce_scatter(out, parts)` | a list of `world_size` pieces | piece *r* summed over the ranks |
#
# `all_reduce` = `reduce_scatter` followed by `all_gather` — which is how the ring of lesson 06
# does it.

# %%
viz.show_code(ddp.collectives_demo)

# %%
results = launch.spawn(ddp.collectives_demo, world_size, backend=backend)
for r, res in enumerate(results):
    print(f"rank {r}: {res}")

# %%
N = world_size
as_in_table = all(
    res["broadcast"] == [10.0] * 3                                      # rank 0 had 1*10
    and res["all_reduce"] == [N * (N + 1) / 2, 10 * N * (N + 1) / 2]    # 1+2+...+N
    and res["all_gather"] == [float(k) for k in range(N)]
    and res["reduce_scatter"] == [float(sum(10 * k + r for k in range(N)))] * 2
    for r, res in enumerate(results))
claim("all four collectives gave the values in the table", as_in_table, results=results)
# What each rank held before each call, as collectives_demo builds it:
before = {
    "broadcast": [[(r + 1) * (10 if r == 0 else 1)] * 3 for r in range(N)],
    "all_reduce": [[r + 1, 10 * (r + 1)] for r in range(N)],
    "all_gather": [[r] for r in range(N)],
    "reduce_scatter": [[[10 * r + j] * 2 for j in range(N)] for r in range(N)],
}
after = {name: [res[name] for res in results] for name in before}
viz.show(viz.collectives_figure(before, after),
         "broadcast copies rank 0's tensor; all_reduce leaves the sum on every rank; all_gather "
         "leaves everyone's pieces on every rank; reduce_scatter leaves rank r the sum of piece r.")

# %% [markdown]
# ## Averaging gradients — and DDP, which does it for you
# Each rank computes the gradient of the **mean loss over its own shard**. The gradient of the
# mean loss over the whole global batch is the *average* of those (the shards are equal in size).
# So after `backward()`, every gradient must be all-reduced with SUM and divided by `world_size`
# — on every rank, before the optimizer step. That is the whole idea of data parallelism; you will
# write it yourself in lab 03. `DistributedDataParallel` does it for you, hidden in `backward()`.
#
# Here is a complete DDP training worker. Every rank builds the same model (same seed), wraps it
# in `DDP`, and trains on its own contiguous shard of each global batch; after `loss.backward()`
# the gradients are already averaged over the ranks. Next to it, the reference: one process on
# the whole global batch.

# %%
viz.show_code(ddp.ddp_worker, ddp.shard_of, ddp.single_process)

# %%
cfg = ddp.StepConfig(global_batch=global_batch, steps=steps, lr=lr, width=width, seed=seed)
per_rank_batch = cfg.per_rank_batch(world_size)
wrapped = launch.spawn(ddp.ddp_worker, world_size, cfg, backend=backend, timeout=120)
single = ddp.single_process(cfg)


def max_diff(a, b):
    return float((a - b).abs().max())


tol = 1e-5
print(f"per-rank batch {per_rank_batch} x {world_size} ranks = global batch {global_batch}")
claim("first-step gradients: DDP == one process on the global batch (to 1e-5)",
      max(max_diff(r["grads"], single["grads"]) for r in wrapped) < tol)
claim(f"weights after {steps} steps: DDP == one process (to 1e-5)",
      max(max_diff(r["params"], single["params"]) for r in wrapped) < tol)
claim("weights after every rank's last step are bit-for-bit equal across the ranks",
      all(torch.equal(wrapped[0]["params"], r["params"]) for r in wrapped))

# %% [markdown]
# ## Lab 03: average the gradients yourself
#
# Before reading on, open [lab03_ddp_first_principles](../labs/lab03_ddp_first_principles.ipynb)
# and write what DDP just did for you: `average_gradients(model)` and a DDP-free training step.
# The rest of this section shows the library's answer, so do the lab first.
#
# The library's `average_gradients`, and the worker that uses it in place of DDP:

# %%
viz.show_code(ddp.average_gradients, ddp.manual_dp_worker)

# %%
manual = launch.spawn(ddp.manual_dp_worker, world_size, cfg, backend=backend, timeout=120)
claim("first-step gradients: hand-averaged == one process (to 1e-5)",
      max(max_diff(r["grads"], single["grads"]) for r in manual) < tol)
claim("first-step gradients: hand-averaged == DDP (to 1e-5)",
      max(max_diff(m["grads"], d["grads"]) for m, d in zip(manual, wrapped)) < tol)
claim(f"weights after {steps} steps: hand-averaged == one process (to 1e-5)",
      max(max_diff(r["params"], single["params"]) for r in manual) < tol)
claim("hand-averaged weights are bit-for-bit equal across the ranks",
      all(torch.equal(manual[0]["params"], r["params"]) for r in manual))

# %% [markdown]
# Equal to float tolerance, not bit for bit, against the single process: summing the gradient
# in two halves and then adding rounds differently from summing it in one go. *Between ranks*,
# though, the weights are identical to the last bit after every step: every rank receives the
# very same all-reduced numbers and applies the same update. Nobody ever sends weights after the
# start — equal gradients keep them equal.
#
# Bad input gets one sentence, not a hang deep in a rank:

# %%
for bad in (lambda: ddp.StepConfig(global_batch=5).per_rank_batch(2),
            lambda: ddp.StepConfig(global_batch=1).per_rank_batch(2)):
    try:
        bad()
    except ValueError as e:
        print("ValueError:", e)

# %%
# NBVAL_IGNORE_OUTPUT
# (why: the message names how many GPUs this machine has.)
too_many = (torch.cuda.device_count() if torch.cuda.is_available() else 0) + 1
try:
    ddp.validate_world_size(too_many, "nccl")
except ValueError as e:
    print("ValueError:", e)
else:
    raise AssertionError("a world size larger than the GPUs must be refused")

# %% [markdown]
# ## How DDP does it
# `DistributedDataParallel(model)` adds three things to what we did by hand:
#
# 1. **Broadcast at construction.** It copies rank 0's weights to every rank, so the ranks start
#    equal even if they were initialised differently.
# 2. **Autograd hooks and buckets.** It registers a hook on every parameter's gradient and groups
#    the gradients into **buckets** of about `bucket_cap_mb` (25 MB by default). When every
#    gradient of a bucket is ready, the whole bucket is all-reduced in one call.
# 3. **Overlap.** Those all-reduces start *while the backward is still computing* the gradients of
#    earlier layers, so communication hides behind computation.
#
# First the broadcast: every rank builds its model from a *different* seed, and after `DDP(model)`
# they are equal.

# %%
viz.show_code(ddp.ddp_internals_worker)

# %%
internals = launch.spawn(ddp.ddp_internals_worker, world_size, 0.1, backend=backend)
claim("DDP(model) left rank 0's weights unchanged", not internals[0]["changed_by_ddp"])
claim("DDP(model) overwrote every other rank's weights",
      all(r["changed_by_ddp"] for r in internals[1:]))
claim("after DDP(model) the weights are equal on all ranks",
      all(r["equal_on_all_ranks"] for r in internals))

# %% [markdown]
# ### Buckets, and why the first iteration has only one
# To see the buckets we replace DDP's all-reduce with our own **comm hook**: DDP calls it once per
# bucket, when the bucket is full, and our hook stamps the time, launches the same asynchronous
# all-reduce DDP would, and stamps the time again when it has finished. A tensor hook on every
# parameter stamps when its gradient is computed. The model is 0.72 MB of float32, and we ask
# for buckets of 0.1 MB — so it cannot fit in one bucket.
#
# (This worker always runs on the CPU with gloo: what we look at is DDP's bookkeeping, which is
# the same with NCCL.)

# %%
def bucket_worker(rank, world_size, bucket_cap_mb, model_fn, find_unused_parameters=False,
                  iterations=3, batch=32):
    import time

    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = model_fn()
    ddp_model = DDP(model, bucket_cap_mb=bucket_cap_mb,
                    find_unused_parameters=find_unused_parameters)
    names = {p: n for n, p in model.named_parameters()}
    log = {"grads": [], "buckets": []}

    def timed_allreduce(state, bucket):          # DDP calls this once per full bucket
        start = time.perf_counter()
        params = [names[p] for p in bucket.parameters()]
        nbytes = bucket.buffer().numel() * bucket.buffer().element_size()

        def finished(fut):                       # runs when the all-reduce has completed
            log["buckets"].append((params, nbytes, start, time.perf_counter()))
            return fut.value()

        return default_hooks.allreduce_hook(None, bucket).then(finished)

    ddp_model.register_comm_hook(None, timed_allreduce)
    for name, p in model.named_parameters():     # a time stamp when each gradient is computed
        p.register_hook(lambda g, name=name: log["grads"].append((name, time.perf_counter())))

    X = torch.randn(batch, 3, 32, 32)
    iterations_seen = []
    for _ in range(iterations):
        log["grads"].clear()
        log["buckets"].clear()
        loss = ddp_model(X).square().mean()
        t0 = time.perf_counter()
        loss.backward()                          # returns once every bucket is all-reduced
        t1 = time.perf_counter()
        ms = lambda t: (t - t0) * 1e3
        iterations_seen.append({
            "backward_end": ms(t1),
            "grads": [(n, ms(t)) for n, t in log["grads"]],
            "buckets": sorted(((p, b, ms(t_start), ms(t_end))
                               for p, b, t_start, t_end in log["buckets"]), key=lambda e: e[2]),
        })
    return iterations_seen


def small_cnn():
    from dpcourse import models

    return models.SmallCNN(width=32)


cap_mb = 0.1
runs = launch.spawn(bucket_worker, world_size, cap_mb, small_cnn, backend="gloo", timeout=60)
model_bytes = sum(b for _, b, *_ in runs[0][0]["buckets"])
for it, seen in enumerate(runs[0]):
    print(f"iteration {it}: {len(seen['buckets'])} bucket(s), parameters per bucket "
          f"{[len(names) for names, *_ in seen['buckets']]}, "
          f"KiB per bucket {[round(b / 1024) for _, b, *_ in seen['buckets']]}")

# %%
first, second, third = runs[0]
claim(f"the model ({model_bytes / 2**20:.2f} MiB) is larger than the bucket cap ({cap_mb} MB)",
      model_bytes > cap_mb * 2**20)
claim("iteration 0: ONE bucket holding all 10 parameters, whatever the cap",
      len(first["buckets"]) == 1 and len(first["buckets"][0][0]) == 10)
claim("from iteration 1 on: several buckets, the same on every later iteration",
      len(second["buckets"]) > 1 and [b[0] for b in second["buckets"]]
      == [b[0] for b in third["buckets"]])
claim("the first bucket reduced holds the last layer (its gradient is computed first)",
      "classifier.4.weight" in second["buckets"][0][0])

# %% [markdown]
# Why one bucket first? Not because of a size limit: the model is seven times the cap. In its
# constructor DDP does not yet know in which order the backward will produce the gradients —
# registration order is only a guess, and a wrong guess could make ranks launch all-reduces in
# different orders (a deadlock or a silent mix-up). So, unless you pass `find_unused_parameters=True`
# or `static_graph=True`, DDP **disables bucketing for the first iteration**: one bucket, all-reduced
# once every gradient is ready. During that iteration the reducer records the order in which the
# gradients really arrived, and before the second forward it **rebuilds the buckets** in that order,
# capped at `bucket_cap_mb` (you can read this in `torch/nn/parallel/distributed.py`, where the
# initial size limit is `sys.maxsize`, and `_rebuild_buckets` in `reducer.cpp`).
#
# With `find_unused_parameters=True` DDP must walk the graph every iteration anyway, and it does
# bucket by size from the start (in reverse registration order). We give that model a head it never
# uses, which is exactly the case that flag exists for:

# %%
def cnn_with_unused_head():
    from torch import nn

    from dpcourse import models

    class WithUnusedHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = models.SmallCNN(width=32)
            self.unused = nn.Linear(10, 10)  # never called in forward

        def forward(self, x):
            return self.net(x)

    return WithUnusedHead()


unused_runs = launch.spawn(bucket_worker, world_size, cap_mb, cnn_with_unused_head, True, 1,
                           backend="gloo", timeout=60)
n_first = len(unused_runs[0][0]["buckets"])
print(f"find_unused_parameters=True, iteration 0: {n_first} buckets")
claim("with find_unused_parameters=True the first iteration is already bucketed", n_first > 1)

# %% [markdown]
# ### The overlap, on a timeline
# Here is iteration 2 on rank 0, drawn from the time stamps the hooks recorded. Each tick on the
# top row is a gradient being computed; each bar is one bucket's all-reduce, from launch to finish.

# %%
claim("iteration 2: the first bucket's all-reduce started before the last gradient was computed",
      third["buckets"][0][2] < max(t for _, t in third["grads"]))
viz.show(viz.ddp_timeline_figure(third, f"rank 0, iteration 2, bucket_cap_mb={cap_mb}"),
         "the first bucket (the classifier) goes on the wire while the convolutions' gradients "
         "are still being computed; backward() returns only when the last bucket is done.")

# %%
# NBVAL_IGNORE_OUTPUT
# Why: the times depend on this machine and its load.
busy = sum(e - s for *_, s, e in third["buckets"])
print(f"iteration 2 on rank 0: backward took {third['backward_end']:.1f} ms; its buckets were on "
      f"the wire for {busy:.1f} ms in all, {third['buckets'][0][2]:.1f} ms after backward() "
      f"began for the first one.")

# %% [markdown]
# On a CPU with gloo, "on the wire" competes with the backward for the same two cores, so do not
# expect the overlap to save time here; on GPUs with NCCL the communication runs on its own
# hardware path, and lesson 07 measures what overlap buys.
#
# | | DataParallel | DDP |
# |---|---|---|
# | processes | 1 (threads, one GIL) | 1 per device |
# | weights sent | every step, from device 0 | once, at the start |
# | gradients | summed onto device 0 | all-reduced, averaged on every rank |
# | per-step traffic at the busiest device | 2(N−1)K | 2(N−1)K/N with ring all-reduce |
# | overlap with backward | no | yes (buckets) |
# | multi-machine | no | yes |

# %% [markdown]
# ## DistributedSampler and `set_epoch`
# Each rank must read a different shard of the data. `DistributedSampler(dataset, num_replicas,
# rank)` shuffles the indices with `seed + epoch`, pads them to a multiple of `world_size`, and
# gives rank *r* every `world_size`-th index starting at *r*. Each rank computes its shard **by
# itself** — no communication — so all ranks must agree on the epoch: that is what
# `sampler.set_epoch(epoch)` is for. Forget it and the epoch stays 0: the same order every epoch.

# %%
n = 10
without = ddp.sampler_orders(n, world_size, epochs=3, set_epoch=False, seed=seed)
with_ = ddp.sampler_orders(n, world_size, epochs=3, set_epoch=True, seed=seed)
for name, orders in (("without set_epoch", without), ("with set_epoch", with_)):
    print(name)
    for e, per_rank in enumerate(orders):
        print(f"  epoch {e}: " + "  ".join(f"rank {r}: {o}" for r, o in enumerate(per_rank)))

# %%
disjoint_cover = all(ddp.shard_overlap(per_rank) == 0                       # disjoint shards
                     and sorted(sum(per_rank, [])) == list(range(n))       # that cover the data
                     for orders in (without, with_) for per_rank in orders)
repeats = without[0] == without[1] == without[2]                     # the same order every epoch
reshuffles = with_[0] != with_[1] and with_[1] != with_[2]           # a new order every epoch
claim("in every epoch the ranks' shards are disjoint and cover the data", disjoint_cover)
claim("without set_epoch every epoch repeats the same order", repeats)
claim("with set_epoch the order changes every epoch", reshuffles)
viz.show(viz.sampler_grid_figure({"without set_epoch": without, "with set_epoch": with_}),
         "without set_epoch the three epochs are the same pattern of colours; with it every epoch "
         "is shuffled anew, and in each epoch the ranks share the indices between them.")

# %% [markdown]
# (When `n` does not divide by `world_size`, the sampler pads by repeating a few indices — a few
# samples count twice per epoch — unless `drop_last=True`.)
#
# ## Summary
#
# - DDP runs one process per device; the processes meet at a rendezvous and talk through
#   collectives (broadcast, all_reduce, all_gather, reduce_scatter) that every rank must call.
# - Averaging the gradients (all-reduce SUM, divide by `world_size`) makes each rank's step the
#   step of one process on the global batch — equal to float tolerance, and bit-for-bit equal
#   across the ranks.
# - `DDP(model)` broadcasts rank 0's weights once, then all-reduces gradients in buckets from
#   inside `backward()`. The first iteration uses one bucket (the gradient order is not known
#   yet); afterwards the buckets follow the order gradients arrived, and they overlap the backward.
# - `DistributedSampler` gives each rank a disjoint shard; call `set_epoch` every epoch or every
#   epoch repeats the same order.
#
# ## Check yourself

# %%
viz.quiz([
    {"q": "Each rank's loss is the mean over its own shard of 16 samples, with 4 ranks. What "
          "must happen to the gradients after backward() so every rank takes the global-batch "
          "step?",
     "options": ["all_reduce with SUM", "all_reduce with SUM, then divide by 4",
                 "broadcast rank 0's gradients"],
     "answer": 1,
     "why": ["The sum of four shard-means is 4 times the mean over the 64 samples.",
             "Right: the average of equal-sized shard means is the global mean.",
             "Then every rank would step with rank 0's shard only."]},
    {"q": "Why does the first backward under DDP all-reduce one bucket holding every gradient?",
     "options": ["The first bucket is capped at 1 MB and the model is small",
                 "DDP does not know the gradients' order yet, so it disables bucketing for the "
                 "first iteration and rebuilds buckets from the order it observed",
                 "gloo cannot all-reduce several buckets at once"],
     "answer": 1,
     "why": ["This lesson's model was seven times the cap and still went in one bucket.",
             "Right: the initial size limit is sys.maxsize; the rebuild happens before the "
             "second forward.",
             "From the second iteration on, gloo all-reduced several buckets."]},
    {"q": "After 10 steps, are DDP's weights bit-for-bit equal to one process on the global "
          "batch?",
     "options": ["Yes, always", "No, but they are equal to float tolerance; and across the "
                 "ranks they ARE bit-for-bit equal", "No, they drift apart by design"],
     "answer": 1,
     "why": ["Summing in two halves rounds differently from summing in one go.",
             "Right: every rank applies the very same all-reduced numbers.",
             "They agree to about 1e-6 here; nothing drifts on purpose."]},
    {"q": "You forget sampler.set_epoch(epoch). What happens?",
     "options": ["Ranks read overlapping data", "Every epoch uses the same shuffled order",
                 "The program hangs at the second epoch"],
     "answer": 1,
     "why": ["The shards stay disjoint: each rank still takes every world_size-th index.",
             "Right: the shuffle is seeded with seed + epoch, and the epoch stays 0.",
             "Nothing is communicated by the sampler, so nothing can hang."]},
])
