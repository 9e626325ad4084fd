# %% [markdown]
# # 03 · Distributed data parallel from first principles
#
# DataParallel ran N threads in one process. DDP runs **N processes**, one per device, each with
# its own copy of the model and its own share of every batch. They agree on the weights because,
# after every backward, they **average their gradients** with a collective operation. In this
# lesson we:
#
# 1. start processes (ranks) from the notebook and try the four collectives;
# 2. average gradients by hand and prove: hand-averaged == DDP == one process on the global batch,
#    and the weights stay equal on every rank for many steps;
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
import inspect
import os

import torch
import torch.distributed as dist

from dpcourse import ddp, devices, launch

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
assert [a["rank"] for a in answers] == list(range(world_size))
assert all(a["backend"] == backend for a in answers)

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
print("all four collectives gave the values in the table:", as_in_table)
assert as_in_table, results

# %% [markdown]
# ## Averaging gradients by hand
# Each rank computes the gradient of the **mean loss over its own shard**. The gradient of the
# mean loss over the whole global batch is the *average* of those (the shards are equal in size).
# So after `backward()`: all-reduce each gradient with SUM, then divide by `world_size` — both
# **in place**, on `p.grad` itself:

# %%
print(inspect.getsource(ddp.average_gradients))

# %% [markdown]
# Now three runs of the same training on the same data: (a) `world_size` ranks averaging by
# hand, (b) `world_size` ranks with `DistributedDataParallel`, (c) one process on the whole global
# batch. `compare_three` returns the largest difference between their first-step gradients and
# their weights after `steps` SGD steps.

# %%
cfg = ddp.StepConfig(global_batch=global_batch, steps=steps, lr=lr, width=width, seed=seed)
cmp = ddp.compare_three(cfg, world_size=world_size, backend=backend)
tol = 1e-5
print(f"per-rank batch {cfg.per_rank_batch(world_size)} x {world_size} ranks = global batch {global_batch}")
print(f"gradients  hand-averaged == one process: {cmp['grad_manual_vs_single'] < tol}")
print(f"gradients  DDP           == one process: {cmp['grad_ddp_vs_single'] < tol}")
print(f"gradients  hand-averaged == DDP:         {cmp['grad_manual_vs_ddp'] < tol}")
print(f"weights after {steps} steps, hand-averaged == one process: {cmp['params_manual_vs_single'] < tol}")
print(f"weights after {steps} steps, DDP == one process:           {cmp['params_ddp_vs_single'] < tol}")
print(f"weights bit-for-bit equal on every rank: by hand {cmp['ranks_bitwise_equal_manual']}, "
      f"DDP {cmp['ranks_bitwise_equal_ddp']}")

# %%
assert max(cmp[k] for k in ("grad_manual_vs_single", "grad_ddp_vs_single", "grad_manual_vs_ddp",
                             "params_manual_vs_single", "params_ddp_vs_single")) < tol
assert cmp["ranks_bitwise_equal_manual"] and cmp["ranks_bitwise_equal_ddp"]

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
# 2. **Autograd hooks and buckets.** It registers a hook on every parameter's gradient. Gradients
#    are grouped into **buckets** (`bucket_cap_mb`, 25 MB by default; the first bucket is kept
#    small, and the buckets are rebuilt after the first iteration in the order gradients become
#    ready — the reverse of the forward). When every gradient of a bucket is ready, the bucket is
#    all-reduced (averaged) at once.
# 3. **Overlap.** Those all-reduces start *while the backward is still computing* the gradients of
#    earlier layers, so communication hides behind computation.
#
# We can watch it: give each rank a different initial model, and register a comm hook that records
# each bucket before all-reducing it, plus a gradient hook on the **first** layer's weight (the
# last gradient the backward computes). A small `bucket_cap_mb` makes several buckets out of our
# small model.

# %%
internals = launch.spawn(ddp.ddp_internals_worker, world_size, 0.1, backend=backend)
r0 = internals[0]
print("rank 0's weights changed by DDP:", r0["changed_by_ddp"],
      "| rank 1's:", internals[1]["changed_by_ddp"])
print("weights equal on all ranks after DDP():", r0["equal_on_all_ranks"])
for it, events in enumerate(r0["iterations"]):
    print(f"iteration {it}:")
    for kind, names in events:
        print("   ", kind, names)

# %%
assert not r0["changed_by_ddp"] and all(r["changed_by_ddp"] for r in internals[1:])
assert all(r["equal_on_all_ranks"] for r in internals)
second = [kind for kind, _ in r0["iterations"][1]]
overlaps = second.index("all_reduce") < second.index("first_layer_grad")
last_layer_first = "classifier.4.weight" in r0["iterations"][1][0][1]  # its bucket goes first
print("after the first iteration, all-reduce starts before the backward ends:", overlaps)
print("the last layer's bucket is reduced first:", last_layer_first)
assert overlaps and last_layer_first, second

# %% [markdown]
# In the first iteration everything fits in one bucket (the first bucket is capped at 1 MB and
# only reduced when the backward is done); from the second, buckets follow the backward's order,
# and the last layers' bucket is on the wire while the first layers' gradients are still being
# computed.
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
print("disjoint shards covering the data:", disjoint_cover)
print("without set_epoch every epoch repeats:", repeats, "| with set_epoch it changes:", reshuffles)
assert disjoint_cover and repeats and reshuffles

# %% [markdown]
# (When `n` does not divide by `world_size`, the sampler pads by repeating a few indices — a few
# samples count twice per epoch — unless `drop_last=True`.)
#
# **Lab 03**: write `average_gradients` and a DDP-free data-parallel step; the check runs them on
# 2 ranks and tells you which classic mistake you made, if any.
