# %% [markdown]
# # 05 — TensorFlow's MirroredStrategy, side by side with DDP
#
# **Prerequisites:** lessons 03–04 (DDP); Keras models and `tf.GradientTape` at a reading level.
#
# **You will be able to:**
# - split a CPU or GPU into logical devices, and say why that must happen first;
# - create mirrored variables and distribute a dataset with the global batch;
# - write a custom mirrored training step whose per-replica loss the strategy's combination
#   turns into one device's gradient, and recognise the scaling bugs that get it wrong;
# - train with Keras `fit`, mixed precision, checkpoints and two multi-worker processes;
# - map every piece of MirroredStrategy to its PyTorch DDP counterpart.
#
# **Time:** about 60 minutes to read and run.
#
# **Lab:** [lab05_mirrored_strategy](../labs/lab05_mirrored_strategy.ipynb) — the custom loop
# with correct loss scaling.
#
# Lessons 03–04 built data parallelism in PyTorch: N processes, each with a copy of the model and
# a slice of the global batch, gradients all-reduced after every backward pass. TensorFlow gives
# the same idea a different shape: **one process** drives N *replicas* (GPUs, or logical devices
# carved out of one CPU or GPU), and a `tf.distribute.Strategy` decides where variables live and
# how gradients are combined. This lesson proves, with the same model and data as before, that a
# mirrored step equals one device on the global batch, shows the classic loss-scaling bug, and
# ends with a PyTorch DDP run and a TF run agreeing to float precision.
#
# Contents: devices and the must-happen-first rule · MirroredStrategy and mirrored variables ·
# tf.data with the global batch (cache, prefetch) · replica and cross-replica context · the
# custom loop's proofs, the 1/N scaling bugs · Keras `fit` · mixed precision · checkpoints · MultiWorkerMirroredStrategy on
# localhost · PyTorch DDP vs TF, side by side.

# %% tags=["parameters"]
data_name = "shapes10"   # or "cifar10" if you have it
n_train = 2048
n_test = 500
global_batch = 64        # split over the replicas
lr = 0.1                 # plain SGD in the proofs
steps = 3                # SGD steps compared between frameworks
world_size = None        # replicas; None: from the hardware profile
multiworker_timeout = 90

# %% [markdown]
# ## 1. Devices — and why this cell comes first
#
# `dpcourse.devices` picks the hardware profile. On a CPU-only machine TensorFlow sees one CPU,
# so we **split it into 2 logical devices**; with one GPU it splits the GPU into logical GPUs; with
# several GPUs it mirrors over the real ones.
#
# TensorFlow fixes its device list the first time anything *uses* a device: creating a tensor, a
# variable, a strategy, a dataset, or listing the logical devices. So the split is the first
# thing a TF notebook does, in every fresh kernel. (Importing TF, or listing the physical
# devices, is harmless.) Before importing TF, `dpcourse.mirrored` sets two environment variables unless you
# set them: `TF_CPP_MIN_LOG_LEVEL=2` (no INFO or WARNING lines from TF's C++; errors still print)
# and `TF_ENABLE_ONEDNN_OPTS=0` (no oneDNN custom operations, Intel's fast CPU kernels), through
# `tf_quiet.set_quiet_environment` (its code is folded at the end of this section).

# %%
# NBVAL_IGNORE_OUTPUT
# (why: the device kind is the machine's: CPU here, GPU on a GPU machine.)
from dpcourse import devices, mirrored, viz
from dpcourse.checks import claim

profile = devices.choose_profile()
n_replicas = world_size or profile.tf_devices
device_names = devices.split_tf_devices(n_replicas)
print("mirroring over", len(device_names), profile.tf_device_type, "device(s)")

# %% [markdown]
# Now TF has started. Asking for a **larger** split is refused with a clear message — the only
# fix is to restart the kernel and run the split first. A smaller one is not refused: it returns
# the first n devices of the existing split (checked below). (Asking for the *same* split again is fine, so
# re-running the cell above does no harm.) The split is one call,
# `tf.config.set_logical_device_configuration(device, [LogicalDeviceConfiguration()] * n)`, and
# TF's own refusal once it has started is a `RuntimeError` ("Virtual devices cannot be modified
# after being initialized") that `split_tf_devices` turns into one that says what to do.

# %% [markdown]
# **▶ `devices.split_tf_devices`, the code** (click the folded cell below).

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show_code(devices.split_tf_devices, folded="▶ code: devices.split_tf_devices")

# %%
# NBVAL_IGNORE_OUTPUT
# (why: the message names this machine's device kind (CPU or GPU) and count.)
try:
    devices.split_tf_devices(n_replicas + 1)
except RuntimeError as err:
    print("RuntimeError:", err)

# %%
claim("asking for the same split again is fine",
      devices.split_tf_devices(n_replicas) == device_names)
claim("a smaller split is not refused: it is the first n devices of the existing one",
      devices.split_tf_devices(1) == device_names[:1])

# %% [markdown]
# **▶ `tf_quiet.set_quiet_environment`, the code** (click the folded cell below).

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
from dpcourse import tf_quiet

viz.show_code(tf_quiet.set_quiet_environment, folded="▶ code: tf_quiet.set_quiet_environment")

# %% [markdown]
# ## 2. MirroredStrategy and mirrored variables
#
# `MirroredStrategy(devices)` keeps one copy of every variable on each replica. A variable
# created **inside `strategy.scope()`** with the default synchronization becomes a
# `MirroredVariable`; the strategy keeps the copies equal by applying the same (all-reduced)
# update to each. A variable created with `synchronization=ON_READ` — as every Keras metric's
# state is (`Metric.add_variable`) — becomes a `SyncOnReadVariable` instead: each replica updates
# its own copy, and they are combined only when the value is read by code that runs once for
# all replicas (the *cross-replica context*). Both kinds are claimed below. A variable
# created outside the scope is an ordinary variable on one device.

# %% [markdown]
# The course builds every strategy with `mirrored.make_strategy(devices)`: plain
# `tf.distribute.MirroredStrategy(devices)` plus a test-only setting lab 05's checks need
# (folded at the end of this section).

# %%
import time

import numpy as np
import tensorflow as tf
import keras
import torch

from dpcourse import data, models

strategy = mirrored.make_strategy(device_names)
claim("the strategy has one replica per device", strategy.num_replicas_in_sync == n_replicas)

with strategy.scope():
    v = tf.Variable(1.0)
outside = tf.Variable(1.0)
print("inside the scope: ", type(v).__name__, "| outside the scope:", type(outside).__name__)
claim("a variable made inside the scope has one copy per replica", len(v.values) == n_replicas)
claim("a variable made outside the scope is not the strategy's",
      not strategy.extended.variable_created_in_scope(outside))
with strategy.scope():
    accuracy = keras.metrics.SparseCategoricalAccuracy()
metric_kinds = {w.name: type(w.value).__name__ for w in accuracy.variables}
claim("a Keras metric made inside the scope keeps its state in SyncOnReadVariables, not mirrored "
      "ones", set(metric_kinds.values()) == {"SyncOnReadVariable"}, kinds=metric_kinds)
viz.show(viz.mirrored_vs_ddp_figure(n_replicas),
         "MirroredStrategy: one process, one Python program, N replicas it drives; DDP: N processes, "
         "each with its own copy; both end each step by combining the gradients of all copies — "
         "TF sums them (by default with a collective all-reduce, next cell), DDP averages them.")

# %% [markdown]
# ### How the replicas' gradients are summed, on each profile
#
# A strategy sums across replicas with a *cross-device ops* object (`tf.distribute.CrossDeviceOps`).
# When you pass none, as here, the installed TensorFlow picks one in
# `MirroredExtended._make_collective_ops_with_fallbacks` (in TF 2's eager mode, as here; a TF1
# session falls back to `ReductionToOneDevice` with any non-GPU device):
#
# | the strategy's devices (and the process's GPUs) | cross-device ops | what travels |
# |---|---|---|
# | CPUs (the course's CPU profile) | `CollectiveAllReduce`, implementation `RING` | TF's own ring all-reduce among the replicas (lesson 06 takes a ring apart) |
# | GPUs, some GPU in the process split into logical ones (one-GPU profile) | `CollectiveAllReduce`, `RING` | the same ring |
# | GPUs, no GPU in the process split (multi-GPU profile) | `CollectiveAllReduce`, `NCCL` | NCCL's all-reduce |
# | CPUs and GPUs mixed | `ReductionToOneDevice` | every replica's value copied to one device, added there, the sum sent back — the naive parameter-server pattern of lesson 02 |
#
# TF's check counts the process's GPUs, not the strategy's: once any GPU is split, even one
# physical GPU per replica gets `RING`.
#
# You can also choose: `MirroredStrategy(devices, cross_device_ops=tf.distribute.ReductionToOneDevice())`
# or `tf.distribute.NcclAllReduce()` (GPUs only).
#
# This notebook's row is measured below; the others are read in TF's source (Sources).
#
# TF has no public getter: `mirrored.cross_device_ops_in_use` reads the strategy's private
# `extended._cross_device_ops` and that object's `_options.implementation`; the next cell prints
# both (**▶ its code**, folded below).

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show_code(mirrored.cross_device_ops_in_use,
              folded="▶ code: mirrored.cross_device_ops_in_use")

# %%
# NBVAL_IGNORE_OUTPUT
# (why: the implementation is the profile's: RING on CPUs or once a GPU is split, else NCCL.)
ops_name, ops_impl = mirrored.cross_device_ops_in_use(strategy)   # reads the two attributes:
print(f"strategy.extended._cross_device_ops: {ops_name}; its ._options.implementation: {ops_impl}")

# %%
# NBVAL_IGNORE_OUTPUT
# (why: the claim names this machine's profile and GPU counts.)
n_physical_gpus = len(tf.config.list_physical_devices("GPU"))
n_logical_gpus = len(tf.config.list_logical_devices("GPU"))
ring_expected = profile.tf_device_type == "CPU" or n_physical_gpus < n_logical_gpus
expected_ops = ("CollectiveAllReduce", "RING" if ring_expected else "NCCL")
claim(f"by default this strategy ({profile.tf_device_type} profile, {n_physical_gpus} physical / "
      f"{n_logical_gpus} logical GPUs) sums gradients with {expected_ops[0]}, implementation "
      f"{expected_ops[1]}", (ops_name, ops_impl) == expected_ops,
      in_use=(ops_name, ops_impl), expected=expected_ops)

# %% [markdown]
# <details><summary>▶ Why make_strategy, not plain MirroredStrategy (optional: a test-only
# setting)</summary>
#
# A `CollectiveAllReduce` numbers its *collective groups* (the sets of devices that all-reduce
# together) from 1 in every strategy. Two strategies of different sizes in one process (lab
# 05's checks build one with N + 1 replicas beside this one) would reuse a number for groups of
# different sizes, and TF aborts. So `make_strategy` gives each strategy its own range through
# the private class attribute `MirroredStrategy._collective_key_base`, which TF's source marks
# "Only set this in tests". With one strategy per process, plain `MirroredStrategy(devices)` is
# all you need.
#
# </details>

# %% [markdown]
# **▶ `mirrored.make_strategy`, the code** (click the folded cell below).

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show_code(mirrored.make_strategy, folded="▶ code: mirrored.make_strategy")

# %% [markdown]
# ## 3. Input: tf.data with the global batch
#
# The data set is the same as in the PyTorch lessons (`dpcourse.data`, NumPy arrays): Keras takes
# channels-last images (N, 32, 32, 3), PyTorch channels-first. The pipeline batches with the
# **global** batch; the strategy hands each replica `global_batch / N` examples.

# %%
ds = data.load(data_name, n_train=n_train, n_test=n_test, seed=0)
train = mirrored.make_dataset(ds.x_train, ds.y_train, global_batch)   # unshuffled: comparable runs
x0, y0 = next(iter(train))
dist_x, dist_y = next(iter(strategy.experimental_distribute_dataset(train)))
local_sizes = [int(t.shape[0]) for t in strategy.experimental_local_results(dist_x)]
print("global batch", tuple(x0.shape), "-> per replica", local_sizes)
claim("each replica gets global_batch / N examples",
      all(s == global_batch // n_replicas for s in local_sizes))
claim("together they hold the whole global batch", sum(local_sizes) == global_batch)

# %% [markdown]
# The other way in (lab 05's stretch A): `strategy.distribute_datasets_from_function(dataset_fn)`
# calls your `dataset_fn(input_context)` once per input pipeline. The `tf.distribute.InputContext`
# says how many input pipelines there are (one per worker process) and which one this is:

# %%
seen = []   # what TF tells dataset_fn: (pipelines, this pipeline's id)


def dataset_fn(ctx):   # ctx: a tf.distribute.InputContext
    seen.append((ctx.num_input_pipelines, ctx.input_pipeline_id))
    return tf.data.Dataset.range(4)


strategy.distribute_datasets_from_function(dataset_fn)
claim("one process, one input pipeline: dataset_fn ran once, as pipeline 0 of 1",
      seen == [(1, 0)], seen=seen)

# %% [markdown]
# ### cache and prefetch
#
# A real image pipeline decodes files (JPEG/PNG) for every example in every epoch. `cache()`
# keeps the decoded result after the first epoch — in memory, so only while the decoded float32
# set fits in RAM (four times the uint8 images); `cache(filename)` keeps it in a file instead.
# `prefetch()` prepares the next batch while the current one is consumed. We store our images as
# PNG and compare two epochs of a pipeline that decodes every time against one with cache and
# prefetch. Where `cache()` stands in the pipeline decides what it keeps: in the course's
# `make_dataset` it comes after the `map` that decodes and normalises, and before `shuffle` and
# `batch` — so it keeps decoded images, and each epoch still shuffles and batches them anew:

# %%
viz.show_code(mirrored.make_dataset)

# %% [markdown]
# Cache saves the decoding of every epoch after the first, so we compare second epochs. Prefetch
# has nothing to overlap with here (the loop does no work with the batches). Nor is `prefetch=False` a sequential pipeline:
# TF 2.21's default tf.data optimizations inject a prefetch after the final `batch`
# (`inject_prefetch`) and run the decoding `map` in parallel (`map_parallelization`) in both
# pipelines (`tensorflow/python/data/ops/options.py`), so the second epochs compare the cache
# alone.
#
# An in-memory cache outlives its iterators, so each round builds both pipelines anew. A fresh
# pipeline's first epoch may pay one-time costs: for the one that decodes every time, its first
# epoch minus its second shows them. After an untimed warm-up of each kind (tracing the `map`:
# recording its ops into a graph, once; and loading the decoder), three rounds, the two kinds
# taking turns to go first; a gain or a one-time cost is called only when every round shows it
# (5 % or more).

# %% [markdown]
# **▶ The timing's code** (folded below; its output shows: each round's two epochs, then what
# this run's numbers show).

# %% jupyter={"source_hidden": true}
# NBVAL_IGNORE_OUTPUT
# (why: timings; they depend on this machine's cores and load.)
def seconds_per_epoch(pipeline, epochs=2):
    times = []
    for _ in range(epochs):
        t0 = time.perf_counter()
        for _batch in pipeline:
            pass
        times.append(time.perf_counter() - t0)
    return times


def pipeline(kind, x, y):   # fresh each time: a cache kept from an earlier round skips decoding
    return mirrored.make_dataset(x, y, global_batch, decode_png=True,
                                 cache=kind == "tuned", prefetch=kind == "tuned")


some_x, some_y = ds.x_train[:1024], ds.y_train[:1024]
for kind in ("plain", "tuned"):         # warm-up, untimed: one-time costs fall on neither
    seconds_per_epoch(pipeline(kind, some_x[:global_batch], some_y[:global_batch]), epochs=1)
rounds = {"plain": [], "tuned": []}     # per round: [first epoch, second epoch] in seconds
for r in range(3):                      # the two take turns to go first
    for kind in (("plain", "tuned") if r % 2 == 0 else ("tuned", "plain")):
        rounds[kind].append(seconds_per_epoch(pipeline(kind, some_x, some_y)))
for kind, label in (("plain", "decode every time"), ("tuned", "cache+prefetch   ")):
    print(f"{label}: epochs 1, 2 = "
          + "; ".join(f"{e1:.3f} s, {e2:.3f} s" for e1, e2 in rounds[kind]))
second = {kind: [e2 for _, e2 in rounds[kind]] for kind in rounds}
gains = [p / t for p, t in zip(second["plain"], second["tuned"])]   # round by round
first_extra = [e1 - e2 for e1, e2 in rounds["plain"]]   # same work in both epochs
if min(gains) < 1.05:
    print("This run: no clear gain from caching: in at least one round the cached second epoch "
          "was not 5 % faster than a second epoch that decodes again.")
else:
    print(f"This run: in every round the cached second epoch was faster than a second epoch that "
          f"decodes again, a median round {np.median(gains):.1f}x (on second epochs of "
          f"{np.median(second['plain']):.3f} s against {np.median(second['tuned']):.3f} s, "
          f"medians, so short that the rounds range from {min(gains):.1f}x to {max(gains):.1f}x).")
if all(d > 0.05 * e2 for d, (_, e2) in zip(first_extra, rounds["plain"])):   # every round
    print(f"In every round, a fresh pipeline that decodes every time took longer over its first "
          f"epoch than over its second, on the same work ({min(first_extra):.3f} s to "
          f"{max(first_extra):.3f} s more): a cost paid once per pipeline, which a two-epoch "
          f"total would have mixed into the comparison.")
else:
    print("This run: no consistent first-epoch cost (first minus second epoch of the one that "
          "decodes every time, round by round: "
          + ", ".join(f"{d:+.3f} s" for d in first_extra) + ").")

# %% [markdown]
# ## 4. Replica and cross-replica context
#
# A mirrored step has three parts: `strategy.run(step_fn)` runs forward and backward on every
# replica with its slice; `optimizer.apply_gradients` **sums** the replicas' gradients (Keras'
# optimizer calls the replica context's `all_reduce(SUM, grads)`, which goes through the
# cross-device ops above) and updates every copy; `strategy.reduce` turns the per-replica
# losses into one number. (Writing that step is lab 05.)
#
# Code inside `strategy.run(fn)` runs once per replica, in the **replica context**:
# `tf.distribute.get_replica_context()` there returns this replica's.
# Code outside it, such as `strategy.reduce`, runs once for all replicas, in the
# **cross-replica context**.
# **Tracing**: a `tf.function`'s first call runs its Python code once, recording the TensorFlow
# operations into a graph that later calls reuse.
#
# The replica context's `all_reduce` is also yours to call inside `strategy.run`: every replica
# passes a value of the same shape, and every replica gets back the same combination of all of
# them, while the step is still running on each replica (`strategy.reduce`, by contrast, gives
# one value on the host after `strategy.run` has returned). Every replica must make the call, in
# the same order. A **merge call** (`replica_context.merge_call(fn)`) is how replica-context code
# reaches the cross-replica context: every replica pauses at the call, and `fn` runs once with
# all replicas' values; this `all_reduce` goes through one whenever the strategy uses merge
# calls. Here each replica passes its own replica id, and their mean, (N − 1) / 2,
# comes back on every replica (`tf.distribute.ReduceOp` has two members, `SUM` and `MEAN`):

# %%
def mean_replica_id():
    replica = tf.distribute.get_replica_context()          # this replica's context
    mine = tf.cast(replica.replica_id_in_sync_group, tf.float32)
    return mine, replica.all_reduce(tf.distribute.ReduceOp.MEAN, mine)


mine, mean_id = strategy.run(mean_replica_id)
ids = [float(v) for v in strategy.experimental_local_results(mine)]
means = [float(v) for v in strategy.experimental_local_results(mean_id)]
claim("inside strategy.run, all_reduce(MEAN) hands every replica the mean of all replicas' "
      "values (here their ids 0 … N-1: (N-1)/2 on every replica)",
      ids == list(range(n_replicas)) and means == [(n_replicas - 1) / 2] * n_replicas,
      ids=ids, means=means)

# %% [markdown]
# *Lab 05 builds on this part: read it before the lab.*
#
# What if one replica skips the call? TF's docstring of `all_reduce` says the operation then
# "hangs"; on this profile it fails instead. Eagerly, `strategy.run` raises a `RuntimeError`; in
# a `tf.function` a call that only some replicas make (under an `if` on the replica id) is
# refused while TF traces, before the step ever runs.
# A traced loop *around* `strategy.run` is fine. So every replica makes the call, in the same
# order. The cells below run both (replica 0 returns before the call, eagerly first), then the
# loop.

# %% [markdown]
# <details><summary>▶ Inside tf.distribute: merge calls</summary>
#
# **Merge calls** explain why, under `MirroredStrategy` on this profile, a skipped `all_reduce`
# does not hang: the replica context's `all_reduce` goes through one
# (`ReplicaContextBase.all_reduce`), and so does Keras' `apply_gradients` (through that
# `all_reduce`); `strategy.reduce`, already in the cross-replica context, needs none.
#
# Read in `mirrored_run.py` (Sources): **eagerly**, `strategy.run` counts each replica's merge
# calls — when some replicas finish while others still wait in one, it raises a `RuntimeError`
# ("different number of … merge_call() calls"). **In a `tf.function`** the `if` on the replica
# id becomes a `tf.cond` whose branches are traced as graphs of their own, and a merge call
# inside such a branch raises another ("`merge_call` called while defining a new graph …
# control flow statement which contains a synchronization point"). A traced loop around
# `strategy.run` is no such branch: its merge calls share the loop body's graph.
#
# By the source alone (no cell of this lesson runs it), a hang is what you get where no merge
# call checks the replicas: a step compiled with XLA (TensorFlow's compiler,
# `tf.function(jit_compile=True)`) on all-GPU devices, where `_use_merge_call` is false; and
# across the processes of `MultiWorkerMirroredStrategy` (section 9), which makes merge calls by
# the same rule, but each process counts only its own replicas, so a replica missing in
# *another* process leaves this one's collective waiting.
#
# </details>

# %%
def replica_0_skips_the_all_reduce():
    replica = tf.distribute.get_replica_context()
    mine = tf.cast(replica.replica_id_in_sync_group, tf.float32)
    # the id is an int32 tensor: eagerly a plain Python if; in a tf.function, AutoGraph makes
    # this if a tf.cond (its branches traced as graphs of their own)
    if replica.replica_id_in_sync_group == 0:
        return mine
    return replica.all_reduce(tf.distribute.ReduceOp.MEAN, mine)


try:
    strategy.run(replica_0_skips_the_all_reduce)
    skipped = "no error"
except RuntimeError as err:
    skipped = str(err)
print("RuntimeError:", skipped)
claim("eagerly, a replica that skips all_reduce makes strategy.run raise the merge-call count "
      "error, not hang",
      n_replicas == 1 or "different number of replica_context().merge_call() calls" in skipped,
      error=skipped)


@tf.function
def traced_skip():   # the same replica function, now traced as a training step is
    return strategy.run(replica_0_skips_the_all_reduce)


try:
    traced_skip()
    skipped_traced = "no error"
except RuntimeError as err:
    skipped_traced = str(err)
at = skipped_traced.find("`merge_call` called")     # the message, past the traceback lines
print("traced, RuntimeError:", skipped_traced[at:at + 160] if at >= 0 else skipped_traced[:160])
claim("in a tf.function the same skip raises while TF traces: a merge call inside a control-flow "
      "branch (TF's message: \"`merge_call` called while defining a new graph\")",
      n_replicas == 1 or "merge_call` called while defining a new graph" in skipped_traced,
      error=skipped_traced[-300:])
id_dtypes = {t.dtype.name for t in strategy.experimental_local_results(strategy.run(
    lambda: tf.distribute.get_replica_context().replica_id_in_sync_group))}
claim("replica_id_in_sync_group is an int32 tensor", id_dtypes == {"int32"}, dtypes=id_dtypes)

# %% [markdown]
# **▶ The traced loop's code** (folded below; its output is the claim).

# %% jupyter={"source_hidden": true}
loop_traces = []


@tf.function
def traced_loop():   # strategy.run(mean_replica_id), all_reduce inside, in a traced loop
    loop_traces.append(1)                                   # Python runs only while TF traces
    total = tf.constant(0.0)
    for _ in tf.range(3):   # AutoGraph: a tf.while_loop, its body traced once as one graph
        total += strategy.experimental_local_results(strategy.run(mean_replica_id)[1])[-1]
    return total


looped = [float(traced_loop()) for _ in range(2)]
claim("a tf.function looping 3 times over strategy.run, all_reduce inside: traced once, no "
      "error, and each call returns 3 × (N-1)/2",
      loop_traces == [1] and looped == [3 * (n_replicas - 1) / 2] * 2,
      traces=len(loop_traces), looped=looped)

# %% [markdown]
# When does the strategy use merge calls at all? By TF's source
# (`MirroredExtended._use_merge_call`, a policy flag; Sources), MirroredStrategy skips merge calls
# only in a function compiled with XLA (TensorFlow's compiler, `tf.function(jit_compile=True)`)
# whose strategy's devices are all GPUs; otherwise it keeps them, XLA or not. The cell reads the
# flag while TF traces an XLA-compiled function on this profile's devices, which tests the one
# case this profile has:

# %%
# NBVAL_IGNORE_OUTPUT
# (why: the claim names the case of this profile's devices, all GPUs or not.)
merge_flags = []


@tf.function(jit_compile=True)   # compiled with XLA
def traced_with_xla(x):
    merge_flags.append(strategy.extended._use_merge_call())   # read while TF traces
    return x + 1


traced_with_xla(tf.constant(0.0))
all_gpu = all("GPU" in name.upper() for name in device_names)
claim(f"inside an XLA-compiled function this strategy, whose devices are "
      f"{'all GPUs' if all_gpu else 'not all GPUs'}, {'skips' if all_gpu else 'uses'} merge calls",
      merge_flags == [not all_gpu], merge_flags=merge_flags, all_gpu=all_gpu)

# %% [markdown]
# ## Lab 05: the custom loop
#
# You have the pieces: the scope (§2), the global batch split over the replicas (§3),
# `strategy.run` (§4), and an optimizer that **sums** the replicas' gradients — so each replica's
# loss is not the mean one device would compute. What it must be, for slices of any size and
# with a penalty every replica holds whole, is the lab's first question. Open
# [lab05_mirrored_strategy](../labs/lab05_mirrored_strategy.ipynb) now: its step is not told
# its size, so a short last batch, which this lesson does not train on, is part 1's case too. **Do
# it before reading on**: §5 proves what its part 1 builds on.

# %% [markdown]
# ## 5. After the lab: the proofs
#
# The rule they rest on, for steps whose global batch is known
# in advance: since the strategy **sums** the replicas' gradients, each replica divides its
# summed per-example losses by the **global** batch (`tf.nn.compute_average_loss` with
# `global_batch_size=`), and the sum of the N gradients is one device's gradient of the mean
# over the whole global batch. Below: the per-example loss, that per-replica loss, one mirrored
# step's gradient, and the one-device gradient (no strategy) every proof compares it with.
# `@tf.function` compiles the step into a graph (tracing: §4); the `loss_scaling` and
# `grad_reduce` options select the wrong variants measured below; the proofs use the defaults.

# %%
viz.show_code(mirrored.per_example_loss, mirrored.per_replica_loss, mirrored.mirrored_gradients,
              mirrored.single_replica_gradients)

# %% [markdown]
# The same starting weights everywhere: we build the PyTorch `SmallCNN` of lessons 01–04 and
# copy its weights into the Keras twin. Convolution kernels are transposed, and the first dense
# layer's rows are reordered — PyTorch flattens a (C, H, W) feature map, Keras an (H, W, C) one.
# The two models then compute the same function (the claim below compares their logits).
# `mirrored.copy_torch_weights` reads the torch model's `state_dict` in order and hands the ten
# arrays to:

# %%
viz.show_code(mirrored.set_torch_layout_weights)

# %% [markdown]
# **▶ `mirrored.copy_torch_weights` itself** (click the folded cell below).

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show_code(mirrored.copy_torch_weights,
              folded="▶ code: mirrored.copy_torch_weights")

# %% [markdown]
# **▶ How this lesson builds a mirrored model and optimizer (lab 05 part 2's answer) — open
# after your lab passes** (click the folded cell below: `mirrored_cnn`, `optimizer_in`, and a
# claim on what goes wrong otherwise).

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
from dpcourse import mirrored_answers

viz.show_code(mirrored.mirrored_cnn, mirrored.optimizer_in,
              folded="▶ mirrored_cnn and optimizer_in — open after your lab passes")
mirrored_cnn = mirrored.mirrored_cnn


def optimizer_in(strat, rate=lr, **options):  # this lesson's learning rate unless told
    return mirrored.optimizer_in(strat, rate, **options)


viz.show_code(mirrored_answers.measure_optimizer_counter,
              folded="▶ The claim's code — open after your lab passes")
with viz.folded_output("▶ The claim — open after your lab passes"):
    mirrored_answers.measure_optimizer_counter(strategy, lr)

# %% [markdown]
# Every proof from here on runs the course's Keras CNN, `mirrored.build_keras_cnn` (the twin of
# `SmallCNN`; §7 comes back to two of its lines). **▶ Its code** (click the folded cell below).
# Its comparisons state a tolerance: with oneDNN's custom operations off (§1), the last bits may
# still differ across machines (float matrix products can still call oneDNN's `dnnl_sgemm`,
# chosen at run time: Sources), and two ways of computing one number may add in different orders.

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show_code(mirrored.build_keras_cnn, folded="▶ code: mirrored.build_keras_cnn")

# %%
torch.manual_seed(0)
torch_model = models.SmallCNN()
init = [p.detach().numpy().copy() for p in torch_model.parameters()]

single = mirrored.copy_torch_weights(torch_model, mirrored.build_keras_cnn())  # no strategy
replicated = mirrored_cnn(strategy, torch_model)   # mirrored variables

xb = data.normalize(ds.x_train[:global_batch])
yb = ds.y_train[:global_batch]
with torch.no_grad():
    torch_logits = torch_model(torch.from_numpy(xb.transpose(0, 3, 1, 2).copy())).numpy()
claim("PyTorch and Keras give the same logits (to 1e-5)",
      np.allclose(torch_logits, single(xb).numpy(), atol=1e-5))

# %% [markdown]
# **Proof, one step:** the gradient the mirrored step applies equals one device's gradient of
# the mean loss over the whole global batch.

# %%
g_single = mirrored.single_replica_gradients(single, xb, yb)
g_mirror = mirrored.mirrored_gradients(strategy, replicated, xb, yb)
max_diff = max(float(np.abs(a - b).max()) for a, b in zip(g_mirror, g_single))
claim("the mirrored gradients equal one device's on the global batch (to 1e-5)", max_diff < 1e-5,
      max_diff=max_diff)

# %% [markdown]
# The same step with `ReductionToOneDevice` — the gradients copied to the first replica's
# device, added there and sent back — gives the same gradients: the two differ in what travels
# where, not in the sum (up to the order of the additions: to 1e-6 here).

# %%
to_one = mirrored.make_strategy(device_names, cross_device_ops=tf.distribute.ReductionToOneDevice())
replicated_to_one = mirrored_cnn(to_one, torch_model)
g_to_one = mirrored.mirrored_gradients(to_one, replicated_to_one, xb, yb)
claim(f"{mirrored.cross_device_ops_in_use(to_one)[0]} gives the default's gradients (to 1e-6)",
      max(float(np.abs(a - b).max()) for a, b in zip(g_to_one, g_mirror)) < 1e-6)

# %% [markdown]
# ### The scaling bugs, in numbers
#
# Two classic mistakes are in the folded table of seven pairings below, measured in the folded
# cell after it (open both after your lab passes).
#
# The loss most Keras 3 code writes is a Keras loss object,
# `keras.losses.SparseCategoricalCrossentropy(from_logits=True)(y, logits)`. A call of a Keras
# loss with a mean reduction — the default `"sum_over_batch_size"`, or `"mean"` — takes the mean
# of all the values its `call` returns, one per example here (a scalar it returns as is: no mean, no 1/N;
# claimed below) and multiplies it by 1 / `num_replicas_in_sync` whenever
# `tf.distribute.get_strategy()` returns the strategy: in `fit` and in your own `strategy.run`
# step alike, but also in plain host code under `with strategy.scope()` (with
# `"mean_with_sample_weight"` and weights, the weight sum is the divisor); `reduction="sum"` or
# `"none"` is not scaled (`reduce_values` and `scale_loss_for_distribution` in Keras' losses;
# claimed below). The 1/N is right only for one replica's share that the strategy then sums. So
# in a custom loop the default loss is already scaled, and code that divides it by the number
# of replicas once more makes the gradient N× too small; and a loss computed once on the host
# for a whole batch inside the scope — a validation loss, say — comes out N× too small.
# The library's function for the Keras rows below:

# %% [markdown]
# **▶ `mirrored.keras_loss_per_replica`** (click the folded cell below).

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show_code(mirrored.keras_loss_per_replica,
              folded="▶ code: mirrored.keras_loss_per_replica")

# %% [markdown]
# <details><summary>▶ The seven pairings: per-replica loss × how gradients combine (its second row and the note under the table on unequal slices are part of lab 05 part 1's answer) — open after your lab passes</summary>
#
# The classic mistake is `tf.reduce_mean` per replica: each replica divides by *its own*
# batch (global / N), and the strategy then **sums** N such gradients — the gradient is **N times
# too big**; with SGD (momentum too) so is the step, like multiplying the learning rate by N, while
# Adam, which divides by the gradient's own running size, barely notices — which is why the bug can
# go unseen. The mirror image hits programmers coming from
# DDP, which *averages* gradients: divide by the global batch *and* average over replicas, and
# the gradient is **N× too small**.
#
# Measured and claimed below. With every replica's slice the same size, as in every training
# step of this lesson, each framework is right only with its own pairing:
#
# | per-replica loss | replicas' gradients | result, equal slices |
# |---|---|---|
# | `compute_average_loss` with `global_batch_size=` (÷ global batch) | SUM (TF's all-reduce) | correct |
# | `compute_average_loss` without it (÷ local batch × N) | SUM (TF's all-reduce) | correct (here local batch × N = global batch) |
# | `reduce_mean` (÷ local batch) | SUM (TF's all-reduce) | N × too big |
# | `compute_average_loss` with `global_batch_size=` (÷ global batch) | MEAN | N× too small |
# | `reduce_mean` (÷ local batch) | MEAN (DDP's all-reduce) | correct |
# | Keras loss object, as is (local mean × 1/N) | SUM (TF's all-reduce) | correct |
# | Keras loss object ÷ `num_replicas_in_sync` | SUM (TF's all-reduce) | N× too small |
#
# Called without `global_batch_size`, `compute_average_loss` divides by its own slice × N: the
# global batch only when the slices are equal.
#
# </details>

# %% [markdown]
# **▶ Six of the seven pairings' gradients, measured — open after your lab passes** (click the
# folded cell below: `mirrored_answers.measure_pairings`; its output and claims are folded too).
# The table's second row is checked on its losses instead: the folded claim that ends the
# second code cell below.

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
# NBVAL_IGNORE_OUTPUT
# (why: the factors are N, the number of replicas, which depends on the profile.)
viz.show_code(mirrored_answers.measure_pairings,
              folded="▶ The pairings' code — open after your lab passes")
with viz.folded_output("▶ The pairings' gradients and claims — open after your lab passes"):
    ratios = mirrored_answers.measure_pairings(strategy, replicated, xb, yb, g_single)

# %% [markdown]
# **▶ The claims on equal slices, on Keras losses computed on the host, and on the table's
# second row** (the code is folded below; its claims show, except the second row's, folded).

# %% jupyter={"source_hidden": true}
def norm(grads):   # a gradient's (or a weight change's) norm, over all its tensors
    return float(np.sqrt(sum(np.sum(g * g) for g in grads)))


n = n_replicas
claim("these slices are equal: the global batch splits evenly", global_batch % n == 0)
logits8, sce = single(xb[:8]), keras.losses.SparseCategoricalCrossentropy
total = float(tf.reduce_sum(mirrored.per_example_loss(yb[:8], logits8)))
outside_scope = float(sce(from_logits=True)(yb[:8], logits8))   # no strategy: the plain mean
with strategy.scope():   # Keras asks tf.distribute.get_strategy() for num_replicas_in_sync
    by = {r: float(sce(from_logits=True, reduction=r)(yb[:8], logits8))
          for r in ("sum_over_batch_size", "sum")}
claim("on the host, under the strategy's scope, the default reduction is the mean × 1/N, "
      "reduction='sum' the unscaled sum (to 1e-5 relative)",
      np.isclose(by["sum_over_batch_size"], total / 8 / n, rtol=1e-5)
      and np.isclose(by["sum"], total, rtol=1e-5), by=by, total=total)
claim("outside the scope the same call is the plain mean: so a whole batch's loss computed on "
      "the host inside the scope is N× too small (to 1e-5 relative)",
      np.isclose(outside_scope, total / 8, rtol=1e-5)
      and np.isclose(by["sum_over_batch_size"] * n, outside_scope, rtol=1e-5),
      outside_scope=outside_scope, inside_scope=by["sum_over_batch_size"])


class ScalarCallLoss(keras.losses.Loss):   # its call already returns the batch's mean
    def call(self, y, logits):
        return tf.reduce_mean(mirrored.per_example_loss(y, logits))


with strategy.scope():
    scalar_call = float(ScalarCallLoss()(yb[:8], logits8))
claim("a Loss whose call already returns a scalar is returned as is under the scope: the plain "
      "mean, no 1/N (to 1e-5 relative)", np.isclose(scalar_call, total / 8, rtol=1e-5),
      scalar_call=scalar_call, total=total)
x_eq, y_eq = next(iter(strategy.experimental_distribute_dataset(
    tf.data.Dataset.from_tensor_slices((xb, yb)).batch(global_batch))))


def two_divisors(x, y):   # compute_average_loss on one replica's slice, without and with the batch
    losses = mirrored.per_example_loss(y, replicated(x))
    return (tf.nn.compute_average_loss(losses),
            tf.nn.compute_average_loss(losses, global_batch_size=global_batch))


implicit, explicit = (np.array(strategy.experimental_local_results(v))
                      for v in strategy.run(two_divisors, args=(x_eq, y_eq)))
with viz.folded_output("▶ The second row's claim — open after your lab passes"):
    claim("with equal slices, compute_average_loss without global_batch_size (÷ its slice × N) "
          "gives each replica the loss it gives with global_batch_size= (to 1e-6 relative)",
          np.allclose(implicit, explicit, rtol=1e-6), implicit=implicit, explicit=explicit)
# %% [markdown]
# **▶ Lab 05's prediction (part 0), answered — open once part 4 has measured it** (click the
# folded cell below; its claims follow, folded too).

# %% [markdown]
# <details><summary>▶ open</summary>
#
# An epoch's last step of **one** sample, distributed by `experimental_distribute_dataset`: replica
# 0 gets the sample, every other replica an **empty** slice, and `strategy.run` calls `step_fn` on
# each of them — none sits the step out (claimed in the folded cell below). A Keras loss on an empty slice is caught
# by a test on the *static* shape: Keras' `reduce_values` returns a value whose shape is known to
# be `(0,)` untouched. So eagerly an empty slice gives an empty tensor of shape `(0,)`. Inside a
# `tf.function` it depends on the shapes TF traces with. A plain `@tf.function` called on the
# distributed batch, as `mirrored.make_train_step`'s is, is traced with that batch's concrete
# shapes — `(1, …)` on replica 0, `(0, …)` on the others — so the test fires there too: shape
# `(0,)` again. Only where the trace leaves the batch dimension unknown does the test not fire, and
# the empty sum, divided with `divide_no_nan`, gives a scalar 0.0: a `tf.function` with an
# `input_signature` of `None` batch size; one that reads an iterator *inside* the function, as
# `fit` does (its shapes come from the dataset's `element_spec`, whose last batch may be short:
# batch size `None`); or a retrace relaxed to unknown shapes (`reduce_retracing=True`, which `fit`
# also sets). All but the last are claimed in the folded cell below (open once part 4 has
# measured your prediction); `fit`'s ways are read in its source (Sources).
#
# </details>

# %% [markdown]
# **▶ Its claims — open once lab 05 part 4 has measured your prediction** (click the folded
# cell below).

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show_code(mirrored_answers.measure_last_step,
              folded="▶ The claims' code — open once lab 05 part 4 has measured your prediction")
with viz.folded_output("▶ Its claims — open once lab 05 part 4 has measured your prediction"):
    mirrored_answers.measure_last_step(strategy, replicated, xb, yb, global_batch)

# %% [markdown]
# **▶ The reference answer — open after your lab passes** (click the folded cell below: the
# library's step, which the rest of this lesson runs; it answers part of lab 05 part 3).

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show_code(mirrored.train_step,
              folded="▶ The reference answer — open after your lab passes")

# %% [markdown]
# **Proof, several steps:** `steps` SGD steps of the mirrored loop (its step: the folded
# reference answer above) end with the same weights as one device on the same global batches.
# The claims below run that library reference; lab 05's checks hold your step to the same
# one-device result. (These weights are also the reference for the multi-worker run and for
# PyTorch below.) While TF traces the step,
# `mirrored.count_cross_device_calls` counts what reaches the two cross-device ops, so we also
# see which one carried the gradients and which one the reported loss. It wraps the cross-device
# ops' `reduce_implementation` and `batch_reduce_implementation` methods (the ones `reduce` and
# `batch_reduce` call) for as long as the `with` block lasts:

# %%
viz.show_code(mirrored.count_cross_device_calls)

# %% [markdown]
# The loop the proof runs: `train_steps` distributes the dataset (each global batch split over
# the replicas) and calls the step that `make_train_step` compiles with `tf.function`. Before it
# traces the step, `make_train_step` builds the optimizer's per-variable state (momentum, Adam's
# moments) under the strategy, so that those variables are created once, mirrored, before the
# trace, rather than lazily during the first call of the traced function. Plain SGD, which this
# lesson and lab 05 use, keeps no such state: for it the build creates no variable. How the
# optimizer must be made is lab 05 part 2's question (this lesson's: `optimizer_in`, folded
# above with a claim).

# %%
viz.show_code(mirrored.make_train_step, mirrored.train_steps)

# %%
sgd_probe = keras.optimizers.SGD(learning_rate=lr)
n_before = len(sgd_probe.variables)
sgd_probe.build(replicated.trainable_variables)
claim("plain SGD's build creates no variable (momentum would add one per weight)",
      len(sgd_probe.variables) == n_before, before=n_before, after=len(sgd_probe.variables))

# %% [markdown]
# From here on the lesson compares weights in torch's layout: `mirrored.keras_weights_as_torch`
# undoes `copy_torch_weights` (transposes back, reorders the first dense layer's rows).
# **▶ Its code** (click the folded cell below).

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show_code(mirrored.keras_weights_as_torch,
              folded="▶ code: mirrored.keras_weights_as_torch")

# %% [markdown]
# The next cell also counts what carries the reported loss. One reduction takes another road on
# every profile: `strategy.reduce(...)` puts its result on the current device (a `with
# tf.device(...)` block's, else the strategy's default device, set for multi-worker jobs, else
# the host CPU: `StrategyExtendedV2._reduce`), and whenever
# the strategy uses merge calls — always, except under XLA on all-GPU devices
# (`MirroredExtended._use_merge_call`, a flag that `_reduce_to` reads) —
# `MirroredExtended._reduce_to` sends a reduction to a CPU, or to devices other than the value's,
# through `ReductionToOneDevice`: here, one number per replica copied to the host.

# %%
sgd = lambda: keras.optimizers.SGD(learning_rate=lr)   # noqa: E731 - plain SGD, as in PyTorch
opt_mirror = optimizer_in(strategy)
with mirrored.count_cross_device_calls() as calls:   # the first call traces the step
    loss_mirror = mirrored.train_steps(strategy, replicated, opt_mirror, train, steps,
                                       global_batch)
n_grads = len(replicated.trainable_variables)
print("calls while the step was traced:", {f"{c}.{m}": k for (c, m), k in calls.counts.items()})
claim(f"apply_gradients summed all {n_grads} gradients in one CollectiveAllReduce.batch_reduce",
      calls.counts.get(("CollectiveAllReduce", "batch_reduce")) == 1
      and calls.tensors[("CollectiveAllReduce", "batch_reduce")] == n_grads, counts=calls.counts)
claim("strategy.reduce of the loss went to the host through ReductionToOneDevice",
      calls.counts.get(("ReductionToOneDevice", "reduce")) == 1, counts=calls.counts)
opt_single = sgd()
loss_single = mirrored.train_steps(None, single, opt_single, train, steps, global_batch)
w_mirror = mirrored.keras_weights_as_torch(replicated)
w_single = mirrored.keras_weights_as_torch(single)
claim(f"after {steps} steps the mirrored weights equal the one-device weights (to 1e-5)",
      all(np.allclose(a, b, atol=1e-5) for a, b in zip(w_mirror, w_single)))
claim("and so do the losses of every step (to 1e-5)",
      np.allclose(loss_mirror, loss_single, atol=1e-5))

# %% [markdown]
# ## 6. Keras `fit` under the strategy
#
# Under `fit`, pass a dataset batched with the global batch, and Keras splits batches, scales
# the loss and all-reduces the gradients. Its loss is a Keras loss object, so its scaling is the one
# section 5's folded table measured.
#
# **▶ `fit` and regularisers (lab 05 part 1's penalty decision, answered) — open after your lab
# passes** (click below).

# %% [markdown]
# <details><summary>▶ open</summary>
#
# Each replica's Keras loss is its mean over its **own** slice, multiplied by
# 1 / `num_replicas_in_sync`. That equals dividing by the global batch when every slice has the
# same size, as here; on a partial last batch, where slices differ, the two differ — so it is
# not lab 05 part 1's answer, which must hold on every split.
#
# Weight *regularisers* (e.g. `kernel_regularizer=`) add terms to `model.losses` that are
# identical on every replica, so summed over N replicas they count N times. In a custom loop
# add them as `tf.nn.scale_regularization_loss(tf.add_n(model.losses))`, which divides by the
# number of replicas; `fit` scales them the same way for you
# (`TensorFlowTrainer._aggregate_additional_loss`). (Our CNN has no regulariser.)
#
# </details>

# %% [markdown]
# The course's `mirrored.fit` builds the model unless it is given one, compiles it with the loss
# from logits and calls Keras' `fit`; left to itself it would make SGD with momentum 0.9, so the
# proof hands it the plain SGD of section 5's loop (`optimizer_in`).
#
# **▶ `mirrored.fit`, the code (lab 05 part 2's answer: where the model and the optimizer are
# built) — open after your lab passes** (click the folded cell below).

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show_code(mirrored.fit,
              folded="▶ mirrored.fit (lab 05 part 2's answer) — open after your lab passes")

# %% [markdown]
# Proof: the same `steps` batches through `fit` under the strategy end with the weights one
# device reached in section 5.

# %%
fit_mirror = mirrored.fit(strategy, train.take(steps), epochs=1,
                          model=mirrored_cnn(strategy, torch_model),
                          optimizer=optimizer_in(strategy))
same_fit = all(np.allclose(a, b, atol=1e-5) for a, b in zip(
    mirrored.keras_weights_as_torch(fit_mirror), w_single))
claim("fit under MirroredStrategy ends with one device's weights (to 1e-5)", same_fit)

# %% [markdown]
# ## 7. Mixed precision
#
# A Keras dtype policy makes layers compute in 16 bits while their variables stay float32:
# `mixed_bfloat16` or `mixed_float16` — Keras ties neither to a device; `mixed_float16` is the
# usual GPU policy (this lesson takes it on every GPU); `mixed_bfloat16` runs on any CPU
# (emulated without bfloat16 units) but is fast only with such units (NVIDIA's Ampere and
# later, AVX512_BF16/AMX CPUs). float16 gradients underflow
# (small values round to zero) without *loss scaling* — multiply the loss by a large factor,
# divide the gradients by it — and bfloat16, with float32's range, needs none. It is
# `model.compile`, not `fit`, that adds the scaling: when the **model's** policy is
# `mixed_float16`, `Trainer.compile` wraps the optimizer in a `LossScaleOptimizer` (unless you
# pass `auto_scale_loss=False`). Two lines of the course's `build_keras_cnn` matter here: the
# last layer, `Activation("linear", dtype="float32")`, which returns the logits in float32
# whatever the layers compute in, and `model.dtype_policy = dtype`, the model's own policy —
# the one `compile` reads; without it, compile would see a float32 model and leave the
# optimizer alone:

# %%
viz.show_code(mirrored.build_keras_cnn)

# %% [markdown]
# Compiling is enough to see the wrapping — nothing is trained in the next cell:

# %%
for policy_name in ("mixed_float16", "mixed_bfloat16"):
    probe, given = mirrored_cnn(strategy, dtype=policy_name), optimizer_in(strategy)  # folded above
    with strategy.scope():
        probe.compile(optimizer=given, loss="sparse_categorical_crossentropy")
    print(f"{policy_name}: compile was given {type(given).__name__}, "
          f"the model now holds {type(probe.optimizer).__name__}")
    wrapped = isinstance(probe.optimizer, keras.optimizers.LossScaleOptimizer)
    if policy_name == "mixed_float16":
        claim("with mixed_float16, compile wrapped the optimizer in a LossScaleOptimizer "
              "(before any fit)", wrapped and probe.optimizer.inner_optimizer is given)
    else:
        claim("with mixed_bfloat16, compile left it alone", probe.optimizer is given)

# %% [markdown]
# A custom loop need not call `compile`, so there you wrap the optimizer yourself — and that is
# only half of loss scaling. `LossScaleOptimizer.apply` **divides** every gradient by its
# dynamic scale (2¹⁵ at the start); the loss must be **multiplied** by the same scale inside the
# tape, with `optimizer.scale_loss(loss)`, as Keras' own train step does. A loop that only wraps
# the optimizer trains without any error, its SGD steps 32768 times too small at the start (the
# dynamic scale then doubles after every 2000 finite steps, so the shortfall grows). Measured: one step of the
# mirrored loop, from the same weights on the same batch, with and without `scale_loss`, with
# float32 layers, where dividing by a power of two loses nothing and the step is a clean
# 1/32768 of plain SGD's (a learning rate of 100, so that a step 32768 times too small still
# moves the float32 weights measurably). Under `mixed_float16` — the case loss scaling exists
# for — it is worse, not measured here: without `scale_loss` the float16 intermediate
# gradients are not lifted, so the small ones underflow to zero (the `LossScaleOptimizer`
# docstring's reason for the scale), and the step is 1/32768 of a gradient that has also lost
# those components.

# %%
probe_lr = 100.0


def loss_scaled_step_size(scale_the_loss):
    """The size of one mirrored SGD step taken through a LossScaleOptimizer."""
    model = mirrored_cnn(strategy, torch_model)
    optimizer = optimizer_in(strategy, probe_lr, loss_scale=True,   # SGD in a LossScaleOptimizer
                             build_for=model.trainable_variables)
    before = model.get_weights()

    @tf.function
    def step(batch):
        def step_fn(x, y):
            with tf.GradientTape() as tape:
                loss = mirrored.per_replica_loss(y, model(x), global_batch)  # answer folded above
                if scale_the_loss:
                    loss = optimizer.scale_loss(loss)   # × the dynamic scale
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))  # ÷ the scale
        strategy.run(step_fn, args=batch)

    step(next(iter(strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((xb, yb)).batch(global_batch)))))
    return norm([a - b for a, b in zip(model.get_weights(), before)]), float(optimizer.initial_scale)


sgd_step = probe_lr * norm(g_single)               # plain SGD's step on one device
unscaled, scale = loss_scaled_step_size(False)
scaled, _ = loss_scaled_step_size(True)
print(f"dynamic scale {scale:.0f}; step size / plain SGD's: with scale_loss "
      f"{scaled / sgd_step:.3f}, without it {unscaled / sgd_step * scale:.3f} / {scale:.0f}")
claim("with optimizer.scale_loss in the tape, the LossScaleOptimizer step is plain SGD's (to 1e-3)",
      abs(scaled / sgd_step - 1) < 1e-3, ratio=scaled / sgd_step)
claim(f"wrapping the optimizer without scale_loss makes the step 1/{scale:.0f} of it (to 1e-3)",
      abs(unscaled / sgd_step * scale - 1) < 1e-3, ratio_times_scale=unscaled / sgd_step * scale)

# %% [markdown]
# The output layer returns float32 logits. Same starting weights, same data: on 256 test images the
# 16-bit model's logits are within 0.01 of float32's (the second cell below prints the typical gap
# between an image's top two logits, what a prediction change would take; an accuracy of this untrained net
# would say nothing), and after `steps` steps of `mirrored.fit` the weights differ from the float32
# loop's of section 5 by less than 5 % of how far the float32 training moved them (largest element
# each). A fixed tolerance would prove nothing once it exceeds the training's own movement, which
# is small in a few steps (printed below): a model that never trained would pass it. This one
# scales with that movement. What is *trained* below is the profile's policy: `mixed_bfloat16` on a
# CPU, `mixed_float16` on a GPU, where `fit`'s `compile` (shown in section 6) wraps the optimizer
# in a `LossScaleOptimizer`. So on this course's CPU profile no float16 layer is ever trained:
# `mixed_float16` was only compiled above, and the `LossScaleOptimizer` step above ran float32
# layers. What is tested is that 16-bit arithmetic changes the logits and the trained weights by
# less than those tolerances. Lesson 01 shows the same with torch AMP.

# %%
policy = "mixed_float16" if profile.tf_device_type == "GPU" else "mixed_bfloat16"
low, full = mirrored_cnn(strategy, torch_model, dtype=policy), mirrored_cnn(strategy, torch_model)
# 16-bit convolutions are slow with TF's own CPU kernels (oneDNN's are off, section 1): 256 images
x_probe = data.normalize(ds.x_test[:256])
logits_low, logits_full = (np.asarray(m(x_probe, training=False)) for m in (low, full))
logit_gap = float(np.abs(logits_low - logits_full).max())
top_two = np.sort(logits_full, axis=-1)[:, -2:]
margin = float(np.median(top_two[:, 1] - top_two[:, 0]))
same_pred = float(np.mean(logits_low.argmax(-1) == logits_full.argmax(-1)))
claim(f"{policy}: the logits are within 0.01 of float32's", logit_gap < 0.01,
      logit_gap=logit_gap, median_top_two_margin=margin)

low = mirrored.fit(strategy, train.take(steps), model=low, optimizer=optimizer_in(strategy))
gap = max(float(np.abs(a - b).max()) for a, b in zip(mirrored.keras_weights_as_torch(low), w_mirror))
moved = max(float(np.abs(a - b).max()) for a, b in zip(w_mirror, init))  # float32's own training
claim(f"after {steps} steps the {policy} weights differ from float32's by under 5 % of how far "
      f"float32's training moved them (largest element each)", gap < 0.05 * moved,
      gap=gap, moved=moved)

# %%
# NBVAL_IGNORE_OUTPUT
# (why: 16-bit rounding errors depend on the kernels this machine's TF runs.)
print(f"{policy} vs float32 before training: largest logit difference {logit_gap:.1e}, median "
      f"gap between an image's top two logits {margin:.3f}, same prediction on {same_pred:.1%}; "
      f"largest weight difference after {steps} steps of training {gap:.1e}, against a largest "
      f"float32 weight change of {moved:.1e} ({gap / moved:.1%})")

# %% [markdown]
# ## 8. Checkpoints under a strategy
#
# `tf.train.Checkpoint` saves one copy of each mirrored variable (they are equal), so the file
# does not depend on the number of replicas: it restores into a mirrored model or into a plain
# one-device model alike: a `MirroredVariable` — every weight here — is written from its
# *primary* copy, with no communication, and restored into every copy. Only a *sync-on-read*
# variable (one whose copies are meant to differ, such as a metric's running total) with SUM
# or MEAN aggregation is reduced across replicas when it is saved (`ONLY_FIRST_REPLICA` saves
# replica 0's). (In multi-worker training, section 9, TF's guidance is that
# every worker calls `save`, since such a reduction is a collective that needs all of them; only
# the *chief*'s directory is kept — the chief is the one worker that also does the bookkeeping
# for the cluster, worker 0 unless `TF_CONFIG` names a separate "chief" task — and the others
# write to temporary directories.)
#
# The two helpers are a `tf.train.Checkpoint` each; the restore ends in `.expect_partial()`,
# which only silences TF's warnings about objects not matched (here: the optimizer's, when a
# model is restored alone) — so a restore checks nothing by itself, and the claims below
# compare the restored weights with the saved ones:

# %% [markdown]
# **▶ `save_checkpoint` and `restore_checkpoint`, the code** (click the folded cell below).

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
viz.show_code(mirrored.save_checkpoint, mirrored.restore_checkpoint,
              folded="▶ code: mirrored.save_checkpoint, mirrored.restore_checkpoint")

# %%
import tempfile

with tempfile.TemporaryDirectory() as ckdir:
    path = mirrored.save_checkpoint(ckdir, replicated, opt_mirror, step=steps)
    plain_model = mirrored.build_keras_cnn(seed=99)                # different weights at first
    restored_step = mirrored.restore_checkpoint(path, plain_model)
    mirror_model, mirror_opt = mirrored_cnn(strategy, seed=99), optimizer_in(strategy)
    mirrored.restore_checkpoint(path, mirror_model, mirror_opt)
ok = all(np.allclose(a, b) for m in (plain_model, mirror_model)
         for a, b in zip(mirrored.keras_weights_as_torch(m), w_mirror))
print("restored step:", restored_step)
claim("the checkpoint restores into a one-device model and into a mirrored one", ok)
claim("it restores the step counter too", restored_step == steps)

# %% [markdown]
# ## 9. MultiWorkerMirroredStrategy: two processes on localhost
#
# The multi-node analogue of lesson 04's two torchrun "nodes": each worker is its own process
# (on a cluster, its own machine) with a `TF_CONFIG` environment variable that lists every
# worker's address and says which one it is:
#
# ```json
# {"cluster": {"worker": ["127.0.0.1:PORT0", "127.0.0.1:PORT1"]}, "task": {"type": "worker", "index": 0}}
# ```
#
# `mirrored.run_multiworker` starts two workers (`python -m dpcourse.tf_multiworker_worker`) on
# free ports, and always ends them. Each worker feeds its own
# half of each global batch; the strategy all-reduces gradients between the processes with
# `CollectiveAllReduce`, implementation RING — **our worker asks for it**
# (`CommunicationOptions(implementation=RING)`). The default, `AUTO`, runs the same ring even on
# GPUs (TF 2's eager runtime takes NCCL for the hint `"nccl"`, or with the `collective_nccl`
# config flag, which this strategy leaves off in eager mode): a GPU cluster must ask for
# `implementation=NCCL`. With RING (ours) the all-reduce's messages between the workers travel
# over gRPC, Google's remote-procedure-call library: the TCP transport TensorFlow's workers
# talk through (`ServerDef(protocol="grpc")` in
# `CollectiveAllReduceExtended._initialize_multi_worker`). With NCCL, gRPC only sets the group
# up (and passes NCCL's communicator key); the tensors go through an NCCL kernel over NCCL's own
# transport (sockets, InfiniBand, NVLink). No `"chief"` task is listed, so
# worker 0 is the chief (`multi_worker_util.is_chief`). Starting from the same weights, both
# workers end with the same weights as each other (bit for bit: `np.array_equal`) and as one
# device in section 5 (to 1e-5). The worker's code — reading `TF_CONFIG`, the forced RING, its
# input pipeline (`strategy.distribute_datasets_from_function`, lab 05's stretch A) and the step
# of section 5 — is folded below.

# %% [markdown]
# **▶ The worker (answers to lab 05's part 2 and stretch A) — open after your lab passes**
# (click the folded cell below).

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
from dpcourse import tf_multiworker_worker

viz.show_code(tf_multiworker_worker.main,
              folded="▶ The worker (lab 05 part 2 and stretch A) — open after your lab passes")

# %% [markdown]
# **▶ `mirrored.run_multiworker`: ports, `TF_CONFIG`, and how the workers are ended**
# (`mirrored.kill_worker`, `launch.kill_tree`, `launch.free_port`; click the folded cell below).

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
import inspect

from dpcourse import launch

viz.show_code(mirrored.run_multiworker, mirrored.kill_worker,
              folded="▶ code: mirrored.run_multiworker, mirrored.kill_worker")
viz.show_code(inspect.getsource(launch.kill_tree), inspect.getsource(launch.free_port),
              folded="▶ code: launch.kill_tree, launch.free_port (dpcourse/launch.py)")

# %%
import os

with tempfile.TemporaryDirectory() as tmp:
    init_path = os.path.join(tmp, "init.npz")
    np.savez(init_path, **{f"w{k}": w for k, w in enumerate(init)})
    cfg = mirrored.MultiWorkerConfig(steps=steps, global_batch=global_batch, lr=lr,
                                     n_train=n_train, seed=0, init_weights=init_path)
    mw = mirrored.run_multiworker(cfg, num_workers=2, timeout=multiworker_timeout)
workers_agree = all(np.array_equal(a, b) for a, b in zip(*mw.weights))
equal_single = all(np.allclose(a, b, atol=1e-5) for a, b in zip(mw.weights[0], w_single))
claim("both workers hold bit-identical weights", workers_agree)
claim("and they equal one device on the global batch (to 1e-5)", equal_single)

# %%
# NBVAL_IGNORE_OUTPUT
# (why: wall-clock time on this machine.)
print(f"2 workers, {steps} steps: {mw.seconds:.1f} s in all (start-up and TF import included)")

# %% [markdown]
# ## 10. Side by side: PyTorch DDP and TF MirroredStrategy
#
# | | PyTorch DDP (lessons 03–04) | TF MirroredStrategy (this lesson) |
# |---|---|---|
# | who runs the replicas | N processes, one per device (`spawn`/`torchrun`) | one process, N replicas (`strategy.run`); N processes with MultiWorkerMirroredStrategy |
# | where the model is copied | each rank builds it; DDP broadcasts rank 0's weights | `MirroredVariable`s created under `strategy.scope()` |
# | splitting the data | `DistributedSampler`: each rank loads its shard | `experimental_distribute_dataset`: the global batch is split over the replicas; across workers each worker's copy of the pipeline is first auto-sharded (`AutoShardPolicy`: by files, else by elements: each of the W workers reads everything and keeps 1/W); `distribute_datasets_from_function`: each input pipeline feeds its replicas |
# | batch size you set | per rank (`per_rank_batch`) | global for `experimental_distribute_dataset` and `fit`; for `distribute_datasets_from_function`: lab 05's stretch A |
# | combining gradients | all-reduce **average**, in backward (buckets) | **sum** in `apply_gradients`, after the backward: by default, in a `tf.function`, all gradients packed into one collective all-reduce (`CommunicationOptions(bytes_per_pack=...)` splits it into packs; `ReductionToOneDevice` if you ask) |
# | so the loss must be | the rank's mean (`reduce_mean` semantics) | scaled so that the replicas' SUM is one device's gradient (for full steps ÷ `global_batch`, §5's table; any step: lab 05 part 1) |
# | reporting the loss | `all_reduce` / rank 0 | `strategy.reduce(op, ...)`, the op chosen by what each replica returns (lab 05) |
# | checkpoints | rank 0 saves `state_dict` | `tf.train.Checkpoint`: mirrored weights saved from their primary copy (multi-worker: every worker calls save; keep the chief's) |
#
# And the proof that both compute the same training: the same initial weights, the same global
# batches, `steps` steps of SGD — once with real DDP over 2 gloo processes, once with TF.

# %%
def ddp_train_step(model, optimizer, x, y):
    optimizer.zero_grad()
    logits = model(x)
    loss = torch.nn.functional.cross_entropy(logits, y)          # the rank's mean
    loss.backward()                                               # DDP all-reduces (average) here
    optimizer.step()
    return loss.detach()


def ddp_worker(rank, world_size, init, batches, lr, train_step):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    from dpcourse.models import SmallCNN

    model = SmallCNN()
    with torch.no_grad():
        for p, w in zip(model.parameters(), init):
            p.copy_(torch.from_numpy(w))
    model = DDP(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    per_rank_batch = len(batches[0][1]) // world_size
    lo, hi = rank * per_rank_batch, (rank + 1) * per_rank_batch
    losses = []
    for x, y in batches:
        loss = train_step(model, optimizer, torch.from_numpy(x[lo:hi]), torch.from_numpy(y[lo:hi]))
        torch.distributed.all_reduce(loss)                        # for reporting only
        losses.append(loss.item() / world_size)
    return [p.detach().numpy() for p in model.module.parameters()], losses


from dpcourse import launch

batches = [(x.numpy().transpose(0, 3, 1, 2).copy(), y.numpy()) for x, y in train.take(steps)]
ddp_results = launch.spawn(ddp_worker, 2, init, batches, lr, ddp_train_step,
                           backend="gloo", timeout=60)
w_ddp, loss_ddp = ddp_results[0]
claim(f"after {steps} steps PyTorch DDP and TF MirroredStrategy hold the same weights (to 1e-5)",
      all(np.allclose(a, b, atol=1e-5) for a, b in zip(w_ddp, w_mirror)))
claim("and every step's loss agrees (to 1e-5)", np.allclose(loss_ddp, loss_mirror, atol=1e-5))
fig = viz.new_figure(5.5, 3.2)
ax = fig.add_subplot(1, 1, 1)
step_axis = list(range(1, steps + 1))
ax.plot(step_axis, loss_ddp, "o-", ms=9, label="PyTorch DDP, 2 processes")
ax.plot(step_axis, loss_mirror, "x--", ms=9, label=f"TF MirroredStrategy, {n_replicas} replicas")
ax.plot(step_axis, loss_single, ".:", color="black", label="TF, one device")
ax.set_xlabel("step")
ax.set_xticks(step_axis)
ax.set_ylabel("loss on the global batch")
ax.grid(True, alpha=0.3)
ax.legend(fontsize=8)
fig.subplots_adjust(left=0.16, right=0.97, bottom=0.16, top=0.95)
viz.show(fig, "from the same initial weights on the same batches, the two frameworks' losses lie on "
              "top of each other (and on one device's), step after step. Each step's loss is "
              "on a new batch, so three steps need not go down: the point is the agreement.")

# %% [markdown]
# The two training steps, as code. The differences are the table above in miniature: TF runs
# the step through `strategy.run` and divides each replica's summed loss by a global batch
# given in advance (`compute_average_loss` with `global_batch_size=`), because its all-reduce
# sums; DDP hides its all-reduce in `backward()` and averages. The diff shows the whole TF
# step — part of lab 05 part 3's answer — so it is folded.

# %% [markdown]
# **▶ The two steps as a diff (part of lab 05 part 3's answer) — open after your lab passes** (click the folded cell below).

# %% jupyter={"source_hidden": true, "outputs_hidden": true}
import difflib
import inspect

tf_step = inspect.getsource(mirrored.train_step)
tf_step = tf_step.split('"""')[0].rstrip(" ") + tf_step.split('"""')[2].lstrip("\n")   # without docstring
torch_step = inspect.getsource(ddp_train_step)
viz.show_code("".join(difflib.unified_diff(torch_step.splitlines(True), tf_step.splitlines(True),
                                           "PyTorch DDP", "TF MirroredStrategy", n=1)),
              folded="▶ The two steps as a diff — open after your lab passes")

# %% [markdown]
# ## Summary
#
# * Split the devices **first**; TF fixes them on first use.
# * Create variables under `strategy.scope()`; batch with the **global** batch.
# * TF **sums** replicas' gradients, DDP averages them: for full steps each replica divides its
#   summed loss by the **global** batch (`compute_average_loss` with `global_batch_size=`);
#   `reduce_mean` makes the gradient N× too big, averaging again N× too small. A Keras
#   loss object (default reduction, per-example `call`) is already scaled (slice mean × 1/N):
#   dividing it again makes the gradient N× too small; and since it is scaled
#   wherever the strategy is current, a whole batch's loss computed on the host under
#   `strategy.scope()` comes out N× too small.
# * By default the sum is a collective all-reduce (`CollectiveAllReduce`: RING on CPUs or once
#   any GPU in the process is split, else NCCL); `ReductionToOneDevice` is what you get with
#   mixed devices or ask for, and, under `MirroredStrategy` whenever merge calls are on, what
#   `strategy.reduce` uses to bring a per-replica result to the host.
# * `compile`, not `fit`, wraps the optimizer in a `LossScaleOptimizer` under `mixed_float16`; a
#   custom loop that wraps it must also call `optimizer.scale_loss(loss)` in the tape, or every
#   gradient is 1/32768 or less of what it should be (measured with float32 layers).
# * Proven here: mirrored step == one device on the global batch == Keras `fit` == two
#   multi-worker processes == PyTorch DDP, from the same weights on the same data.
#
# **▶ The penalty's rule (lab 05 part 1 asks it too) — open after your lab passes** (click
# below).

# %% [markdown]
# <details><summary>▶ open</summary>
#
# * Regularisation losses, the same on every replica, go through `scale_regularization_loss`.
#
# </details>
#
# **▶ And lab 05's prediction (part 0), answered — open after your lab passes** (click
# below).

# %% [markdown]
# <details><summary>▶ open</summary>
#
# * In an epoch's last step of one sample, replica 0 holds it and every other replica runs
#   `step_fn` on an empty slice (§5's fold measured it). A Keras loss object there gives a `(0,)`
#   tensor eagerly and in a plain `@tf.function` (traced with the slice's concrete shape), a
#   scalar 0.0 only where the trace leaves the batch dimension unknown (an `input_signature`,
#   an iterator read inside the function as in `fit`, a relaxed retrace).
#
# </details>

# %% [markdown]
# ## Check yourself
#
# **▶ The quiz** — run the folded cell below and answer in the widget (or read its output,
# where the answers are folded).

# %% jupyter={"source_hidden": true}
from dpcourse import quizzes

viz.quiz(quizzes.questions("05"))

# %% [markdown]
# ## Sources
#
# Checked in the installed packages (paths relative to `site-packages`):
#
# - `tensorflow/include/absl/base/log_severity.h` — `kInfo = 0`, `kWarning = 1`, `kError = 2`: TF's C++ logs a line whose severity is at least `TF_CPP_MIN_LOG_LEVEL` (upstream `tsl/platform/default/logging.cc`, not installed), so 2 keeps errors.
# - `tensorflow/python/eager/context.py` — `Context.set_logical_device_configuration`: "Virtual devices cannot be modified after being initialized" once TF has used its devices; `list_logical_devices` initializes them (lines 1906-1908), `list_physical_devices` does not.
# - `tensorflow/python/distribute/mirrored_strategy.py` — `MirroredStrategy._collective_key_base`, a class attribute under the comment "Only set this in tests", which `MirroredExtended.__init__` copies from its strategy; `MirroredExtended.__init__` keeps the cross-device ops in the private `_cross_device_ops` (no public getter).
# - `tensorflow/python/distribute/mirrored_strategy.py` — `MirroredExtended._make_collective_ops_with_fallbacks`: with no `cross_device_ops`, `CollectiveAllReduce` with `RING` on CPUs, and on GPUs when the whole process lists fewer physical GPUs than logical ones (`len(physical_gpus) < len(logical_gpus)`, from `context.list_physical_devices` / `list_logical_devices`, whichever GPUs the strategy uses), else the `NCCL` set in `MirroredExtended.__init__`; `ReductionToOneDevice` for mixed CPU/GPU devices.
# - `tensorflow/python/distribute/mirrored_strategy.py` — `MirroredExtended._reduce_to`: a reduction to a CPU destination (`strategy.reduce`) goes through `ReductionToOneDevice`; `MirroredExtended._batch_reduce_to`: the replica context's `all_reduce` goes through the strategy's cross-device ops.
# - `tensorflow/python/distribute/mirrored_strategy.py` — `MirroredExtended._use_merge_call`: true unless the step runs under XLA on all-GPU devices; only when it is true, `_reduce_to` takes `ReductionToOneDevice` for a destination that is a CPU or does not match the value's devices (`cross_device_ops._devices_match`).
# - `tensorflow/python/distribute/distribute_lib.py` — `StrategyExtendedV2._reduce`: `strategy.reduce`'s destination is `device_util.current()` (a `tf.device` scope's device), else the strategy's `_default_device` (`None` in `StrategyExtendedV2.__init__`; set for multi-worker jobs: the first worker in `tensorflow/python/distribute/mirrored_strategy.py` — `MirroredExtended._initialize_multi_worker` (also for a single worker on a job other than `localhost`, `_initialize_single_worker`), this task in `tensorflow/python/distribute/collective_all_reduce_strategy.py` — `CollectiveAllReduceExtended._initialize_multi_worker`), else `"/device:CPU:0"`.
# - `tensorflow/include/tensorflow/core/util/port.h` — `IsMklEnabled`; its definition, compiled into `tensorflow/libtensorflow_framework.so.2`, is TF's `tensorflow/core/util/port.cc` (not shipped as source): `DefaultOneDnnPolicy` turns oneDNN's custom operations on by default on Linux only when the CPU has AVX512_VNNI, AVX512_BF16, AVX_VNNI or AMX, and `TF_ENABLE_ONEDNN_OPTS` overrides that default.
# - `tensorflow/libtensorflow_framework.so.2` (compiled; its strings): the notice "oneDNN custom operations are on … To turn them off, set the environment variable `TF_ENABLE_ONEDNN_OPTS=0`".
# - `tensorflow/include/tensorflow/compiler/xla/tsl/framework/contraction/eigen_contraction_kernel.h` — under `TENSORFLOW_USE_MKLDNN_CONTRACTION_KERNEL` Eigen's float contractions (matrix products, convolutions) can call oneDNN's `dnnl_sgemm`; `UseCustomContractionKernels()` decides at run time ("a runtime check, that uses environment variables"); `tensorflow/libtensorflow_cc.so.2` contains that symbol.
# - `tensorflow/python/distribute/distribute_lib.py` — `ReplicaContextBase.all_reduce`: called inside `strategy.run`, every replica passes a value of the same shape and gets back the combination of all of them; all replicas must make the call, in the same order.
# - `tensorflow/python/distribute/distribute_lib.py` — `InputContext`: `num_input_pipelines`, `input_pipeline_id`; `Strategy.distribute_datasets_from_function`: `dataset_fn` is called on each worker's CPU, one input pipeline per worker.
# - `tensorflow/python/data/ops/dataset_ops.py` — `DatasetV2.cache(filename="")`: the elements are cached "either in the specified file or in memory" on the first iteration, and later iterations "use the cached data".
# - `tensorflow/python/data/ops/options.py` — `OptimizationOptions.inject_prefetch` and `map_parallelization` both "default to True": a prefetch after the final `batch`, and a parallel `map`; `AutoShardPolicy`: AUTO "Attempts FILE-based sharding, falling back to DATA-based sharding"; DATA: "Each worker will process the whole dataset and discard the portion that is not for itself".
# - `tensorflow/python/distribute/distribute_lib.py` — `Strategy.reduce` requires the cross-replica context (`_require_cross_replica_or_default_context_extended`) and calls `_reduce` → `reduce_to`, no merge call.
# - `tensorflow/python/distribute/distribute_lib.py` — `ReplicaContext.merge_call`: replica-context code hands a function to the cross-replica context, which runs it once with all replicas' values; `tensorflow/python/distribute/mirrored_run.py` — `_MirroredReplicaContext._merge_call` records whether it was entered eagerly (`merge_call_entered_in_eager`), and `_call_for_each_replica` runs the merge function eagerly when it was entered eagerly (at each call), in the graph being traced otherwise.
# - `tensorflow/python/distribute/distribute_lib.py` — `ReplicaContextBase.replica_id_in_sync_group`: "Returns: a `Tensor`" (an int32 constant); `tensorflow/python/autograph/operators/control_flow.py` — `if_stmt`: in a `tf.function`, an `if` on a tensor is staged as a `tf.cond` (`_tf_if_stmt`).
# - `tensorflow/python/distribute/cross_device_ops.py` — `ReductionToOneDevice.reduce_implementation` (copy to one device, `add_n`, broadcast back), `CollectiveAllReduce` (`__init__` keeps its options in the private `_options`), `NcclAllReduce`.
# - `tensorflow/python/distribute/collective_util.py` — `CommunicationImplementation`: `RING`, `NCCL`, `AUTO`.
# - `tensorflow/python/distribute/cross_device_ops.py` — `CollectiveAllReduce._all_reduce`: the dense gradients go through `cross_device_utils.group_by_size(dense_values, options.bytes_per_pack)` and then `CollectiveReplicaLauncher.batch_all_reduce` (`tensorflow/python/distribute/cross_device_utils.py`), which in a `tf.function` concatenates each pack into one all-reduce (eagerly: one per tensor); `group_by_size`: `bytes_per_pack == 0` gives a single pack; `tensorflow/python/distribute/collective_util.py` — `Options.__init__`: `bytes_per_pack=0` by default (MirroredStrategy's options set only `implementation`: `MirroredExtended._make_collective_ops_with_fallbacks`).
# - `keras/src/optimizers/sgd.py` — `SGD.build`: slot variables (`momentums`) only when `momentum != 0`.
# - `tensorflow/python/ops/nn_impl_distribute.py` — `compute_average_loss`: the sum of the per-example losses (each scaled by its `sample_weight` when one is given) divided by `global_batch_size` when it is given (what it does without it: Sources that answer lab 05).
# - `keras/src/backend/tensorflow/optimizer.py` — `TFOptimizer._all_reduce_sum_gradients`: `apply_gradients` sums the replicas' gradients with the replica context's `all_reduce(SUM, ...)`.
# - `keras/src/losses/loss.py` — `Loss.__call__` → `reduce_weighted_values` → `reduce_values` → `scale_loss_for_distribution`: a call of a Keras loss (in `fit` or in a custom `strategy.run` step) with reduction `"sum_over_batch_size"` (the default), `"mean"` or `"mean_with_sample_weight"` divides the slice's summed losses (the per-example values `call` returned; a scalar is returned as is) by its size (by its weight sum for `"mean_with_sample_weight"` with weights) and multiplies by 1 / `num_replicas_in_sync` under `tf.distribute`; `"sum"` and `"none"` return before any scaling; `scale_loss_for_distribution` reads the factor from `tf.distribute.get_strategy().num_replicas_in_sync`, so it applies wherever that returns the strategy, host code under `strategy.scope()` included.
# - `tensorflow/python/distribute/mirrored_run.py` — `_call_for_each_replica`: when some replicas are done while others wait in a merge call, "Some replicas made a different number of replica_context().merge_call() calls." (a `RuntimeError`, the eager check, lines 234-237); `_MirroredReplicaContext._merge_call`: a merge call made in a graph other than the one being traced — inside a control-flow branch of a `tf.function` — raises "`merge_call` called while defining a new graph or a tf.function … control flow statement which contains a synchronization point" (lines 490-503), the test being `ops.get_default_graph() != t.graph` (line 501), the graph `strategy.run` was called in: a `tf.function`'s loop around `strategy.run` calls it in the loop body's graph, where its merge calls are made too, so no error; a loop *inside* the replica function gives its body a graph of its own, and a merge call there raises; `tensorflow/python/distribute/distribute_lib.py` — `ReplicaContextBase.all_reduce` goes through `merge_call` when `_use_merge_call()`, and its docstring says a skipped all-reduce "hangs".
# - `keras/src/metrics/metric.py` — `Metric.add_variable`: a metric's state variables are created with `synchronization="on_read"` (line 204); `tensorflow/python/distribute/mirrored_strategy.py` — `MirroredExtended._create_variable` calls `distribute_utils.create_mirrored_variable` with `VARIABLE_CLASS_MAPPING` (`tensorflow/python/distribute/distribute_utils.py`, lines 480-484): `ON_WRITE` (the default) → `MirroredVariable`, `ON_READ` → `SyncOnReadVariable`.
# - `tensorflow/python/distribute/values.py` — `MirroredVariable._gather_saveables_for_checkpoint` / `_MirroredSaveable`: a checkpoint saves the primary copy of a mirrored variable and restores the value into every copy; `SyncOnReadVariable` ("values are reduced on save") through `_SyncOnReadSaveable` and `values_util.get_on_read_saveable` (the cross-replica value); `SyncOnReadVariable._get_cross_replica`: read in the cross-replica context, the copies are combined by `strategy.reduce` with the variable's aggregation (the first replica's copy for `ONLY_FIRST_REPLICA`).
# - `keras/src/backend/tensorflow/trainer.py` — `TensorFlowTrainer.train_step`: `self.optimizer.scale_loss(loss)` inside the tape; `keras/src/optimizers/loss_scale_optimizer.py` — `LossScaleOptimizer.scale_loss` multiplies by the dynamic scale (`initial_scale=2**15`), `apply` divides the gradients by it; `dynamic_growth_steps=2000`: after that many finite steps in a row the scale doubles. `keras/src/optimizers/adam.py` — `Adam.update_step`: the step divides the first moment by the root of the second, so a constant factor on every gradient nearly cancels.
# - `keras/src/dtype_policies/dtype_policy.py` — `DTypePolicy` (docstring) and `_parse_name`: `"mixed_float16"` / `"mixed_bfloat16"` give compute dtype float16 / bfloat16 and variable dtype float32, with no device check.
# - `tensorflow/include/Eigen/src/Core/arch/Default/BFloat16.h` — "Definitions for CPUs, mostly working through conversion to/from fp32" (lines 266-267): `operator+`, `operator*`, … on `bfloat16` (lines 269-286) convert both operands to float32, compute, and round back, so TF's own CPU kernels run bfloat16 on any CPU, in software.
# - `keras/src/trainers/trainer.py` — `Trainer.compile`: with the model's dtype policy `mixed_float16` and `auto_scale_loss=True`, the optimizer is wrapped in a `LossScaleOptimizer`.
# - `keras/src/optimizers/loss_scale_optimizer.py` — `LossScaleOptimizer`: dynamic loss scaling, `inner_optimizer`; its docstring (lines 21-24): the loss is scaled "to prevent numeric underflow in intermediate gradients when float16 is used", which scales the intermediate gradients too.
# - `tensorflow/python/distribute/collective_all_reduce_strategy.py` — `CollectiveAllReduceExtended._initialize_multi_worker`: `TF_CONFIG`'s cluster, a gRPC server per worker (`protocol="grpc"`).
# - `tensorflow/python/distribute/collective_util.py` — `Options`: the communication implementation defaults to `AUTO`; `dpcourse/tf_multiworker_worker.py` asks for `RING`.
# - `tensorflow/python/distribute/cross_device_utils.py` — `CollectiveReplicaLauncher.all_reduce`: `communication_hint=options.implementation.value` (`"AUTO"` by default); `tensorflow/python/ops/collective_ops.py` — `all_reduce_v2`: `communication_hint.lower()` (line 152); `tensorflow/python/distribute/collective_all_reduce_strategy.py` — `CollectiveAllReduceExtended._update_config_proto`: `collective_nccl = True` only when `not ops.executing_eagerly_outside_functions()` (TF 1 graphs, lines 880-885), and its eager set-up (`_initialize_local`, `_initialize_multi_worker`) calls `configure_collective_ops` without `use_nccl_communication` (`tensorflow/python/eager/context.py`, line 1406). Read upstream (C++, not installed): `tensorflow/core/common_runtime/collective_param_resolver_local.cc` — `CollectiveParamResolverLocal::AssignCollectiveType`: NCCL only when `nccl_` (the config's `collective_nccl`) or `communication_hint == "nccl"`, on a GPU group. Read upstream (C++, not installed; the CPU wheel's `tensorflow/libtensorflow_cc.so.2` has only its `MaybeCreateNcclCommunicator` symbol): `tensorflow/core/nccl/collective_communicator.cc` — `NcclCommunicator::Enqueue`: an NCCL all-reduce is handed to `NcclManager::AddToAllReduce` with the group's `communicator_key`, and `NcclManager` launches the NCCL kernel on a CUDA stream of its own.
# - `tensorflow/python/distribute/multi_worker_util.py` — `is_chief`: without a "chief" task, worker 0 is the chief.
# - `tensorflow/python/checkpoint/checkpoint.py` — `CheckpointLoadStatus.expect_partial`: silences the warnings about saved or expected objects left unmatched (so a restore checks nothing by itself: the claims in §8 compare the weights).

# %% [markdown]
# ### Sources that answer lab 05
#
# **▶ Open after your lab passes** (click below).

# %% [markdown]
# <details><summary>▶ open</summary>
#
# #### Sources (lab 05's answers)
#
# - `tensorflow/python/distribute/input_lib.py` — `DistributedDataset._make_rebatch_fn`: each global batch is cut into one batch per replica (`dataset.rebatch` with `batch_sizes_for_worker`, or `_LegacyRebatchDataset` in `tensorflow/python/data/experimental/ops/distribute.py`, whose docstring shows a replica getting `[]`); `DistributedDataset._create_cloned_datasets_from_dataset`: each worker's copy, rebatched, goes through `input_ops.auto_shard_dataset`; `tensorflow/python/distribute/mirrored_run.py` — `_call_for_each_replica`: one thread per replica, each calling the function.
# - `keras/src/losses/loss.py` — `reduce_values` (lines 140-161): a value whose static shape is `(0,)` or `()` is returned unreduced and unscaled (traced with an unknown batch dimension, an empty value is summed and divided with `divide_no_nan`: 0.0).
# - `keras/src/backend/tensorflow/trainer.py` — `TensorFlowTrainer._make_function`: `fit`'s `multi_step_on_iterator` calls `iterator.get_next()` inside a `tf.function(..., reduce_retracing=True)`, so the step is traced with the dataset's element spec (a batch dimension of `None` where the last batch may be short), and `one_step_on_data` is a `tf.function` with `reduce_retracing=True` too.
# - `keras/src/optimizers/base_optimizer.py` — `BaseOptimizer.__init__` and `BaseOptimizer.build`: which variables each creates (the part-2 fold's claim); `build` adds only per-weight ones (EMA averages, accumulated gradients).
# - `tensorflow/python/ops/nn_impl_distribute.py` — `compute_average_loss`: the sum of the per-example losses (each scaled by its `sample_weight` when one is given) divided by `global_batch_size` when it is given; without it (`global_batch_size is None`, lines 116-128), by the replica's own batch (`shape(per_example_loss)[0]`) × `num_replicas_in_sync` (the docstring's "Defaults to", lines 98-99).
# - `tensorflow/python/ops/nn_impl_distribute.py` — `scale_regularization_loss`: the regularisation loss divided by `num_replicas_in_sync`.
# - `keras/src/backend/tensorflow/trainer.py` — `TensorFlowTrainer._aggregate_additional_loss`: `fit` scales `model.losses` (regularisers) by the same 1 / `num_replicas_in_sync`.
# - `tensorflow/python/distribute/distribute_lib.py` — `Strategy.distribute_datasets_from_function`: the function's dataset is not batched or sharded again, so it is batched per replica (`InputContext.get_per_replica_batch_size`: the global batch divided by the context's `num_replicas_in_sync`, the replicas of every worker).
#
# </details>
