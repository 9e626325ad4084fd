# %% [markdown]
# # 03 · Distributed data parallel from first principles
#
# **Prerequisites:** lessons 01 and 02 (the training step; why DataParallel is slow).
#
# **You will be able to:**
# - start ranks from a notebook and say what each of the four collectives leaves on every rank;
# - read a complete DDP training worker (process group, `DistributedDataParallel`, sharded
#   data, the loop) and write its averaging step yourself;
# - prove that averaging gradients by hand, DDP, and one process on the global batch agree;
# - explain why DDP groups gradients into buckets, why by default its first iteration
#   reduces them all in one bucket, and how later buckets can overlap the backward — and
#   measure how far a bucket can exceed its size cap, from what you record;
# - say which BatchNorm statistics each rank uses and rank 0 saves, and why;
# - shard data with `DistributedSampler` and say what forgetting `set_epoch` does.
#
# **Time:** about 65 minutes to read and run, and about 30 more for the lab.
#
# **Lab:** [lab03_ddp_first_principles](../labs/lab03_ddp_first_principles.ipynb) — write
# `average_gradients`, a DDP-free data-parallel step, and the average over shards of unequal
# sizes (which this lesson does not show).
#
# DataParallel ran N threads in one process. DDP runs **N processes**, one per device, each with
# its own copy of the model and its own share of every batch. They agree on the weights because,
# after every backward, they **average their gradients** with a collective operation. In this
# lesson we:
#
# 1. start processes (ranks) from the notebook and try the four collectives;
# 2. train with DDP and prove: DDP == one process on the global batch (to 1e-5), and after
#    10 steps the weights are bit-for-bit equal on every rank; then (after lab 03) the same
#    by hand;
# 3. look inside DDP: the initial broadcast, the gradient buckets and when they are sent,
#    during the backward; the buffers broadcast before (most) forwards;
# 4. shard the data with `DistributedSampler`, and see what forgetting `set_epoch` does.
#
# Every multi-process cell goes through `dpcourse.launch.spawn`. The hello cell, the four
# collectives, the core comparison (DDP, one process, and the hand-averaged step) and DDP's
# initial broadcast use the backend that `dpcourse.devices` picks: gloo with 2 ranks on the CPU
# here; nccl with one GPU per rank on a multi-GPU machine, where they are written to print and
# prove the same (checked on the CPU profile only: the stored outputs are its, and the NCCL path
# has not been run on a multi-GPU machine; its bit-for-bit claim between two launches rests on
# the deterministic convolutions `setup_rank` asks cuDNN for).
# The internals sections — 3 ranks, the buckets and their timeline, the flag for a model that
# uses the same parameters every iteration, the buffers — always run gloo on the CPU, whatever
# the machine, because they look at DDP's bookkeeping. What NCCL does differently there (its
# all-reduce runs on the GPU, asynchronously) is read from source, not measured, and marked so.

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
# here a TCP **store** (a small key-value server through which the ranks swap the addresses
# they need to connect) at `MASTER_ADDR:MASTER_PORT`, which rank 0 hosts under `spawn` (under
# `torchrun`, lesson 04's launcher, usually a process of torchrun's own on the first node;
# lesson 04 and Sources give the exceptions). The
# **backend** is the library that moves the bytes: **gloo** (a collective communication library
# from Meta, made for CPU tensors; it runs most collectives on GPU tensors too, slowly, through the
# CPU's memory: the appendix finds which) or **nccl** (NVIDIA's
# Collective Communications
# Library: GPU tensors only, one GPU per rank by default (lesson 00 finds the switch), much
# faster on GPUs). In every rank `spawn` sets
# `MASTER_ADDR`, `MASTER_PORT`, `RANK` and `WORLD_SIZE` in the environment, then runs
#
# ```python
# dist.init_process_group(backend, rank=rank, world_size=world_size)
# result = fn(rank, world_size, *args)      # your worker; spawn hands `result` back
# ```
#
# The default `env://` rendezvous takes the store's address from the environment, and rank and
# world size from the arguments when they are given (from `RANK` and `WORLD_SIZE` otherwise,
# which is how a script that `torchrun` starts calls `init_process_group(backend)` with no
# more). A worker is any function `f(rank, world_size, ...)` — even one defined in a cell like
# this:

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
# A **collective** is an operation that *every* rank of the group calls, in the same order as the
# others; the table says what it leaves on each rank. With gloo on the CPU the call returns
# once the result is in the tensor. With nccl it queues the work on the GPU and returns
# without waiting for it (unless `TORCH_NCCL_BLOCKING_WAIT=1`, lesson 10); later GPU work still
# runs after it. With `async_op=True` either call returns at once a *work* handle, whose
# `wait()` makes what follows wait for the collective.
# NCCL runs a group's collectives over its *communicator*: the connections between the ranks'
# GPUs, formed by default at the first collective (lesson 10 shows where that matters).
#
# | collective | every rank gives | every rank gets |
# |---|---|---|
# | `broadcast(t, src=0)` | its `t` | rank 0's `t` |
# | `all_reduce(t, SUM)` | its `t` | the sum of all `t` (in place) |
# | `all_gather(parts, t)` | its `t` | the list of everyone's `t` |
# | `reduce_scatter(out, parts)` | a list of `world_size` pieces | piece *r* summed over the ranks |
#
# `all_reduce` = `reduce_scatter` followed by `all_gather` — which is how the ring of lesson 06
# does it. (`collectives_demo` first calls `ddp.setup_rank()`, shown in the next section.)

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
# mean loss over the whole global batch is the *average* of those, when:
#
# 1. **Equal counts**: every shard's mean divides by the same count. Equal shards are not enough:
#    padded targets skipped by `ignore_index`, or class weights, change what `F.cross_entropy`'s
#    mean divides by, shard by shard (the cell below shows it).
# 2. **Independent samples**: each sample's loss depends on that sample alone. Training-mode
#    BatchNorm breaks it: it normalises each sample with its batch's statistics, so a rank's
#    shard gives a different gradient than the global batch (the cell below shows it too).
# 3. **No randomness** in the forward. Dropout breaks it even on identically seeded ranks (they
#    all draw the same masks, which the global batch would not): still a valid
#    stochastic gradient, not the same numbers. Every model here keeps `SmallCNN`'s
#    `dropout=0.0`.
#
# So after `backward()` and before the optimizer step, every rank must replace each of its
# gradients by their average over all the ranks — the same numbers on every rank. That is the
# whole idea of data parallelism; how to produce that average from the collectives above, you
# will work out yourself in lab 03. `DistributedDataParallel` does it for you, hidden
# in `backward()` (how DDP orders the arithmetic comes after the lab).
#
# The identity in one process, no ranks needed: the average of the gradients of two halves of
# a batch, against the gradient of the whole batch, for the course's small CNN (no BatchNorm)
# and for a small network with a BatchNorm layer in training mode; then the small CNN again,
# with some targets in one half padded out.

# %%
from torch import nn
from torch.nn import functional as F

from dpcourse import models

viz.show_code(models.SmallCNN, folded="▶ code: models.SmallCNN, this lesson's model (lesson 01's)")


def flat_grad(model, X, y):
    model.zero_grad()
    F.cross_entropy(model(X), y).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def halves_vs_whole(model, X, y):
    halves = [flat_grad(model, Xh, yh) for Xh, yh in zip(X.chunk(2), y.chunk(2))]
    return max_diff((halves[0] + halves[1]) / 2, flat_grad(model, X, y))


def max_diff(a, b):
    return float((a - b).abs().max())


torch.manual_seed(seed)
X16, y16 = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
no_bn = models.SmallCNN(width=8)
with_bn = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                        nn.Flatten(), nn.Linear(8 * 32 * 32, 10))
claim("no BatchNorm: the average of the two halves' gradients == the whole batch's (to 1e-5)",
      halves_vs_whole(no_bn, X16, y16) < 1e-5)
claim("training-mode BatchNorm: they differ by more than 1e-3",
      halves_vs_whole(with_bn.train(), X16, y16) > 1e-3)
padded = y16.clone()
padded[:6] = -100      # cross_entropy's ignore_index: the first half counts 2 targets, the second 8
claim("no BatchNorm, but 6 targets padded in the first half: they differ by more than 1e-3",
      halves_vs_whole(no_bn, X16, padded) > 1e-3)

# %% [markdown]
# So DDP on a BatchNorm network takes the step of N *smaller* batches averaged, not of the
# global batch. A BatchNorm that computes its statistics over every rank's shard together
# restores the identity: lesson 04 measures that with a CPU stand-in that combines the
# ranks' statistics (`nn.SyncBatchNorm` itself refuses CPU tensors in training mode inside a
# process group, so what it computes is not measured on this machine; on GPUs it aims at the
# same by another route).
#
# Here is a complete DDP training worker. Every rank builds the same model (`make_model`: same
# seed, `SmallCNN` with its default `dropout=0.0`, so the forward draws nothing at random), wraps
# it in `DDP`, and trains on its own contiguous shard of each global batch
# (`global_batch_for_step` hands every process the same consecutive samples; `shard_of` cuts
# rank r's share); after `loss.backward()` the gradients are already averaged over the ranks.
# Next to it, the reference: one process on the whole global batch. Then `flat_params` and
# `_flat_grads`, which copy a model's weights and gradients into one flat CPU vector each, in
# `model.parameters()` order: the tensors the claims compare. `setup_rank()`, shown
# last, prepares the process and returns the rank's device (`cuda:<rank>` under nccl, the CPU
# under gloo); on a GPU it turns off TF32 (TensorFloat-32: float32 matrix products and
# convolutions computed with 10 mantissa bits, not 23), whose ~1e-3 rounding would hide the
# 1e-5 agreement below, and asks cuDNN for deterministic convolutions: torch lists `Conv2d` on
# CUDA as normally nondeterministic, and a claim below compares two launches bit for bit.

# %%
viz.show_code(ddp.make_model, ddp.global_batch_for_step, ddp.ddp_worker, ddp.shard_of,
              ddp.single_process, ddp.flat_params, inspect.getsource(ddp._flat_grads),
              ddp.setup_rank)

# %% [markdown]
# **▶ The experiment's numbers and data** (click the folded cell below): `StepConfig` (the
# run below prints it) and `_train_tensors` (lesson 01's `make_shapes10`, made once per
# process).

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show_code(ddp.StepConfig, inspect.getsource(ddp._train_tensors),
              folded="▶ StepConfig and _train_tensors")

# %% [markdown]
# `ddp.same_bits(a, b)`, which the claims below use, asks whether two float32 tensors are equal
# bit for bit. Not `torch.equal` on the floats, which compares values (−0.0 equals 0.0, a NaN
# equals nothing): it compares their int32 views, the same 4 bytes read as integers, equal
# exactly when the bits are. The cell after it tests it: it must refuse two tensors that
# differ in one element by one float (`torch.nextafter`, the smallest step a float32 can
# take) and accept a copy.

# %%
viz.show_code(ddp.same_bits)

# %%
same_bits = ddp.same_bits
probe = torch.randn(1000)
one_float_off = probe.clone()
one_float_off[500] = torch.nextafter(probe[500], torch.tensor(float("inf")))
claim("same_bits accepts a copy and refuses a tensor one float away in one element of 1000",
      same_bits(probe, probe.clone()) and not same_bits(probe, one_float_off))
zero, nan = torch.tensor([0.0]), torch.tensor([float("nan")])
claim("torch.equal holds -0.0 equal to 0.0 and a NaN unequal to itself; same_bits the reverse",
      torch.equal(-zero, zero) and not torch.equal(nan, nan)
      and not same_bits(-zero, zero) and same_bits(nan, nan.clone()))

# %% [markdown]
# The headline: DDP on the ranks against one process on the whole global batch.

# %%
cfg = ddp.StepConfig(global_batch=global_batch, steps=steps, lr=lr, width=width, seed=seed)
per_rank_batch = cfg.per_rank_batch(world_size)
wrapped = launch.spawn(ddp.ddp_worker, world_size, cfg, backend=backend, timeout=120)
single = ddp.single_process(cfg)
tol = 1e-5
print(f"{cfg}: per-rank batch {per_rank_batch} x {world_size} ranks = global batch "
      f"{global_batch}")
claim("first-step gradients: DDP == one process on the global batch (to 1e-5)",
      max(max_diff(r["grads"], single["grads"]) for r in wrapped) < tol)
claim(f"weights after {steps} steps: DDP == one process (to 1e-5)",
      max(max_diff(r["params"], single["params"]) for r in wrapped) < tol)
claim(f"weights after the {steps} steps are bit-for-bit equal across the ranks (same_bits)",
      all(same_bits(wrapped[0]["params"], r["params"]) for r in wrapped))

# %% [markdown]
# ## Lab 03: average the gradients yourself
#
# Before reading on, open [lab03_ddp_first_principles](../labs/lab03_ddp_first_principles.ipynb)
# and write what DDP just did for you: `average_gradients(model)` (also for ranks that did not
# all use the same parameters) and a DDP-free training step that also reports the global
# batch's loss; then the average when the ranks' shards differ in size. No cell here shows
# either of those two cases.
# The library's own `average_gradients` is in the folded cell below: open it once your lab
# passes.

# %% [markdown]
# **▶ The reference answer — open after your lab passes** (click the folded cells below).
#
# <details><summary>▶ open</summary>
#
# This is the reference for THIS lesson's model, where every rank used every parameter: a
# `p.grad` that is `None` is then `None` on every rank (a frozen parameter), and skipping it
# skips the same tensors everywhere. It is NOT an answer to lab 03 part 1, whose ranks use
# different heads: there the ranks would skip different tensors and their `all_reduce` calls
# would pair the wrong tensors or hang (the case DDP's `find_unused_parameters=True` is for).
# Part 1's contract, every parameter that got a gradient on any rank ends with the mean on
# every rank, is one this function does not meet.
#
# </details>

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show_code(ddp.average_gradients,
              folded="▶ The reference answer — open after your lab passes")

# %% [markdown]
# The worker that uses it in place of DDP, `manual_dp_worker`, has the same model, data and
# steps as `ddp_worker`. How its step is built is lab 03's part 3 (there with the global
# batch's loss too), so it is folded as well; the claims after it compare it with DDP and with
# one process.
#
# **▶ The reference answer — open after your lab passes** (click the folded cell below).

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show_code(ddp.manual_dp_worker,
              folded="▶ The reference answer — open after your lab passes")

# %%
manual = launch.spawn(ddp.manual_dp_worker, world_size, cfg, backend=backend, timeout=120)
claim("first-step gradients: hand-averaged == one process (to 1e-5)",
      max(max_diff(r["grads"], single["grads"]) for r in manual) < tol)
if world_size == 2:   # why 2 ranks agree to the last bit: "The reducer's arithmetic"
    claim("2 ranks: first-step gradients, hand-averaged == DDP bit for bit (same_bits)",
          all(same_bits(m["grads"], d["grads"]) for m, d in zip(manual, wrapped)))
else:                 # with 3 or more ranks the two round differently in the last bits
    claim(f"{world_size} ranks: first-step gradients, hand-averaged == DDP to 1e-5, not bit for "
          f"bit: the two order their arithmetic differently (\"The reducer's arithmetic\")",
          max(max_diff(m["grads"], d["grads"]) for m, d in zip(manual, wrapped)) < tol)
claim(f"weights after {steps} steps: hand-averaged == one process (to 1e-5)",
      max(max_diff(r["params"], single["params"]) for r in manual) < tol)
claim("hand-averaged weights are bit-for-bit equal across the ranks (same_bits)",
      all(same_bits(manual[0]["params"], r["params"]) for r in manual))
gap = max(max_diff(r["params"], single["params"]) for r in wrapped + manual)
claim(f"{world_size} ranks: weights after {steps} steps == one process to 1e-5, not bit for bit "
      f"(DDP and hand-averaged alike)", 0 < gap < tol, gap=gap)

# %% [markdown]
# Equal to 1e-5, not bit for bit (the last claim: the gap is above 0), against the single
# process: summing the gradient
# in two halves and then adding rounds differently from summing it in one go. *Between ranks*,
# though, the weights after the last step are identical to the last bit: every rank receives
# the very same averaged gradients and applies the same update. Nobody sends weights after the
# start — equal gradients keep them equal. That holds for any number of ranks on two
# conditions: the all-reduce hands every rank the same bytes (say, each piece of the sum
# computed once and copied to the others; that gloo's did so in this run shows in its result,
# bit-equal weights on every rank, not in its code, which is not installed), and every rank's
# update is deterministic: the same optimizer kernels on the same kind of device, giving the
# same bits for the same inputs (the gradients a rank computes before the all-reduce need not
# be, since its result replaces them). It
# does not make N ranks bit-for-bit equal to one process: on 3 ranks too, that agreement is to
# a tolerance. The next cell checks both on 3 ranks (gloo, on the CPU, whatever this machine's
# profile; a global batch of 24, since 32 does not split over 3; there the ranks' weights are
# compared bit for bit, with `same_bits`). `compare_three` runs the
# hand-averaged workers, the DDP workers and the single process, each in its own launch, and
# returns the largest differences between them:

# %%
viz.show_code(ddp.compare_three)

# %%
cfg3 = ddp.StepConfig(global_batch=24, steps=steps, lr=lr, width=width, seed=seed)
three = ddp.compare_three(cfg3, world_size=3, backend="gloo")
claim("3 ranks: the weights are bit-for-bit equal across the ranks (same_bits), hand-averaged "
      "and DDP",
      three["ranks_bitwise_equal_manual"] and three["ranks_bitwise_equal_ddp"])
gap3 = max(three["params_manual_vs_single"], three["params_ddp_vs_single"])
claim(f"3 ranks: weights after {steps} steps == one process on the global batch to 1e-5, not "
      f"bit for bit", 0 < gap3 < tol, three=three)
claim("3 ranks: first-step gradients, hand-averaged == DDP to 1e-6, not bit for bit: the two "
      "order their arithmetic differently (\"The reducer's arithmetic\", after lab 03)",
      0 < three["grad_manual_vs_ddp"] < 1e-6, three=three)

# %% [markdown]
# Against DDP, the hand-averaged gradients agree bit for bit on 2 ranks but not on 3: DDP orders
# its arithmetic differently from the library's `average_gradients` — how, and in which two
# ways, "The reducer's arithmetic" (the reducer: DDP's C++ object that buckets and all-reduces
# the gradients, next section) says and measures, for after your lab passes.
#
# **A question to try:** suppose each rank stepped with its own gradients and the ranks then
# averaged their *weights*. Would that give the same weights as averaging the gradients, with
# this lesson's plain SGD? With Adam? Why?
#
# **▶ An answer — open after you have tried** (click the folded cell below).

# %% [markdown]
# <details><summary>▶ open</summary>
#
# With SGD yes, with Adam no (lab 03's check runs both). Plain SGD's update is linear in the
# gradient: the mean over the ranks of w − lr·g_r is w − lr·(mean of the g_r), the step on
# the averaged gradient. Adam divides each gradient's running mean by the square root of its
# running square, which is not linear: the mean of the ranks' Adam updates is not the Adam
# update of the mean gradient, and each rank's optimizer state follows its own shard.
# Averaging the gradients before the step keeps every rank's optimizer fed with the same
# numbers, whatever it computes from them.
#
# </details>
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
# This section reads DDP's internals from what they record; the later section "The reducer's
# arithmetic" is for after your lab.
#
# Inside `DistributedDataParallel` the work is done by its **reducer**: a C++ object that owns
# the gradient buckets and launches their all-reduces. It belongs to **c10d**, torch's C++
# library for distributed communication (process groups, the store, the reducer), whose Python
# face is `torch.distributed`. `DDP(model)` does four things:
#
# 1. **Broadcast at construction.** With `init_sync=True` (the default; `False` skips it and
#    leaves equal weights to you) it copies rank 0's weights and buffers to every rank, so
#    the ranks start equal even if they were initialised differently (`manual_dp_worker` did
#    the same for the weights by hand).
# 2. **Buffers broadcast before a forward.** Buffers are a module's state that is not a
#    parameter, such as BatchNorm's running statistics: no gradient reaches them, so no
#    all-reduce averages them. By default (`forward_sync_buffers=True`) DDP copies rank 0's
#    buffers to every rank at the start of a forward, in `train()` or `eval()` mode alike. It
#    skips the copy when the previous forward ran without gradients or inside `no_sync()`, a
#    context in which a backward does not average the gradients (lesson 04 accumulates them
#    with it); the buffers section measures both. The older switch, `broadcast_buffers`
#    (deprecated since torch 2.13), also leaves the buffers out of item 1's broadcast when
#    `False` (the weights are still copied); `forward_sync_buffers=False` does not.
# 3. **Autograd hooks and buckets.** The reducer hooks every parameter's gradient and groups
#    the gradients into **buckets** of about `bucket_cap_mb` **MiB** (by default 25 MiB, and
#    1 MiB for the first bucket, kept small "to reduce latency"; an explicit `bucket_cap_mb`
#    gives every bucket the same cap; the argument's name says MB, but DDP multiplies it by
#    1024 × 1024). As each gradient becomes ready, the reducer copies it into its bucket
#    (`gradient_as_bucket_view=True`, which makes `p.grad` a view of the bucket, is lesson
#    07's). When every gradient in a bucket is there, the bucket goes to the wire in one
#    collective call, in bucket order on every rank (how, lesson 07). Why buckets? Each call
#    pays a fixed start-up cost, α (lesson 06 measures it): one call per tensor pays it per
#    tensor, while one bucket for the whole model waits for the backward's end (no overlap:
#    item 4). Buckets trade the two.
# 4. **Overlap.** Those calls start *while the backward is still computing* the gradients
#    of earlier layers (claimed below), so communication can overlap computation; whether
#    that saves time is lesson 07's measurement.

# %% [markdown]
# First the broadcast: every rank builds its model from a *different* seed, and after
# `DDP(model)` they are equal. (Its comm hook, defined in the next section, notes each
# bucket's parameters, then averages it with torch's `allreduce_hook`; the last claim reads
# its notes.)

# %%
viz.show_code(ddp.ddp_internals_worker)

# %%
internals = launch.spawn(ddp.ddp_internals_worker, world_size, 0.1, backend=backend)
claim("DDP(model) left rank 0's weights unchanged", not internals[0]["changed_by_ddp"])
claim("DDP(model) overwrote every other rank's weights",
      all(r["changed_by_ddp"] for r in internals[1:]))
claim("after DDP(model) the weights are equal as values on all ranks (torch.equal)",
      all(r["equal_on_all_ranks"] for r in internals))
# that broadcast is gated by init_sync (read in DDP's __init__: Sources); this checks its default
claim("DDP's init_sync flag defaults to True", inspect.signature(
    torch.nn.parallel.DistributedDataParallel).parameters["init_sync"].default is True)
kinds = [kind for kind, _ in internals[0]["iterations"][1]]   # rank 0, the second iteration
claim("in the second iteration rank 0's comm hook got a bucket before the first layer's "
      "gradient existed: an all-reduce began while the backward still ran",
      kinds.index("all_reduce") < kinds.index("first_layer_grad"), kinds=kinds)

# %% [markdown]
# ### Buckets, and why the first iteration has only one
# To see the buckets we replace DDP's all-reduce with our own **comm hook**: a function that
# DDP calls in place of its own all-reduce, once per bucket, when every gradient in the bucket
# is ready, and that must return a future of the reduced bucket. A **future**
# (`torch.futures.Future`) holds a result that may not exist yet: `dist.all_reduce(t,
# async_op=True)` returns a work handle whose `get_future()` is one; `fut.then(f)` returns a new
# future that runs `f(fut)` once `fut` has completed, and inside `f`, `fut.value()` is the
# result. Our hook stamps the time, averages the bucket asynchronously through torch's Python
# `allreduce_hook` (it returns such a future), and, in a `then` callback, stamps the time
# again when it has finished. Without a hook, DDP averages inside its C++ reducer instead
# (how: "The reducer's arithmetic", after lab 03). A tensor hook on
# every parameter stamps when its gradient is computed. We ask for buckets of 0.1 MiB
# (102.4 KiB) with `bucket_cap_mb`, one cap for every bucket (`bucket_cap_mb_list` would give
# one per bucket); the claims below measure the model against that cap. Two DDP flags stay off
# until the folded cells: `find_unused_parameters=True` has DDP look, after
# each forward, for parameters that will get no gradient; `static_graph=True` promises that
# every iteration uses the same parameters in the same way.

# %%
def bucket_worker(rank, world_size, bucket_cap_mb, model_fn, find_unused_parameters=False,
                  iterations=3, batch=32, static_graph=False):
    import time

    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp.setup_rank()                             # this rank's share of the cores (gloo: CPU)
    torch.manual_seed(0)
    model = model_fn()
    ddp_model = DDP(model, bucket_cap_mb=bucket_cap_mb,
                    find_unused_parameters=find_unused_parameters, static_graph=static_graph)
    names = {p: n for n, p in model.named_parameters()}
    log = {"grads": [], "buckets": []}

    def timed_allreduce(state, bucket):          # DDP calls this once per ready bucket
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
    print(f"iteration {it}: {len(seen['buckets'])} bucket(s)")

# %%
first, second, third = runs[0]
claim(f"the model ({model_bytes / 2**20:.2f} MiB) is larger than the bucket cap ({cap_mb} MiB)",
      model_bytes > cap_mb * 2**20)
claim("iteration 0 (one bucket_cap_mb, no bucket_cap_mb_list; both flags off): ONE "
      "bucket holding all 10 parameters, whatever bucket_cap_mb",
      len(first["buckets"]) == 1 and len(first["buckets"][0][0]) == 10)
claim("from iteration 1 on: several buckets, the same on every later iteration",
      len(second["buckets"]) > 1 and [b[0] for b in second["buckets"]]
      == [b[0] for b in third["buckets"]])
claim("the first bucket reduced holds the last layer (its gradient is computed first)",
      "classifier.4.weight" in second["buckets"][0][0])
# Which gradients share a bucket is lab 07 part 1's question: the buckets' contents are folded.
tensor_kib = {n: p.numel() * p.element_size() / 1024 for n, p in small_cnn().named_parameters()}
with viz.folded_output("▶ What each bucket holds — open after lab 07 part 1 passes"):
    for it, seen in enumerate(runs[0]):
        print(f"iteration {it}: parameters per bucket "
              f"{[len(names) for names, *_ in seen['buckets']]}, "
              f"KiB per bucket {[round(b / 1024) for _, b, *_ in seen['buckets']]}")
    print("iteration 1, first bucket: "
          + ", ".join(f"{n} ({tensor_kib[n]:.2f} KiB)" for n in second["buckets"][0][0]))

# %% [markdown]
# Why one bucket first? Not because of a size limit: the model is seven times the cap. With
# the default flags, as here, the reducer records the order in which the gradients really
# became ready during the first iteration (registration order is only a guess), and before
# the next forward with gradients enabled (not a `no_grad` one) it **rebuilds the buckets** in
# that order, once and for all (`_pre_forward`: `if torch.is_grad_enabled() and
# self.reducer._rebuild_buckets()`); until then, one bucket is the safe
# choice (the hazard is folded below).
# With `find_unused_parameters=True` and no `static_graph`, the reducer never rebuilds
# (`should_rebuild_buckets`): one bucket would then be for good, so DDP buckets by size from
# the start. The ranks cannot disagree about which gradients a bucket holds (the rebuilt
# assignment is broadcast from rank 0), and the reducer launches buckets strictly in index
# order; but *when* a bucket is ready can differ between ranks (folded below).
#
# **▶ Going further (lesson 07's ground): the hazard one bucket guards against, and how the
# two flags change the first iterations** — folded below, with their claims. The rest of this
# lesson does not need them.

# %% [markdown]
# <details><summary>▶ open: the one bucket's hazard, and the two flags</summary>
#
# The comment in `_ddp_init_helper` states the intent of one bucket. When the backward also
# runs other collectives (say, those of `nn.SyncBatchNorm`, the BatchNorm that pools every
# rank's statistics) **and** a parameter is unused on some ranks only, a bucket could be
# all-reduced too early on the rank with the unused parameter, to be matched with a
# *different* collective on another rank — a hang or garbage. Hence a size limit of
# `sys.maxsize`: one all-reduce, after every gradient of the graph is computed.
#
# The two flags (defined above) bear on this, and the cells below check each. With neither
# flag, a parameter without a gradient is not supported at all. Unused on every rank, it is an
# error (lesson 10, bug 9). Unused on some ranks only, the ranks no longer agree on when a
# bucket is ready, so one can wait in an all-reduce that the other never launches.
#
# The code's condition does not match that hazard, though. Two settings bucket by size from the
# start, in the limits DDP computes for iteration 0 (`ddp.initial_bucket_limits` asks DDP's own
# `_BucketCapacityConfig`; `ddp.bucket_limits` gives the cap in bytes):
#
# - `find_unused_parameters=True` without `static_graph`;
# - a `bucket_cap_mb_list`, whatever the flags.
#
# </details>

# %% jupyter={"source_hidden": true}
import sys

viz.show_code(ddp.bucket_limits, ddp.initial_bucket_limits,
              folded="▶ ddp.bucket_limits and initial_bucket_limits")
one_bucket = [sys.maxsize]
by_flags = {(static, unused): ddp.initial_bucket_limits(cap_mb, static_graph=static,
                                                        find_unused_parameters=unused)
            for static in (False, True) for unused in (False, True)}
flag_words = {(s, u): f"static_graph={'on' if s else 'off'}, find_unused={'on' if u else 'off'}"
              for s, u in by_flags}
print("iteration 0's limits in bytes: " + "; ".join(f"{flag_words[k]}: {v}" for k, v in
                                                     by_flags.items())
      + f" (sys.maxsize = {sys.maxsize}); bucket_limits(None) = {ddp.bucket_limits(None)}")
claim("iteration 0's limit is sys.maxsize (one bucket) for every flag setting but "
      "find_unused_parameters=True without static_graph",
      [flags for flags, limits in by_flags.items() if limits != one_bucket] == [(False, True)])
claim("bucket_cap_mb left at None: the first bucket's limit is 1 MiB, the others' 25 MiB",
      ddp.bucket_limits(None) == (2**20, 25 * 2**20))
by_list = {(static, unused): ddp.initial_bucket_limits(None, [cap_mb], static_graph=static,
                                                       find_unused_parameters=unused)
           for static in (False, True) for unused in (False, True)}
print(f"with bucket_cap_mb_list=[{cap_mb}]: "
      + "; ".join(f"{flag_words[k]}: {v}" for k, v in by_list.items()))
claim(f"with bucket_cap_mb_list=[{cap_mb}], iteration 0 is bucketed by size under every flag "
      "setting", all(limits == [int(cap_mb * 2**20)] for limits in by_list.values()))

# %% [markdown]
# <details><summary>▶ open: static_graph=True, one iteration longer</summary>
#
# `static_graph=True` waits one iteration longer: in its first iteration the reducer only notes
# which parameters received a gradient, and all-reduces everything after the backward (the
# timeline below names the code); it records the order in the second iteration and rebuilds
# before the third. The same model and cap:
#
# </details>

# %% jupyter={"source_hidden": true}
static_runs = launch.spawn(bucket_worker, world_size, cap_mb, small_cnn, static_graph=True,
                           backend="gloo", timeout=60)
per_iteration = [len(seen["buckets"]) for seen in static_runs[0]]
print(f"static_graph=True: buckets per iteration {per_iteration}")
claim("static_graph=True: one bucket in iterations 0 AND 1",
      per_iteration[0] == per_iteration[1] == 1)
claim("static_graph=True, iteration 2: the same buckets the default got in iteration 1",
      [b[0] for b in static_runs[0][2]["buckets"]] == [b[0] for b in second["buckets"]])

# %% [markdown]
# <details><summary>▶ open: find_unused_parameters=True, bucketed from the start</summary>
#
# With `find_unused_parameters=True` (and no `static_graph`) the first iteration is already
# bucketed, and the buckets are never rebuilt (lesson 07 measures how they are grouped). Here
# the model gets a head it never uses, the case that flag exists for:
#
# </details>

# %% jupyter={"source_hidden": true}
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


unused_runs = launch.spawn(bucket_worker, world_size, cap_mb, cnn_with_unused_head, True, 2,
                           backend="gloo", timeout=60)
unused_buckets = [[b[0] for b in seen["buckets"]] for seen in unused_runs[0]]
print(f"find_unused_parameters=True: parameters per bucket "
      f"{[[len(names) for names in it] for it in unused_buckets]} in iterations 0 and 1")
claim("with find_unused_parameters=True the first iteration is already bucketed, and iteration "
      "1 keeps its buckets (no rebuild)",
      len(unused_buckets[0]) > 1 and unused_buckets[0] == unused_buckets[1])

# %% [markdown]
# <details><summary>▶ open: static_graph=True and a head never used</summary>
#
# `static_graph=True` handles an unused parameter too, another way: after its first backward it
# knows which parameters got no gradient and, from then on, has the reducer mark them ready
# without one, so their bucket can complete. (How the reducer marks them, and what a bucket
# waiting for a gradient that never comes does, is lesson 07's section 6.) The same model with
# its unused head, under `static_graph=True`:
#
# </details>

# %% jupyter={"source_hidden": true}
static_unused = launch.spawn(bucket_worker, world_size, cap_mb, cnn_with_unused_head, False, 3,
                             static_graph=True, backend="gloo", timeout=60)
head = {"unused.weight", "unused.bias"}
reduced_with_head = [[len(names) for names, *_ in seen["buckets"] if head <= set(names)]
                     for seen in static_unused[0]]
print(f"static_graph=True: buckets per iteration {[len(s['buckets']) for s in static_unused[0]]}"
      f"; parameters in the bucket holding unused.*: {reduced_with_head}")
claim("static_graph=True, unused head: no gradient of unused.* is ever computed, yet in every "
      "iteration a bucket holding them is all-reduced — from iteration 1 on because the reducer "
      "marked them ready (iteration 0 all-reduces everything at its end)",
      not any(n in head for seen in static_unused[0] for n, _ in seen["grads"])
      and all(len(r) == 1 for r in reduced_with_head))
claim("static_graph=True, iteration 2: the buckets are by size while the marking goes on, "
      "unused.* in the last bucket",
      len(static_unused[0][2]["buckets"]) > 1
      and head <= set(static_unused[0][2]["buckets"][-1][0]))
claim("static_graph=True, unused head: in every iteration the bucket holding unused.* started "
      "after the last gradient was computed (the hook's start stamp against the tensor hooks')",
      all(start >= max(t for _, t in seen["grads"])
          for seen in static_unused[0] for names, _, start, _ in seen["buckets"]
          if head <= set(names)))

# %% [markdown]
# <details><summary>▶ open: what these runs do not show</summary>
#
# Here both ranks leave the same head unused and the rebuild appends the unused parameters
# after the recorded order, so their bucket is the last one and goes out when the last gradient
# arrives: nothing went out early in these runs (the last claim above). The case torch's
# comment guards against, a parameter unused on some ranks only, is not run in this lesson.
#
# </details>

# %% [markdown]
# ### The cap is not a ceiling
# The cap is 0.1 MiB (102.4 KiB), and `classifier.1.weight` is 512 KiB by itself. The reducer
# never splits a gradient, so a bucket can end far above its cap (claimed below). Which
# gradients share a bucket, and exactly when one closes, is lesson 07's section 3 and lab 07's
# part 1; that is why the buckets' contents above are folded.

# %%
first_limit, limit = ddp.bucket_limits(cap_mb)   # shown above: DDP's _BucketCapacityConfig
claim(f"bucket_cap_mb={cap_mb} is in MiB: DDP's limit is int({cap_mb} * 1024 * 1024) = "
      f"{limit} bytes, for the first bucket too", first_limit == limit == int(cap_mb * 2**20))
claim(f"classifier.1.weight alone is {tensor_kib['classifier.1.weight']:.0f} KiB, "
      f"{tensor_kib['classifier.1.weight'] * 1024 / limit:.1f}x the cap: more than 4x",
      tensor_kib["classifier.1.weight"] * 1024 > 4 * limit)
largest = max(nbytes for _, nbytes, *_ in second["buckets"])
claim("a rebuilt bucket here is more than 4x its cap", largest > 4 * limit)

# %% [markdown]
# ### The overlap, on a timeline
# Here are iterations 0 and 2 on rank 0, and `static_graph`'s warm iteration 1, drawn from the
# time stamps the hooks recorded (`viz.bucket_timelines_figure` only draws them). With
# `static_graph=True` the first backward all-reduces everything at its end (`_DDPSink.backward`
# queues the reducer's `_delay_all_reduce`), and the buckets change only from iteration 2
# (claimed in the fold above): its iteration 1 is one bucket, warm.
# Each tick on a "gradients computed" row is a gradient being computed; each bar is one bucket,
# from DDP's call to the hook to the all-reduce's completion callback: a latency, any wait
# before the transfer included, so bars can overlap. Labels give its index, not its size or
# tensors (folded above). The axis ends when the slowest backward returned.

# %%
claim("iteration 0: its one bucket was launched only after the last gradient was computed",
      first["buckets"][0][2] >= max(t for _, t in first["grads"]))
claim("iteration 2: the first bucket's all-reduce started before the last gradient was computed",
      third["buckets"][0][2] < max(t for _, t in third["grads"]))

# %%
# NBVAL_IGNORE_OUTPUT
# Why: the caption reads this run's times.
ends = {"iteration 0": first["backward_end"], "iteration 2": third["backward_end"],
        "the warm single bucket": static_runs[0][1]["backward_end"]}
place = ["first", "second", "last"][sorted(ends.values()).index(ends["iteration 2"])]
viz.show(viz.bucket_timelines_figure({
    f"iteration 0: one bucket (rank 0, bucket_cap_mb={cap_mb} MiB)": first,
    "iteration 2: the rebuilt buckets": third,
    "static_graph=True, iteration 1: one bucket, warm (another launch)": static_runs[0][1]}),
    "in iteration 0 the single bucket waits for the last gradient: nothing overlaps. In "
    "iteration 2 the first bucket (the classifier) is in flight while the convolutions' "
    "gradients are still being computed. Read when backward() returns (black line): "
    + ", ".join(f"{k} {v:.0f} ms" for k, v in ends.items())
    + f"; the bucketed backward ended {place} of the three in this run"
    + (", so overlap did not make it end sooner here: on gloo the all-reduces share the CPU "
       "cores with the backward, and a bar also waits for the other rank, which rank 0's "
       "stamps cannot tell apart." if place == "last" else " (one sample each: no cause).")
    + " On gloo backward() returns when the last bucket is done; on NCCL, once it is queued.")

# %%
# NBVAL_IGNORE_OUTPUT
# Why: the times depend on this machine and its load.
in_flight = reach = 0.0                        # the union of the bars: they can overlap
for *_, s, e in third["buckets"]:              # sorted by launch time
    in_flight, reach = in_flight + max(0.0, e - max(s, reach)), max(reach, e)
print(f"iteration 2 on rank 0: backward took {third['backward_end']:.1f} ms; the first bucket "
      f"went out {third['buckets'][0][2]:.1f} ms after it began; some bucket was in flight "
      f"during {in_flight:.1f} ms (the union of the bars, not the sum of their lengths).")
ms_per_mib = lambda bs: sum(e - s for *_, s, e in bs) / sum(b for _, b, *_ in bs) * 2**20
during = [b for b in third["buckets"] if b[2] < max(t for _, t in third["grads"])]
r0, r2 = ms_per_mib(first["buckets"]), ms_per_mib(during)
print(f"hook to callback, ms per MiB: {r0:.1f} for iteration 0's bucket, {r2:.1f} for iteration "
      f"2's buckets launched during the backward: "
      + ("slower; these bars also wait for the other rank, and this run does not tell that "
         "wait from sharing the cores with the backward." if r2 > r0
         else "not slower in this run."))
last_grad = {k: max(t for _, t in it["grads"]) for k, it in (("0", first), ("2", third))}
print(f"last gradient computed {last_grad['0']:.1f} ms after backward() began in iteration 0, "
      f"{last_grad['2']:.1f} ms in iteration 2 (iteration 0's is compute alone; iteration 2's "
      f"also carries the first buckets' all-reduces, on gloo's threads sharing the cores).")
warm = static_runs[0][1]                # static_graph=True, iteration 1: one bucket, warm
tail = {k: it["backward_end"] - max(t for _, t in it["grads"])
        for k, it in (("0", first), ("2", third), ("warm", warm))}
print(f"after the last gradient, backward() waited for communication {tail['0']:.1f} ms in "
      f"iteration 0 (cold), {tail['warm']:.1f} ms in static_graph's iteration 1 (one bucket, "
      f"warm) and {tail['2']:.1f} ms in iteration 2: "
      + ("shorter than the warm single bucket in this run (one sample each: it shows no "
         "cause)." if tail["2"] < tail["warm"] else "not shorter than the warm single bucket "
         "in this run, which reads rank 0's times only and so cannot tell waiting for rank 1 "
         "from sharing the cores with the backward."))

# %% [markdown]
# Read the cell above in two parts. The time until the last gradient is compute alone in
# iteration 0, the run's first backward (why it took longer here than in iteration 2 is not
# measured); in iteration 2 it also carries the first buckets' all-reduces, on gloo's threads
# (NCCL runs them on a GPU stream of its own). The time *after* the last gradient is
# communication the backward could not hide: in iteration 0 the whole model in one bucket,
# also its process's first all-reduce; in iteration 2 what the last buckets still needed —
# fewer bytes, though on these shared cores not always less time. The overlap
# rests on the bucket's all-reduce being *asynchronous*: torch's `allreduce_hook` (our hook's)
# runs `dist.all_reduce(..., async_op=True)`, and DDP's internal `_AllReduceBySumCommHook` (its
# path without a hook) likewise returns a future from its `runHook`, so the backward goes on
# while a bucket is on the wire.
# Lesson 07 measures what overlap buys.
#
# ### Buffers: rank 0's BatchNorm statistics, before a forward
# A BatchNorm layer keeps a running mean and variance: every forward in training mode updates
# them from the batch it sees, and eval mode normalises with them instead of the batch's. They
# are buffers, so each rank updates its own from its own shard and no all-reduce touches them.
# Before a forward through the wrapper, DDP broadcasts rank 0's buffers to the other ranks
# (rank 0 is the "authoritative" copy, except inside lesson 04's `Join`, the context manager
# for ranks with uneven inputs, which uses the highest-numbered rank not yet joined) — but not
# before one that follows a forward run under `torch.no_grad()` or inside `no_sync()`, whatever
# `train()` or `eval()` says (`_post_forward` notes how each forward ran, `_pre_forward` reads
# it: Sources).
# `buffer_sync_worker` trains a small BatchNorm network for three steps with
# `forward_sync_buffers=True` and then `False`, each rank on its own data, evaluates it, then
# runs a training-mode forward under `no_grad`, a step, and a step accumulated under
# `no_sync()`; a forward pre-hook on the BatchNorm layer records the running mean each forward
# starts from, after DDP's own pre-forward work.

# %%
viz.show_code(ddp.BNNet, ddp.buffer_sync_worker)

# %%
buffers = launch.spawn(ddp.buffer_sync_worker, world_size, backend="gloo", timeout=60)
on, off = [r[True] for r in buffers], [r[False] for r in buffers]
forwards = len(on[0]["seen"])      # 3 training forwards, then 1 in eval mode
claim(f"forward_sync_buffers=True: each of the {forwards} forwards (the eval one too) started "
      f"from rank 0's running mean on every rank (torch.equal)",
      all(torch.equal(r["seen"][k], on[0]["seen"][k]) for r in on for k in range(forwards)))
claim("forward_sync_buffers=True: yet after the last training step the ranks' running means "
      "differ (that forward updated each from its own shard)",
      all(not torch.equal(r["final_running_mean"], on[0]["final_running_mean"]) for r in on[1:]))
claim("forward_sync_buffers=True: in eval mode every rank gives the same output for the same "
      "input (torch.equal)", all(torch.equal(r["eval_out"], on[0]["eval_out"]) for r in on))
claim("forward_sync_buffers=False: from the second forward on, the other ranks start from "
      "their own running means, not rank 0's",
      all(not torch.equal(r["seen"][k], off[0]["seen"][k])
          for r in off[1:] for k in range(1, forwards)))
claim("forward_sync_buffers=False: in eval mode the ranks give different outputs for the same "
      "input", all(not torch.equal(r["eval_out"], off[0]["eval_out"]) for r in off[1:]))
claim("either way the weights are bit-for-bit the same, same_bits (training-mode BatchNorm "
      "normalises with the batch's statistics, not the running ones)",
      all(same_bits(a["params"], b["params"]) for a, b in zip(on, off)))
claim("either way rank 0's running mean is bit-for-bit the same (same_bits): the broadcast never "
      "changes rank 0's buffers",
      same_bits(on[0]["final_running_mean"], off[0]["final_running_mean"]))
# Then the five training-mode forwards after the evaluation, with forward_sync_buffers=True:
synced = {}
for k, (follows, _) in enumerate(on[0]["later"]):
    same = all(torch.equal(r["later"][k][1], on[0]["later"][k][1]) for r in on)
    state = "the same on every rank" if same else "different on each rank"
    print(f"after the evaluation, forward {k + 1} (it follows {follows}): the running mean "
          f"it started from is {state}")
    synced.setdefault(follows, []).append(same)
claim("forward_sync_buffers=True: a forward that follows a no-grad forward, or a no_sync() "
      "one, starts from each rank's own running mean (no broadcast); one that follows a "
      "training forward, from rank 0's",
      synced == {"the eval forward": [True], "a no-grad forward": [False],
                 "a no_sync forward": [False], "a training forward": [True, True]},
      synced=synced)

# %% [markdown]
# Forward 1 follows the no-grad evaluation, so nothing was broadcast before it; the ranks
# agree anyway, since eval mode changed no statistic. Forward 1 itself (training mode, under
# `no_grad`) updates each rank's statistics from its own batch, and forward 2 starts from them
# unbroadcast; forward 3, under `no_sync()` (lesson 04's gradient accumulation), does the same
# to forward 4 — though DDP's docstring says `forward_sync_buffers` syncs "at the beginning of
# ``forward``".
#
# So the statistics rank 0 saves in a checkpoint (lesson 04 saves from rank 0) come from rank
# 0's shards only, 1/N of each global batch, whatever the setting. What the broadcast decides is
# what the *other* ranks use: with it on, every rank evaluates through the wrapper with rank 0's
# statistics, the model you checkpoint, and gets the same outputs (`ddp_model.module` skips the
# broadcast); with it off, each rank evaluates with its own
# and N ranks report N different accuracies for the same weights. Statistics over the whole
# global batch need `nn.SyncBatchNorm` (lesson 04), which, in every training-mode forward,
# **all-gathers** each rank's batch mean, inverse standard deviation and sample count (an
# all-reduce of the per-rank means and invstds could not weigh unequal counts), and
# all-reduces only in its backward. Its source says so (the collectives each
# method calls, read from the installed torch):

# %%
import re

from torch.nn.modules import _functions as bn_functions

calls = {name: re.findall(r"(?:dist|torch\.distributed)\.(\w+)\(",
                          inspect.getsource(getattr(bn_functions.SyncBatchNorm, name)))
         for name in ("forward", "backward")}
print("the collectives nn.SyncBatchNorm's autograd function calls:", calls)
claim("SyncBatchNorm's forward only all-gathers (no all_reduce); its backward only all-reduces",
      calls["forward"] and all("all_gather" in c for c in calls["forward"]) and
      calls["backward"] and set(calls["backward"]) == {"all_reduce"}, calls=calls)

# %% [markdown]
# | | DataParallel | DDP |
# |---|---|---|
# | processes | 1 (threads, one GIL) | 1 per device |
# | weights sent | every step, from device 0 | once, at the start, and again when a `Join` context ends (`Join`: lesson 04's context manager in which ranks out of batches keep answering the others' collectives; buffers: before each forward whose previous forward ran with gradients enabled, outside `no_sync`) |
# | gradients | summed onto device 0 | the same average on every rank (how: lab 03) |
# | per-step traffic at the busiest device, numbers sent + received (K: the number of gradient values, as lesson 02 counted them; times 4 for bytes in float32) | 2(N−1)K for a naive parameter server (lesson 02's copy-one-by-one version) | 4(N−1)K/N with ring all-reduce (2(N−1)K/N each way; lesson 06 derives it) |
# | overlap with backward | no | yes (buckets) |
# | multi-machine | no | yes |
#
# (The real `nn.DataParallel` moves its copies with `torch.nn.parallel.comm`, whose
# `reduce_add` uses an NCCL reduce when it can; lesson 02's count is for the naive pattern.)

# %% [markdown]
# ## DistributedSampler and `set_epoch`
# Each rank must read a different shard of the data. `DistributedSampler(dataset, num_replicas,
# rank)` shuffles the indices with `seed + epoch`, pads them to a multiple of `world_size`, and
# gives rank *r* every `world_size`-th index starting at *r*. Each rank computes its shard **by
# itself** — no communication — from `seed + epoch`, and `sampler.set_epoch(epoch)` sets that
# epoch. Forget it on every rank and the epoch stays 0 everywhere: the shards stay disjoint,
# but every epoch repeats the same order. Call it on some ranks only (say under
# `if rank == 0:`) and the ranks shuffle with different epochs: their shards overlap, and some
# samples are seen twice in an epoch while others are skipped. `sampler_orders` builds one
# sampler per rank, as each rank would in its own process, and `shard_overlap` counts the
# repeated reads in one epoch (every read of an index beyond its first):

# %%
viz.show_code(ddp.sampler_orders, ddp.shard_overlap)

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
# Now the real hazard: `set_epoch(1)` called on rank 0 only, so in epoch 1 rank 0 shuffles with
# `seed + 1` and the other ranks still with `seed + 0`. Each rank builds its own sampler, as it
# would in its own process:

# %%
from torch.utils.data import DistributedSampler

dataset = list(range(n))
mismatched = []
for r in range(world_size):
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=r, shuffle=True,
                                 seed=seed)
    if r == 0:
        sampler.set_epoch(1)          # the other ranks forgot: they stay at epoch 0
    mismatched.append(list(sampler))
print("epoch 1, set_epoch on rank 0 only: "
      + "  ".join(f"rank {r}: {o}" for r, o in enumerate(mismatched)))
seen = sum(mismatched, [])
claim("ranks on different epochs: their shards overlap, so some samples are read twice this "
      "epoch and others not at all",
      ddp.shard_overlap(mismatched) > 0 and len(set(seen)) < n,
      overlap=ddp.shard_overlap(mismatched))

# %% [markdown]
# (When `n` does not divide by `world_size`, the sampler pads by repeating a few indices — a few
# samples count twice per epoch — unless `drop_last=True`.)

# %% [markdown]
# ## The reducer's arithmetic
#
# Reference, for after lab 03: how the reducer turns the ranks' gradients into their average —
# which is why DDP and `average_gradients` agree bit for bit on 2 ranks and not on 3. Besides,
# the run-time broadcasts `forward_sync_buffers` decides include one at the end of a `Join`
# (the claim below).
#
# **▶ How the reducer turns the ranks' gradients into their average — open after your lab
# passes** (click the folded cell below; it is lab 03's part 1, done DDP's way).

# %% [markdown]
# <details><summary>▶ open</summary>
#
# The library's `average_gradients` sums, then divides; DDP **scales first, then sums**. Without
# a comm hook, c10d's `Reducer::mark_variable_ready_dense` (`reducer.cpp`, not installed: the
# appendix finds its compiled names) copies each gradient into its bucket as it becomes
# ready and scales it in the same pass, `at::mul_out(bucket_view, grad, 1. / div_factor_)`: a
# multiplication by the reciprocal of the world size; then the bucket goes to one all-reduce
# with SUM. Lesson 07's reference answer to its lab 07 tables every case (a gradient that
# already is its bucket's view, a comm hook, `zero_grad`'s part) and measures the views. One
# case only this lesson names, read in DDP's docstring, not run: with `batched_grad_copy=True`
# (default `False`) the bucket's copies are batched and the flat bucket divided once when full.
#
# With 2 ranks the order cannot show: 1/2 is exact in binary, so multiplying by it, or dividing
# by 2 before or after the sum, gives the same bits (barring underflow). With 3 ranks float32's
# 1/3 is not a third, and scaling first rounds differently from dividing after the sum. A
# second cause adds to it: DDP all-reduces one flat bucket, the library each tensor on its own,
# and the all-reduce need not add the ranks' values in the same order at every position of a
# tensor (measured, not read: gloo's source is not installed). The 3-rank claim after the lab
# cannot tell the two apart; the folded control run below can. With a comm hook the reducer
# copies without scaling and leaves the averaging to the hook: one that sums the raw bucket,
# then divides, keeps DDP's layout with the library's arithmetic.
#
# </details>

# %%
from torch.nn.parallel import DistributedDataParallel

ddp_defaults = inspect.signature(DistributedDataParallel.__init__).parameters
claim("DDP's batched_grad_copy defaults to False: deferring a bucket's gradient copies is opt-in",
      ddp_defaults["batched_grad_copy"].default is False)

claim("forward_sync_buffers also decides the buffers' broadcast at the end of a Join: "
      "_sync_final_model passes broadcast_buffers=self.forward_sync_buffers",
      "broadcast_buffers=self.forward_sync_buffers"
      in inspect.getsource(DistributedDataParallel._sync_final_model))

# %% [markdown]
# **▶ The control run that tells layout from scaling — open after your lab passes** (click the
# folded cell below).

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show_code(ddp.sum_then_divide_hook,
              folded="▶ The control run's hook — open after your lab passes")
hooked = launch.spawn(ddp.ddp_worker, 3, cfg3, ddp.sum_then_divide_hook, backend="gloo",
                      timeout=120)[0]["grads"]
layout = int((hooked != three["grads_manual"]).sum())  # same arithmetic, other layout
scaling = int((hooked != three["grads_ddp"]).sum())    # same layout, scale first or divide after
with viz.folded_output(
        "▶ The control run that tells layout from scaling — open after your lab passes"):
    print(f"3 ranks, first-step gradients ({hooked.numel()} elements): {layout} differ between "
          f"the hooked DDP and average_gradients, {scaling} between the hooked DDP and DDP's own "
          "path")
    claim("layout alone: DDP summing then dividing in its one flat bucket differs from "
          "average_gradients' per-tensor all-reduces in the last bits", layout > 0, layout=layout)
    claim("scaling alone: in the same bucket, DDP's scale-first path differs from "
          "sum-then-divide", scaling > 0, scaling=scaling)
    claim("both are last-bit rounding: the gradients agree to 1e-6",
          max(float((hooked - three[k]).abs().max()) for k in ("grads_manual", "grads_ddp"))
          < 1e-6)

# %% [markdown]
# ## Appendix: names in torch's compiled libraries
# ### The reducer's scaled copy and batched path

# %%
# reducer.cpp is not installed, but its compiled code is: the installed libtorch_cpu holds the
# name mark_variable_ready_dense records for its scaled copy, and the batched path's message.
import mmap
from pathlib import Path

libtorch_cpu = next((Path(torch.__file__).parent / "lib").glob("libtorch_cpu.*"))
marks = ["torch::distributed::reducer::mul_out", "batched_grad_copy is incompatible with"]
with open(libtorch_cpu, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
    found = {mark: m.find(mark.encode()) >= 0 for mark in marks}
claim(f"the installed {libtorch_cpu.name} (torch {torch.__version__.split('+')[0]}) holds the reducer's "
      f"'mul_out' copy and the batched_grad_copy path", all(found.values()), found=found)

# %% [markdown]
# ### Which collectives gloo runs on GPU tensors
# gloo's code for a collective on CUDA tensors
# is a class of its own, `Async<Collective>CUDA…Work`, compiled into torch's libraries; their
# names, searched in the installed ones, say which collectives have it (**▶ folded**; it
# matters only where gloo is handed GPU tensors, which no profile of this course does).
# Besides the four of "The four collectives", the claim names operations this lesson does not use: `reduce` and `gather` (the
# result on one rank only), `scatter` (one rank's pieces, one to each rank), `all_to_all`
# (every rank sends a piece to every rank), and `send`/`recv` (one rank to one other).

# %% jupyter={"source_hidden": true}
import mmap
import re
from pathlib import Path

torch_lib = Path(torch.__file__).parent / "lib"
gloo_cuda = {}
for so in ("libtorch_cpu.so", "libtorch_cuda.so"):
    if (torch_lib / so).exists():   # libtorch_cuda.so: only in a torch built for CUDA
        with open(torch_lib / so, "rb") as f, \
                mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as lib:
            gloo_cuda[so] = sorted({name.decode() for name in
                                    re.findall(rb"Async(\w+?)CUDA(?:Device|Host)?Work", lib)})
print("gloo's CUDA work classes, Async<name>CUDA…Work, by library:", gloo_cuda)
with_cuda = set().union(*gloo_cuda.values())
claim("gloo has CUDA code for broadcast and all_gather (libtorch_cpu.so) and, in a torch built "
      "for CUDA, all_reduce (libtorch_cuda.so); also for reduce, gather, scatter and all_to_all; "
      "none for send or recv",
      {"Broadcast", "Allgather", "Reduce", "Gather", "Scatter", "Alltoall"} <= with_cuda
      and ("Allreduce" in with_cuda or "libtorch_cuda.so" not in gloo_cuda)
      and not any(name.startswith(("Send", "Recv")) for name in with_cuda), found=gloo_cuda)

# %% [markdown]
# So gloo has GPU code for most collectives (none in send or recv): more than the all_reduce and
# broadcast that PyTorch's backend table in its documentation marks. (`reduce_scatter` has no class of
# its own, so the names say nothing about it.) It is slow with them: gloo sends and receives
# from the CPU's memory, so these classes copy the GPU tensor there and the result back. The
# exception, `AsyncAllreduceCUDADeviceWork`, runs on GPU memory, chosen only when gloo's
# transport reads GPU memory directly (GPUDirect, over InfiniBand's ibverbs); this torch's gloo
# has only its TCP transport (*read from source, not measured*: PyTorch's
# `ProcessGroupGloo*.cpp`, not installed; the transport's names in the library, ▶ folded below).

# %% jupyter={"source_hidden": true}
with open(next(torch_lib.glob("libtorch_cpu.*")), "rb") as f, \
        mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as lib:
    transports = {name: lib.find(name.encode()) >= 0
                  for name in ("makeTCPDevice", "makeIBVerbsDevice", "TORCH_GLOO_IBV_NAME")}
claim("this torch's gloo can make its TCP transport and has no ibverbs one (libtorch_cpu.so "
      "names makeTCPDevice, neither makeIBVerbsDevice nor TORCH_GLOO_IBV_NAME)",
      transports == {"makeTCPDevice": True, "makeIBVerbsDevice": False,
                     "TORCH_GLOO_IBV_NAME": False}, found=transports)

# %% [markdown]
# ## Summary
#
# - DDP runs one process per device; the processes meet at a rendezvous and talk through
#   collectives (broadcast, all_reduce, all_gather, reduce_scatter) that every rank must call.
# - Every rank ending each backward with the average of the ranks' gradients (lab 03; DDP's way
#   of computing it is in "The reducer's arithmetic") makes each rank's step the
#   step of one process on the global batch — equal to 1e-5 here (on 2 and on 3 ranks), and
#   bit-for-bit equal across the ranks (the all-reduce hands each the same bytes) — as long
#   as every shard's mean loss divides by the same count (equal shards, no padding skipped
#   unevenly), no layer couples the samples of a batch (training-mode BatchNorm does) and the
#   forward draws nothing at random (dropout, even seeded alike, gives a valid stochastic
#   gradient, not the same numbers; `SmallCNN`'s is 0 here).
# - `DDP(model)` broadcasts rank 0's weights once, then its reducer all-reduces gradients in
#   buckets from inside `backward()`. The first iteration uses one bucket (the gradient order is
#   not known yet; with `static_graph=True` the first two iterations do), unless
#   `find_unused_parameters=True` without `static_graph`, or `bucket_cap_mb_list`; afterwards
#   the buckets follow the order the gradients arrived, rank 0's assignment on every rank, and
#   let communication overlap the backward (what that buys, lesson 07 measures).
# - `bucket_cap_mb` is in MiB and is not a ceiling: a gradient is never split, and a bucket
#   can end several times the cap; how DDP groups them is lesson 07's.
# - Before the first forward, and before each forward whose previous forward ran with gradients
#   enabled and outside `no_sync()` (in `train()` or `eval()` mode alike), DDP broadcasts
#   rank 0's buffers (`forward_sync_buffers=True`; outside `Join`): every rank evaluates
#   with rank 0's BatchNorm statistics, which come from rank 0's shards only. A forward that
#   follows one under `no_grad` or `no_sync()` starts from each rank's own.
# - `DistributedSampler` gives each rank a disjoint shard; call `set_epoch` every epoch, on every
#   rank: forgotten everywhere, every epoch repeats the same order; called on some ranks only,
#   the shards overlap.
#
# Next, lesson 04 turns this into the script you would really run: `torchrun`, checkpoints
# from rank 0, evaluation, `SyncBatchNorm`.
#
# ## Check yourself
#
# **▶ The quiz** — run the folded cell below and answer in the widget (or read its output,
# where the answers are folded).

# %% jupyter={"source_hidden": true}
from dpcourse import quizzes

viz.quiz(quizzes.questions("03"))

# %% [markdown]
# ## Sources
#
# Checked against the installed torch 2.14.1 (paths relative to `site-packages`):
#
# - `torch/distributed/rendezvous.py` — `_env_rendezvous_handler`, `_create_c10d_store`: the
#   `env://` rendezvous reads `MASTER_ADDR` and `MASTER_PORT` from the environment, and `RANK`
#   and `WORLD_SIZE` only when `init_process_group` was not given `rank`/`world_size`; rank 0
#   hosts the TCP store (`start_daemon = rank == 0`) unless `_agent_store_serves(hostname,
#   port)`: under torchrun (`TORCHELASTIC_USE_AGENT_STORE`, set by
#   `torch/distributed/elastic/agent/server/local_elastic_agent.py` from the rendezvous
#   handler's `use_agent_store`: True always in
#   `torch/distributed/elastic/rendezvous/static_tcp_rendezvous.py`, and unless
#   `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` in
#   `torch/distributed/elastic/rendezvous/dynamic_rendezvous.py`, the c10d backend's handler,
#   where node rank 0's agent starts it in `next_rendezvous`, ~line 1210) every
#   rank is a client (`is_master=False`) of the agent's store. The etcd rendezvous
#   (`torch/distributed/elastic/rendezvous/etcd_rendezvous.py`, `EtcdRendezvousHandler`, ~line
#   170) keeps the base class's `use_agent_store` (False, `api.py` ~line 159): its store is
#   etcd's (`etcd_store.py`), and `RendezvousStoreInfo.build` (`api.py` ~line 88) gives the
#   workers rank 0's host and a free port, where rank 0 hosts the TCP store.
#   `torch/distributed/run.py` — `--rdzv-backend` defaults to `static` (~line 523); `static`
#   becomes `c10d` under `--standalone`, or on one node with no `--rdzv-endpoint` and no
#   `--master-port` (`run`, ~lines 1098-1122).
# - `torch/distributed/distributed_c10d.py` — `Backend.backend_capability`: gloo takes `cpu`
#   and `cuda` tensors, nccl `cuda` only; it lists device types, not collectives.
# - `torch/lib/libtorch_cpu.so` and `torch/lib/libtorch_cuda.so` — gloo's CUDA work classes,
#   found by the claim in the appendix: `AsyncBroadcastCUDAWork`,
#   `AsyncAllgatherCUDAWork`, `AsyncReduceCUDAWork`, `AsyncGatherCUDAWork`,
#   `AsyncScatterCUDAWork`, `AsyncAlltoallCUDAWork`, `AsyncAlltoallListCUDAWork` (libtorch_cpu)
#   and `AsyncAllreduceCUDADeviceWork`, `AsyncAllreduceCUDAHostWork` (libtorch_cuda); none for
#   send or recv. PyTorch's backend table (`docs/source/distributed.rst` § Backends, not
#   installed) marks only broadcast and all_reduce, which the binaries contradict. That these
#   classes copy through host memory is read from upstream `ProcessGroupGloo.cpp` (not
#   installed), e.g. `AsyncAllgatherCUDAWork`: a pinned CPU copy, the CPU allgather, the copy
#   back; upstream `ProcessGroupGlooCuda.cpp`, `makeAllreduceCUDAWork`:
#   `AsyncAllreduceCUDADeviceWork` (gloo's `CudaAllreduceRingChunked` on the GPU pointers)
#   only when `context->getDevice()->hasGPUDirect()`, else `AsyncAllreduceCUDAHostWork` (the
#   copy); gloo's `transport/device.h` returns `false` from `hasGPUDirect()` unless a transport
#   overrides it (its ibverbs one does); upstream `GlooDeviceFactory.cpp` — `makeTCPDevice`,
#   and `makeIBVerbsDevice` (`TORCH_GLOO_IBV_NAME`) only in builds with gloo's ibverbs
#   transport: the installed `libtorch_cpu.so` names the first and neither of the others
#   (claimed).
# - `torch/include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp` — the comment above
#   `class ProcessGroupNCCL`: "All NCCL functions provided by this class are asynchronous
#   functions", and calls must come in the same order on all processes ("`WorkNCCL::wait()` or
#   `WorkNCCL::synchronize()`, both achieves the same functionality"; `synchronize`: "Let
#   current stream wait on the completion of the NCCL work"); `ncclStreams_` ("The CUDA streams
#   used by NCCL kernels"); `TORCH_NCCL_BLOCKING_WAIT`: "Control whether or not wait() is
#   blocking or non-blocking".
# - `torch/include/torch/csrc/distributed/c10d/ProcessGroupGloo.hpp` — `Options::threads{2}`;
#   `enqueue` ("Queue work to run on worker thread") and `runLoop`: gloo's own threads.
# - `torch/include/ATen/core/ivalue_inl.h` — `Future::wait()`: waits for `completed_`, then
#   `synchronizeWithCurrentStreams()`, which makes the current streams wait on the future's
#   events (`event.block`); the reducer's `finalize_backward` calls `wait()` on each bucket's
#   future (`reducer.cpp`, below), and ProcessGroupNCCL marks its future complete when the
#   work is queued, so on NCCL `backward()` returns without waiting for the GPU.
# - `torch/distributed/distributed_c10d.py` — `init_process_group`'s docstring for `device_id`:
#   under NCCL "the communicator is immediately formed ... rather than the normal lazy call";
#   `torch/include/torch/csrc/distributed/c10d/NCCLUtils.hpp` — `NCCLComm::waitReady` ("Wait
#   for the communicator to be ready. This is a blocking function").
# - `torch/distributed/distributed_c10d.py` — `all_reduce` (and the other collectives): `opts.asyncOp
#   = async_op`; with `async_op=True` the `Work` is returned, otherwise `work.wait()` when the
#   backend returned one, and none is needed when it did not ("the backend has sync'ed at CPP
#   level"); `torch/include/torch/csrc/distributed/c10d/Types.hpp` — `AllreduceOptions::asyncOp`
#   (`= true` by default); `torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py` —
#   `_allreduce_fut` calls `dist.all_reduce(tensor, group=..., async_op=True)`.
# - `torch/nn/modules/loss.py` — `CrossEntropyLoss`'s docstring: with `reduction='mean'` the
#   summed loss is divided by the sum of `weight[y_n]` over the targets not equal to
#   `ignore_index` (default -100), not by the batch size.
# - `torch/__init__.py` — `set_float32_matmul_precision`'s docstring: "highest" keeps float32's
#   23 stored mantissa bits, "high" may use "the TensorFloat32 datatype (10 mantissa bits
#   explicitly stored)" (TF32; `setup_rank` turns it off for matmuls and cuDNN);
#   `use_deterministic_algorithms`' docstring lists `torch.nn.Conv2d` "when called on CUDA
#   tensor" among the "normally-nondeterministic operations" (hence `setup_rank`'s
#   `torch.backends.cudnn.deterministic = True` on a GPU; `torch/backends/cudnn/__init__.py` —
#   `CudnnModule.deterministic`, `benchmark`). Not run here: no GPU.
# - `torch/nn/parallel/distributed.py` — `DistributedDataParallel.__init__`:
#   `forward_sync_buffers` defaults to `True`; `broadcast_buffers` is deprecated (since 2.13)
#   in its favour, and its warning says that `broadcast_buffers=False` also skips the buffer
#   sync at construction (`init_sync_buffers`) while `forward_sync_buffers=False` does not;
#   construction calls `_sync_module_states(..., src=0, ...)` under `if init_sync:` (default
#   `True`; the docstring: with `False` "the user is required to ensure themselves that the
#   weights are the same on all ranks"), defined in
#   `torch/distributed/utils.py`, which broadcasts rank 0's parameters and buffers. The
#   docstring of `forward_sync_buffers`: "syncing (broadcasting) buffers of the module at
#   runtime, including at the beginning of ``forward`` and after uneven-input joins";
#   `_sync_final_model` (the end of a `Join`) broadcasts the parameters again, from a last rank
#   to join, and passes `broadcast_buffers=self.forward_sync_buffers` (claimed above);
#   `torch/distributed/algorithms/join.py` — `Join` (`__exit__` runs the post-hooks unless
#   `enable=False` or an exception): the context manager whose
#   hooks "shadow the collective communications of non-joined processes" (ranks that ran out
#   of inputs). `register_comm_hook`: the control run's hook replaces DDP's own averaging
#   of each bucket.
# - `torch/nn/parallel/distributed.py` — `DistributedDataParallel._ddp_init_helper`, the
#   comment before the bucket limits: parameters are not in execution order, and when a model
#   has both "other collectives comm ops in its backward graph" and an "unused parameter in
#   subset ranks", bucketing "could insert ALL-REDUCE comm op too early on the rank with unused
#   parameter", matching another rank's other collective; so the first iteration is not
#   bucketed. c10d's `reducer.cpp` (PyTorch repository, not installed) —
#   `Reducer::autograd_hook`: at the first hook of a backward it marks ready
#   (`mark_variable_ready`) every parameter in `unused_parameters_`, which two functions fill:
#   `Reducer::prepare_for_backward`, from the forward's outputs, which
#   `DistributedDataParallel._post_forward` passes only when `find_unused_parameters and not
#   static_graph` (`prepare_for_backward([])` otherwise; the list is cleared only when
#   `dynamic_graph_find_unused()`), and `Reducer::delay_all_reduce`, a static graph's first
#   backward, which records every parameter whose hook never fired; the callback queued by
#   `Reducer::mark_variable_ready` appends them to the rebuilt order
#   (`push_rebuilt_params`), which is why they end in the last bucket above.
# - `torch/nn/parallel/distributed.py` — `_BucketCapacityConfig.create`: `bucket_cap_mb` is in
#   MiB (`_MB_TO_BYTES = 1024 * 1024`), 25 MiB by default; the first bucket's limit is
#   `dist._DEFAULT_FIRST_BUCKET_BYTES` (1 MiB) only when the cap is left at its default; the
#   `_BucketCapacityConfig` docstring: the first bucket is smaller "to reduce latency"; the
#   limit reaches `dist.Reducer` as `first_bucket_bytes_cap` (`_ddp_init_helper`).
# - `torch/nn/parallel/distributed.py` — `_BucketCapacityConfig.compute_bucket_size_limits`:
#   "Case 1", a user's `bucket_cap_mb_list` (a `DistributedDataParallel.__init__` argument),
#   gives its limits from iteration 0 whatever the flags; otherwise the initial limit is
#   `[sys.maxsize]` (one bucket) when `static_graph or not find_unused_parameters`
#   (`ddp.initial_bucket_limits` asks it, claimed above);
#   `DistributedDataParallel._ddp_init_helper` passes it to the function that assigns the
#   buckets (lesson 07 names it, folded: it is lab 07 part 1's rule) and hands the reversed
#   buckets to `dist.Reducer`.
# - `torch/nn/parallel/distributed.py` — `DistributedDataParallel._pre_forward`: calls
#   `self.reducer._rebuild_buckets()` before a forward with `torch.is_grad_enabled()`, then `_sync_buffers()` when
#   `_check_sync_bufs_pre_fwd()` (`will_sync_module_buffers`: `require_forward_param_sync`
#   and `forward_sync_buffers` and the module has buffers); `_sync_buffers` uses rank 0 as the
#   authoritative copy unless `Join` is active, when `_find_common_rank` (an all-reduce MAX,
#   joined ranks sending -1) picks the highest-numbered rank not yet joined.
#   `DistributedDataParallel._post_forward` sets
#   `require_forward_param_sync` to `True` only when `torch.is_grad_enabled()` and
#   `require_backward_grad_sync` (which `no_sync()` turns off), to `False` otherwise;
#   `__init__` starts it at `True`.
# - `torch/nn/modules/_functions.py` — `SyncBatchNorm.forward`: `all_gather` (or
#   `all_gather_single` when the backend is not gloo) of `[mean, invstd, count]`, "Use allgather
#   instead of allreduce because count could be different across ranks";
#   `SyncBatchNorm.backward`: `all_reduce` of `sum_dy` and `sum_dy_xmu`. `nn.SyncBatchNorm`
#   (`torch/nn/modules/batchnorm.py`) calls it as `sync_batch_norm.apply`.
# - `torch/nn/parallel/distributed.py` — `_DDPSink.backward`: with `static_graph`, the first
#   backward queues `reducer._delay_all_reduce` (every bucket all-reduced after the backward).
# - `torch/include/torch/csrc/distributed/c10d/reducer.hpp` — `Reducer::next_bucket_` (the
#   buckets are launched in index order); `Reducer::sync_bucket_indices` ("Broadcast rebuilt
#   buckets from rank 0 to other ranks"); `Reducer::should_rebuild_buckets`
#   (rebuild once, never with `find_unused_parameters` unless `static_graph`).
#   `Reducer::rebuild_buckets` and `Reducer::autograd_hook` (no order recorded in a static
#   graph's first iteration) are in c10d's `reducer.cpp` in the PyTorch repository (not
#   installed); the claims above check the behaviour on the installed build.
# - `torch/nn/parallel/comm.py` — `reduce_add`: uses `nccl.reduce` when NCCL is available (the
#   real `nn.DataParallel`'s gradient path, through `ReduceAddCoalesced` in
#   `torch/nn/parallel/_functions.py`).
# - `torch/utils/data/distributed.py` — `DistributedSampler.__iter__`: shuffles with
#   `seed + epoch`, pads to a multiple of `num_replicas`, takes `indices[rank::num_replicas]`;
#   `set_epoch` sets the epoch.
#
# **▶ The sources of DDP's averaging — open after your lab passes** (click the folded cell
# below).

# %% [markdown]
# <details><summary>▶ open</summary>
#
# ### Sources, continued
#
# - `torch/nn/parallel/distributed.py` — `DistributedDataParallel.__init__`'s docstring for
#   `find_unused_parameters` (default `False`): parameters that receive no gradient in the
#   forward's graph are "preemptively marked as being ready to be reduced" (the note in the
#   folded reference `average_gradients`).
# - `torch/nn/parallel/distributed.py` — `DistributedDataParallel.__init__`'s docstring for
#   `batched_grad_copy` (default `False`): only when it is `True` are the "per-parameter
#   gradient-to-bucket copy and division operations" deferred and flushed as one
#   `_foreach_copy_` "plus one flat `div_` when a bucket becomes ready", most useful with
#   `zero_grad(set_to_none=True)` (the default), "where `gradient_as_bucket_view` alone cannot
#   avoid copies because the bucket view alias is destroyed every iteration";
#   `torch/include/torch/csrc/distributed/c10d/reducer.hpp` — `Reducer::mark_variable_ready_dense`
#   (declared), `Bucket::deferred_copy_indices` and `Reducer::flush_deferred_copies` (the
#   batched path, "Only used when batched_grad_copy is enabled").
# - `torch/nn/parallel/distributed.py` — `DistributedDataParallel.register_comm_hook`: the hook
#   is called once per bucket when it is ready, with a `GradBucket` not yet divided by the world
#   size; `torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py` — `allreduce_hook`
#   calls `_allreduce_fut`, which does `tensor.div_(group size)` and then `all_reduce` ("Apply
#   the division first to avoid overflow, especially for FP16") on the whole bucket. Without a
#   hook the reducer divides too, but per gradient, as it copies each into the bucket (below).
# - `torch/futures/__init__.py` — `Future.then` ("Append the given callback function to this
#   `Future`, which will be run when the `Future` is completed"; returns "A new `Future`" holding
#   the callback's return value) and `Future.value` (the value of a completed future, to call
#   after `wait` or inside a `then` callback); `torch/_C/_distributed_c10d.pyi` — `Work.get_future`;
#   `_allreduce_fut` chains `dist.all_reduce(..., async_op=True).get_future().then(...)`.
# - `torch/include/torch/csrc/distributed/c10d/reducer.hpp` — `Reducer::div_factor_` (the
#   division factor for the gradients: the process group's size).
# - c10d's `reducer.cpp` (in the PyTorch repository, under `torch/csrc/distributed/c10d/`; not
#   installed; the v2.14.1 tag could not be fetched here, so it was read at a revision that
#   already has `batched_grad_copy`, the option the installed 2.14.1 has, and the installed
#   `libtorch_cpu.so` holds its record name and message, a claim above) —
#   `Reducer::mark_variable_ready_dense`: without a comm hook,
#   `at::mul_out(bucket_view, grad, wrapped)` with `wrapped =
#   at::native::wrapped_scalar_tensor(1. / div_factor_)` (under the `RECORD_FUNCTION` name
#   `torch::distributed::reducer::mul_out`); with a hook, `bucket_view.copy_(grad)`; when the
#   gradient already aliases its bucket view, `bucket_view.div_(div_factor_)` without a hook
#   and nothing with one; with `batched_grad_copy_`, the copy is deferred to
#   `Reducer::flush_deferred_copies`. `Reducer::set_divide_factor` sets `div_factor_` to
#   `process_group_->getSize()` (or, under `Join` with `divide_by_initial_world_size=False`,
#   the count of ranks that have not joined yet).
# - `torch/nn/parallel/distributed.py` — `DistributedDataParallel.__init__`: the broadcast at
#   construction (`_verify_param_shape_across_processes`, then `_sync_module_states(...,
#   src=0)`) runs only under `if init_sync:` ("All collectives during initialization are gated
#   by this flag"), lines 1061-1073; the docstring for `static_graph`: the set of used and
#   unused parameters does not change, **and** "How the graph is trained will not change during
#   the whole training loop (meaning there is no control flow depending on iterations)",
#   lines 743-749.
# - `torch/include/torch/csrc/distributed/c10d/default_comm_hooks.hpp` — `_AllReduceBySumCommHook`
#   ("Almost same as AllReduceCommHook, but without division inside the hook ... when no
#   communication hook is provided by the user"), lines 35-50, whose `runHook` returns a
#   `c10::ivalue::Future`; `torch/include/torch/csrc/distributed/c10d/reducer.hpp` —
#   `Reducer::comm_hook_` (the hook the reducer runs, line 554).
#
# </details>
